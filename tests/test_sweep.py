"""A sweep as docs/tracking.md gives it: two experiments queued with ``dvc exp run --queue`` and run with
``dvc queue start -j 2``, each one complete MLflow run in the same experiment; then the MLflow UI over
their store, served by a real ``mlflow server`` and read in headless Chromium (Playwright), with
screenshots kept as test artifacts."""

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from .conftest import REPO
from .test_pipeline import _copy_repo, _dvc_json, _env, _runs

pytestmark = pytest.mark.slow

SWEEP = ["-S", "profile=ci", "-S", "train.nproc=1", "-S", "augment=none,flip"]  # -j 2 on 2 cores: one process each
# Between two `dvc queue status` calls while the sweep runs: each costs about 1.2 s of CPU (measured, 2 AVX2 cores),
# taken from the experiments it waits for.
QUEUE_POLL_S = 6.0
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
ARTIFACTS = Path(os.environ.get("PIPELINES_TEST_ARTIFACTS", REPO / "test-artifacts")) / "mlflow-ui"


def wait_for_queue(repo: Path, env: dict, count: int, timeout_s: float) -> str:
    """``dvc queue status`` once none of the queue's ``count`` experiments is queued or running. That command
    costs about 1.2 s of CPU, taken from the experiments it waits for, so until they are done this counts
    the queue's result files (one per finished task, in celery's file backend) every second, and asks DVC
    only then, or every minute in case this DVC keeps them elsewhere."""
    results = repo / ".dvc" / "tmp" / "exps" / "celery" / "result"
    start = asked = time.monotonic()
    while True:
        done = len(list(results.glob("celery-task-meta-*"))) if results.is_dir() else 0
        since = time.monotonic() - asked
        if (done >= count and since >= QUEUE_POLL_S) or since >= 60:
            status = subprocess.run(["dvc", "queue", "status"], cwd=repo, env=env, capture_output=True, text=True,
                                    timeout=120).stdout
            if not re.search(r"\b(Queued|Running)\b", status):
                return status
            assert time.monotonic() - start < timeout_s, status
            asked = time.monotonic()
        time.sleep(1)


