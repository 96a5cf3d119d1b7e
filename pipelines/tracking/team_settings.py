"""A joined clone's team settings: the git-ignored file ``.team/settings.json`` (mode 600) that
``make team-join`` (:mod:`pipelines.team.join`) writes and the stages read.

It holds the team's tracking URI and this teammate's MLflow user and password (and, for the record, the DVC
remote it configured). :func:`~pipelines.tracking.store.tracking_uri` reads it where ``MLFLOW_TRACKING_URI``
is not set, so a stage in a clone that joined a team never falls back to the repository's ``mlflow.db``;
``MLFLOW_TRACKING_USERNAME`` and ``MLFLOW_TRACKING_PASSWORD`` set in the environment win over the file's,
variable by variable. A settings file that cannot be read is one :class:`~pipelines.errors.TeamError` line,
never a silent fall-back.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..errors import TeamError

FOLDER = ".team"
FILE = "settings.json"
FIELDS = ("tracking_uri", "username", "password")
"""What the stages need from it; ``join`` writes more (the S3 endpoint, remote, bucket, credentials file)."""


def path(root: Path) -> Path:
    return root / FOLDER / FILE


def write(root: Path, record: dict) -> Path:
    """Write ``record`` as the settings file of the clone at ``root``, readable by its owner only from its first
    byte (the folder too: it also holds the S3 credentials file)."""
    folder = root / FOLDER
    folder.mkdir(mode=0o700, exist_ok=True)
    folder.chmod(0o700)
    target = path(root)
    tmp = target.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(json.dumps(record, indent=1) + "\n")
    tmp.replace(target)
    return target


def read(root: Path) -> dict | None:
    """The settings of the clone at ``root``; None where it joined no team (no settings file).

    Raises:
        TeamError: the file is there but cannot be used (unreadable, not JSON, a field missing), one line
            naming the file and what to do.
    """
    target = path(root)
    if not target.exists():
        return None
    redo = "run make team-join TEAM_ENV=... again (docs/team.md)"
    try:
        record = json.loads(target.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise TeamError(f"{target}: the team settings cannot be read ({type(err).__name__}); {redo}") from None
    if not isinstance(record, dict):
        raise TeamError(f"{target}: expected a JSON object of team settings; {redo}")
    for field in FIELDS:
        if not isinstance(record.get(field), str) or not record[field]:
            raise TeamError(f"{target}: {field}: missing; {redo}")
    return record


def apply(root: Path) -> str | None:
    """The tracking URI of the clone at ``root``'s team settings, its user and password put in the process
    environment where the environment has none (MLflow's client reads them there); None without settings."""
    record = read(root)
    if record is None:
        return None
    os.environ.setdefault("MLFLOW_TRACKING_USERNAME", record["username"])
    os.environ.setdefault("MLFLOW_TRACKING_PASSWORD", record["password"])
    return record["tracking_uri"]
