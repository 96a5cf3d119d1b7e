"""benchmarks.compare: paired comparisons over seeds, kept models, its record and its MLflow runs."""

from __future__ import annotations

import hashlib
import json

import mlflow
import pytest

from benchmarks import compare
from pipelines import cli
from pipelines.errors import ConfigError

TINY = ["--baseline", "profile=ci", "--images", "0-7", "--resamples", "200"]


@pytest.mark.parametrize("text, expected", [("0-4", [0, 1, 2, 3, 4]), ("3,1,2-3", [3, 1, 2]), (" 0 , 5 ", [0, 5])])
def test_seeds_are_read_as_ranges_and_lists(text, expected):
    assert compare.parse_seeds(text) == expected


@pytest.mark.parametrize("text, says", [("", "at least two seeds"), ("4-0", "runs backwards"), ("0-64", "at most 64"),
                                        ("a-b", "expected seeds"), ("3", "at least two seeds")])
def test_bad_seeds_are_one_line_naming_the_flag(text, says):
    with pytest.raises(ConfigError, match=says) as err:
        compare.parse_seeds(text)
    assert str(err.value).startswith("--seeds:") and "\n" not in str(err.value)


def test_the_t_interval_and_the_fixed_rule():
    low, high = compare.t_interval([0.01, 0.02, 0.03])
    assert low == pytest.approx(0.02 - 4.302653 * 0.01 / 3 ** 0.5, abs=1e-6) and high == pytest.approx(0.02 + 0.0248414, abs=1e-6)
    assert compare.verdict([0.01, 0.02], (0.001, 0.03), saves_time=False) == "adopt"
    assert compare.verdict([0.01, 0.02], (-0.001, 0.03), saves_time=False) == "reject"
    assert compare.verdict([0.01, 0.02], (-0.004, 0.03), saves_time=True) == "adopt"
    assert compare.verdict([0.08, -0.031], (0.001, 0.05), saves_time=False) == "reject"  # one seed collapsed


@pytest.mark.parametrize("args, says", [
    (["-S", "train.bogus=1"], "train.bogus"),
    (["-S", "train.base_lr=-1"], "train.base_lr"),
    (["-S", "train.max_iter=8"], "leaves the baseline as it is"),  # the ci profile's own value
    (["--seeds", "2-1"], "--seeds"),
    (["--images", "7"], "--images"),
])
def test_bad_input_is_one_line_and_starts_no_run(tmp_path, capsys, args, says):
    keep = tmp_path / "keep"
    candidate = [] if "-S" in args else ["-S", "train.base_lr=0.002"]
    with pytest.raises(SystemExit) as exit_:
        cli.run(compare.main, [*TINY, "--keep", str(keep), *candidate, *args])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and err.startswith("error:") and says in err and "\n" not in err
    assert not keep.exists()


def test_kept_models_of_another_configuration_are_refused(tmp_path, capsys):
    keep = tmp_path / "keep"
    keep.mkdir()
    (keep / "settings.json").write_text(json.dumps({"dataset": {"name": "synthetic", "seed": 7}, "class": "AVX2"}))
    with pytest.raises(SystemExit) as exit_:
        cli.run(compare.main, [*TINY, "-S", "train.base_lr=0.002", "--keep", str(keep), "--seeds", "0-1"])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and "another configuration" in err and "\n" not in err
    assert sorted(p.name for p in keep.iterdir()) == ["settings.json"]


