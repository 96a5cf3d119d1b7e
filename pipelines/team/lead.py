"""The lead's commands: a team's two servers with one command, and one command per teammate (docs/team.md).

    python -m pipelines.team.lead server --host 0.0.0.0 --public-url http://team.example:5000   # make team-server
    python -m pipelines.team.lead user alice     # make team-user NAME=alice: alice's team.env, mode 600
    python -m pipelines.team.lead user alice --reset | --remove
    python -m pipelines.team.lead backup [--to DIR]   # make team-backup: databases, buckets, identities
    python -m pipelines.team.lead status | stop

``server`` starts, in the background and each in a folder of its own under ``--folder`` (default
:func:`.service.state_folder`, outside the checkout), the S3 server (:mod:`~pipelines.team.s3_server`, in
``s3/``) and the tracking server (:mod:`~pipelines.team.mlflow_server`, in ``tracking/``) with auth and
workspaces on (a user reads what they were not granted and creates nothing; ``user`` grants EDIT on the team's
experiment) and its artifacts in the S3 server's MLflow bucket, reached with the MLflow server's own key (it
goes from one folder to the other, never through a command line). The S3 server's public URL is the tracking
server's with ``--s3-port`` unless ``--s3-public-url`` says otherwise. Where the tracking server cannot start,
the S3 server it started is stopped again. What the teammates' files need (the public URLs, the DVC remote) is
kept in ``FOLDER/team.json``.

``user NAME`` makes the teammate's MLflow user (a random password, EDIT on ``--experiment``) and S3 key (the DVC
bucket only) and writes both, with the public URLs, into one ``team.env`` (mode 600; default
``FOLDER/users/NAME.team.env``), the file a teammate hands to ``make team-join``
(:mod:`~pipelines.team.join`): no secret is printed or typed. ``--reset`` gives both a new secret (the old
ones are refused from then on) and writes the file again; ``--remove`` takes both away.
"""

from __future__ import annotations

import json
import os
import time
import urllib.parse
from pathlib import Path

from ..errors import TeamError
from . import address, join, mlflow_server, s3_identities, s3_server, service

TEAM = "team.json"  # FOLDER/team.json: the public URLs and the DVC remote (no secret)
REMOTE = "team"  # the DVC remote's name in the teammates' clones


def folders(folder: Path) -> tuple[Path, Path]:
    """The tracking server's and the S3 server's folders under the team's ``folder``."""
    return folder / "tracking", folder / "s3"


def derived_s3_url(tracking_url: str, s3_port: int) -> str:
    """The S3 server's public URL where none is given: the tracking server's scheme and host, port ``s3_port``."""
    parts = urllib.parse.urlsplit(tracking_url)
    host = address._bracketed(parts.hostname or "")
    return f"{parts.scheme}://{host}:{s3_port}"


def team_record(folder: Path) -> dict:
    """``FOLDER/team.json`` of a team whose servers run; a :class:`TeamError` line otherwise."""
    tracking, s3 = folders(folder)
    record = folder / TEAM
    if not record.is_file():
        raise TeamError(f"--folder {folder}: no team server was started there; start it first: make team-server "
                        f"(python -m pipelines.team.lead server --folder {folder})")
    for name, part in (("tracking server", tracking), ("S3 server", s3)):
        if not service.running(part):
            raise TeamError(f"--folder {folder}: its {name} does not run ({part}); start the team's servers: "
                            f"python -m pipelines.team.lead server --folder {folder}")
    return json.loads(record.read_text())


def start(folder: Path, *, host: str, port: int, s3_port: int, public_url: str | None, s3_public_url: str | None,
          workers: int | None, service_user: str, experiment: str, auth_cache: int = mlflow_server.AUTH_CACHE,
          say=print) -> str:
    """Start the S3 server, then the tracking server on it (module docstring); what to print."""
    folder = folder.resolve()
    tracking, s3 = folders(folder)
    public = public_url or address.default_public_url(host, port)
    s3_public = s3_public_url or derived_s3_url(public, s3_port)
    folder.mkdir(parents=True, exist_ok=True)  # it holds the two servers' folders, each private
    s3_state, _ = s3_server.start(s3, host=host, port=s3_port, public=s3_public, say=say)
    try:
        os.environ.update(AWS_SHARED_CREDENTIALS_FILE=str(s3 / "mlflow.credentials"),
                          MLFLOW_S3_ENDPOINT_URL=s3_state.bind)
        server, _ = mlflow_server.start(tracking, host=host, port=port, public_url=public, auth=True, workspaces=True,
                                        artifacts=f"s3://{s3_state.mlflow_bucket}/artifacts", workers=workers,
                                        service_user=service_user, auth_cache=auth_cache, say=say)
    except BaseException:
        s3_server.stop(s3)
        raise
    record = {"tracking_uri": server.url, "s3_endpoint": s3_state.endpoint, "dvc_bucket": s3_state.bucket,
              "dvc_remote": REMOTE, "experiment": experiment}
    (folder / TEAM).write_text(json.dumps(record, indent=1) + "\n")
    return (f"{server.describe()}\n"
            f"S3 server at {s3_state.endpoint} (listening on {host}:{s3_port}; SeaweedFS's other ports on 127.0.0.1): "
            f"DVC bucket {s3_state.bucket}, MLflow's artifacts in bucket {s3_state.mlflow_bucket}.\n"
            f"Team state in {folder}. A teammate: make team-user NAME=alice, then hand them the team.env it writes; "
            "they run make team-join TEAM_ENV=that-file in their clone. make team-stop stops both servers.")


