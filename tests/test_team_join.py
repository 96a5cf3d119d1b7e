"""``make team-join`` (pipelines.team.join) and the team settings the stages read (pipelines.tracking.team_settings).

Tiny and serverless: a fake tracking/S3 server on 127.0.0.1 (http.server in a thread) answers the one
authenticated request of each check; refusals leave the clone untouched."""

from __future__ import annotations

import json
import logging
import os
import stat
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from pipelines import cli
from pipelines.errors import TeamError
from pipelines.team import join
from pipelines.tracking import store
from pipelines.tracking import team_settings as settings

USER, PASSWORD = "alice", "s3cret-pw"
KEY = ("teamAKIA", "teamSECRET")


class _Fake(BaseHTTPRequestHandler):
    """MLflow's search answers 200 to alice's password and 401 otherwise; S3 (``/dvc``) answers an empty
    listing to any key but ``bad``, InvalidAccessKeyId to that (a fake: it checks no signature)."""

    def do_GET(self):  # noqa: N802 (http.server's name)
        import base64

        if self.path.startswith("/api/2.0/mlflow/"):
            good = "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
            ok = self.headers.get("Authorization") == good
            self._answer(200 if ok else 401, b"{}" if ok else b"You are not authenticated.", "application/json")
        elif self.path.startswith("/dvc"):
            if "Credential=bad/" in self.headers.get("Authorization", ""):
                self._answer(403, b"<?xml version='1.0'?><Error><Code>InvalidAccessKeyId</Code><Message>no such key</Message>"
                                  b"</Error>", "application/xml")
            else:
                self._answer(200, b"<?xml version='1.0'?><ListBucketResult><Name>dvc</Name><KeyCount>0</KeyCount>"
                                  b"<MaxKeys>1</MaxKeys><IsTruncated>false</IsTruncated></ListBucketResult>",
                             "application/xml")
        else:
            self._answer(404, b"no", "text/plain")

    def _answer(self, code: int, body: bytes, kind: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):  # quiet
        pass


@pytest.fixture(scope="module")
def fake():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Fake)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture
def clone(tmp_path, monkeypatch):
    root = tmp_path / "clone"
    (root / ".dvc").mkdir(parents=True)
    (root / ".dvc" / "config").write_text("")
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "AWS_ACCESS_KEY_ID",
                 "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE", "AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE"):
        monkeypatch.setenv(name, "")  # recorded, so that what the store's resolution sets is undone afterwards
        monkeypatch.delenv(name)
    monkeypatch.setenv("DVC_ROOT", str(root))
    return root


def _team_env(path: Path, url: str, *, mode: int = 0o600, drop: str | None = None, **changed: str) -> Path:
    fields = {"MLFLOW_TRACKING_URI": url, "MLFLOW_TRACKING_USERNAME": USER, "MLFLOW_TRACKING_PASSWORD": PASSWORD,
              "S3_ENDPOINT_URL": url, "DVC_REMOTE": "team", "DVC_BUCKET": "dvc", "AWS_ACCESS_KEY_ID": KEY[0],
              "AWS_SECRET_ACCESS_KEY": KEY[1], **changed}
    fields.pop(drop, None)
    path.write_text("# team.env for alice\n" + "".join(f"{k}={v}\n" for k, v in fields.items()))
    path.chmod(mode)
    return path


def _nothing_written(root: Path) -> None:
    assert not (root / ".team").exists() and not (root / ".dvc" / "config.local").exists()


def test_join_writes_the_dvc_remote_and_a_private_settings_file_the_stages_read(clone, fake, tmp_path):
    join.join(_team_env(tmp_path / "team.env", fake), root=clone, pull=False)
    local = (clone / ".dvc" / "config.local").read_text()
    assert "['remote \"team\"']" in local and "url = s3://dvc" in local and f"endpointurl = {fake}" in local
    assert "remote = team" in local and "credentialpath" in local
    credentials = clone / ".team" / "s3.credentials"
    assert f"aws_access_key_id = {KEY[0]}" in credentials.read_text()
    record = settings.path(clone)
    assert stat.S_IMODE(record.stat().st_mode) == 0o600 and stat.S_IMODE(credentials.stat().st_mode) == 0o600
    assert stat.S_IMODE((clone / ".team").stat().st_mode) == 0o700
    assert json.loads(record.read_text())["tracking_uri"] == fake
    assert store.tracking_uri() == fake  # DVC_ROOT is the clone
    assert os.environ["MLFLOW_TRACKING_USERNAME"] == USER and os.environ["MLFLOW_TRACKING_PASSWORD"] == PASSWORD
    assert "/.team/" in (Path(__file__).parents[1] / ".gitignore").read_text().splitlines()


