"""The result in the repository: the search's metrics say how its winner stands against the published genome,
``python -m stages.publish_search`` copies a finished search's policy file and metrics into a committed folder
(refusing a missing, unfinished or mixed one in one line, replacing the folder whole), and ``augment=searched``
reads the committed policy file."""

import dataclasses
import json
import subprocess
import sys

import pytest
import yaml

from pipelines.compose import compose_params
from pipelines.config.load import params_from_dict, read_policy_file
from pipelines.errors import ConfigError, SearchError
from pipelines.policy import PUBLISHED_POLICY
from pipelines.search.evolution import Search
from pipelines.search.publish import PUBLISHED, outputs, preset_text, publish
from pipelines.search.record import SearchRecord
from pipelines.search.space import space
from stages import publish_search

from .conftest import REPO
from .search_probe import SETTINGS, made_up_score

GENOME = [3, 0, 6, 7, 2, 7, 1, 3, 4, 2, 3, 9, 1, 1, 9, 0, 2, 3, 1, 3, 0, 4, 1, 5, 4, 5, 7, 0, 1, 2, 6, 5, 3, 7, 0, 0,
          9, 5, 1, 6]
APS = {"AP": 0.5, "APs": 0.4, "APm": 0.5, "APl": 0.6}


def _scorer(score):
    """A made-up scorer that yields every field the search's metrics read."""
    def run(genomes):
        for genome in genomes:
            yield genome, {"score": score(genome), "balance": 0.1, "pareto_penalty": 1.0, "regulariser": 0.0,
                           **APS, "bins": [1, 1, 1, 1]}
    return run


def _metrics(tmp_path, settings, score):
    search = Search(tmp_path, settings)
    best = search.run(_scorer(score))
    record = SearchRecord(tmp_path, "", settings, "", "baseline")
    return record.metrics(best, APS, {0: APS}, search.ranked()), search.ranked()


@pytest.mark.parametrize("name", ["full", "scale"])
def test_the_metrics_rank_the_published_genome_among_every_candidate(tmp_path, name):
    genes = space(name, 5)
    settings = dataclasses.replace(SETTINGS, space=name, include=(genes.published(),))
    metrics, ranked = _metrics(tmp_path, settings, made_up_score)
    published = genes.key(genes.canonical(genes.published()))
    (entry,) = [r for r in ranked if r["key"] == published]
    assert metrics["winner"] == ranked[0]["key"] and metrics["winner_score"] == ranked[0]["score"] == metrics["score"]
    assert metrics["published_rank"] == 1 + sum(r["score"] < entry["score"] for r in ranked) > 1  # 1 is the best
    assert metrics["published_score"] == entry["score"]
    assert metrics["margin"] == pytest.approx(metrics["winner_score"] - entry["score"]) and metrics["margin"] < 0
    assert {"balance", "AP", "baseline_AP", "comparator_AP", "candidates"} <= set(metrics)  # kept as before


def test_the_published_genome_that_wins_has_rank_one_and_one_never_scored_is_null(tmp_path):
    published = dataclasses.replace(SETTINGS, rounds=2, include=(PUBLISHED_POLICY,))
    metrics, _ = _metrics(tmp_path / "won", published, lambda g: sum(a != b for a, b in zip(g, PUBLISHED_POLICY)))
    assert metrics["published_rank"] == 1 and metrics["margin"] == 0 and metrics["winner"] == "".join(
        map(str, PUBLISHED_POLICY))
    metrics, _ = _metrics(tmp_path / "left out", dataclasses.replace(SETTINGS, rounds=2), made_up_score)
    assert metrics["winner"] and {metrics[k] for k in ("published_rank", "published_score", "margin")} == {None}