def team_env(record: dict, *, name: str, password: str, key: tuple[str, str]) -> str:
    """The text of a teammate's ``team.env`` (:data:`.join.FIELDS` and the key inline)."""
    values = {"MLFLOW_TRACKING_URI": record["tracking_uri"], "MLFLOW_TRACKING_USERNAME": name,
              "MLFLOW_TRACKING_PASSWORD": password, "S3_ENDPOINT_URL": record["s3_endpoint"],
              "DVC_REMOTE": record["dvc_remote"], "DVC_BUCKET": record["dvc_bucket"],
              "AWS_ACCESS_KEY_ID": key[0], "AWS_SECRET_ACCESS_KEY": key[1]}
    assert set(values) == {*join.FIELDS, *join.KEY_FIELDS}
    return (f"# {name}'s team.env: hand it over as a file, keep it mode 600; in a clone: make team-join TEAM_ENV=FILE\n"
            + "".join(f"{field}={value}\n" for field, value in values.items()))


def add_user(folder: Path, name: str, *, out: Path | None, reset: bool = False) -> str:
    """Make (``reset``: renew) ``name``'s MLflow user and S3 key and write its ``team.env``; what to print."""
    folder = folder.resolve()
    if not s3_identities.NAME.fullmatch(name) or name in (s3_identities.ADMIN, s3_identities.MLFLOW, mlflow_server.ADMIN):
        raise TeamError(f"NAME={name!r}: not a user name; expected a-z, 0-9, '-', '_', up to 32, starting with a "
                        "letter, not admin or mlflow")
    record = team_record(folder)
    tracking, s3 = folders(folder)
    if reset:
        password = mlflow_server.change_user(tracking, name, remove=False)
    else:
        password = mlflow_server.add_user(tracking, name, experiment=record["experiment"])
        if not password:
            raise TeamError(f"user {name}: exists already; give them a new team.env with --reset (make team-user "
                            f"NAME={name} ARGS=--reset), which refuses their old one")
    key, _, _ = s3_server.make_key(s3, name, record["dvc_bucket"])
    (folder / "users").mkdir(mode=0o700, exist_ok=True)
    path = (out or folder / "users" / f"{name}.team.env").resolve()
    service.write_secret(path, team_env(record, name=name, password=password, key=key))
    when = mlflow_server.refused_when(tracking)
    renewed = f" (new password and key; the old password is refused {when}, the old key from now on)" if reset else ""
    return (f"{name}: MLflow user with EDIT on experiment {record['experiment']!r}, S3 key for bucket "
            f"{record['dvc_bucket']} (not deleting it){renewed}.\nTheir team.env (mode 600, shown nowhere else): "
            f"{path}\nHand that file over; in their clone they run: make team-join TEAM_ENV=/path/to/{path.name}")


def remove_user(folder: Path, name: str) -> str:
    """Take ``name``'s MLflow user and S3 key away; what to print."""
    folder = folder.resolve()
    record = team_record(folder)
    tracking, s3 = folders(folder)
    mlflow_server.change_user(tracking, name, remove=True)
    try:
        s3_server.remove_key(s3, name, record["dvc_bucket"])
    except KeyError:
        pass  # an MLflow user without a key (made by hand): nothing to take away
    (folder / "users" / f"{name}.team.env").unlink(missing_ok=True)
    return (f"{name} removed: their MLflow password is refused {mlflow_server.refused_when(tracking)}, their S3 key "
            "from now on")