def test_the_environment_wins_over_the_settings_file(clone, monkeypatch):
    settings.write(clone, {"tracking_uri": "http://tracking.example:5000", "username": USER, "password": PASSWORD})
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "bob")
    assert store.store_source() == ("http://tracking.example:5000", f"team settings {settings.path(clone)}, user 'bob'")
    assert os.environ["MLFLOW_TRACKING_PASSWORD"] == PASSWORD  # the file's, where the environment had none
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://other.example:5000")
    assert store.tracking_uri() == "http://other.example:5000"


def test_a_broken_settings_file_stops_rather_than_falling_back_to_mlflow_db(clone):
    settings.write(clone, {"tracking_uri": "http://tracking.example:5000", "username": USER})
    with pytest.raises(TeamError, match=r"settings.json: password: missing; run make team-join"):
        store.tracking_uri()
    assert not (clone / "mlflow.db").exists()


def test_a_tracked_stage_names_its_store_in_its_first_line_without_the_password(clone, capsys, monkeypatch,
                                                                                  restore_logging):
    def main(argv):
        logging.getLogger("stage").info("working")

    cli.run(main, [], announce=store.announce)
    first = capsys.readouterr().err.splitlines()[0]
    assert first.endswith(f"tracking store sqlite:///{clone / 'mlflow.db'} (the repository's own; no MLFLOW_TRACKING_URI, "
                          "no team settings)")
    settings.write(clone, {"tracking_uri": "http://tracking.example:5000", "username": USER, "password": PASSWORD})
    cli.run(main, [], announce=store.announce)
    first = capsys.readouterr().err.splitlines()[0]
    assert first.endswith(f"tracking store http://tracking.example:5000 (team settings {settings.path(clone)}, user 'alice')")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://{USER}:{PASSWORD}@tracking.example:5000")
    cli.run(main, [], announce=store.announce)
    first = capsys.readouterr().err.splitlines()[0]
    assert first.endswith("tracking store http://***@tracking.example:5000 (MLFLOW_TRACKING_URI)") and PASSWORD not in first


@pytest.mark.parametrize("case, expected", [
    ("missing", r"^TEAM_ENV=.*team.env: no such file"),
    ("mode", r"^TEAM_ENV=.*team.env: mode 644, expected 600 .*chmod 600"),
    ("field", r"team.env: DVC_BUCKET: missing; expected the DVC remote's bucket"),
    ("key", r"team.env: AWS_SECRET_ACCESS_KEY: missing"),
    ("unknown", r"team.env: MLFLOW_TRACKING_PASSWROD: unknown field"),
    ("url", r"team.env: MLFLOW_TRACKING_URI: 'tracking.example' is not an http\(s\) URL"),
    ("password", r"team.env: MLFLOW_TRACKING_PASSWORD: http://127.0.0.1:\d+ refused user 'alice' \(HTTP 401\): this "
                 r"team.env is for another server"),
    ("s3 key", r"team.env: AWS_ACCESS_KEY_ID: http://127.0.0.1:\d+ refused the key for bucket 'dvc' \(InvalidAccessKeyId\)"),
    ("unreachable", r"team.env: MLFLOW_TRACKING_URI: http://127.0.0.1:9 does not answer as an MLflow tracking server"),
])
def test_bad_team_env_is_one_line_naming_the_field_and_nothing_is_written(clone, fake, tmp_path, case, expected):
    path = tmp_path / "team.env"
    if case != "missing":
        _team_env(path, fake, mode=0o644 if case == "mode" else 0o600,
                  drop={"field": "DVC_BUCKET", "key": "AWS_SECRET_ACCESS_KEY"}.get(case),
                  **{"unknown": {"MLFLOW_TRACKING_PASSWROD": "x"}, "url": {"MLFLOW_TRACKING_URI": "tracking.example"},
                     "password": {"MLFLOW_TRACKING_PASSWORD": "wrong"}, "s3 key": {"AWS_ACCESS_KEY_ID": "bad"},
                     "unreachable": {"MLFLOW_TRACKING_URI": "http://127.0.0.1:9"}}.get(case, {}))
    with pytest.raises(TeamError, match=expected) as err:
        join.join(path, root=clone, pull=False)
    assert "\n" not in str(err.value) and PASSWORD not in str(err.value)
    _nothing_written(clone)


def test_make_team_join_without_team_env_is_one_line_exit_2(clone, capsys, monkeypatch, restore_logging):
    monkeypatch.chdir(clone)
    with pytest.raises(SystemExit) as stop:
        cli.run(join.main, ["--team-env", ""])
    assert stop.value.code == 2
    assert capsys.readouterr().err == ("error: TEAM_ENV: not set; expected make team-join TEAM_ENV=path/to/team.env "
                                       "(the lead's make team-user NAME=... made it for you)\n")
    _nothing_written(clone)
