"""The search's confirm stage: the best candidates and fixed presets trained by the train stage, scored on the
held-out images, the best written as the policy file that ``augment=searched`` trains with; a confirm killed
at any moment resumes to the uninterrupted result without training a kept run again."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import mlflow
import pytest
import yaml

from pipelines.compose import compose_params
from pipelines.config.load import params_from_dict, read_policy_file
from pipelines.errors import ConfigError
from pipelines.policy import PUBLISHED_POLICY
from pipelines.search.confirm import Arm, arms, policy_file, table, verdict
from pipelines.search.genome import key
from pipelines.search.space import space
from pipelines.tracking.run import write_run_file
from pipelines.tracking.tracker import Tracker
from stages import confirm as stage

from .confirm_probe import train_in_this_process
from .conftest import REPO, set_dotted
from .test_pipeline import TINY_ONE_PROCESS

GENOME = [(g + 3) % 10 for g in PUBLISHED_POLICY]  # a candidate of the search: any valid genes


@pytest.fixture(scope="module")
def tiny() -> dict:
    """The tiny params of the end-to-end tests (composed once)."""
    return yaml.safe_load(compose_params(REPO, TINY_ONE_PROCESS))


def _with(raw: dict, **dotted) -> dict:
    tree = json.loads(json.dumps(raw))
    for name, value in dotted.items():
        set_dotted(tree, name.replace("__", "."), value)
    return tree


@pytest.fixture(scope="module")
def search_data(tmp_path_factory):
    """A search's prepared data and caches: 8 search-train images, 4 held out (``val``)."""
    from pipelines.data.annotation_cache import build_cache
    from pipelines.data.synthetic import generate_split

    root = tmp_path_factory.mktemp("search")
    for split, size, seed in (("train", 8, 1), ("val", 4, 2)):
        coco = generate_split(root / "prepared" / split, split=split, size=size, seed=seed, num_classes=5,
                              min_side=128, max_side=192, min_objects=2, max_objects=4)
        (root / "prepared" / f"{split}.json").write_text(json.dumps(coco))
        build_cache(root / "prepared" / f"{split}.json", root / "cache" / split,
                    image_root=str(root / "prepared" / split), drop_empty=split == "train")
    return root


def test_the_confirm_stage_trains_each_arm_with_the_train_stage_and_writes_the_best(search_data, tiny, tmp_path,
                                                                                    monkeypatch, restore_logging):
    """One candidate and a missing preset (skipped with a warning), one seed: the train stage trains it as
    ``augment=searched`` would, as a child run of the search's MLflow run; the table, the policy file and the
    held-out figures on the run. Run again (with another setting of the search), it trains nothing and writes
    the same."""
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.setenv("DVC_ROOT", str(tmp_path))  # the store's artifacts go there too
    commands = []

    train_in_this_process(monkeypatch, commands)
    raw = _with(tiny, confirm__top_k=1, confirm__seeds=1, confirm__arms=["no_such_preset"],
                model__precision="fp32", train__max_iter=2)
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump(raw, sort_keys=False))
    ranked = tmp_path / "ranked.json"
    ranked.write_text(json.dumps([{"genome": GENOME, "key": key(GENOME, 5), "score": 0.1},
                                  {"genome": list(PUBLISHED_POLICY), "key": key(PUBLISHED_POLICY, 5), "score": 0.2}]))
    parent = Tracker.start(experiment="detection", params={}, run_name="search")
    parent.finish()
    write_run_file(tmp_path / "search_run.json", run_id=parent.run_id, experiment="detection", status="finished")
    out = {name: tmp_path / name for name in ("confirm", "policy.json", "confirm_metrics.json")}
    argv = ["--params", str(params), "--cache", str(search_data / "cache"), "--prepared", str(search_data / "prepared"),
            "--ranked", str(ranked), "--search-run", str(tmp_path / "search_run.json"), "--out", str(out["confirm"]),
            "--policy", str(out["policy.json"]), "--metrics", str(out["confirm_metrics.json"])]
    stage.main(argv)
    assert len(commands) == 1

    figures = json.loads(out["confirm_metrics.json"].read_text())
    assert figures["winner"] == "search-1" and figures["seeds"] == [0] and set(figures["arms"]) == {"search-1"}
    entry = figures["arms"]["search-1"]
    assert entry["key"] == key(GENOME, 5) and entry["AP"] == entry["AP_s0"] == figures["winner_AP"]
    policy = json.loads(out["policy.json"].read_text())
    assert policy["policy"] == GENOME and policy["scale_splits"] == [52, 262, 1311]  # the search's bounds at 128
    kept = json.loads((out["confirm"] / f"g{key(GENOME, 5)}-s0.json").read_text())
    assert kept["AP"] == entry["AP"]
    trained = yaml.safe_load((out["confirm"] / f"g{key(GENOME, 5)}-s0" / "params.yaml").read_text())
    assert trained["augment"]["name"] == "sa_autoaug" and trained["train"] == {**raw["train"], "stop_at": 1.0}

    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")  # not the process's (another test's) URI
    (run,) = client.search_runs([parent.experiment_id], f"tags.`mlflow.parentRunId` = '{parent.run_id}'")
    assert run.info.run_id == kept["training_run_id"] and run.data.tags["pipeline.stage"] == "train"
    assert json.loads(run.data.params["augment.policy"]) == GENOME  # read from the candidate's policy file
    assert run.data.metrics["heldout/AP"] == pytest.approx(entry["AP"])
    assert client.get_run(parent.run_id).data.metrics["confirm/search-1/AP"] == pytest.approx(entry["AP"])

    before = {name: path.read_text() for name, path in out.items() if path.is_file()}
    params.write_text(yaml.safe_dump(_with(raw, search__rounds=9), sort_keys=False))  # another search setting
    stage.main(argv)
    assert len(commands) == 1  # the kept run was not trained again
    assert {name: path.read_text() for name, path in out.items() if path.is_file()} == before


