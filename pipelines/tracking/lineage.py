"""Lineage of a stage's MLflow run: its tags (stage, params hash, data and upstream outputs, git commit,
DVC experiment), its readable name and its description in the UI; and the way back, from a run to the
DVC experiment that made it and from an experiment to its runs (:func:`describe_run`,
:func:`describe_experiment`, which ``python -m stages.lineage`` prints)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import subprocess
from pathlib import Path
from typing import Any

from ..errors import TrackingError
from .store import find_runs, get_run, tracking_uri
from .wording import address

log = logging.getLogger("pipelines.tracking")

UI_URL = "http://127.0.0.1:5000"
"""Where ``mlflow ui`` (and ``mlflow server``) serve by default; run URLs of a local store are given under it."""
STAGE_TAG = "pipeline.stage"  # train | evaluate
TRAINING_RUN_TAG = "training_run_id"  # on an evaluation run: the training run whose model it scored
EXP_NAME_TAG, BASELINE_TAG, COMMIT_TAG = "dvc.exp_name", "dvc.baseline_rev", "mlflow.source.git.commit"
PARAMS_HASH_TAG = "params.sha256"
NOTE_TAG = "mlflow.note.content"  # the run's description in the UI (Markdown)
PARENT_TAG = "mlflow.parentRunId"  # how MLflow's UI nests a run under another
PARENT_RUN_ENV = "PIPELINES_PARENT_RUN_ID"  # set by a stage whose runs are another run's children (the search's confirm)
_TAG_KEY = re.compile(r"[^\w./ :-]")  # characters MLflow does not take in a tag key


def git(*args: str, cwd: Path | None = None) -> str | None:
    """Output of ``git ARGS`` in ``cwd`` (the current folder by default), stripped; None if it fails."""
    try:
        done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def git_commit(cwd: Path | None = None) -> str | None:
    return git("rev-parse", "HEAD", cwd=cwd) or None


def environment_tags(root: Path) -> dict[str, str]:
    """The tags every run gets from where it runs: ``pipeline``, the git commit of ``root``, the DVC
    experiment's name and baseline when DVC sets ``DVC_EXP_NAME`` and ``DVC_EXP_BASELINE_REV``, and the
    parent run (:data:`PARENT_TAG`) that :data:`PARENT_RUN_ENV` names (the search's confirm sets it for the
    trainings it starts)."""
    tags = {"pipeline": "detection"}
    if commit := git_commit(root):
        tags[COMMIT_TAG] = commit
    if exp_name := os.environ.get("DVC_EXP_NAME"):
        tags[EXP_NAME_TAG] = exp_name
    if baseline := os.environ.get("DVC_EXP_BASELINE_REV"):
        tags[BASELINE_TAG] = baseline
    if parent := os.environ.get(PARENT_RUN_ENV):
        tags[PARENT_TAG] = parent
    return tags


def _shown(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))


def describe_changes(params: dict[str, Any], defaults: dict[str, Any], *, first: tuple[str, ...] = (),
                     limit: int = 60) -> str:
    """The params (dotted keys) that differ from ``defaults``, as ``key=value`` pairs: those starting
    with ``first`` come first, then in key order; at most ``limit`` characters, the rest counted, e.g.
    ``evaluate.tta=true, train.max_iter=4 (+12 more)``. Empty if nothing differs."""
    changed = sorted((k for k in params if params[k] != defaults.get(k, object())),
                     key=lambda k: (not k.startswith(first) if first else False, k))
    shown: list[str] = []
    for i, key in enumerate(changed):
        pair = f"{key}={_shown(params[key])}"
        rest = len(changed) - i - 1
        if shown and len(", ".join([*shown, pair])) + (len(f" (+{rest} more)") if rest else 0) > limit:
            return ", ".join(shown) + f" (+{len(changed) - i} more)"
        shown.append(pair)
    return ", ".join(shown)


def run_name(stage: str, params: dict[str, Any], defaults: dict[str, Any] | None, *,
              first: tuple[str, ...] = ()) -> str:
    """A readable MLflow run name: the DVC experiment name (``DVC_EXP_NAME``) when DVC sets it, else the
    params changed against ``defaults`` (see :func:`describe_changes`; None when they are unknown), else
    ``<stage> <8 hex digits of the params' hash>``. Training runs end in `` (train)``."""
    label = os.environ.get("DVC_EXP_NAME") or (describe_changes(params, defaults, first=first) if defaults else "")
    if not label:
        digest = hashlib.sha256(json.dumps(params, sort_keys=True, default=str).encode()).hexdigest()[:8]
        return f"{stage} {digest}"
    return label if stage == "evaluate" else f"{label} ({stage})"


