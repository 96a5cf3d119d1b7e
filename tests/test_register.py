"""stages.register, promotion and serving: the ONNX export as a models-from-code MLflow model in a test SQLite
registry (tags, aliases, linked AP, torch-free code and requirements), ``--promote champion --if-better``,
``mlflow models serve`` of ``models:/detector@champion`` (started and stopped by pid: the same detections as
stages.predict on the ONNX backend, ``score_thresh``, bad requests answered 4xx in one line), stages.predict
with ``models:/`` URIs and MLflow model folders, and the commands' one-line errors.

The ONNX file is a tiny graph made with ``onnx.helper`` (the exported graph's input, outputs and model card,
random 1x1 convolutions over pooled pixels): exporting a real detector takes longer than this file's
whole time budget, and the export's parity with PyTorch is tested in tests/test_predict_onnx.py and
tests/test_onnx_export.py; what is tested here is what happens to an exported file.
"""

from __future__ import annotations

import ast
import base64
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import onnx
import pytest
import yaml
from onnx import TensorProto, helper
from PIL import Image

from pipelines import cli
from pipelines.errors import ConfigError
from pipelines.inference import registration
from pipelines.inference.card import METADATA_KEY, ModelCard, output_names, write_card
from pipelines.tracking import store as tracking_store
from pipelines.tracking.registry import Registry, parse_model_uri
from stages import register as register_stage

from .conftest import REPO, scene, set_dotted

CATEGORIES = [{"id": 1, "name": "circle"}, {"id": 3, "name": "square"}, {"id": 7, "name": "triangle"}]
ANCHORS = [8, 16, 32, 64, 128]
MAX_PIXELS = 20_000  # the card's pixel cap: 64x96 images pass, 160x160 does not
FINGERPRINT = "f" * 64
PTH_MD5, ONNX_MD5 = "1" * 32, "2" * 32