def test_a_killed_confirm_resumes_to_the_uninterrupted_table_without_training_a_kept_run_again(tmp_path):
    """SIGKILL of the confirm loop (a made-up training, tests/confirm_probe.py) after two runs were kept."""
    def probe(folder, *extra):
        return [sys.executable, "-m", "tests.confirm_probe", str(folder), *extra]

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    expected = subprocess.run(probe(tmp_path / "whole"), cwd=REPO, env=env, capture_output=True, text=True, check=True)
    folder = tmp_path / "killed"
    process = subprocess.Popen(probe(folder, "--delay", "0.3"), cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while len(list(folder.glob("*.json"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(process.pid, signal.SIGKILL)
    process.wait(timeout=30)
    kept = {p.stem for p in folder.glob("*.json")}
    assert 2 <= len(kept) < 6
    again = subprocess.run(probe(folder), cwd=REPO, env=env, capture_output=True, text=True, check=True)
    assert json.loads(again.stdout) == json.loads(expected.stdout)
    started = (folder / "ran.log").read_text().split()
    assert sorted(set(started)) == sorted(p.stem for p in folder.glob("*.json"))  # all six kept
    assert all(started.count(name) == 1 for name in kept)  # a kept run never starts again
    assert len(started) <= 7  # and at most the one run the kill interrupted starts twice


def test_the_presets_come_first_and_a_tie_goes_to_them():
    """A searched policy must beat the presets to be chosen; the one line when the published policy wins."""
    presets = {"sa_autoaug": {"name": "sa_autoaug", "policy": list(PUBLISHED_POLICY), "scale_splits": [1, 2, 3]},
               "flip": {"name": "flip"}, "searched": {"name": "sa_autoaug", "policy": None}}
    ranked = [{"genome": GENOME, "key": "a", "score": 0.1}, {"genome": GENOME, "key": "b", "score": 0.2}]
    found = arms(ranked, top_k=1, presets=["sa_autoaug", "trivial_zoom", "flip"], compose=presets.get,
                 scale_splits=[4, 5, 6], space=space("full", 5))
    assert [a.name for a in found] == ["sa_autoaug", "flip", "search-1"]
    assert found[0].genes == tuple(PUBLISHED_POLICY) and found[2].scale_splits == (4, 5, 6)
    rows = [{"arm": "sa_autoaug", "seed": 0, "AP": 0.5}, {"arm": "sa_autoaug", "seed": 1, "AP": 0.7},
            {"arm": "flip", "seed": 0, "AP": 0.55}, {"arm": "flip", "seed": 1, "AP": 0.6},
            {"arm": "search-1", "seed": 0, "AP": 0.7}, {"arm": "search-1", "seed": 1, "AP": 0.5}]
    figures = table(found, [0, 1], rows)
    assert figures["winner"] == "sa_autoaug" and figures["margin"] == 0  # a tie with search-1: the preset
    assert figures["arms"]["flip"]["AP_s1"] == 0.6 and figures["arms"]["flip"]["AP"] == pytest.approx(0.575)
    assert verdict(figures).startswith("the published policy won the confirmation (held-out AP 0.600")
    rows[4]["AP"] = 0.71
    assert table(found, [0, 1], rows)["winner"] == "search-1"


def test_the_policy_file_trains_the_winner_a_candidate_or_a_preset(tiny, tmp_path):
    """``augment=searched`` reads the confirmed policy: a candidate's genes and bounds, or a preset's whole
    augment section (the flip here)."""
    raw = _with(tiny, augment=yaml.safe_load(compose_params(REPO, ["augment=searched"]))["augment"])
    flip = yaml.safe_load(compose_params(REPO, ["augment=flip"]))["augment"]
    candidate = Arm("search-1", raw["augment"], genes=tuple(GENOME), scale_splits=(7, 8, 9), key="k", score=0.1)
    path = tmp_path / "policy.json"
    raw["augment"]["policy_file"] = str(path)
    p = params_from_dict(raw)
    path.write_text(json.dumps(policy_file(candidate, 5)))
    searched = read_policy_file(p)
    assert searched.augment.policy == GENOME and searched.augment.scale_splits == [7, 8, 9]
    path.write_text(json.dumps(policy_file(Arm("flip", flip), 5)))
    flipped = read_policy_file(p)
    assert flipped.augment.name == "flip" and flipped.augment.hflip_prob == flip["hflip_prob"]
    assert flipped.augment.policy is None and flipped.augment.policy_file == str(path)
    path.write_text(json.dumps({"arm": "flip", "augment": {**flip, "hflip_prob": 2}}))
    with pytest.raises(ConfigError, match=r"augment.policy_file: .*policy.json: augment.hflip_prob"):
        read_policy_file(p)


@pytest.mark.parametrize("setting, message", [
    ({"confirm__arms": ["flip", "flip"]}, "confirm.arms: expected distinct augment preset names"),
    ({"confirm__arms": ["searched"]}, "confirm.arms: expected distinct augment preset names"),
    ({"confirm__arms": [], "confirm__top_k": 0}, "confirm.top_k: expected at least one policy"),
    ({"confirm__seeds": 0}, "confirm.seeds: expected at least 1"),
    ({"confirm__fraction": 0}, "confirm.fraction: expected a fraction in (0, 1]"),
    ({"confirm__top_k": 4, "search__rescore_top_k": 3}, "confirm.top_k: expected at most search.rescore_top_k (3)"),
])
def test_bad_confirm_settings_are_one_line_errors(tiny, setting, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        params_from_dict(_with(tiny, **setting), source="params.yaml")