def _search(root, *, arm="search-1", key="g1", winner="g1"):
    """A finished search's files where ``root/search/pipeline.yaml`` (the repository's) says they go."""
    (root / "search").mkdir(parents=True, exist_ok=True)
    (root / "search" / "pipeline.yaml").write_text((REPO / "search" / "pipeline.yaml").read_text())
    files = outputs(root / "search" / "pipeline.yaml")
    content = {"policy.json": {"arm": arm, "policy": GENOME, "n_subpolicies": 5, "scale_splits": [210, 1049, 5243],
                               "key": key},
               "search.json": {"score": 0.1, "winner": winner, "published_rank": 4},
               "curve.json": [{"round": 0, "best": 0.1}], "bins.json": [{"candidate": "1. g1", "share": 0.25}],
               "confirm.json": {"winner": arm,
                                "arms": {"sa_autoaug": {"AP": 0.5}, "search-1": {"AP": 0.6, "key": key}}}}
    for name, path in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(content[name], indent=2) + "\n")
    return files


def test_the_search_pipeline_names_the_files_published():
    files = outputs(REPO / "search" / "pipeline.yaml")
    assert {name: str(path.relative_to(REPO)) for name, path in files.items()} == {
        "policy.json": "search/outputs/policy.json", "search.json": "search/metrics/search.json",
        "curve.json": "search/metrics/curve.json", "bins.json": "search/metrics/bins.json",
        "confirm.json": "search/metrics/confirm.json"}
    assert set(PUBLISHED) == set(files)


def test_publishing_copies_the_files_byte_for_byte_and_the_preset_trains_them(tmp_path, capsys):
    files = _search(tmp_path)
    out, preset = tmp_path / "records" / "search", tmp_path / "conf" / "searched.yaml"
    out.mkdir(parents=True)
    (out / "stale.json").write_text("{}")  # of an earlier publish: the folder is replaced whole
    publish_search.main(["--pipeline", str(tmp_path / "search" / "pipeline.yaml"), "--out", str(out),
                         "--preset", str(preset)])
    assert sorted(p.name for p in out.iterdir()) == sorted(files)
    assert all((out / name).read_bytes() == path.read_bytes() for name, path in files.items())
    assert preset.read_text() == preset_text(str(out / "policy.json"))
    augment = yaml.safe_load(compose_params(REPO, ["augment=searched"]))["augment"]
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    raw["augment"] = {**augment, "policy_file": yaml.safe_load(preset.read_text())["policy_file"]}
    trained = read_policy_file(params_from_dict(raw)).augment
    assert trained.policy == GENOME and trained.scale_splits == [210, 1049, 5243]


def test_the_committed_preset_reads_the_committed_policy_file_and_says_what_to_run_without_one(tmp_path,
                                                                                               monkeypatch):
    """conf/augment/searched.yaml is what the command writes, and reads benchmarks/records/search/policy.json
    (committed), never a DVC output of the search; where no search was published, training says what to run."""
    committed = "benchmarks/records/search/policy.json"
    assert (REPO / "conf" / "augment" / "searched.yaml").read_text() == preset_text(committed)
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    raw["augment"] = yaml.safe_load(compose_params(REPO, ["augment=searched"]))["augment"]
    assert raw["augment"]["policy_file"] == "benchmarks/records/search/policy.json"
    published = REPO / committed
    if published.is_file():  # the genes (or the preset's section) of the published search are what trains
        monkeypatch.chdir(REPO)
        found, p = json.loads(published.read_text()), read_policy_file(params_from_dict(raw))
        assert p.augment.policy == found["policy"] if "policy" in found else p.augment.name == found["augment"]["name"]
    monkeypatch.chdir(tmp_path)  # a clone where no search was published
    with pytest.raises(ConfigError, match=r"^params.yaml: augment.policy_file: benchmarks/records/search/policy.json: "
                                          r"not found; .*python -m stages.publish_search"):
        read_policy_file(params_from_dict(raw))


