"""Benchmark: the default configuration's AP over seeds, on held-out val images, with the seed-0 model's hash.

    python -m benchmarks.record run default-ap -- benchmarks.default_ap --seeds 0-4 --images 1024-2047 --hold avx2

The configuration in ``conf/`` (or with ``--baseline`` overrides) is trained and evaluated at each seed
by the pipeline's own stages, exactly as ``benchmarks.compare`` runs its baseline (and in the same
``--keep`` folder, so the models a comparison trained are reused), and scored on ``--images``: by
default the confirmation images 1024-2047, which no decision looked at. It prints the AP figures per
seed, their mean with a t-based 95% interval over seeds, the lowest seed's AP, and the SHA-256 of the
seed-0 model: ``dvc repro`` of the same configuration under the same hold gives that very file, which is
how a reader checks that the record is the default's.
"""

from __future__ import annotations

import argparse
import json
import statistics

from pipelines import cli

from .compare import Runner, add_run_arguments, compose, parse_images, parse_seeds, subset_ground_truth, t_interval

SHOWN = ("AP", "AP50", "AP75", "APs", "APm", "APl")


def measure(args) -> dict:
    seeds, images = parse_seeds(args.seeds), parse_images(args.images)
    raw = compose(args.baseline, images)
    runner = Runner(args.keep, args.hold, raw["dataset"], args.records)
    data = runner.data(raw)
    gt, ids = subset_ground_truth(data, images)
    runs = {seed: runner.arm({**raw, "seed": seed}, data, images, gt, ids)[0] for seed in seeds}
    per_seed = {str(seed): run["figures"] for seed, run in runs.items()}
    precision = {run["precision"] for run in runs.values()}
    aps = [per_seed[str(s)]["AP"] for s in seeds]
    return {"baseline": args.baseline, "seeds": seeds, "images": [images.start, images.stop - 1], "hold": args.hold,
            "precision": ", ".join(sorted(precision)), "per_seed": per_seed, "mean_AP": statistics.fmean(aps),
            "ci95": list(t_interval(aps)), "min_AP": min(aps), f"seed{seeds[0]}_model_sha256":
            runs[seeds[0]]["model_sha256"]}


def table(f: dict) -> str:
    lines = [f"`{' '.join(f['baseline']) or 'conf/'}`, seeds {', '.join(map(str, f['seeds']))}, val images "
             "{}-{}".format(*f["images"]) + (f", held to {f['hold']}" if f["hold"] else "") + f", {f['precision']}.",
             "", "| seed | " + " | ".join(SHOWN) + " |", "|---|" + "---|" * len(SHOWN)]
    for seed, figures in f["per_seed"].items():
        lines.append(f"| {seed} | " + " | ".join("-" if figures[k] is None else f"{figures[k]:.3f}" for k in SHOWN) + " |")
    lines += ["", f"Mean AP {f['mean_AP']:.4f}, t 95% interval over seeds [{f['ci95'][0]:.4f}, {f['ci95'][1]:.4f}], "
                  f"lowest seed {f['min_AP']:.4f}."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_arguments(parser, images="1024-2047")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args(argv)
    figures = measure(args)
    print(json.dumps(figures) if args.json else table(figures))


if __name__ == "__main__":
    cli.run(main)
