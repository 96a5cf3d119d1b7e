"""The lead's commands (pipelines.team.lead) without servers: the team.env they write is the one
``make team-join`` reads, the S3 URL follows the tracking server's, and bad input is one line. The servers
themselves, started by ``lead server`` and joined across hosts, are tested in test_team_netns.py."""

from __future__ import annotations

import json
import stat

import pytest

from pipelines import cli
from pipelines.team import join, lead, service


@pytest.mark.parametrize("tracking, port, s3", [
    ("http://team.example:5000", 9000, "http://team.example:9000"),
    ("https://team.example/mlflow", 9443, "https://team.example:9443"),
    ("http://[fd00::1]:5000", 9000, "http://[fd00::1]:9000"),
])
def test_the_s3_url_is_the_tracking_servers_host_on_the_s3_port(tracking, port, s3):
    assert lead.derived_s3_url(tracking, port) == s3


def test_the_team_env_it_writes_is_what_team_join_reads(tmp_path):
    record = {"tracking_uri": "http://team.example:5000", "s3_endpoint": "http://team.example:9000",
              "dvc_bucket": "dvc", "dvc_remote": "team", "experiment": "detection"}
    path = tmp_path / "alice.team.env"
    service.write_secret(path, lead.team_env(record, name="alice", password="pw", key=("teamKEY", "SECRET")))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert join.read_team_env(path) == {
        "MLFLOW_TRACKING_URI": "http://team.example:5000", "MLFLOW_TRACKING_USERNAME": "alice",
        "MLFLOW_TRACKING_PASSWORD": "pw", "S3_ENDPOINT_URL": "http://team.example:9000", "DVC_REMOTE": "team",
        "DVC_BUCKET": "dvc", "AWS_ACCESS_KEY_ID": "teamKEY", "AWS_SECRET_ACCESS_KEY": "SECRET"}


@pytest.mark.parametrize("argv, message", [
    (["user"], "error: user: give the teammate's name (make team-user NAME=alice) (--help for usage)"),
    (["user", "Alice!"], "error: NAME='Alice!': not a user name; expected a-z, 0-9, '-', '_', up to 32, starting "
                         "with a letter, not admin or mlflow"),
    (["user", "admin"], "error: NAME='admin': not a user name"),
    (["user", "alice"], "error: --folder {folder}: no team server was started there; start it first: make "
                        "team-server (python -m pipelines.team.lead server --folder {folder})"),
    (["stop", "alice"], "error: alice: goes with the action user NAME (--help for usage)"),
    (["server", "--reset"], "error: --reset/--remove/--out: goes with the action user NAME (--help for usage)"),
    (["server", "--s3-port", "70000"], "error: argument --s3-port: expected a TCP port from 1 to 65535, got '70000'"),
])
def test_bad_input_is_one_line_exit_2_and_nothing_is_made(argv, message, tmp_path, capsys, restore_logging):
    folder = tmp_path / "team"
    with pytest.raises(SystemExit) as stop:
        cli.run(lead.main, [*argv, "--folder", str(folder)])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(message.format(folder=folder)) and err.count("\n") == 1, err
    assert not folder.exists()


def test_a_team_whose_server_stopped_is_named_in_one_line(tmp_path, capsys, restore_logging):
    folder = tmp_path / "team"
    folder.mkdir()
    (folder / lead.TEAM).write_text(json.dumps({"tracking_uri": "http://x:5000"}))
    with pytest.raises(SystemExit):
        cli.run(lead.main, ["user", "alice", "--folder", str(folder)])
    assert capsys.readouterr().err == (f"error: --folder {folder}: its tracking server does not run ({folder}/tracking); "
                                       f"start the team's servers: python -m pipelines.team.lead server --folder {folder}\n")