def baseline_params(params_file: str | Path = "params.yaml") -> dict[str, Any] | None:
    """The params (dotted keys) that ``params_file`` held in the commit a run starts from, for
    :func:`run_name`: the DVC experiment's baseline (``DVC_EXP_BASELINE_REV``), else ``HEAD``. A record
    that exists already, so nothing is composed. None where git has none (logged at INFO)."""
    from omegaconf import OmegaConf

    from ..config.load import to_flat_dict
    from ..config.yamlio import parse_yaml
    from ..errors import ConfigError

    rev = os.environ.get("DVC_EXP_BASELINE_REV") or "HEAD"
    path = Path(params_file).resolve()
    text = git("show", f"{rev}:./{path.name}", cwd=path.parent)
    if text is None:
        log.info("%s has no committed version at %s: run names use a hash", params_file, rev)
        return None
    try:
        tree = OmegaConf.to_container(parse_yaml(text, f"{rev}:{params_file}"))
    except ConfigError as err:
        log.info("%s: run names use a hash", err)
        return None
    return to_flat_dict(tree) if isinstance(tree, dict) else None


def training_note(run_id: str) -> str:
    """The UI description of a training run."""
    return (f"Training run: loss curves, model and checkpoints. Each evaluation of its model is a run of its own, "
            f"tagged `{TRAINING_RUN_TAG}` = `{run_id}` (search `tags.{TRAINING_RUN_TAG} = '{run_id}'`).")


def evaluation_note(training_run_id: str | None, experiment_id: str | None) -> str:
    """The UI description of an evaluation run, linking to its training run."""
    if not training_run_id:
        return "Evaluation run; the model's training was not tracked."
    link = f"[{training_run_id}](#/experiments/{experiment_id}/runs/{training_run_id})" if experiment_id \
        else f"`{training_run_id}`"
    return f"Evaluation run: params and `eval/*` metrics of this configuration. Model from training run {link}."


CODE_FOLDERS = ("pipelines/", "stages/")  # code deps: the git commit (or DVC experiment) pins them


def _lock_tags(lock_file: Path, stage: str) -> dict[str, str]:
    """``dvc.lock/<stage>/<path>: <md5>`` for every dep and out that is not code (:data:`CODE_FOLDERS`)
    of the stages before ``stage`` (in the order of ``dvc.yaml`` beside ``lock_file``, else of the
    lock file): the data and model that ``stage`` reads, and the data they were made from. These
    entries are final when ``stage`` runs (DVC writes a stage's own entry only after it ends)."""
    stages = _bounded_yaml(lock_file).get("stages") or {}
    pipeline = lock_file.with_name("dvc.yaml")
    order = list(_bounded_yaml(pipeline).get("stages") or {}) if pipeline.is_file() else []
    order += [name for name in stages if name not in order]
    tags = {}
    for name in order[: order.index(stage)] if stage in order else []:
        entry = stages.get(name) or {}
        for item in [*(entry.get("deps") or []), *(entry.get("outs") or [])]:
            digest = item.get("md5") or item.get("etag") or item.get("checksum")
            if item.get("path") and digest and not str(item["path"]).startswith(CODE_FOLDERS):
                tags[_TAG_KEY.sub("_", f"dvc.lock/{name}/{item['path']}")[:250]] = str(digest)
    return tags


def _bounded_yaml(path: Path) -> dict:
    """A YAML mapping read with the size and alias-expansion bounds of ``params.yaml``; ``{}`` where it
    is unusable (lineage tags are worth no stop)."""
    from omegaconf import OmegaConf

    from ..config.yamlio import parse_yaml, read_yaml_text
    from ..errors import ConfigError

    try:
        tree = OmegaConf.to_container(parse_yaml(read_yaml_text(path), str(path)))
    except ConfigError as err:
        log.info("%s: not used for lineage tags (%s)", path, err)
        return {}
    return tree if isinstance(tree, dict) else {}


def stage_tags(stage: str, *, params_file: str | Path, cache: str | Path | None = None,
               lock_file: str | Path = "dvc.lock") -> dict[str, str]:
    """The lineage tags of a stage's run, from files in the stage's working folder:

    * ``pipeline.stage``: ``stage``; ``params.sha256``: SHA-256 of ``params_file``'s bytes;
    * ``data.cache.<split>``: SHA-256 of the array hashes in ``<cache>/<split>/meta.json`` (the
      annotation cache's content), for every split there;
    * ``dvc.lock/<stage>/<path>``: the md5 that ``lock_file`` records for each dep and out, code
      aside, of the stages that run before ``stage`` (the data and model it reads), if there is one.

    The git commit and DVC experiment name and baseline are added by :meth:`Tracker.start`. A file
    that cannot be read leaves its tags out (logged at INFO): tracking never stops a stage."""
    tags = {STAGE_TAG: stage}
    try:
        tags[PARAMS_HASH_TAG] = hashlib.sha256(Path(params_file).read_bytes()).hexdigest()
        for meta in sorted(Path(cache).glob("*/meta.json")) if cache else []:
            arrays = json.loads(meta.read_text())["arrays"]
            digest = hashlib.sha256(json.dumps(arrays, sort_keys=True).encode())
            tags[f"data.cache.{meta.parent.name}"] = digest.hexdigest()
        if Path(lock_file).is_file():
            tags.update(_lock_tags(Path(lock_file), stage))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        log.info("lineage tags left incomplete: %s: %s", type(err).__name__, err)
    return tags


