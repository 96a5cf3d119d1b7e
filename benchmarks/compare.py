"""Benchmark: a paired comparison of a candidate configuration with a baseline, over seeds.

    python -m benchmarks.compare -S train.base_lr=0.002 --seeds 0-4 [--images 0-1023] [--hold avx2]
    python -m benchmarks.compare -S evaluate.merge=vote --seeds 0-4     # evaluation only: the same models

The baseline is ``conf/`` with the ``--baseline`` overrides (none: the default configuration); the
candidate adds the ``-S`` overrides. At each seed both are trained and evaluated by the pipeline's own
stages (``pipelines.launch stages.train``, then ``stages.evaluate``), so they share the seed's
initialisation, data order and augmentation draws: the comparison is paired. Every model is kept in
``--keep`` under a key of what training reads, so a candidate that changes only ``evaluate`` is scored on
the baseline's very models (no training noise at all), and a comparison that was stopped resumes from
the runs already finished (an interruption costs at most the run in progress). Each finished arm (a
seed's model scored on ``--images``) is also written as a small record to ``--records`` (default
``benchmarks/records/arms``, committed), keyed by what it trained and evaluated, the hold and a digest of
the source of every project module the stages import: a later checkout with the same code reuses it
instead of training again, though its per-image matches are not kept, so a comparison with a reused arm
has no paired image bootstrap (it says so). Any change to that code starts the arms afresh.

The val split is raised to cover ``--images`` (indices into the synthetic val split; images 0-127 stay
the default pipeline's, and the train split and its models do not change). Decide on 0-1023 and keep
1024-2047 for the final confirmation. Per seed it prints ΔAP (candidate minus baseline) and ΔAP at IoU
0.5, 0.75, 0.85, 0.9 and 0.95 and for small, medium and large objects; over the seeds the mean ΔAP with
a t-based 95% interval, and a paired image bootstrap (the same resampled images for both arms and
every seed) of the mean, which measures the val-sampling part alone. The verdict follows a rule fixed
before any run: **adopt** when the t interval's lower bound is above 0 (above -0.005 with
``--saves-time``, for a change that saves compute) and no seed loses more than 0.03; otherwise
**reject**.

The runs are recorded in MLflow (``MLFLOW_TRACKING_URI`` or the project's ``mlflow.db``): a parent run
named after the comparison with one child per arm and seed. ``--json`` prints the figures as one JSON
object for ``benchmarks.record``. Decide in fp32 held to AVX2 (``--hold avx2``: the AVX2 machines'
model bit for bit); screen in bf16 on the fast class if you must, never mixing the two in one ``--keep``.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import yaml

from pipelines import cli
from pipelines.errors import ConfigError, PipelineError
from pipelines.fileio import atomic_dir, write_json
from pipelines.lifetime import parent_death_signal

from .precision import CLASSES

REPO = Path(__file__).resolve().parents[1]
RECORDS = REPO / "benchmarks" / "records" / "arms"
MAX_SEEDS = 64
ARMS = ("baseline", "candidate")
# the figures compared per seed: AP, AP at five IoU thresholds, AP per object size
COMPARED = ("AP", "AP_iou50", "AP_iou75", "AP_iou85", "AP_iou90", "AP_iou95", "APs", "APm", "APl")
ADOPT_MARGIN, SAVING_MARGIN, WORST_SEED = 0.0, -0.005, -0.03
# what training does not read: two configurations equal outside these train the same model
NOT_TRAINING = ("evaluate", "tracking", "launch", "search", "confirm")
SCORING = ("backend", "bootstrap")  # evaluate settings that score detections without changing them
# evaluate settings added after evaluations were first kept: left out of an evaluation's key while off (null or
# false), so that the evaluations kept before they existed are found again
EVALUATE_ADDED = ("bn_reestimate",)


class RunFailed(PipelineError):
    """A stage of one of the comparison's runs failed (its log says why)."""

    exit_code = 1