def test_an_evaluation_only_candidate_is_scored_on_the_baselines_models_and_resumes(tmp_path, capsys, monkeypatch):
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    keep = tmp_path / "keep"
    records = tmp_path / "records"
    argv = [*TINY, "-S", "evaluate.tta=false", "--seeds", "0-1", "--keep", str(keep), "--json", "--name", "no-tta",
            "--records", str(records)]
    cli.run(compare.main, argv)
    f = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # two seeds, two arms; one model per seed: the candidate changes evaluation alone
    assert sorted(p.name.rsplit("-", 1)[1] for p in (keep / "models").iterdir()) == ["s0", "s1"]
    assert len(list((keep / "evaluations").iterdir())) == 4
    runs = {(r["arm"], r["seed"]): r for r in f["runs"]}
    assert runs["baseline", 0]["model"] == runs["candidate", 0]["model"] != runs["baseline", 1]["model"]
    assert set(f["per_seed_delta"]) == {"0", "1"} and f["verdict"] in ("adopt", "reject")
    deltas = [runs["candidate", s]["figures"]["AP"] - runs["baseline", s]["figures"]["AP"] for s in (0, 1)]
    assert [f["per_seed_delta"][s] for s in ("0", "1")] == pytest.approx(deltas)
    assert f["mean_delta"] == pytest.approx(sum(deltas) / 2)
    assert f["ci95"][0] <= f["mean_delta"] <= f["ci95"][1] and len(f["bootstrap95"]) == 2
    # MLflow: the parent run and one child per arm and seed, each with its AP
    client = mlflow.MlflowClient(tracking_uri=store)
    parent = client.get_run(f["mlflow_run_id"])
    assert parent.data.tags["compare.verdict"] == f["verdict"]
    assert parent.data.metrics["mean_delta_AP"] == pytest.approx(f["mean_delta"])
    children = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    assert sorted((c.data.tags["compare.arm"], c.data.params["seed"]) for c in children) == [
        ("baseline", "0"), ("baseline", "1"), ("candidate", "0"), ("candidate", "1")]
    assert {c.data.metrics["AP"] for c in children} == {r["figures"]["AP"] for r in f["runs"]}

    # stopped after some runs (an evaluation, and so its record, not written): only what is missing runs again,
    # and the figures are the same
    missing = sorted((keep / "evaluations").iterdir())[0]
    for record in records.iterdir():
        key = json.loads(record.read_text())["key"]
        if f"{key['evaluation']}-s{key['model'].rsplit('-s', 1)[1]}" == missing.name:
            record.unlink()
    for path in sorted(missing.iterdir()):
        path.unlink()
    missing.rmdir()
    cli.run(compare.main, argv)
    again = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert {k: again[k] for k in ("per_seed_delta", "ci95", "bootstrap95")} == \
        {k: f[k] for k in ("per_seed_delta", "ci95", "bootstrap95")}
    assert len(list((keep / "evaluations").iterdir())) == 4

    # the default's figures over seeds reuse the same kept models and evaluations
    from benchmarks import default_ap

    before = sorted(p.name for p in keep.rglob("*"))
    cli.run(default_ap.main, ["--baseline", "profile=ci", "--images", "0-7", "--seeds", "0-1", "--keep", str(keep),
                              "--records", str(records), "--json"])
    d = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert sorted(p.name for p in keep.rglob("*")) == before  # nothing trained or evaluated again
    assert [d["per_seed"][s]["AP"] for s in ("0", "1")] == [runs["baseline", s]["figures"]["AP"] for s in (0, 1)]
    assert d["mean_AP"] == pytest.approx((d["per_seed"]["0"]["AP"] + d["per_seed"]["1"]["AP"]) / 2)
    seed0 = keep / "models" / runs["baseline", 0]["model"] / "model.pth"
    assert d["seed0_model_sha256"] == hashlib.sha256(seed0.read_bytes()).hexdigest()

    # a new checkout keeps no models, only the committed records of each arm: the comparison is the same
    # without training or evaluating, and says that it has no image bootstrap
    assert len(list(records.iterdir())) == 4  # an arm per seed and evaluation; the candidate's reuses its model
    import shutil

    shutil.rmtree(keep)
    cli.run(compare.main, [a for a in argv if a != "--json"])
    shown = capsys.readouterr().out
    assert "no paired image bootstrap (4 runs reused from records" in shown and "verdict" in shown
    assert not (keep / "models").exists() and not (keep / "evaluations").exists()
    cli.run(compare.main, argv)
    reused = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert {k: reused[k] for k in ("per_seed_delta", "ci95", "verdict")} == {k: f[k] for k in ("per_seed_delta", "ci95", "verdict")}
    assert reused["bootstrap95"] is None and reused["reused"] == 4
    # records of other code are not reused, and the comparison says how many it found
    first = sorted(records.iterdir())[0]
    first.write_text(first.read_text().replace(compare.code_digest(), "0" * 16))
    cli.run(compare.main, argv)
    assert "1 arm records were made by other code" in capsys.readouterr().err
    # another hold (or another version of the code the stages import) is another key: nothing is reused
    assert compare.arm_key({**compare.compose(["profile=ci"], range(8)), "seed": 0}, range(8), "avx2") != \
        compare.arm_key({**compare.compose(["profile=ci"], range(8)), "seed": 0}, range(8), None)


def test_the_code_digest_covers_what_the_stages_import_and_nothing_else():
    modules = compare.stage_modules()
    assert {"stages.train", "stages.evaluate", "pipelines.model", "pipelines.evaluation", "pipelines.solver",
            "pipelines.data.autoaug.zoom"} <= set(modules)
    assert not any(m.startswith(("pipelines.team", "benchmarks", "stages.search")) for m in modules)


