"""Stage confirm (search/dvc.yaml): confirm before output. The ``confirm.top_k`` best candidates of the
search and the augment presets of ``confirm.arms`` (``sa_autoaug``: the published policy; a preset
missing from ``conf/augment/`` is skipped with a warning) are trained by the train stage on the search-train
images at ``confirm.seeds`` seeds (``seed``, ``seed`` + 1, ...) up to ``confirm.fraction`` of
the schedule, and scored by AP on the held-out images (never val). The best by mean AP is written as the
policy file (``--policy``, read by ``augment=searched``): a candidate's genes and bounds, or a preset's whole
augment section; so the output is at least as good as the published policy on held-out data, up to noise.
``--out`` keeps every finished run: a stage killed at any moment resumes to the same result. In MLflow: the
trainings are child runs of the search's run (``--search-run``), which gets the confirm table.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import yaml

from pipelines import cli, lifetime
from pipelines.compose import compose_params
from pipelines.config.load import load_params
from pipelines.fileio import write_json
from pipelines.search.confirm import arms, confirm, policy_file, table, verdict
from pipelines.search.full_run import FullRun
from pipelines.search.proxy import search_params
from pipelines.search.space import space
from pipelines.tracking import store
from pipelines.tracking.run import read_run_file
from pipelines.tracking.tracker import Tracker
from stages import train as train_stage

log = logging.getLogger("confirm")


def main(argv: list[str] | None = None) -> None:
    args = cli.parse_args(__doc__, argv, output_folders=("out",), output_files=("policy", "metrics"),
                          cache="the search's annotation caches (train, val: held out)",
                          prepared="the search's prepared dataset (val.json: the held-out ground truth)",
                          ranked="the search's candidates, best first (JSON)",
                          search_run="the search stage's MLflow run file (the confirm runs are its children)",
                          out="the confirm's kept runs", policy="the confirmed policy (JSON)",
                          metrics="the confirm table (JSON) for dvc metrics")
    if os.environ.get("DVC_STAGE"):  # started by DVC: it dies with dvc (and the training it started with it)
        lifetime.die_with(lifetime.owner_beyond_shells())
    p = search_params(load_params(args.params))  # the search's scale bounds: the candidates train with them
    c, n = p.confirm, p.augment.n_subpolicies
    root = Path.cwd()

    def compose(preset: str) -> dict | None:
        if not (root / "conf" / "augment" / f"{preset}.yaml").is_file():
            return None
        return yaml.safe_load(compose_params(root, [f"augment={preset}"]))["augment"]

    candidates = json.loads(args.ranked.read_text())
    confirmed = arms(candidates, top_k=c.top_k, presets=c.arms, compose=compose,
                     scale_splits=p.augment.scale_splits, space=space(p.search.space, n))
    seeds = [p.seed + i for i in range(c.seeds)]
    parent = read_run_file(args.search_run).get("run_id")
    run = FullRun(raw=yaml.safe_load(Path(args.params).read_text()), cache=args.cache,
                  heldout=args.prepared / "val.json", train_module=train_stage.__name__, fraction=c.fraction,
                  n_subpolicies=n, parent_run_id=parent)
    log.info("confirming %d policies (%s) at seeds %s", len(confirmed), ", ".join(a.name for a in confirmed), seeds)
    figures = table(confirmed, seeds, confirm(confirmed, seeds, run, args.out, identity=run.identity))
    winner = next(a for a in confirmed if a.name == figures["winner"])
    write_json(args.policy, {**policy_file(winner, n), "confirm_AP": figures["winner_AP"]})
    write_json(args.metrics, figures)
    if parent:
        tracker = Tracker.resume(parent)
        tracker.log_metrics({f"confirm/{name}/AP": e["AP"] for name, e in figures["arms"].items()})
        tracker.log_artifact(args.metrics, "confirm")
        tracker.log_artifact(args.policy, "confirm")
        tracker.finish()
    for name, entry in figures["arms"].items():
        per_seed = ", ".join(f"{entry[f'AP_s{seed}']:.3f}" for seed in seeds)
        log.info("%-14s held-out AP %.3f (seeds: %s)", name, entry["AP"], per_seed)
    log.info(verdict(figures))


if __name__ == "__main__":
    cli.run(main, announce=store.announce)