def parse_seeds(text: str) -> list[int]:
    """``"0-4"`` or ``"0,2,5"`` (or a mix) as a list of distinct seeds in the order given."""
    seeds: list[int] = []
    try:
        for part in filter(None, (p.strip() for p in text.split(","))):
            first, dash, last = part.partition("-")
            low, high = int(first), int(last) if dash else int(first)
            if high < low:
                raise ConfigError(f"--seeds: {part!r} runs backwards; write it as {high}-{low}")
            seeds += [s for s in range(low, high + 1) if s not in seeds]
            if len(seeds) > MAX_SEEDS:
                raise ConfigError(f"--seeds: at most {MAX_SEEDS} seeds, got more in {text!r}")
    except ValueError:
        raise ConfigError(f"--seeds: expected seeds such as 0-4 or 0,2,5, got {text!r}") from None
    if len(seeds) < 2:
        raise ConfigError(f"--seeds: a paired comparison needs at least two seeds, got {text!r}")
    return seeds


def parse_images(text: str) -> range:
    """``"0-1023"``: the val images compared, by index in the val split."""
    first, dash, last = text.partition("-")
    try:
        images = range(int(first), int(last) + 1) if dash else None
    except ValueError:
        images = None
    if images is None or images.start < 0 or len(images) < 1:
        raise ConfigError(f"--images: expected a range of val image indices such as 0-1023, got {text!r}")
    return images


def compose(overrides: list[str], images: range) -> dict:
    """The params of ``overrides`` over ``conf/``, validated, with the val split raised to cover ``images``."""
    from pipelines.compose import compose_params
    from pipelines.config.load import params_from_text

    raw = yaml.safe_load(compose_params(REPO, overrides))
    if raw["dataset"]["name"] != "synthetic":
        raise ConfigError(f"dataset: the comparison draws more val images from the synthetic set; "
                          f"got dataset {raw['dataset']['name']!r}")
    raw["dataset"]["val_size"] = max(raw["dataset"]["val_size"], images.stop)
    params_from_text(yaml.safe_dump(raw), source="the composed params")  # one line if a value is wrong
    return raw


def digest(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]


def training_key(raw: dict) -> str:
    """What training reads: two arms with the same key train the same model at a seed. A setting that is
    off (``false`` or ``null``, as every lever is until adopted) is left out, so a lever added later
    leaves the key of the models already kept as it was. A search's policy file is read as the train stage
    reads it (:func:`read_policy_file`), and ``augment.policy_file`` itself is left out: ``augment=searched``
    with the published policy in its file trains the published preset's very models."""
    reads = {k: v for k, v in _resolved(raw).items() if k not in NOT_TRAINING and k != "seed"}
    reads["dataset"] = {k: v for k, v in raw["dataset"].items() if k != "val_size"}
    reads["augment"] = {k: v for k, v in reads["augment"].items() if k != "policy_file"}
    return digest(_without_off(reads))


def _resolved(raw: dict) -> dict:
    """``raw`` with its ``augment`` section as the train stage trains it (a search's policy file read)."""
    import dataclasses

    from pipelines.config.load import params_from_text, read_policy_file

    augment = raw.get("augment", {})
    if augment.get("policy") is not None or not str(augment.get("policy_file", "")).endswith(".json"):
        return raw
    resolved = dataclasses.asdict(read_policy_file(params_from_text(yaml.safe_dump(raw), source="the composed params"))
                                  .augment)  # (the values it changes: 512.0 and 512 are one setting)
    return {**raw, "augment": {**augment, **{k: v for k, v in resolved.items() if augment.get(k) != v}}}


def evaluation_key(raw: dict, model: str) -> str:
    """What an evaluation of the kept ``model`` (its folder's name) detects with: ``raw``'s evaluate settings
    but those that only score (:data:`SCORING`) and those added later while off (:data:`EVALUATE_ADDED`),
    and the val split's size."""
    detecting = {k: v for k, v in raw["evaluate"].items()
                 if k not in SCORING and not (k in EVALUATE_ADDED and (v is None or v is False))}
    return digest([model, detecting, raw["dataset"]["val_size"]])