def _dvc(repo: Path, *args: str, timeout: float = 120) -> str:
    done = subprocess.run(["dvc", *args], cwd=repo, env=_env(), capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """A fresh repository after the sweep; its two experiments' names."""
    repo = tmp_path_factory.mktemp("sweep")
    _copy_repo(repo)
    # up to evaluate: what is checked here is the runs of train and evaluate (the export would add its exporter's
    # start to each experiment on the 2 cores)
    queued = re.findall(r"Queued experiment '([\w-]+)'", _dvc(repo, "exp", "run", "--queue", *SWEEP, "evaluate"))
    assert len(queued) == 2
    with open(repo / "queue-start.log", "w") as log:  # not a pipe: the workers it leaves running inherit it
        started = subprocess.run(["dvc", "queue", "start", "-j", "2"], cwd=repo, env=_env(), stdout=log,
                                 stderr=subprocess.STDOUT, timeout=120)
    assert started.returncode == 0, (repo / "queue-start.log").read_text()
    status = wait_for_queue(repo, _env(), len(queued), timeout_s=900)
    for name in queued:
        assert re.search(rf"{name}\s.*\bSuccess\b", status), status + _dvc(repo, "queue", "logs", name)[-3000:]
    return repo, queued


def _experiments(repo: Path) -> dict[str, dict]:
    """``dvc exp show``'s experiments by name: their params and metrics files' data."""
    found = {}
    for baseline in _dvc_json(repo, "exp", "show"):
        for experiment in baseline.get("experiments") or []:
            for rev in experiment["revs"]:
                found[rev["name"]] = rev["data"]
    return found


def test_a_queued_sweep_gives_each_experiment_one_complete_run_pair(sweep):
    repo, names = sweep
    experiments = _experiments(repo)
    client, runs = _runs(repo)
    assert len(runs) == 4 and all(r.info.status == "FINISHED" for r in runs)
    by_id = {r.info.run_id: r for r in runs}
    augment = {}
    for name in names:
        ids = experiments[name]["metrics"]["metrics/run.json"]["data"]
        evaluation, training = by_id[ids["mlflow_run_id"]], by_id[ids["mlflow_training_run_id"]]
        assert (evaluation.info.run_name, training.info.run_name) == (name, f"{name} (train)")
        assert evaluation.data.tags["training_run_id"] == training.info.run_id
        assert evaluation.data.tags["dvc.exp_name"] == training.data.tags["dvc.exp_name"] == name
        assert evaluation.data.metrics["eval/AP"] == experiments[name]["metrics"]["metrics/eval.json"]["data"]["AP"]
        augment[name] = evaluation.data.params["augment.name"]
        assert training.data.params["augment.name"] == augment[name]
        assert {a.path for a in client.list_artifacts(training.info.run_id)} >= {"model", "preview"}
    assert sorted(augment.values()) == ["flip", "none"]
    for stage in ("train", "evaluate"):  # the same metric names, so that the UI compares them
        names_per_run = [set(r.data.metrics) for r in runs if r.data.tags["pipeline.stage"] == stage]
        assert names_per_run[0] == names_per_run[1] and names_per_run[0]
    assert len({r.info.experiment_id for r in runs}) == 1

    # dvc plots diff: the loss, precision-recall and per-category curves of both experiments, and their previews
    diff = _dvc_json(repo, "plots", "diff", *names)
    assert not diff.get("errors"), diff.get("errors")
    for title in ("Training loss", "Precision-recall (val)", "Per-category AP (val)", "Dataset counts"):
        (chart,) = diff["data"][title]
        assert {row["rev"] for row in chart["content"]["data"]["values"]} == set(names), title
    previews = diff["data"]["outputs/train/augment_preview.png"]
    assert {image["revisions"][0] for image in previews} == set(names)


# --- the MLflow UI ---------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ui(sweep):
    """A real ``mlflow server`` on 127.0.0.1 over the sweep's store; its address."""
    with serve(sweep[0]) as base:
        yield base


@contextlib.contextmanager
def serve(repo: Path):
    """A real ``mlflow server`` on 127.0.0.1 over ``repo``'s store, for a browser; its address."""
    if not Path(CHROMIUM).is_file():
        pytest.skip(f"{CHROMIUM} not found (apt-get install chromium; .ci/run installs it)")
    port = _free_port()
    env = {**_env(), "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    log = open(repo / "mlflow-server.log", "w")
    server = subprocess.Popen([str(Path(sys.executable).parent / "mlflow"), "server", "--host", "127.0.0.1",
                               "--port", str(port), "--workers", "1", "--backend-store-uri",
                               f"sqlite:///{repo / 'mlflow.db'}"], cwd=repo, env=env, stdout=log, stderr=log)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            urllib.request.urlopen(f"{base}/health", timeout=2)
            break
        except OSError:
            assert server.poll() is None and time.monotonic() < deadline, (repo / "mlflow-server.log").read_text()
            time.sleep(0.5)
    try:
        yield base
    finally:
        server.terminate()  # the test started it: stopped by pid
        server.wait(timeout=30)
        log.close()


@pytest.fixture(scope="module")
def browser(ui):
    with chromium_page() as page:
        yield page


@contextlib.contextmanager
def chromium_page():
    """A page of a headless Chromium driven by Playwright."""
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        page = chromium.new_page(viewport={"width": 1600, "height": 1000})
        page.set_default_timeout(60_000)
        yield page
        chromium.close()


def _metric_row(page, name: str) -> list[str]:
    """The values shown beside metric ``name`` in the compare view's metrics table, left to right.

    The table is two virtualised grids, names and values, whose cells share a row offset."""
    return page.evaluate("""(name) => {
        const link = [...document.querySelectorAll('[role=grid] a')].find(a => a.textContent.trim() === name);
        const top = link.closest('[role=rowgroup] > div').style.top;
        const grids = [...link.closest('.du-bois-light-collapse-content-box').querySelectorAll('[role=grid]')];
        const values = grids.find(g => !g.contains(link));
        return [...values.querySelectorAll('[role=rowgroup] > div')].filter(d => d.style.top === top)
            .sort((a, b) => parseFloat(a.style.left) - parseFloat(b.style.left)).map(d => d.innerText.trim());
    }""", name)


def _row(page, label: str) -> list[str] | None:
    """The cells after the first in the compare view's table row whose first cell reads ``label``."""
    return page.evaluate("""(label) => {
        const row = [...document.querySelectorAll('tr')].find(r => r.cells.length && r.cells[0].innerText.trim() === label);
        return row ? [...row.cells].slice(1).map(c => c.innerText.trim()) : null;
    }""", label)


def test_the_mlflow_ui_lists_compares_and_shows_the_artifacts_of_the_sweep(sweep, ui, browser, tmp_path):
    repo, names = sweep
    page, url = browser, ui
    client, runs = _runs(repo)
    experiment_id = runs[0].info.experiment_id
    evaluations = sorted((r for r in runs if r.data.tags["pipeline.stage"] == "evaluate"), key=lambda r: r.info.run_name)

    # the experiment's runs: both experiments' runs, by their DVC experiment names
    page.goto(f"{url}/#/experiments/{experiment_id}/runs?workflowType=machine_learning")
    for name in names:
        page.get_by_text(name, exact=True).first.wait_for()
        page.get_by_text(f"{name} (train)", exact=True).first.wait_for()
    page.screenshot(path=ARTIFACTS / "runs.png")

    # the compare view: the two evaluation runs side by side, with their params and eval/AP
    ids = json.dumps([r.info.run_id for r in evaluations])
    page.goto(f"{url}/#/compare-runs?runs={ids}&experiments={json.dumps([experiment_id])}")
    page.locator("[role=grid] a", has_text="eval/AP").first.wait_for()
    page.locator("svg.main-svg").first.wait_for()  # the parallel-coordinates chart has drawn
    assert _row(page, "Run ID:")[:2] == [r.info.run_id for r in evaluations]
    assert _row(page, "Run Name:")[:2] == [r.info.run_name for r in evaluations]
    assert _row(page, "augment.name")[:2] == [r.data.params["augment.name"] for r in evaluations]
    assert _row(page, "train.max_iter")[:2] == ["8", "8"]
    shown = [float(value) for value in _metric_row(page, "eval/AP")]
    assert shown == pytest.approx([r.data.metrics["eval/AP"] for r in evaluations], rel=0.1, abs=5e-4)
    page.screenshot(path=ARTIFACTS / "compare.png")
    page.get_by_text("augment.name", exact=True).last.scroll_into_view_if_needed()
    page.screenshot(path=ARTIFACTS / "compare-params.png")
    page.get_by_text("eval/AP50", exact=True).last.scroll_into_view_if_needed()
    page.screenshot(path=ARTIFACTS / "compare-metrics.png")

    # a training run's artifacts: the preview image (opened) and the model
    training = next(r for r in runs if r.info.run_name == f"{names[0]} (train)")
    page.goto(f"{url}/#/experiments/{experiment_id}/runs/{training.info.run_id}/artifacts")
    page.get_by_text("model", exact=True).first.click()
    page.get_by_text("model_final.pth", exact=True).first.wait_for()
    page.get_by_text("preview", exact=True).first.click()
    page.get_by_text("augment_preview.png", exact=True).first.click()
    image = page.locator("img[alt='preview/augment_preview.png']").first
    image.wait_for()
    png = Path(client.download_artifacts(training.info.run_id, "preview/augment_preview.png", str(tmp_path))).read_bytes()
    page.wait_for_function("img => img.complete && img.naturalWidth > 0", arg=image.element_handle())
    assert image.evaluate("img => img.naturalWidth") == int.from_bytes(png[16:20], "big")  # the PNG's own width
    page.screenshot(path=ARTIFACTS / "artifacts.png")
