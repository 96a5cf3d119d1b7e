"""Join a team (``make team-join TEAM_ENV=team.env``): a teammate's one command after ``git clone``.

``python -m pipelines.team.join --team-env FILE [--no-pull]`` reads the ``team.env`` that the lead handed
over (:data:`FIELDS`; docs/team.md), checks it against the servers with one authenticated request to each,
then writes, in the clone (the current folder):

* ``.team/s3.credentials`` (mode 600): the DVC bucket's key, as an AWS credentials file;
* ``.dvc/config.local`` (git-ignored by DVC): the remote (``s3://BUCKET``, the default), its ``endpointurl``
  and ``credentialpath``;
* ``.team/settings.json`` (mode 600, git-ignored): the tracking URI, user and password that the stages read
  where ``MLFLOW_TRACKING_URI`` is not set (:mod:`pipelines.tracking.team_settings`);

and pulls the main pipeline's outputs (``dvc pull dvc.yaml``: an uncommitted search's ``search/dvc.yaml``
does not break it). Bad input is one ``error:`` line naming the file and field, exit 2, and nothing written:
a missing ``team.env``, one readable by others than its owner (not mode 600), a field missing or
malformed, an unknown one, and a ``team.env`` for another server (the tracking server or the S3 server
refuses the credentials, or does not answer).
"""

from __future__ import annotations

import argparse
import base64
import configparser
import json
import re
import stat
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

from .. import cli
from ..errors import TeamError, first_line
from ..tracking import team_settings as settings
from . import address, service

FIELDS = {
    "MLFLOW_TRACKING_URI": "the tracking server's public URL, http(s)://NAME[:PORT][/PATH]",
    "MLFLOW_TRACKING_USERNAME": "your MLflow user",
    "MLFLOW_TRACKING_PASSWORD": "your MLflow password",
    "S3_ENDPOINT_URL": "the S3 server's public URL, http(s)://NAME[:PORT]",
    "DVC_REMOTE": "the DVC remote's name (e.g. team)",
    "DVC_BUCKET": "the DVC remote's bucket (e.g. dvc)",
}
"""The fields every ``team.env`` has, ``NAME=VALUE`` one a line; the DVC bucket's key as well, either inline
(:data:`KEY_FIELDS`) or as :data:`CREDENTIALS_FIELD`."""

KEY_FIELDS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
CREDENTIALS_FIELD = "S3_CREDENTIALS"
"""The path of an AWS credentials file (``[default]`` with both keys; ``s3_server user NAME`` writes one), relative
to the ``team.env``'s folder."""

CHECK_TIMEOUT = 10.0
"""Seconds each server is given to answer the one authenticated request of the check."""

CREDENTIALS_FILE = "s3.credentials"
_LINE = re.compile(r"\s*(?:export\s+)?([A-Z][A-Z0-9_]*)\s*=\s*(.*?)\s*")
_REMOTE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")


def read_team_env(path: Path) -> dict[str, str]:
    """The checked fields of ``path``, the DVC key as ``AWS_ACCESS_KEY_ID`` and ``AWS_SECRET_ACCESS_KEY``.

    Raises:
        TeamError: one line naming the file and the field (or the mode, or the line).
    """
    try:
        info = path.stat()
    except FileNotFoundError:
        raise TeamError(f"TEAM_ENV={path}: no such file; expected the team.env the lead made for you "
                        "(make team-user NAME=...)") from None
    except OSError as err:
        raise TeamError(f"TEAM_ENV={path}: cannot be read ({first_line(err)})") from None
    if not stat.S_ISREG(info.st_mode):
        raise TeamError(f"TEAM_ENV={path}: not a regular file; expected the team.env the lead made for you")
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o077:
        raise TeamError(f"TEAM_ENV={path}: mode {mode:03o}, expected 600 (it holds your passwords): chmod 600 {path}")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise TeamError(f"TEAM_ENV={path}: cannot be read ({first_line(err) or type(err).__name__})") from None
    known = {*FIELDS, *KEY_FIELDS, CREDENTIALS_FIELD}
    values: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        match = _LINE.fullmatch(line)
        if not match:
            raise TeamError(f"{path}: line {number}: expected NAME=VALUE")
        name, value = match.groups()
        if name not in known:
            raise TeamError(f"{path}: {name}: unknown field; expected {', '.join(sorted(known))}")
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        values[name] = value
    for name, what in FIELDS.items():
        if not values.get(name):
            raise TeamError(f"{path}: {name}: missing; expected {what}")
    for name in ("MLFLOW_TRACKING_URI", "S3_ENDPOINT_URL"):
        try:
            values[name] = address.public_url(values[name])
        except argparse.ArgumentTypeError as err:
            raise TeamError(f"{path}: {name}: {err}") from None
    if not _REMOTE.fullmatch(values["DVC_REMOTE"]):
        raise TeamError(f"{path}: DVC_REMOTE: {values['DVC_REMOTE']!r} is not a remote name; expected letters, "
                        "digits, '_', '.', '-'")
    if not _BUCKET.fullmatch(values["DVC_BUCKET"]):
        raise TeamError(f"{path}: DVC_BUCKET: {values['DVC_BUCKET']!r} is not an S3 bucket name")
    values.update(_key(path, values))
    return values