STAGES = ("stages.prepare", "stages.cache", "stages.train", "stages.evaluate", "pipelines.launch")


def stage_modules() -> list[str]:
    """Every project module that the stages a comparison runs import, directly or not, at module level or in a
    function (the import graph)."""
    import grimp

    graph = grimp.build_graph("pipelines", "stages", include_external_packages=False)
    return sorted(set(STAGES).union(*(graph.find_upstream_modules(m) for m in STAGES)))


@functools.cache
def code_digest() -> str:
    """A digest of the source of :func:`stage_modules` and of torch's and torchvision's versions."""
    import torch
    import torchvision

    h = hashlib.sha256(f"{torch.__version__} {torchvision.__version__}".encode())
    for module in stage_modules():
        path = REPO.joinpath(*module.split("."))
        path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
        h.update(f"{module}\0".encode() + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def arm_key(raw: dict, images: range, hold: str | None) -> dict:
    """What an arm's figures depend on: its training, its evaluation, the seed, the images scored, the CPU
    class it ran in and the code."""
    from benchmarks.record import machine

    model = f"{training_key(raw)}-s{raw['seed']}"
    return {"model": model, "evaluation": evaluation_key(raw, model), "images": [images.start, images.stop - 1],
            "class": f"held to {hold}" if hold else machine()["class"], "code": code_digest()}


def _without_off(value):
    if isinstance(value, dict):
        return {k: _without_off(v) for k, v in value.items() if v is not None and v is not False}
    return value


class Runner:
    """Trains and evaluates in ``keep``: each model and each evaluation is kept as it finishes and found again."""

    def __init__(self, keep: Path, hold: str | None, dataset: dict, records: Path | None = None):
        self.keep, self.hold, self.records = keep, hold, records
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "DVC_"))}
        # the stages' own runs go to a store in the folder; the comparison's runs go to the user's
        self.env.update(MLFLOW_TRACKING_URI=f"sqlite:///{(keep / 'mlflow.db').resolve()}", DVC_ROOT=str(keep.resolve()))
        if hold:
            for key in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS"):
                self.env.pop(key, None)
            self.env.update(CLASSES[hold])
        self._check_folder(dataset)
        if records is not None and records.is_dir():
            stale = sum(json.loads(r.read_text())["key"]["code"] != code_digest() for r in records.glob("*.json"))
            if stale:
                print(f"{records}: {stale} arm records were made by other code than the stages' now (digest "
                      f"{code_digest()}): they are not reused", file=sys.stderr, flush=True)

    def _check_folder(self, dataset: dict) -> None:
        from benchmarks.record import machine

        settings = {"dataset": {k: v for k, v in dataset.items() if k != "val_size"},
                    "class": f"held to {self.hold}" if self.hold else machine()["class"]}
        found = self.keep / "settings.json"
        if found.is_file():
            kept = json.loads(found.read_text())
            if kept != settings:
                differ = ", ".join(k for k in settings if kept.get(k) != settings[k])
                raise ConfigError(f"--keep: {self.keep} holds models of another configuration ({differ} differ: "
                                  f"{kept}); choose another folder")
        else:
            self.keep.mkdir(parents=True, exist_ok=True)
            write_json(found, settings)

    def _run(self, command: list[str], log: str) -> float:
        """Run ``python -m COMMAND`` with its output in ``logs/LOG.log``; its wall time."""
        log = self.keep / "logs" / f"{log}.log"
        log.parent.mkdir(exist_ok=True)
        start = time.perf_counter()
        with log.open("w") as out:
            done = subprocess.run([sys.executable, "-m", *command], cwd=REPO, env=self.env, stdout=out,
                                  stderr=subprocess.STDOUT, preexec_fn=parent_death_signal)
        if done.returncode:
            raise RunFailed(f"{' '.join(command[:3])}... exited with {done.returncode}; its log: {log}")
        return round(time.perf_counter() - start, 1)

    def data(self, raw: dict) -> Path:
        """The prepared and cached dataset of ``raw`` (made once per dataset section, in place: the cache
        names its images' folder; ``done`` marks it finished, and an unfinished one is made again)."""
        folder = self.keep / f"data-{digest(raw['dataset'])}"
        if not (folder / "done").is_file():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
            (folder / "params.yaml").write_text(yaml.safe_dump(raw))
            self._run(["stages.prepare", "--params", str(folder / "params.yaml"), "--out", str(folder / "prepared"),
                       "--metrics", str(folder / "dataset.json")], f"prepare-{folder.name}")
            self._run(["stages.cache", "--prepared", str(folder / "prepared"), "--out", str(folder / "cache")],
                      f"cache-{folder.name}")
            (folder / "done").touch()
        return folder

    def model(self, raw: dict, data: Path) -> Path:
        """The model trained on ``raw`` (kept under its training key and seed)."""
        folder = self._model_folder(raw)
        if not (folder / "model.pth").is_file():
            print(f"seed {raw['seed']}: training ({folder.name})", file=sys.stderr, flush=True)
            with atomic_dir(folder) as tmp:
                params = tmp / "params.yaml"
                params.write_text(yaml.safe_dump(raw, sort_keys=False))
                seconds = self._run(["pipelines.launch", "--params", str(params), "--run-file",
                                     str(tmp / "checkpoints" / "run.json"), "stages.train", "--cache",
                                     str(data / "cache"), "--checkpoints", str(tmp / "checkpoints"),
                                     "--model", str(tmp / "model.pth"), "--run", str(tmp / "run.json"),
                                     "--train-log", str(tmp / "log.csv"), "--preview", str(tmp / "preview.png")],
                                    f"train-{folder.name}")
                shutil.rmtree(tmp / "checkpoints")
                write_json(tmp / "seconds.json", {"train": seconds})
        return folder

    def _model_folder(self, raw: dict) -> Path:
        return self.keep / "models" / f"{training_key(raw)}-s{raw['seed']}"

    def _evaluation_folder(self, raw: dict, model: str) -> Path:
        return self.keep / "evaluations" / f"{evaluation_key(raw, model)}-s{raw['seed']}"

    def arm(self, raw: dict, data: Path, images: range, gt: Path, ids: set[int]):
        """``raw``'s model scored on ``images``: its run (model, its SHA-256, precision, figures, seconds) and
        the per-image matches, or None for the matches where the run is reused from ``records``. An
        evaluation kept in the folder comes first (it has its matches), then a record, then training and
        evaluating; a run that ran is written to ``records``."""
        from benchmarks.record import machine
        from pipelines import ap_bootstrap, checkpoint
        from pipelines.evaluation import image_matches

        record = None
        if self.records is not None:
            key = arm_key(raw, images, self.hold)
            record = self.records / f"{digest(key)}.json"
            kept = self._evaluation_folder(raw, key["model"]) / "detections.json"
            if record.is_file() and not kept.is_file():
                return json.loads(record.read_text())["run"], None
        model = self.model(raw, data)
        detections, seconds = self.detections(raw, data, model)
        matches = image_matches(gt, [d for d in detections if d["image_id"] in ids])
        point = ap_bootstrap.figures(matches)
        run = {"model": model.name, "model_sha256": hashlib.sha256((model / "model.pth").read_bytes()).hexdigest(),
               "precision": checkpoint.load(model / "model.pth")["precision"],
               "figures": {k: None if np.isnan(v) else float(v) for k, v in zip(ap_bootstrap.FIGURES, point)},
               "seconds": {**json.loads((model / "seconds.json").read_text()), **seconds}}
        if record is not None and not record.is_file():
            record.parent.mkdir(parents=True, exist_ok=True)
            write_json(record, {"key": key, "run": run, "machine": machine()})
        return run, matches

    def detections(self, raw: dict, data: Path, model: Path) -> tuple[list[dict], dict]:
        """The detections of ``model`` on the whole val split with ``raw``'s evaluate settings (kept), and the
        evaluation's wall time."""
        folder = self._evaluation_folder(raw, model.name)
        if not (folder / "detections.json").is_file():
            print(f"seed {raw['seed']}: evaluating ({folder.name})", file=sys.stderr, flush=True)
            with atomic_dir(folder) as tmp:
                params = tmp / "params.yaml"
                params.write_text(yaml.safe_dump(raw, sort_keys=False))
                out = {name: str(tmp / f"{name}.json") for name in ("metrics", "per_category", "ids", "pr", "run")}
                seconds = self._run(["pipelines.launch", "--params", str(params), "--single-node", "--run-file",
                                     out["run"], "stages.evaluate", "--cache", str(data / "cache"), "--prepared",
                                     str(data / "prepared"), "--model", str(model / "model.pth"), "--train-run",
                                     str(model / "run.json"), "--metrics", out["metrics"], "--per-category",
                                     out["per_category"], "--run-ids", out["ids"], "--plots", out["pr"],
                                     "--detections", str(tmp / "detections.json")], f"evaluate-{folder.name}")
                write_json(tmp / "seconds.json", {"evaluate": seconds})
        return json.loads((folder / "detections.json").read_text()), json.loads((folder / "seconds.json").read_text())


