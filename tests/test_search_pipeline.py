"""End to end: the policy search (search/pipeline.yaml, copied to search/dvc.yaml) on a tiny configuration
in a copy of the repository: a tree of MLflow runs, resumed after a kill to the result of an uninterrupted
search, and its policy trained with ``augment=searched``."""

import json
import re
import shutil
import subprocess
import sys
import time

import mlflow
import pytest

from pipelines.policy import decode_policy
from pipelines.search.space import space

from .search_probe import kill_when_scored
from .test_pipeline import TINY_ONE_PROCESS as TINY, _copy_repo, _env

pytestmark = pytest.mark.slow

SEARCH = ["search.population=3", "search.rounds=2", "search.kept=2", "search.mutations=1", "search.crossovers=1",
          "search.random=0", "search.fine_tune_iters=2", "search.candidates_at_once=2", "search.heldout_fraction=0.25",
          "search.rescore_top_k=1", "search.rescore_seeds=1",
          "loader.num_workers=1",  # as by default: a candidate's process must not start loader workers
          "confirm.top_k=1", "confirm.arms=[]", "confirm.seeds=1"]  # the confirm: one training
STAGES = {"search/dvc.yaml:holdout", "search/dvc.yaml:cache", "search/dvc.yaml:baseline", "search/dvc.yaml:search",
          "search/dvc.yaml:confirm"}


def _dvc(repo, *args, timeout=900):
    done = subprocess.run(["dvc", *args], cwd=repo, env=_env(), capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def _ran(stdout: str) -> set[str]:
    return set(re.findall(r"Running stage '([\w/.:]+)'", stdout))


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    repo = tmp_path_factory.mktemp("search")
    _copy_repo(repo)
    composed = subprocess.run([sys.executable, "-m", "pipelines.compose", *TINY, *SEARCH], cwd=repo, env=_env(),
                              capture_output=True, text=True)
    assert composed.returncode == 0, composed.stderr
    (repo / "search" / "dvc.yaml").unlink(missing_ok=True)  # (a working tree's own, copied with its files)
    (repo / "search" / "dvc.yaml").symlink_to("pipeline.yaml")  # an older checkout's link: the copy replaces it
    made = subprocess.run(["make", "search-pipeline"], cwd=repo, env=_env(), capture_output=True, text=True)
    assert made.returncode == 0, made.stderr  # what `make search` does before its `dvc repro search/dvc.yaml`
    return repo


def test_a_search_writes_its_policy_metrics_and_plots_and_a_tree_of_mlflow_runs(repo):
    _dvc(repo, "repro", "prepare")  # all the search needs of the default pipeline (tests/test_pipeline.py
    # checks that the default repro never starts a search)
    assert _ran(_dvc(repo, "repro", "search/dvc.yaml")) >= STAGES
    state = repo / "search" / "outputs" / "state"
    history = json.loads((state / "history.json").read_text())
    assert [entry["round"] for entry in history] == [0, 1]
    candidates = sorted(p.stem for p in (state / "candidates").glob("*.json"))
    best = json.loads((repo / "search" / "outputs" / "search_policy.json").read_text())
    decode_policy(best["policy"], best["n_subpolicies"])
    assert best["scale_splits"] == [52, 262, 1311]  # search.scale_splits auto: the original's x (128 / 800)^2
    assert best["key"] == history[-1]["best"]["key"] and best["key"] in candidates
    ranked = json.loads((repo / "search" / "outputs" / "ranked.json").read_text())
    assert sorted(r["key"] for r in ranked) == candidates and ranked[0]["key"] == best["key"]
    confirmed = json.loads((repo / "search" / "outputs" / "policy.json").read_text())  # the only arm: the best
    same = ("policy", "scale_splits", "key")
    assert {k: confirmed[k] for k in same} == {k: best[k] for k in same}
    table = json.loads((repo / "search" / "metrics" / "confirm.json").read_text())
    assert table["winner"] == "search-1" and table["arms"]["search-1"]["key"] == best["key"]
    metrics = json.loads((repo / "search" / "metrics" / "search.json").read_text())
    assert metrics["score"] == best["score"] and {"APs", "APm", "APl", "baseline_APs"} <= set(metrics)
    keys, genes = [r["key"] for r in ranked], space("full", 5)
    published = keys.index(genes.key(genes.canonical(genes.published())))  # scored in round 0: include_published
    assert metrics["winner"] == best["key"] and metrics["winner_score"] == best["score"]
    assert metrics["published_rank"] == published + 1 and metrics["published_score"] == ranked[published]["score"]
    assert metrics["margin"] == pytest.approx(best["score"] - ranked[published]["score"])
    assert [row["round"] for row in json.loads((repo / "search" / "metrics" / "curve.json").read_text())] == [0, 1]
    shown = json.loads(_dvc(repo, "metrics", "show", "--json"))[""]["data"]
    assert shown["search/metrics/search.json"]["data"]["score"] == best["score"]
    assert shown["search/metrics/confirm.json"]["data"]["winner_AP"] == table["winner_AP"]
    # the held-out images are train images, never val ones, and no train image of the search is held out
    held = {im["file_name"] for im in json.loads((repo / "search/data/prepared/val.json").read_text())["images"]}
    kept = {im["file_name"] for im in json.loads((repo / "search/data/prepared/train.json").read_text())["images"]}
    train = {im["file_name"] for im in json.loads((repo / "data/prepared/train.json").read_text())["images"]}
    assert held and kept and not held & kept and held | kept == train

    client = mlflow.MlflowClient(f"sqlite:///{repo / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("detection").experiment_id])
    (parent,) = [r for r in runs if r.data.tags.get("pipeline.stage") == "search"]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id
                and r.data.tags.get("pipeline.stage") != "train"]
    null = [r for r in children if r.data.params["genome"] == "null"]  # the comparator, at seed indices 0 and 1
    children = [r for r in children if r not in null]
    assert sorted(r.data.params["seed_index"] for r in null) == ["0", "1"]
    assert sorted(r.data.params["genome"] for r in children) == candidates
    assert all({"score", "balance", "pareto_penalty", "regulariser", "APs", "APm", "APl", "loss_share/small"}
               <= set(r.data.metrics) for r in children)
    rescored = json.loads((state / "candidates" / f"{history[0]['rescored'][0]}.json").read_text())
    assert len(rescored["seed_scores"]) == 2 and rescored["score"] == pytest.approx(sum(rescored["seed_scores"]) / 2)
    assert json.loads((state / "candidates" / f"{best['key']}.json").read_text())["rescored_round"] in (0, 1)
    (run,) = [r for r in children if r.data.params["genome"] == rescored["key"]]
    assert run.data.metrics["score"] == pytest.approx(rescored["score"])  # the mean over its seeds
    seeds = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "seed_score"))
    assert [s for s, _ in seeds] == [0, 1] and [v for _, v in seeds] == pytest.approx(rescored["seed_scores"])
    (confirm,) = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id
                  and r.data.tags.get("pipeline.stage") == "train"]  # the confirm's training, a child too
    assert confirm.data.metrics["heldout/AP"] == pytest.approx(table["winner_AP"])
    assert parent.data.metrics["search/best_score"] == best["score"]
    assert parent.info.status == "FINISHED"
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"search_policy.json", "best_policy.txt", "preview", "confirm"} <= artifacts