def ui_url(uri: str | None = None) -> str:
    """Where the MLflow UI of the store ``uri`` (default the pipeline's) is: a tracking server serves it at its
    own URL (without a user or password in it); a local store's at :data:`UI_URL`, once ``mlflow ui`` runs."""
    uri = uri or tracking_uri()
    if uri.startswith(("http://", "https://")):
        return address(uri).replace("***@", "", 1).rstrip("/")
    return UI_URL


def run_url(experiment_id: str, run_id: str, base: str | None = None) -> str:
    """The run's page in the MLflow UI served at ``base`` (default :func:`ui_url`)."""
    return f"{base or ui_url()}/#/experiments/{experiment_id}/runs/{run_id}"


# --- from a run to its experiment and back (``python -m stages.lineage``) ------------------------------------

RUN_IDS_FILE = "metrics/run.json"  # written by the evaluate stage (dvc.yaml)
RUN_ID = re.compile(r"[0-9a-f]{32}")


def describe_run(run) -> str:
    """What made ``run`` and how to restore it."""
    tags, info = run.data.tags, run.info
    lines = [f"MLflow run {info.run_id} ({tags.get(STAGE_TAG, 'run')} \"{info.run_name}\", {info.status})",
             f"  {run_url(info.experiment_id, info.run_id)}"]
    if training := tags.get(TRAINING_RUN_TAG):
        lines.append(f"  model from training run {training}")
    commit, exp, baseline = tags.get(COMMIT_TAG), tags.get(EXP_NAME_TAG), tags.get(BASELINE_TAG)
    params_hash = tags.get(PARAMS_HASH_TAG)
    experiment = (exp + (f" (baseline {baseline})" if baseline else "")) if exp else "none (dvc repro)"
    lines += [f"  git commit:       {commit or 'unknown'}",
              f"  DVC experiment:   {experiment}",
              f"  params.yaml:      sha256 {params_hash or 'unknown'}"]
    lines += [f"  {key}: {value}" for key, value in sorted(tags.items()) if key.startswith("data.cache.")]
    lines.append("To restore its experiment:")
    if exp:
        lines.append(f"  dvc exp apply {exp}")
        if commit:
            lines.append(f"  (if it was removed: git checkout {commit}, then dvc exp run with the run's params)")
    elif commit:
        lines.append(f"  git checkout {commit} && dvc checkout   # the commit `dvc repro` ran on; the outputs are "
                     "there if they were committed")
    else:
        lines.append("  unknown: the run has no git commit")
    if params_hash:
        lines.append(f"then `sha256sum params.yaml` prints {params_hash} for exactly the params of this run.")
    return "\n".join(lines)


def describe_experiment(name: str) -> str:
    """The MLflow runs of a DVC experiment, git revision or the workspace, with their UI URLs."""
    where, recorded = _run_ids_at(name)
    ids = [v for v in (recorded.get("mlflow_run_id"), recorded.get("mlflow_training_run_id")) if v]
    runs = [r for r in map(get_run, ids) if r is not None] if ids else []
    if not runs and where.startswith("DVC experiment"):
        runs = find_runs(f"tags.`{EXP_NAME_TAG}` = '{name}'")
    if not runs:
        raise TrackingError(f"{name}: {where} has no MLflow run in {RUN_IDS_FILE} or the store")
    lines = [f"{where}:"]
    for run in runs:
        stage = run.data.tags.get(STAGE_TAG, "run")
        lines.append(f"  {stage:<9} {run.info.run_id}  \"{run.info.run_name}\"  {run.info.status}")
        lines.append(f"            {run_url(run.info.experiment_id, run.info.run_id)}")
    base = ui_url()
    lines.append(f"(URLs under {base}, where `mlflow ui --backend-store-uri sqlite:///mlflow.db` serves by default)"
                 if base == UI_URL else f"(URLs under {base}, the tracking server's UI)")
    return "\n".join(lines)


def _run_ids_at(name: str) -> tuple[str, dict]:
    """Where ``name`` points (in words) and the ``metrics/run.json`` recorded there (``{}`` if none)."""
    if name == "workspace":
        try:
            return "the workspace", _as_dict(open(RUN_IDS_FILE).read())
        except OSError:
            return "the workspace", {}
    refs = git("for-each-ref", "--format=%(refname)", "refs/exps") or ""
    matches = [ref for ref in refs.split() if ref.rsplit("/", 1)[-1] == name]
    if matches:
        where, rev = f"DVC experiment {name}", matches[0]
    elif (commit := git("rev-parse", "--verify", "--quiet", f"{name}^{{commit}}")) is not None:
        where, rev = f"git revision {name} ({commit[:12]})", commit
    elif RUN_ID.fullmatch(name):
        raise TrackingError(f"{name}: no such MLflow run in the store, DVC experiment or git revision")
    else:
        raise TrackingError(f"{name}: not an MLflow run id, DVC experiment or git revision of this repository")
    return where, _as_dict(git("show", f"{rev}:{RUN_IDS_FILE}") or "")


def _as_dict(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