def subset_ground_truth(data: Path, images: range) -> tuple[Path, set[int]]:
    """The val ground truth restricted to ``images`` (by index in the val split), written once."""
    path = data / f"val-{images.start}-{images.stop - 1}.json"
    gt = json.loads((data / "prepared" / "val.json").read_text())
    if images.stop > len(gt["images"]):
        raise ConfigError(f"--images: the val split has {len(gt['images'])} images, asked for up to {images.stop - 1}")
    chosen = gt["images"][images.start:images.stop]
    ids = {im["id"] for im in chosen}
    if not path.is_file():
        write_json(path, {**gt, "images": chosen, "annotations": [a for a in gt["annotations"] if a["image_id"] in ids]})
    return path, ids


def t_interval(values: list[float], level: float = 0.95) -> tuple[float, float]:
    from scipy import stats

    n = len(values)
    mean, sd = statistics.fmean(values), statistics.stdev(values)
    half = stats.t.ppf(0.5 + level / 2, n - 1) * sd / math.sqrt(n)
    return mean - half, mean + half


def verdict(per_seed: list[float], ci: tuple[float, float], *, saves_time: bool) -> str:
    margin = SAVING_MARGIN if saves_time else ADOPT_MARGIN
    return "adopt" if ci[0] > margin and min(per_seed) >= WORST_SEED else "reject"