def test_a_committed_search_is_read_by_dvc_in_its_commit(repo):
    """As docs/search.md says to commit it (with the lock and the metrics), DVC reads the search's pipeline in
    that commit too: a link in place of the copy fails there ("expected a dictionary")."""
    dvc_file = repo / "search" / "dvc.yaml"
    assert not dvc_file.is_symlink() and dvc_file.read_text() == (repo / "search" / "pipeline.yaml").read_text()
    identity = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@localhost", "GIT_COMMITTER_NAME": "t",
                "GIT_COMMITTER_EMAIL": "t@localhost"}
    for command in (["git", "add", "search/dvc.yaml", "search/dvc.lock", "search/metrics"],
                    ["git", "commit", "-qm", "the search"]):
        subprocess.run(command, cwd=repo, env={**_env(), **identity}, check=True, capture_output=True)
    shown = json.loads(_dvc(repo, "exp", "show", "--json"))
    assert [(row["rev"], row["error"]) for row in shown if row["error"]] == []
    head = json.loads(_dvc(repo, "metrics", "show", "--json", "-a"))
    committed = next(data for rev, data in head.items() if rev != "workspace")
    assert "error" not in committed and committed["data"]["search/metrics/search.json"]["data"]["winner"]


def test_a_killed_search_resumes_to_the_history_and_policy_of_an_uninterrupted_one(repo):
    """SIGKILL of ``dvc repro`` (the process this test started) while candidates are being scored: the
    search dies with it; run again, it scores only what it had not and ends as the search above did."""
    state = repo / "search" / "outputs" / "state"
    expected = (state / "history.json").read_text(), (repo / "search/outputs/policy.json").read_text()
    shutil.rmtree(state)
    (repo / "search/outputs/search_policy.json").unlink()  # an output missing: dvc repro re-runs the search stage
    dvc = subprocess.Popen(["dvc", "repro", "search/dvc.yaml"], cwd=repo, env=_env(),
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    kill_when_scored(dvc, state, 2, rounds=2, timeout=300)
    time.sleep(2)  # the search and its candidate processes die with dvc
    _dvc(repo, "repro", "search/dvc.yaml")
    assert ((state / "history.json").read_text(), (repo / "search/outputs/policy.json").read_text()) == expected


def test_augment_searched_trains_the_policy_the_search_found(repo):
    """Published (as ``make search`` publishes it), the search's policy file is the committed one that
    ``augment=searched`` trains."""
    published = subprocess.run([sys.executable, "-m", "stages.publish_search"], cwd=repo, env=_env(),
                               capture_output=True, text=True)
    assert published.returncode == 0, published.stderr[-3000:]
    assert ((repo / "benchmarks/records/search/policy.json").read_bytes()
            == (repo / "search/outputs/policy.json").read_bytes())
    subprocess.run([sys.executable, "-m", "pipelines.compose", *TINY, *SEARCH, "augment=searched"], cwd=repo,
                   env=_env(), check=True)
    ran = _ran(_dvc(repo, "repro", "evaluate"))
    assert {"train", "evaluate"} <= ran and not {s for s in ran if s.startswith("search/")}
    best = json.loads((repo / "search" / "outputs" / "policy.json").read_text())
    client = mlflow.MlflowClient(f"sqlite:///{repo / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("detection").experiment_id],
                              "tags.`pipeline.stage` = 'train' and params.`augment.name` = 'sa_autoaug'")
    assert runs and json.loads(runs[0].data.params["augment.policy"]) == best["policy"]
    assert json.loads(runs[0].data.params["augment.scale_splits"]) == best["scale_splits"]


def test_the_policies_benchmark_keeps_each_run_and_never_runs_a_kept_one_again(repo, tmp_path):
    """benchmarks/policies.py through the train and evaluate stages, on the tiny params: one record per preset
    and seed; run again, it reads them back and runs nothing."""
    runs = tmp_path / "runs"
    command = [sys.executable, "-m", "benchmarks.policies", "--augment", "searched", "--seeds", "3", "--runs", str(runs),
               "--policy-file", "search/outputs/policy.json"]  # the search's own, published or not
    first = subprocess.run(command, cwd=repo, env=_env(), capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    kept = {p.name: json.loads(p.read_text()) for p in runs.glob("*.json")}
    assert set(kept) == {"searched-s3.json"}
    found = json.loads((repo / "search" / "outputs" / "policy.json").read_text())
    record = kept["searched-s3.json"]
    assert record["genes"] == found["policy"] and record["scale_splits"] == found["scale_splits"]
    assert record["seed"] == 3 and set(record["metrics"]) == {"AP", "AP50", "AP75", "APs", "APm", "APl"}
    assert "| searched | 3 |" in first.stdout
    again = subprocess.run([*command, "--json"], cwd=repo, env=_env(), capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and "training and evaluating" not in again.stderr  # nothing ran
    assert [r["metrics"] for r in json.loads(again.stdout)["runs"]] == [record["metrics"]]


def test_the_mlflow_ui_shows_the_search_and_compares_two_candidates(repo):
    """In a real browser (skipped without Chromium): the search's parent run in the experiment's list, and
    two candidates side by side with their genes and scores."""
    from .test_sweep import ARTIFACTS, _metric_row, _row, chromium_page, serve

    client = mlflow.MlflowClient(f"sqlite:///{repo / 'mlflow.db'}")
    experiment_id = client.get_experiment_by_name("detection").experiment_id
    runs = client.search_runs([experiment_id])
    (parent,) = [r for r in runs if r.data.tags.get("pipeline.stage") == "search"
                 and r.data.metrics.get("search/best_score") is not None][-1:]
    children = sorted((r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id
                       and "score" in r.data.metrics),  # the candidates, not the confirm's training
                      key=lambda r: r.data.metrics["score"])[:2]
    with serve(repo) as url, chromium_page() as page:
        page.goto(f"{url}/#/experiments/{experiment_id}/runs?workflowType=machine_learning")
        page.get_by_text(parent.info.run_name, exact=True).first.wait_for()
        # a tree: the candidates are hidden under their search until its row is expanded
        assert page.get_by_text(children[0].info.run_name, exact=True).count() == 0
        page.locator(f"[role=row][row-id='{parent.info.run_id}'] button").first.click()
        page.get_by_text(children[0].info.run_name, exact=True).first.wait_for()
        page.screenshot(path=ARTIFACTS / "search-runs.png")
        ids = json.dumps([r.info.run_id for r in children])
        page.goto(f"{url}/#/compare-runs?runs={ids}&experiments={json.dumps([experiment_id])}")
        page.locator("[role=grid] a", has_text="score").first.wait_for()
        assert _row(page, "Run ID:")[:2] == [r.info.run_id for r in children]
        assert _row(page, "genome")[:2] == [r.data.params["genome"] for r in children]
        shown = [float(v) for v in _metric_row(page, "score")]
        assert shown == pytest.approx([r.data.metrics["score"] for r in children], abs=5e-4)  # shown to 3 decimals
        page.screenshot(path=ARTIFACTS / "search-compare.png")