def backup(folder: Path, to: Path | None) -> str:
    """The team's databases (``pg_dump``), both buckets' objects and the S3 identities, copied into ``to``
    (default ``FOLDER/backups/DATE``, mode 700) while the servers run; what to print."""
    folder = folder.resolve()
    team_record(folder)
    tracking, s3 = folders(folder)
    to = (to or folder / "backups" / time.strftime("%Y%m%d-%H%M%S")).resolve()
    if to.exists() and any(to.iterdir()):
        raise TeamError(f"--to {to}: not empty; expected a new folder for the backup")
    to.mkdir(mode=0o700, parents=True, exist_ok=True)
    dumps = mlflow_server.backup(tracking, to / "tracking")
    objects = s3_server.backup(s3, to / "s3")
    return (f"backup in {to}: {', '.join(p.name for p in dumps)} (pg_restore), {objects} objects of the buckets and "
            "the S3 identities (s3.json)")


def status(folder: Path) -> str:
    tracking, s3 = folders(folder.resolve())
    lines = []
    running = service.running(tracking)
    lines.append(mlflow_server.Server(**running).describe() if running else f"{tracking}: no tracking server runs")
    found = service.running(s3)
    lines.append(f"S3 server at {found['endpoint']} (pid {found['s3_pid']})" if found else f"{s3}: no S3 server runs")
    return "\n".join(lines)


def stop(folder: Path) -> bool:
    """Stop the tracking server, then the S3 server; whether either ran."""
    tracking, s3 = folders(folder.resolve())
    ran = mlflow_server.stop(tracking)
    return s3_server.stop(s3) or ran


def main(argv: list[str] | None = None) -> None:
    parser = service.parser(__doc__, actions=("server", "user", "backup", "status", "stop"), port=5000,
                            folder=str(service.state_folder("")), default_action="server", detach=False, helps={
        "action": "server (start both servers, in the background), user NAME (a teammate's team.env), backup "
                  "(databases and buckets, --to DIR), status, stop",
        "folder": "the team's state, outside the checkout (default %(default)s)",
        "host": "the address both servers listen on (0.0.0.0: all); auth is on either way",
        "port": "the tracking server's port"})
    parser.add_argument("name", nargs="?", help="user: the teammate's name")
    parser.add_argument("--s3-port", type=service.port_number, default=9000, help="the S3 server's port (%(default)s)")
    parser.add_argument("--s3-public-url", type=address.public_url, metavar="URL",
                        help="the S3 server's public URL (default: --public-url's host, port --s3-port)")
    parser.add_argument("--workers", type=mlflow_server.worker_count, help="the tracking server's processes")
    parser.add_argument("--auth-cache", type=mlflow_server.cache_seconds, default=mlflow_server.AUTH_CACHE,
                        metavar="SECONDS", help="how long each tracking server worker remembers a checked password "
                        "(default %(default)s; 0: every request checks it)")
    parser.add_argument("--service-user", default=mlflow_server.SERVICE_USER, metavar="USER",
                        help="started as root: the unprivileged user that runs the MLflow server (%(default)s)")
    parser.add_argument("--experiment", default="detection", help="the experiment teammates may edit (%(default)s)")
    parser.add_argument("--to", type=Path, help="backup: the folder (default FOLDER/backups/DATE)")
    parser.add_argument("--out", type=Path, help="user: where to write the team.env (default FOLDER/users/NAME.team.env)")
    change = parser.add_mutually_exclusive_group()
    change.add_argument("--reset", action="store_true", help="user NAME --reset: a new password and key")
    change.add_argument("--remove", action="store_true", help="user NAME --remove: take both away")
    args = parser.parse_args(argv)
    if args.action == "user":
        if not args.name:
            parser.error("user: give the teammate's name (make team-user NAME=alice)")
        print(remove_user(args.folder, args.name) if args.remove else
              add_user(args.folder, args.name, out=args.out, reset=args.reset))
    elif args.action == "backup":
        print(backup(args.folder, args.to))
    elif args.name or args.reset or args.remove or args.out:
        parser.error(f"{args.name or '--reset/--remove/--out'}: goes with the action user NAME")
    elif args.action == "stop":
        print("stopped" if stop(args.folder) else f"{args.folder}: no team server runs")
    elif args.action == "status":
        print(status(args.folder))
    else:
        print(start(args.folder, host=args.host, port=args.port, s3_port=args.s3_port, public_url=args.public_url,
                    s3_public_url=args.s3_public_url, workers=args.workers, service_user=args.service_user,
                    experiment=args.experiment, auth_cache=args.auth_cache))


if __name__ == "__main__":
    from .. import cli

    cli.run(main)