def compare(args) -> dict:
    seeds, images = parse_seeds(args.seeds), parse_images(args.images)
    arms = {"baseline": compose(args.baseline, images), "candidate": compose(args.baseline + args.set, images)}
    if arms["baseline"] == arms["candidate"]:
        raise ConfigError(f"-S: {' '.join(args.set) or '(nothing)'} leaves the baseline as it is: nothing to compare")
    runner = Runner(args.keep, args.hold, arms["baseline"]["dataset"], args.records)
    data = runner.data(arms["baseline"])
    gt, ids = subset_ground_truth(data, images)
    runs, matches = {}, {}
    for seed in seeds:  # every run kept as it finishes
        for arm, raw in arms.items():
            runs[arm, seed], matches[arm, seed] = runner.arm({**raw, "seed": seed}, data, images, gt, ids)
    from pipelines import ap_bootstrap

    precisions = sorted({r["precision"] for r in runs.values()})
    if len(precisions) > 1:  # e.g. a candidate that sets model.precision: not a comparison of one arithmetic
        raise ConfigError(f"the arms trained in different precisions ({', '.join(precisions)}); compare within one")
    per_seed = {seed: {k: _delta(runs["candidate", seed]["figures"], runs["baseline", seed]["figures"], k)
                       for k in COMPARED} for seed in seeds}
    deltas = [per_seed[s]["AP"] for s in seeds]
    ci = t_interval(deltas)
    # the paired image bootstrap: the same resampled images for every arm and seed (not for runs reused
    # from records, which keep no per-image matches)
    order = [(arm, seed) for seed in seeds for arm in ARMS]
    boot = None
    if all(matches[k] is not None for k in order):
        drawn = ap_bootstrap.resampled_figures([matches[k] for k in order], args.resamples, seed=0)
        ap = drawn[:, :, ap_bootstrap.FIGURES.index("AP")].reshape(args.resamples, len(seeds), 2)
        mean_deltas = (ap[:, :, 1] - ap[:, :, 0]).mean(axis=1)
        boot = [float(x) for x in np.quantile(mean_deltas, [0.025, 0.975])]
    return {"name": args.name or " ".join(args.set), "baseline": args.baseline, "candidate": args.set,
            "seeds": seeds, "images": [images.start, images.stop - 1], "hold": args.hold, "precision": precisions[0],
            "saves_time": args.saves_time,
            "runs": [{"arm": arm, "seed": seed, **runs[arm, seed]} for seed in seeds for arm in ARMS],
            "per_seed": {str(s): per_seed[s] for s in seeds},
            "per_seed_delta": {str(s): per_seed[s]["AP"] for s in seeds},
            "mean_delta": statistics.fmean(deltas), "ci95": list(ci), "bootstrap95": boot,
            "reused": sum(matches[k] is None for k in order),
            "mean": {k: statistics.fmean(v for s in seeds if (v := per_seed[s][k]) is not None) for k in COMPARED
                     if any(per_seed[s][k] is not None for s in seeds)},
            "verdict": verdict(deltas, ci, saves_time=args.saves_time)}