def test_the_training_key_ignores_evaluation_and_settings_left_off():
    from benchmarks.compare import compose, parse_images, training_key

    images = parse_images("0-127")
    base = compose([], images)
    key = training_key(base)
    assert training_key(compose(["evaluate.merge=nms", "confirm.seeds=3"], images)) == key
    assert training_key({**base, "seed": 7}) == key  # the seed names the folder, not the key
    # a lever added later, off (false or null), keeps the kept models' key; on, it changes it
    later = {**base, "model": {**base["model"], "a_later_lever": False, "another": None}}
    assert training_key(later) == key
    assert training_key({**base, "model": {**base["model"], "a_later_lever": True}}) != key
    assert training_key(compose(["train.base_lr=0.0015"], images)) != key


def test_a_searched_policy_file_is_keyed_by_the_policy_it_holds(tmp_path):
    """``augment=searched`` trains what its policy file holds: with the published genes and bounds, the
    published preset's very models (one key); with other genes, or a preset's section, other models."""
    import json

    from benchmarks.compare import compose, parse_images, training_key

    images = parse_images("0-127")
    published = compose([], images)
    searched = compose(["augment=searched"], images)
    genes = list(published["augment"]["policy"])
    bounds = published["augment"]["scale_splits"]

    def holding(content: dict) -> dict:
        path = tmp_path / f"policy-{len(list(tmp_path.iterdir()))}.json"
        path.write_text(json.dumps(content))
        return {**searched, "augment": {**searched["augment"], "policy_file": str(path)}}

    assert searched["augment"]["policy"] is None
    assert training_key(holding({"policy": genes, "scale_splits": bounds})) == training_key(published)
    other = [(g + 1) % 10 for g in genes]
    assert training_key(holding({"policy": other, "scale_splits": bounds})) != training_key(published)
    assert training_key(holding({"policy": genes, "scale_splits": [1024, 8192, 40960]})) != training_key(published)
    assert training_key(holding({"augment": compose(["augment=flip"], images)["augment"]})) == \
        training_key(compose(["augment=flip"], images))


def test_the_evaluation_key_keeps_evaluations_kept_before_a_later_evaluation_lever():
    """``evaluate.bn_reestimate`` off gives the key evaluations had before it existed; on, another key."""
    from benchmarks.compare import SCORING, compose, digest, evaluation_key, parse_images

    base = compose([], parse_images("0-127"))
    before = {k: v for k, v in base["evaluate"].items() if k not in SCORING and k != "bn_reestimate"}
    assert base["evaluate"]["bn_reestimate"] is None
    assert evaluation_key(base, "m-s0") == digest(["m-s0", before, base["dataset"]["val_size"]])
    assert evaluation_key(compose(["evaluate.bn_reestimate=256"], parse_images("0-127")), "m-s0") != \
        evaluation_key(base, "m-s0")
    assert evaluation_key(compose(["evaluate.merge=wbf"], parse_images("0-127")), "m-s0") != evaluation_key(base, "m-s0")


def test_the_table_names_the_baseline_and_shows_each_seed_and_the_verdict():
    figures = {k: 0.0 for k in compare.COMPARED}
    runs = [{"arm": arm, "seed": s, "figures": {**figures, "AP": ap + s / 100}}
            for s in (0, 1) for arm, ap in (("baseline", 0.5), ("candidate", 0.52))]
    f = {"name": "searched-vs-flip", "baseline": ["augment=flip"], "seeds": [0, 1], "images": [1024, 2047],
         "hold": "avx2", "precision": "fp32", "runs": runs,
         "per_seed": {str(s): {**figures, "AP": 0.02} for s in (0, 1)}, "mean": {**figures, "AP": 0.02},
         "bootstrap95": [0.01, 0.03], "mean_delta": 0.02, "ci95": [0.02, 0.02], "verdict": "adopt"}
    text = compare.table(f)
    assert text.startswith("`searched-vs-flip` against the baseline (augment=flip), seeds 0, 1, val images 1024-2047, "
                           "held to avx2, fp32.")
    assert "| 1 | 0.510 | 0.530 |" in text and "verdict: **adopt**" in text
    assert "against the baseline (the default configuration)" in compare.table({**f, "baseline": []})
    assert "the very same models" not in text
    same = [{**r, "model_sha256": f"m{r['seed']}", "figures": {**figures, "AP": 0.5}} for r in runs]
    assert "Both arms are the very same models" in compare.table({**f, "runs": same})