def _key(path: Path, values: dict[str, str]) -> dict[str, str]:
    """The DVC bucket's key: inline, or from the ``S3_CREDENTIALS`` file."""
    inline = [name for name in KEY_FIELDS if values.get(name)]
    if inline and values.get(CREDENTIALS_FIELD):
        raise TeamError(f"{path}: {CREDENTIALS_FIELD}: give either it or {' and '.join(KEY_FIELDS)}, not both")
    if values.get(CREDENTIALS_FIELD):
        file = path.parent / values[CREDENTIALS_FIELD]
        parser = configparser.ConfigParser()
        try:
            parser.read_string(file.read_text())
            key = {name: parser["default"][name.lower()] for name in KEY_FIELDS}
        except FileNotFoundError:
            raise TeamError(f"{path}: {CREDENTIALS_FIELD}: {file}: no such file") from None
        except (OSError, UnicodeDecodeError, configparser.Error, KeyError) as err:
            raise TeamError(f"{path}: {CREDENTIALS_FIELD}: {file}: expected an AWS credentials file with [default] "
                            f"aws_access_key_id and aws_secret_access_key ({type(err).__name__})") from None
        return key
    for name in KEY_FIELDS:
        if not values.get(name):
            raise TeamError(f"{path}: {name}: missing; expected the DVC bucket's key ({' and '.join(KEY_FIELDS)}, "
                            f"or {CREDENTIALS_FIELD}=FILE)")
    return {name: values[name] for name in KEY_FIELDS}


def check_tracking(path: Path, values: dict[str, str]) -> None:
    """One authenticated request to the tracking server; a :class:`TeamError` line where it does not admit them."""
    uri, user = values["MLFLOW_TRACKING_URI"], values["MLFLOW_TRACKING_USERNAME"]
    token = base64.b64encode(f"{user}:{values['MLFLOW_TRACKING_PASSWORD']}".encode()).decode()
    request = urllib.request.Request(f"{uri}/api/2.0/mlflow/experiments/search?max_results=1",
                                     headers={"Authorization": f"Basic {token}"})
    try:
        with urllib.request.urlopen(request, timeout=CHECK_TIMEOUT) as answer:
            json.loads(answer.read() or b"{}")
    except urllib.error.HTTPError as err:
        body = err.read().decode(errors="replace")
        if "Invalid Host header" in body:
            raise TeamError(f"{path}: MLFLOW_TRACKING_URI: {uri} refused the name it was reached by (403 Invalid "
                            "Host header): this team.env is for another server, or the server's --public-url "
                            "differs") from None
        if err.code in (401, 403):
            raise TeamError(f"{path}: MLFLOW_TRACKING_PASSWORD: {uri} refused user {user!r} (HTTP {err.code}): this "
                            "team.env is for another server, or the user was reset or removed; ask the lead for a new "
                            "one") from None
        raise TeamError(f"{path}: MLFLOW_TRACKING_URI: {uri} is not an MLflow tracking server (HTTP {err.code})") from None
    except (OSError, ValueError) as err:
        why = first_line(getattr(err, "reason", None) or err, 160) if not isinstance(err, ValueError) else "not JSON"
        raise TeamError(f"{path}: MLFLOW_TRACKING_URI: {uri} does not answer as an MLflow tracking server "
                        f"({why}); nothing written") from None