def _delta(candidate: dict, baseline: dict, key: str) -> float | None:
    if candidate.get(key) is None or baseline.get(key) is None:
        return None
    return candidate[key] - baseline[key]


def log_to_mlflow(f: dict, experiment: str) -> str:
    """A parent run for the comparison, one child per arm and seed; the parent's id."""
    import mlflow

    from pipelines.tracking import store

    client = mlflow.MlflowClient(tracking_uri=store.tracking_uri())
    exp = store.experiment_id(client, experiment, artifact_location=store.artifact_location(experiment))
    parent = client.create_run(exp, run_name=f"compare: {f['name']}", tags={"compare.verdict": f["verdict"]})
    pid = parent.info.run_id
    client.log_param(pid, "candidate", " ".join(f["candidate"]))
    client.log_param(pid, "baseline", " ".join(f["baseline"]) or "(conf/)")
    client.log_param(pid, "seeds", ",".join(map(str, f["seeds"])))
    client.log_param(pid, "images", "{}-{}".format(*f["images"]))
    for name, value in (("mean_delta_AP", f["mean_delta"]), ("ci95_low", f["ci95"][0]), ("ci95_high", f["ci95"][1]),
                        *(zip(("bootstrap95_low", "bootstrap95_high"), f["bootstrap95"] or ()))):
        client.log_metric(pid, name, value)
    for r in f["runs"]:
        child = client.create_run(exp, run_name=f"{r['arm']} seed {r['seed']}",
                                  tags={"mlflow.parentRunId": pid, "compare.arm": r["arm"]})
        client.log_param(child.info.run_id, "seed", r["seed"])
        client.log_param(child.info.run_id, "overrides",
                         " ".join(f["baseline"] + (f["candidate"] if r["arm"] == "candidate" else [])) or "(conf/)")
        for k, v in r["figures"].items():
            if v is not None:
                client.log_metric(child.info.run_id, k, v)
        client.set_terminated(child.info.run_id)
    client.set_terminated(pid)
    return pid


def _fmt(value: float | None, sign: bool = True) -> str:
    return "-" if value is None else (f"{value:+.3f}" if sign else f"{value:.3f}")