def tiny_graph(path: Path) -> ModelCard:
    """An ONNX file with the exported graph's contract and a model card: ``uint8 [N, 3, H, W]`` in, per level
    ``cls_logits_l`` ``[N, h, w, 3]``, ``bbox_regression_l`` ``[N, h, w, 4]``, ``bbox_ctrness_l`` ``[N, h, w, 1]``
    out (levels at strides 8 to 128, sizes rounded up as FCOS's), from random 1x1 convolutions of the
    normalised, average-pooled pixels. Returns its card (also written as model.json beside it)."""
    rng = np.random.default_rng(0)
    card = ModelCard(categories=CATEGORIES, min_size_test=64, max_size_test=96, size_divisibility=32,
                     max_image_pixels=MAX_PIXELS, pixel_mean=[123.675, 116.28, 103.53],
                     pixel_std=[58.395, 57.12, 57.375], anchor_sizes=ANCHORS, score_thresh=0.05, nms_thresh=0.6,
                     topk_candidates=1000, detections_per_img=100,
                     exporter="onnx.helper (a test graph)", opset=17, torch_version="none", trained_precision="fp32",
                     outputs=output_names(len(ANCHORS)), git_commit="0" * 40)
    nodes, inits = [], []

    def const(name: str, value: np.ndarray) -> str:
        inits.append(helper.make_tensor(name, TensorProto.FLOAT, value.shape, value.astype(np.float32).ravel()))
        return name

    mean = const("mean", np.array(card.pixel_mean).reshape(1, 3, 1, 1))
    std = const("std", np.array(card.pixel_std).reshape(1, 3, 1, 1))
    nodes += [helper.make_node("Cast", ["images"], ["x"], to=TensorProto.FLOAT),
              helper.make_node("Sub", ["x", mean], ["centred"]), helper.make_node("Div", ["centred", std], ["p"])]
    previous = "p"
    for level in range(len(ANCHORS)):
        feature = f"f{level}"
        if level == 0:
            nodes.append(helper.make_node("AveragePool", [previous], [feature], kernel_shape=[8, 8], strides=[8, 8]))
        else:  # halve, rounding up (a stride-2 3x3 window padded by 1)
            nodes.append(helper.make_node("AveragePool", [previous], [feature], kernel_shape=[3, 3], strides=[2, 2],
                                          pads=[1, 1, 1, 1]))
        previous = feature
        for kind, channels, scale, bias in (("cls_logits", 3, 3.0, -1.0), ("bbox_regression", 4, 1.0, 1.0),
                                            ("bbox_ctrness", 1, 2.0, 0.0)):
            weight = const(f"w_{kind}_{level}", rng.normal(0, scale, (channels, 3, 1, 1)))
            b = const(f"b_{kind}_{level}", rng.normal(bias, 0.3, (channels,)))
            conv = f"{kind}_{level}_nchw"
            nodes.append(helper.make_node("Conv", [feature, weight, b], [conv]))
            if kind == "bbox_regression":
                nodes.append(helper.make_node("Relu", [conv], [conv + "_relu"]))
                conv += "_relu"
            nodes.append(helper.make_node("Transpose", [conv], [f"{kind}_{level}"], perm=[0, 2, 3, 1]))
    outputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in card.outputs]
    graph = helper.make_graph(nodes, "tiny", [helper.make_tensor_value_info("images", TensorProto.UINT8,
                                                                            ["N", 3, "H", "W"])], outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    helper.set_model_props(model, {METADATA_KEY: card.to_json()})
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    write_card(card, path.parent / "model.json")
    return card


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(main, argv: list[str], capsys) -> tuple[int, str]:
    """A command's ``main`` in this process: (exit code, stderr)."""
    code = 0
    try:
        cli.run(main, argv)
    except SystemExit as exit_:
        code = exit_.code or 0
    return code, capsys.readouterr().err


def errors(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error:")]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A project folder: params.yaml, export/model.onnx with its card, bare.onnx without one, the export's
    metrics (linked to a training run of the test store), a dvc.lock naming both model files, and images: val
    at the test size, one to resize, one over the card's pixel cap."""
    root = tmp_path_factory.mktemp("register")
    tree = yaml.safe_load((REPO / "params.yaml").read_text())
    set_dotted(tree, "tracking.experiment", "detection-test")
    (root / "params.yaml").write_text(yaml.safe_dump(tree))
    tiny_graph(root / "export" / "model.onnx")
    bare = onnx.load(str(root / "export" / "model.onnx"))
    del bare.metadata_props[:]
    onnx.save(bare, str(root / "bare.onnx"))
    (root / "dvc.lock").write_text(yaml.safe_dump({"schema": "2.0", "stages": {
        "train": {"cmd": "train", "outs": [{"path": "outputs/train/model_final.pth", "md5": PTH_MD5}]},
        "export": {"cmd": "export", "outs": [{"path": "export/model.onnx", "md5": ONNX_MD5}]}}}))
    (root / "images").mkdir()
    Image.fromarray(scene(64, 96, 0)).save(root / "images" / "val.png")
    Image.fromarray(scene(128, 150, 1)).save(root / "images" / "big.png")  # resized to 64 x 75
    Image.fromarray(scene(160, 160, 2)).save(root / "over_cap.png")
    return root


@pytest.fixture(scope="module")
def env(workspace):
    """The test store as the tracking store, one ONNX Runtime thread, and the workspace as the current folder."""
    import mlflow

    uri = f"sqlite:///{workspace / 'mlflow.db'}"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLFLOW_TRACKING_URI", uri)
        patch.setenv("DVC_ROOT", str(workspace))
        patch.setenv("PIPELINES_THREADS", "1")
        patch.chdir(workspace)
        client = mlflow.MlflowClient(tracking_uri=uri)
        experiment = client.create_experiment("detection-test", artifact_location=(workspace / "mlartifacts").as_uri())
        training = client.create_run(experiment, tags={"dvc.exp_name": "tiny-exp"})
        (workspace / "metrics").mkdir()
        (workspace / "metrics" / "export.json").write_text(json.dumps({
            "max_abs_diff": 1e-6, "match_rate": 1.0, "ap_torch": 0.5, "ap_onnx": 0.5, "ap_torch_tta": 0.55,
            "ap_onnx_tta": 0.55, "val_fingerprint": FINGERPRINT, "mlflow_run_id": training.info.run_id}))
        yield {"uri": uri, "client": client, "training_run": training.info.run_id}
        for key in tracking_store.HTTP_DEFAULTS:  # set by the store's clients
            os.environ.pop(key, None)


LOAD_CHECK = """
import json, sys
import mlflow.pyfunc, pandas
model = mlflow.pyfunc.load_model("models:/detector/1")
rows = model.predict(pandas.DataFrame({"image": [open("images/val.png", "rb").read()]}))
print(json.dumps({"served": sys.modules["pipelines.inference.served"].__file__, "torch": "torch" in sys.modules,
                  "rows": len(rows)}))
"""


@pytest.fixture(scope="module")
def registered(env, workspace):
    """Version 1 of ``detector``, registered and promoted to champion by the command; then a server of
    ``models:/detector@champion`` starts in the background (the tests below run while it loads)."""
    register_stage.main(["--onnx", "export/model.onnx", "--example", "images/val.png", "--promote", "champion",
                         "--if-better"])
    version = env["client"].get_model_version_by_alias("detector", "champion")
    port = free_port()
    bin_dir = Path(sys.executable).parent  # `mlflow models serve` runs uvicorn from PATH
    server = subprocess.Popen([str(bin_dir / "mlflow"), "models", "serve", "-m", "models:/detector@champion",
                               "--env-manager", "local", "-p", str(port), "-h", "127.0.0.1"],
                              env={**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"},
                              stdout=subprocess.DEVNULL, stderr=open(workspace / "server.log", "wb"),
                              start_new_session=True)
    loader = subprocess.Popen([sys.executable, "-c", LOAD_CHECK], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)  # meanwhile, in a fresh process: what loading the model imports
    yield {"version": version, "port": port, "server": server, "loader": loader}
    if loader.poll() is None:
        loader.kill()
        loader.wait()
    if server.poll() is None:  # the server and the uvicorn process it started: their process group, by pid
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


# --- register ------------------------------------------------------------------------------------------------------


def test_register_logs_a_torch_free_model_with_its_figures_tags_and_aliases(registered, env, workspace):
    import mlflow

    client, version = env["client"], registered["version"]
    assert str(version.version) == "1"
    assert str(client.get_model_version_by_alias("detector", "candidate").version) == "1"
    tags = version.tags
    assert tags["data.val_fingerprint"] == FINGERPRINT and tags["eval.tta"] == "true"  # evaluate.tta of the params
    assert float(tags["eval.ap"]) == 0.55 and tags["eval.metric"] == "ap_onnx_tta"
    assert tags["mlflow.source.git.commit"] == "0" * 40  # the card's commit
    assert tags["params.sha256"] and tags["training_run_id"] == env["training_run"]
    assert tags["dvc.exp_name"] == "tiny-exp"  # from the training run
    assert tags["dvc.lock/export/export/model.onnx"] == ONNX_MD5
    assert tags["dvc.lock/train/outputs/train/model_final.pth"] == PTH_MD5
    model = client.get_logged_model(version.source.removeprefix("models:/"))
    assert {m.key: m.value for m in model.metrics}["ap_onnx_tta"] == 0.55  # the AP, linked to the logged model
    run = client.get_run(model.source_run_id)
    assert run.info.experiment_id == client.get_run(env["training_run"]).info.experiment_id

    folder = Path(mlflow.artifacts.download_artifacts(artifact_uri=version.source, dst_path=str(workspace / "model")))
    mlmodel = yaml.safe_load((folder / "MLmodel").read_text())
    flavor = mlmodel["flavors"]["python_function"]
    assert flavor["loader_module"] == "mlflow.pyfunc.loaders.code_model"  # models-from-code
    assert not list(folder.rglob("*.pkl"))  # nothing pickled
    assert flavor["artifacts"]["model"]["path"] == "artifacts/model.onnx"
    assert json.loads(mlmodel["signature"]["params"])[0]["name"] == "score_thresh"
    assert json.loads(mlmodel["signature"]["inputs"]) == [{"type": "binary", "name": "image", "required": True}]
    assert (folder / "input_example.json").is_file()
    requirements = [line.split("==")[0] for line in (folder / "requirements.txt").read_text().split()]
    assert sorted(requirements) == ["mlflow", "numpy", "onnxruntime", "pillow"]
    shipped = sorted(str(p.relative_to(folder / "code")) for p in (folder / "code").rglob("*.py"))
    assert "pipelines/inference/served.py" in shipped and "pipelines/inference/onnx_runtime.py" in shipped
    assert not any("torch_backend" in p or "onnx_export" in p for p in shipped)
    for path in (folder / "code").rglob("*.py"):  # what ships imports neither torch nor torchvision
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.split(".")[0] in ("torch", "torchvision") for n in names), path


def test_promote_if_better_compares_like_with_like(env, registered):
    """--if-better moves the alias only for an AP at least the holder's on the same val data and TTA setting."""
    registry, client, name = Registry(), env["client"], "detector-ab"
    client.create_registered_model(name)

    def version(ap: float, *, fingerprint: str = FINGERPRINT, tta: str = "false") -> str:
        return client.create_model_version(name, registered["version"].source, tags={
            "eval.ap": repr(ap), "data.val_fingerprint": fingerprint, "eval.tta": tta}).version

    first = version(0.40)
    assert registration.promote(registry, name, first, alias="champion", if_better=True) == (
        True, f"{name} version 1 is now champion")
    worse = version(0.39)
    moved, line = registration.promote(registry, name, worse, alias="champion", if_better=True)
    assert not moved and line == "not promoted to champion: AP 0.3900 is below champion (version 1)'s 0.4000"
    moved, line = registration.promote(registry, name, version(0.9, fingerprint="e" * 64), alias="champion",
                                       if_better=True)
    assert not moved and "other val data" in line
    moved, line = registration.promote(registry, name, version(0.9, tta="true"), alias="champion", if_better=True)
    assert not moved and "evaluate.tta=false" in line
    equal = version(0.40)
    assert registration.promote(registry, name, equal, alias="champion", if_better=True)[0]
    assert registration.promote(registry, name, worse, alias="champion", if_better=False)[0]  # forced
    assert str(client.get_model_version_by_alias(name, "champion").version) == str(worse)


@pytest.mark.parametrize("args, expected", [
    (["--onnx", "missing.onnx"], "error: missing.onnx: ONNX file not found"),
    (["--onnx", "bare.onnx"], "error: bare.onnx: an ONNX file without a model card"),
    (["--metrics", "missing.json"], "error: missing.json: cannot be read"),
    (["--if-better"], "error: --if-better: give --promote ALIAS too"),
    (["--example", "over_cap.png"], "error: --example: over_cap.png: 160x160 pixels"),
], ids=["no-onnx", "no-card", "no-metrics", "if-better-alone", "example-over-cap"])
def test_register_errors_are_one_line(env, capsys, args, expected):
    code, err = run(register_stage.main, ["--onnx", "export/model.onnx", "--example", "images/val.png", *args], capsys)
    assert code == 2 and errors(err) and errors(err)[0].startswith(expected), err
    assert len(errors(err)) == 1


def test_unreachable_registry_is_one_line(env, capsys, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    code, err = run(register_stage.main, ["--onnx", "export/model.onnx", "--example", "images/val.png"], capsys)
    assert code == 2 and errors(err)[0].startswith("error: MLflow store http://127.0.0.1:"), err
    assert errors(err)[0].endswith("unreachable"), err
    from stages import predict

    code, err = run(predict.main, ["images", "--model", "models:/detector@champion", "--out", "out-unreachable"],
                    capsys)
    assert code == 2 and "unreachable" in errors(err)[0] and not Path("out-unreachable").exists(), err


# --- predict with MLflow models ---------------------------------------------------------------------------------------


def _predict(args: list[str], capsys) -> list[dict]:
    from stages import predict

    code, err = run(predict.main, args, capsys)
    assert code == 0, err
    out = Path(args[args.index("--out") + 1])
    return json.loads((out / "predictions.json").read_text())


def test_predict_runs_registered_models_and_model_folders_as_their_onnx(registered, capsys):
    import mlflow

    plain = _predict(["images", "--model", "export/model.onnx", "--out", "out-onnx"], capsys)
    assert plain, "the test graph should detect something"
    folder = Path("model-folder")
    if not (folder / "MLmodel").is_file():
        mlflow.artifacts.download_artifacts(artifact_uri=registered["version"].source, dst_path=str(folder))
    for model in ("models:/detector@champion", "models:/detector/1", str(folder)):
        found = _predict(["images", "--model", model, "--out", "out-mlflow"], capsys)
        assert found == plain, model
        summary = json.loads(Path("out-mlflow/summary.json").read_text())
        assert summary["backend"] == "onnx" and summary["model"] == str(Path(model))


@pytest.mark.parametrize("model, expected", [
    ("models:/detector@nope", "error: models:/detector@nope: registered model 'detector' has no alias 'nope'"),
    ("models:/detector/9", "error: models:/detector/9: registered model 'detector' has no version 9"),
    ("models:/nothing@champion", "error: models:/nothing@champion: no registered model 'nothing'"),
    ("models:/detector", "error: models:/detector: expected models:/<name>@<alias> or models:/<name>/<version>"),
    ("other-model", "error: other-model/MLmodel: an MLflow model without the artifact 'model' of the python_function"),
], ids=["alias", "version", "name", "form", "folder"])
def test_predict_missing_registered_model_is_one_line_and_writes_nothing(registered, capsys, model, expected):
    from stages import predict

    Path("other-model").mkdir(exist_ok=True)
    Path("other-model/MLmodel").write_text("flavors:\n  python_function:\n    loader_module: other\n")

    code, err = run(predict.main, ["images", "--model", model, "--out", "out-missing"], capsys)
    assert code == 2 and errors(err) == [errors(err)[0]] and errors(err)[0].startswith(expected), err
    assert not Path("out-missing").exists()


def test_example_is_the_first_prepared_val_image_and_export_metrics_are_checked(tmp_path):
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "b.png").write_bytes(b"png")
    (tmp_path / "dataset.json").write_text(json.dumps({"splits": {"val": {"images": str(tmp_path / "images")}}}))
    (tmp_path / "val.json").write_text(json.dumps({"images": [{"id": 1, "file_name": "b.png"}]}))
    assert registration.example_image(tmp_path) == tmp_path / "images" / "b.png"
    with pytest.raises(ConfigError, match="no prepared val image for the input example"):
        registration.example_image(tmp_path / "missing")
    metrics = {"max_abs_diff": 0.0, "match_rate": 1.0, "ap_torch": 0.3, "ap_onnx": 0.3, "ap_torch_tta": 0.4,
               "ap_onnx_tta": 0.41, "val_fingerprint": "a", "mlflow_run_id": None}
    (tmp_path / "export.json").write_text(json.dumps(metrics))
    evaluation = registration.read_evaluation(tmp_path / "export.json", tta=True)
    assert (evaluation.metric, evaluation.ap, evaluation.training_run_id) == ("ap_onnx_tta", 0.41, None)
    assert registration.read_evaluation(tmp_path / "export.json", tta=False).ap == 0.3
    (tmp_path / "export.json").write_text(json.dumps(metrics | {"ap_onnx_tta": None}))
    with pytest.raises(ConfigError, match="ap_onnx_tta is None, expected a number"):
        registration.read_evaluation(tmp_path / "export.json", tta=True)


def test_the_logged_model_loads_without_torch_from_its_own_code(registered):
    """In a fresh process (started with the server), loading the model and predicting imports no torch, and
    the served module comes from the model's code folder."""
    out, err = registered["loader"].communicate(timeout=120)
    assert registered["loader"].returncode == 0, err[-2000:]
    loaded = json.loads(out.strip().splitlines()[-1])
    assert loaded["rows"] == 1 and loaded["torch"] is False
    assert "/code/pipelines/inference/served.py" in loaded["served"]


def test_parse_model_uri():
    assert parse_model_uri("models:/detector@champion") == ("detector", "champion")
    assert parse_model_uri("models:/detector/12") == ("detector", "12")


# --- serving ----------------------------------------------------------------------------------------------------------


def _post(port: int, body: dict, timeout: float = 30) -> tuple[int, dict]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/invocations", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _wait_ready(server: subprocess.Popen, port: int, workspace: Path, limit: float = 120.0) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"the server ended ({server.returncode}): {(workspace / 'server.log').read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    pytest.fail(f"the server did not answer /ping in {limit:g} s")


def _b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def _same(served: dict, predicted: list[dict], tolerance: float = 1e-3) -> None:
    """The served detections of one image equal stages.predict's (COCO xywh) within ``tolerance``."""
    assert len(served["scores"]) == len(predicted)
    order = sorted(predicted, key=lambda d: -d["score"])
    for box, score, category, d in zip(served["boxes"], served["scores"], served["category_ids"], order):
        x, y, w, h = d["bbox"]
        assert category == d["category_id"] and abs(score - d["score"]) <= tolerance
        assert np.abs(np.array(box) - np.array([x, y, x + w, y + h])).max() <= tolerance


def test_served_champion_answers_as_predict_and_refuses_bad_requests_in_one_line(registered, workspace, capsys):
    port = registered["port"]
    _wait_ready(registered["server"], port, workspace)
    predicted = _predict(["images/val.png", "--model", "export/model.onnx", "--out", "out-served"], capsys)
    start = time.perf_counter()
    status, body = _post(port, {"dataframe_split": {"columns": ["image"], "data": [[_b64(Path("images/val.png"))]]}})
    round_trip = time.perf_counter() - start
    assert status == 200, body
    [answer] = body["predictions"]
    assert (answer["width"], answer["height"]) == (96, 64)
    assert answer["names"] == [{1: "circle", 3: "square", 7: "triangle"}[c] for c in answer["category_ids"]]
    _same(answer, predicted)
    with capsys.disabled():
        print(f"\nserving round-trip, one 96x64 PNG: {round_trip * 1000:.1f} ms")
    resized = _predict(["images/big.png", "--model", "export/model.onnx", "--out", "out-big"], capsys)
    status, body = _post(port, {"dataframe_split": {"columns": ["image"], "data": [[_b64(Path("images/big.png"))]]}})
    assert status == 200 and (body["predictions"][0]["width"], body["predictions"][0]["height"]) == (150, 128)
    _same(body["predictions"][0], resized)  # an image the model resizes

    status, body = _post(port, {"dataframe_records": [{"image": _b64(Path("images/val.png"))}],
                                "params": {"score_thresh": 0.5}})
    assert status == 200
    higher = _predict(["images/val.png", "--model", "export/model.onnx", "--score", "0.5", "--out", "out-0.5"], capsys)
    _same(body["predictions"][0], higher)
    assert len(higher) < len(predicted)

    bad = {"bad base64": "not base64!!", "not an image": base64.b64encode(b"hello, world").decode(),
           "a path": "/etc/passwd", "over the pixel cap": _b64(workspace / "over_cap.png")}
    for what, value in bad.items():
        status, body = _post(port, {"dataframe_split": {"columns": ["image"], "data": [[value]]}})
        assert 400 <= status < 500, (what, status, body)
        assert "\n" not in body["message"] and len(body["message"]) < 400, (what, body)
    _, body = _post(port, {"dataframe_split": {"columns": ["image"], "data": [[bad["over the pixel cap"]]]}})
    assert body["message"].startswith("image[0]: 160x160 pixels") and "max_image_pixels" in body["message"]
    _, body = _post(port, {"dataframe_split": {"columns": ["image"], "data": [[bad["not an image"]]]}})
    assert body["message"] == "image[0]: unreadable image (not a JPEG, PNG, WebP or GIF file)"
    status, body = _post(port, {"dataframe_split": {"columns": ["image"], "data": [[_b64(Path("images/val.png"))]]},
                                "params": {"score_thresh": 2}})
    assert status == 400 and body["message"] == "params.score_thresh: expected a number from 0 to 1, got 2.0"
    status, body = _post(port, {"dataframe_split": {"columns": ["image"], "data": [[_b64(Path("images/val.png"))]]},
                                "params": {"score_thresh": 1.0}})
    assert status == 200 and body["predictions"] == [{"boxes": [], "scores": [], "category_ids": [], "names": [],
                                                      "width": 96, "height": 64}]  # no detection: empty arrays