def check_bucket(path: Path, values: dict[str, str]) -> None:
    """One signed request (list at most one object) to the DVC bucket with the key; a :class:`TeamError` line
    where the S3 server refuses it, has no such bucket, or does not answer."""
    import boto3
    from botocore.config import Config
    from botocore.exceptions import BotoCoreError, ClientError

    endpoint, bucket = values["S3_ENDPOINT_URL"], values["DVC_BUCKET"]
    client = boto3.session.Session().client(
        "s3", endpoint_url=endpoint, aws_access_key_id=values["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=values["AWS_SECRET_ACCESS_KEY"], region_name="us-east-1",
        config=Config(connect_timeout=CHECK_TIMEOUT / 2, read_timeout=CHECK_TIMEOUT / 2, retries={"max_attempts": 1},
                      s3={"addressing_style": "path"}))
    try:
        client.list_objects_v2(Bucket=bucket, MaxKeys=1)
    except ClientError as err:
        code = err.response.get("Error", {}).get("Code", "")
        if code == "NoSuchBucket":
            raise TeamError(f"{path}: DVC_BUCKET: {endpoint} has no bucket {bucket!r}: this team.env is for another "
                            "server") from None
        if code == "AccessDenied":  # a key the server knows, without rights on this bucket
            raise TeamError(f"{path}: DVC_BUCKET: {endpoint} does not let this key use bucket {bucket!r} (AccessDenied): "
                            "the bucket or the key is another team's; ask the lead for a new team.env") from None
        field = "AWS_SECRET_ACCESS_KEY" if code == "SignatureDoesNotMatch" else "AWS_ACCESS_KEY_ID"
        raise TeamError(f"{path}: {field}: {endpoint} refused the key for bucket {bucket!r} ({code or 'refused'}): "
                        "this team.env is for another server, or the key was removed; ask the lead for a new "
                        "one") from None
    except BotoCoreError as err:
        raise TeamError(f"{path}: S3_ENDPOINT_URL: {endpoint} does not answer ({first_line(err, 160)}); nothing "
                        "written") from None


def write_dvc_remote(root: Path, values: dict[str, str], credentials: Path) -> None:
    """The remote in ``.dvc/config.local``, the default: ``s3://BUCKET``, ``endpointurl``, ``credentialpath``."""
    from dvc.config import Config

    config = Config(dvc_dir=str(root / ".dvc"))
    name = values["DVC_REMOTE"]
    with config.edit("local") as conf:
        conf["remote"][name] = {"url": f"s3://{values['DVC_BUCKET']}", "endpointurl": values["S3_ENDPOINT_URL"],
                                "credentialpath": str(credentials)}
        conf["core"]["remote"] = name


def join(team_env: Path, *, root: Path, pull: bool = True) -> None:
    """Check ``team_env`` and the servers, then write the clone's settings and pull (module docstring)."""
    if not (root / ".dvc").is_dir():
        raise TeamError(f"{root}: not a DVC repository (no .dvc/); run make team-join in the clone's root")
    values = read_team_env(team_env)
    check_tracking(team_env, values)
    check_bucket(team_env, values)
    credentials = root / settings.FOLDER / CREDENTIALS_FILE
    (root / settings.FOLDER).mkdir(mode=0o700, exist_ok=True)
    service.write_secret(credentials, "[default]\n" f"aws_access_key_id = {values['AWS_ACCESS_KEY_ID']}\n"
                                      f"aws_secret_access_key = {values['AWS_SECRET_ACCESS_KEY']}\n")
    write_dvc_remote(root, values, credentials.resolve())
    written = settings.write(root, {
        "tracking_uri": values["MLFLOW_TRACKING_URI"], "username": values["MLFLOW_TRACKING_USERNAME"],
        "password": values["MLFLOW_TRACKING_PASSWORD"], "s3_endpoint": values["S3_ENDPOINT_URL"],
        "dvc_remote": values["DVC_REMOTE"], "dvc_bucket": values["DVC_BUCKET"], "credentials": str(credentials)})
    print(f"joined: the stages record into {values['MLFLOW_TRACKING_URI']} as {values['MLFLOW_TRACKING_USERNAME']} "
          f"({written}); DVC remote {values['DVC_REMOTE']} = s3://{values['DVC_BUCKET']} at {values['S3_ENDPOINT_URL']} "
          "(.dvc/config.local)", flush=True)
    if pull:
        done = subprocess.run([sys.executable, "-m", "dvc", "pull", "dvc.yaml"], cwd=root)
        if done.returncode:
            raise TeamError(f"dvc pull dvc.yaml: exit {done.returncode} (DVC's message above); the team settings are "
                            "written: run `dvc pull dvc.yaml` again")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog="docs/team.md")
    parser.add_argument("--team-env", required=True, help="the team.env the lead made for you")
    parser.add_argument("--no-pull", action="store_true", help="write the settings, do not run dvc pull dvc.yaml")
    args = parser.parse_args(argv)
    if not args.team_env.strip():
        raise TeamError("TEAM_ENV: not set; expected make team-join TEAM_ENV=path/to/team.env (the lead's make team-user "
                        "NAME=... made it for you)")
    join(Path(args.team_env), root=Path.cwd(), pull=not args.no_pull)


if __name__ == "__main__":
    cli.run(main)