def table(f: dict) -> str:
    against = f" ({' '.join(f['baseline'])})" if f.get("baseline") else " (the default configuration)"
    lines = [f"`{f['name']}` against the baseline{against}, seeds {', '.join(map(str, f['seeds']))}, val images "
             "{}-{}".format(*f["images"]) + (f", held to {f['hold']}" if f["hold"] else "") + f", {f['precision']}.", "",
             "| seed | AP base | AP cand | " + " | ".join(f"Δ{k}" for k in COMPARED) + " |",
             "|---|---|---|" + "---|" * len(COMPARED)]
    base = {r["seed"]: r for r in f["runs"] if r["arm"] == "baseline"}
    cand = {r["seed"]: r for r in f["runs"] if r["arm"] == "candidate"}
    for s in f["seeds"]:
        d = f["per_seed"][str(s)]
        lines.append(f"| {s} | {_fmt(base[s]['figures']['AP'], False)} | {_fmt(cand[s]['figures']['AP'], False)} | "
                     + " | ".join(_fmt(d[k]) for k in COMPARED) + " |")
    lines.append("| mean | | | " + " | ".join(_fmt(f["mean"].get(k)) for k in COMPARED) + " |")
    boot = (f"paired image bootstrap 95% [{f['bootstrap95'][0]:+.4f}, {f['bootstrap95'][1]:+.4f}]"
            if f["bootstrap95"] else f"no paired image bootstrap ({f['reused']} runs reused from records keep no "
            "per-image matches)")
    if all(base[s].get("model_sha256") and base[s].get("model_sha256") == cand[s].get("model_sha256")
           and base[s]["figures"] == cand[s]["figures"] for s in f["seeds"]):
        lines += ["", "Both arms are the very same models, scored alike: the candidate trains and evaluates as the "
                      "baseline does (ΔAP 0 by construction, not by chance)."]
    lines += ["", f"Mean ΔAP {f['mean_delta']:+.4f}, t 95% interval [{f['ci95'][0]:+.4f}, {f['ci95'][1]:+.4f}], "
                  f"{boot}; verdict: **{f['verdict']}**."]
    return "\n".join(lines)


def add_run_arguments(parser: argparse.ArgumentParser, *, images: str) -> None:
    """The arguments of what runs and where it is kept, shared with ``benchmarks.default_ap``."""
    parser.add_argument("--baseline", action="append", default=[], metavar="OVERRIDE",
                        help="a Hydra override of every run (e.g. profile=ci); none: the configuration in conf/")
    parser.add_argument("--seeds", default="0-4", help="the seeds, e.g. 0-4 or 0,2,5 (default 0-4)")
    parser.add_argument("--images", default=images, help=f"the val images scored, by index (default {images})")
    parser.add_argument("--keep", type=Path, default=REPO / "outputs" / "compare",
                        help="where models and detections are kept and found again (default outputs/compare)")
    parser.add_argument("--hold", choices=[k for k in CLASSES if k != "native"], help="run the stages held to this class")
    parser.add_argument("--records", type=Path, default=RECORDS,
                        help="where each finished arm's figures are written and found again across checkouts "
                             "(default benchmarks/records/arms)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-S", "--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a Hydra override of the candidate (repeat for several)")
    add_run_arguments(parser, images="0-1023")
    parser.add_argument("--saves-time", action="store_true", help="the candidate saves compute: adopt above -0.005")
    parser.add_argument("--resamples", type=int, default=1000, help="image bootstrap resamples (default 1000)")
    parser.add_argument("--name", help="the comparison's name (default: the -S overrides)")
    parser.add_argument("--experiment", default="compare", help="the MLflow experiment of its runs")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args(argv)
    if args.resamples < 100:
        raise ConfigError(f"--resamples: expected at least 100, got {args.resamples}")
    figures = compare(args)
    figures["mlflow_run_id"] = log_to_mlflow(figures, args.experiment)
    print(json.dumps(figures) if args.json else table(figures))


if __name__ == "__main__":
    cli.run(main)
