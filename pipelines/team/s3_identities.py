"""Who may do what on the team's S3 server: SeaweedFS's identities file, ``FOLDER/s3.json`` (mode 600).

Three kinds of identity, each with a key of its own:

- ``admin`` (actions ``Admin``, ``Read``, ``Write``, ``List``, ``Tagging``): used only by the server's own set-up
  (creating the buckets); its key is in ``FOLDER/credentials`` and goes to nobody.
- ``mlflow``: the MLflow server's key, ``Read``/``Write``/``List`` on the MLflow bucket only, in
  ``FOLDER/mlflow.credentials``.
- one per teammate (``python -m pipelines.team.s3_server user NAME``): ``Read``/``Write``/``List`` on the DVC
  bucket only, in ``FOLDER/users/NAME.credentials``. SeaweedFS's ``Write`` covers putting and deleting
  objects, not creating or deleting a bucket (that needs ``Admin``), and no key may delete a bucket that is
  not empty (``-s3.allowDeleteBucketNotEmpty=false``).

A credentials file is AWS's shared-credentials format (``[default]`` with ``aws_access_key_id`` and
``aws_secret_access_key``), which DVC reads through ``credentialpath`` and boto3 (the MLflow server)
through ``AWS_SHARED_CREDENTIALS_FILE``, so no secret is typed on a command line. A removed user's entry
keeps its name with a new random key and no action: ``weed`` reloads the file on SIGHUP, and that
replaces an identity by name but keeps one left out of the file.
"""

from __future__ import annotations

import json
import re
import secrets
from pathlib import Path

from . import service

IDENTITIES = "s3.json"
ADMIN, MLFLOW = "admin", "mlflow"
NAME = re.compile(r"[a-z][a-z0-9_-]{0,31}")
BUCKET_ACTIONS = ("Read", "Write", "List")


def new_key() -> tuple[str, str]:
    """A fresh access key id and secret (hex: no leading "-" for a command line)."""
    return "team" + secrets.token_hex(8), secrets.token_hex(20)


def aws_credentials(access_key: str, secret_key: str) -> str:
    return f"[default]\naws_access_key_id = {access_key}\naws_secret_access_key = {secret_key}\n"


def _identity(name: str, key: tuple[str, str], actions: list[str]) -> dict:
    return {"name": name, "credentials": [{"accessKey": key[0], "secretKey": key[1]}], "actions": actions}


def _bucket_actions(bucket: str) -> list[str]:
    return [f"{action}:{bucket}" for action in BUCKET_ACTIONS]


def load(folder: Path) -> dict:
    path = folder / IDENTITIES
    return json.loads(path.read_text()) if path.is_file() else {"identities": []}


def _save(folder: Path, config: dict) -> None:
    service.write_secret(folder / IDENTITIES, json.dumps(config, indent=1) + "\n")


def _find(config: dict, name: str) -> dict | None:
    return next((i for i in config["identities"] if i["name"] == name), None)


def key_of(folder: Path, name: str) -> tuple[str, str]:
    found = _find(load(folder), name)
    if found is None:
        raise KeyError(name)
    credential = found["credentials"][0]
    return credential["accessKey"], credential["secretKey"]


def ensure(folder: Path, *, mlflow_bucket: str) -> None:
    """``s3.json`` with the admin and MLflow identities, made on first start; the MLflow key's actions follow
    ``mlflow_bucket``. The admin key of an older folder (``FOLDER/credentials``, from ``weed mini``) is kept."""
    config = load(folder)
    if _find(config, ADMIN) is None:
        legacy = folder / "credentials"
        key = new_key()
        if legacy.is_file():
            found = json.loads(legacy.read_text())
            key = (found["access_key_id"], found["secret_access_key"])
        config["identities"].insert(0, _identity(ADMIN, key, ["Admin", "Read", "Write", "List", "Tagging"]))
        service.write_secret(legacy, json.dumps({"access_key_id": key[0], "secret_access_key": key[1]}))
    found = _find(config, MLFLOW)
    key = new_key() if found is None else key_of_entry(found)
    config["identities"] = [i for i in config["identities"] if i["name"] != MLFLOW]
    config["identities"].insert(1, _identity(MLFLOW, key, _bucket_actions(mlflow_bucket)))
    _save(folder, config)
    service.write_secret(folder / "mlflow.credentials", aws_credentials(*key))


def key_of_entry(entry: dict) -> tuple[str, str]:
    return entry["credentials"][0]["accessKey"], entry["credentials"][0]["secretKey"]


def users(config: dict) -> list[str]:
    """The teammates with a working key."""
    return [i["name"] for i in config["identities"] if i["name"] not in (ADMIN, MLFLOW) and i["actions"]]


def user_file(folder: Path, name: str) -> Path:
    return folder / "users" / f"{name}.credentials"


def add_user(folder: Path, name: str, bucket: str) -> tuple[tuple[str, str], bool]:
    """Give ``name`` a new key for ``bucket`` (replacing any earlier one), written to its credentials file;
    the key and whether the user had one."""
    config = load(folder)
    had = name in users(config)
    key = new_key()
    config["identities"] = [i for i in config["identities"] if i["name"] != name]
    config["identities"].append(_identity(name, key, _bucket_actions(bucket)))
    _save(folder, config)
    service.write_secret(user_file(folder, name), aws_credentials(*key))
    return key, had


def remove_user(folder: Path, name: str) -> tuple[str, str]:
    """Take ``name``'s key away (its entry kept with a random key and no action); the key it had. Raises
    KeyError for a name without a working key."""
    config = load(folder)
    if name not in users(config):
        raise KeyError(name)
    entry = _find(config, name)
    old = key_of_entry(entry)
    entry.update(_identity(name, new_key(), []))
    _save(folder, config)
    user_file(folder, name).unlink(missing_ok=True)
    return old