@pytest.mark.parametrize("spoil, message", [
    (lambda f: f["policy.json"].unlink(), r"search/outputs/policy.json: not found; run the search \(make search\)"),
    (lambda f: f["confirm.json"].write_text("{}\n"), r"confirm.json: empty, the search has not finished"),
    (lambda f: f["curve.json"].write_text("[\n"), r"curve.json: not readable JSON"),
    (lambda f: f["policy.json"].write_text('{"policy": [10]}'), r"policy.json: expected a policy file with a 'policy'"),
    (lambda f: f["policy.json"].write_text('{"policy": [10], "n_subpolicies": 5}'), r"policy.json: .*expected"),
    (lambda f: f["search.json"].write_text('{"score": 0.1}'), r"search.json: no 'winner': written by an earlier"),
    (lambda f: f["policy.json"].write_text(json.dumps({"arm": "flip", "augment": {"name": "flip"}})),
     r"policy.json: holds flip, but the confirm table's winner is search-1: the files are of different searches"),
    (lambda f: f["search.json"].write_text('{"score": 0.1, "winner": "g2"}'),
     r"search.json: its winner is g2, but the confirm table's search-1 is g1: the files are of different searches"),
])
def test_a_missing_unfinished_or_mixed_search_is_refused_and_the_published_one_kept(tmp_path, spoil, message):
    files = _search(tmp_path)
    out, preset = tmp_path / "records", tmp_path / "searched.yaml"
    publish(files, out, preset, policy_file="x/policy.json")
    before = {p.name: p.read_bytes() for p in out.iterdir()}, preset.read_text()
    spoil(files)
    with pytest.raises(SearchError, match=message):
        publish(files, out, preset, policy_file="x/policy.json")
    assert ({p.name: p.read_bytes() for p in out.iterdir()}, preset.read_text()) == before


def test_the_command_prints_one_error_line_and_writes_nothing(tmp_path):
    root = tmp_path / "repo"
    (root / "search").mkdir(parents=True)
    (root / "search" / "pipeline.yaml").write_text((REPO / "search" / "pipeline.yaml").read_text())
    done = subprocess.run([sys.executable, "-m", "stages.publish_search", "--pipeline", "search/pipeline.yaml",
                           "--out", "benchmarks/records/search", "--preset", "conf/augment/searched.yaml"],
                          cwd=root, capture_output=True, text=True, env={"PYTHONPATH": str(REPO), "PATH": ""})
    assert done.returncode == 2
    assert done.stderr.splitlines() == ["error: search/outputs/policy.json: not found; run the search "
                                        "(make search) before publishing it"]
    assert not (root / "benchmarks").exists() and not (root / "conf").exists()


def test_the_policy_table_shows_the_bounds_each_policy_trained_with_and_any_kept_arm(tmp_path):
    """The published policy with the original's bounds and with the scaled ones (another arm's name) are two rows,
    each with its bounds, beside a searched policy's; a policy-free preset shows none."""
    from benchmarks import policies

    def kept(name, preset, seed, ap, *, genes=None, splits=None):
        record = {"name": name, "preset": preset, "seed": seed, "genes": genes, "scale_splits": splits,
                  "metrics": {k: ap for k in policies.METRICS}, "seconds": {"train": 1.0, "evaluate": 1.0},
                  "machine": {"class": "AVX2"}, "precision": "fp32", "model": "fcos_tiny", "schedule": "8 iterations"}
        (tmp_path / f"{name}-s{seed}.json").write_text(json.dumps(record))

    for seed in (0, 1):
        kept("flip", "flip", seed, 0.5, splits=[2048, 10240, 51200])
        kept("sa_autoaug", "sa_autoaug", seed, 0.6, splits=[2048, 10240, 51200])
        kept("sa_autoaug-auto", "sa_autoaug", seed, 0.62 + seed / 100, splits=[210, 1049, 5243])
        kept("searched-auto", "searched", seed, 0.55, genes=GENOME, splits=[210, 1049, 5243])
    table = policies.table(policies.figures(policies.kept(tmp_path)))
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ")[1:3] for line in table.splitlines()
            if line.startswith("| ") and " | 0, 1 | " in line}
    assert rows == {"sa_autoaug": ["2048 / 10240 / 51200", "0, 1"], "sa_autoaug-auto": ["210 / 1049 / 5243", "0, 1"],
                    "searched-auto": ["210 / 1049 / 5243", "0, 1"], "flip": ["-", "0, 1"]}
    assert "| sa_autoaug-auto | 210 / 1049 / 5243 | 0, 1 | 0.625 (0.010) |" in table and "+0.120, +0.130 |" in table
    kept("zz-arm", "zz_preset", 0, 0.5)  # a preset the benchmark does not know: after the known ones
    assert [r["name"] for r in policies.kept(tmp_path)][-1] == "zz-arm"
