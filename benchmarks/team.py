"""Benchmark: what a team's tracking server costs (docs/team.md), measured side by side in one run.

The team's servers start as the lead starts them (``python -m pipelines.team.lead server``: the S3 server and
the MLflow server on PostgreSQL with auth and workspaces, its artifacts in the S3 bucket), with a teammate
made by ``lead user``; every client call carries that user's password. With ``--link netns`` (the default
where this runs as root with ``ip``) the servers run in a network namespace of their own and the clients in
another, reaching them by the public name through a veth link (``benchmarks.netns``), as a teammate on
another machine would; ``--link loopback`` (the fallback, said in one line) keeps both on 127.0.0.1.

- **Writers.** ``--writers`` processes (default 4) log at once into one store, as the tracker logs
  (``benchmarks.team_writers``: params, then metrics in batches of 20 values): against a SQLite file (the
  single user's store, the baseline) and against the server. Throughput in logged values per second
  over the whole concurrent phase, each call's time, and then every logged value read back: a store that
  loses any is an error, not a figure.
- **Stages.** The train and evaluate stages of a small configuration (``--overrides``, by default the
  ``ci`` profile), run as ``dvc repro`` runs them (``benchmarks.policies.train_and_evaluate``) on data
  prepared once, alternately against SQLite and against the server; ``--repeats`` pairs, medians.
- **Checkpoint upload.** A file of ``--megabytes`` (a checkpoint's size) logged as an artifact of a run,
  as the tracker logs checkpoints: into the SQLite store's local folder (the baseline) and through the
  server into its bucket; medians over ``--repeats``.

    python -m benchmarks.team [--link netns|loopback] [--writers 4] [--repeats 3] [--megabytes 152] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from pipelines.cli import exit_now
from pipelines.compose import compose_params
from pipelines.lifetime import free_port
from pipelines.team import mlflow_server

from . import netns
from .policies import train_and_evaluate
from .sizing import prepare_and_cache

REPO = Path(__file__).resolve().parents[1]
EXPERIMENT = "detection"  # the one experiment a teammate made by `lead user` may write (workspaces on)
USER = "bench"


def _service_user() -> list[str]:
    """As root the tracking server runs as an unprivileged user, who must reach this checkout's Python; where a
    private folder above it (root's home) forbids that, it stays root (as the tests do)."""
    venv = Path(sys.executable).parent
    if os.geteuid() == 0 and not all(p.stat().st_mode & 0o001 for p in (venv, *venv.parents)):
        return ["--service-user", "root"]
    return []


def _lead(*args: str, prefix: tuple[str, ...] = ()) -> str:
    done = subprocess.run([*prefix, sys.executable, "-m", "pipelines.team.lead", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    if done.returncode:
        raise SystemExit(f"error: lead {args[0]}: {(done.stderr or done.stdout).strip().splitlines()[-1]}")
    return done.stdout


@contextlib.contextmanager
def team(root: Path, *, link: str, workers: int | None, auth_cache: int | None):
    """The team's servers (``lead server``) and a teammate's settings: (tracking URI, the client environment,
    the prefix that runs a client: ``ip netns exec CLIENT`` or nothing)."""
    folder = root / "team"
    root.chmod(0o755)  # PostgreSQL runs as `postgres` when this runs as root
    with contextlib.ExitStack() as stack:
        if link == "netns":
            net = stack.enter_context(netns.network())
            host, name = net.server_address, net.name
            server, client = tuple(netns.exec_in(net.server, [])), tuple(netns.exec_in(net.client, []))
        else:
            host, name, server, client = "127.0.0.1", "127.0.0.1", (), ()
        port, s3_port = free_port(), free_port()
        _lead("server", "--folder", str(folder), "--host", host, "--port", str(port), "--s3-port", str(s3_port),
              "--public-url", f"http://{name}:{port}", *(["--workers", str(workers)] if workers else []),
              *(["--auth-cache", str(auth_cache)] if auth_cache is not None else []),
              *_service_user(), prefix=server)
        stack.callback(lambda: subprocess.run([*server, sys.executable, "-m", "pipelines.team.lead", "stop", "--folder",
                                               str(folder)], cwd=REPO, capture_output=True, timeout=120))
        _lead("user", USER, "--folder", str(folder), "--out", str(root / "bench.team.env"), prefix=server)
        values = dict(line.split("=", 1) for line in (root / "bench.team.env").read_text().splitlines()
                      if line and not line.startswith("#"))
        env = {k: values[k] for k in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")}
        yield values["MLFLOW_TRACKING_URI"], env, client


def writers(uri: str, *, count: int, runs: int, batches: int, env: dict, prefix: tuple[str, ...]) -> dict:
    """``count`` concurrent writers into ``uri`` (``benchmarks.team_writers``), then every value read back."""
    run_env = {**os.environ, **env}
    command = [*prefix, sys.executable, "-m", "benchmarks.team_writers", "--uri", uri, "--experiment", EXPERIMENT,
               "--runs", str(runs), "--batches", str(batches)]
    tag = os.urandom(4).hex()
    started = [subprocess.Popen([*command, "--tag", f"{tag}-{i}"], cwd=REPO, env=run_env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True) for i in range(count)]
    found = []
    for process in started:
        out, err = process.communicate(timeout=600)
        if process.returncode:
            raise SystemExit(f"error: a writer into {uri} failed: {(err or out).strip().splitlines()[-1]}")
        found.append(json.loads(out.strip().splitlines()[-1]))
    calls = sorted(c for f in found for c in f["calls_s"])
    written = sum(f["values"] for f in found)
    seconds = max(f["end"] for f in found) - min(f["start"] for f in found)
    present = 0
    for i in range(count):
        done = subprocess.run([*command, "--tag", f"{tag}-{i}", "--check"], cwd=REPO, env=run_env, capture_output=True,
                              text=True, timeout=600)
        present += json.loads(done.stdout.strip().splitlines()[-1])["values"] if done.returncode == 0 else 0
    if present != written:
        raise SystemExit(f"error: {uri} holds {present} of the {written} values the writers logged")
    return {"values": written, "seconds": round(seconds, 2), "values_per_s": round(written / seconds, 1),
            "call_p50_ms": round(1000 * calls[len(calls) // 2], 1),
            "call_p95_ms": round(1000 * calls[int(len(calls) * 0.95)], 1), "present": present}


def _upload_s(uri: str, path: Path, artifacts: str | None) -> float:
    """Seconds to log ``path`` as an artifact of a new run of the team's experiment in ``uri``'s store (its
    artifacts in ``artifacts``; None: the tracking server's, as the pipeline's runs get there)."""
    import mlflow

    from pipelines.tracking import store

    client = mlflow.MlflowClient(uri)
    run_id = client.create_run(store.experiment_id(client, EXPERIMENT, artifact_location=artifacts)).info.run_id
    start = time.perf_counter()
    client.log_artifact(run_id, str(path), "checkpoints")
    seconds = time.perf_counter() - start
    client.set_terminated(run_id)
    return seconds


def _in(prefix: tuple[str, ...], function: str, *args) -> float:
    """``benchmarks.team.<function>(*args)`` run by ``prefix`` (in the client's namespace); its number."""
    code = f"import sys, benchmarks.team as t; print(t.{function}(*{args!r}))"
    done = subprocess.run([*prefix, sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=600)
    if done.returncode:
        raise SystemExit(f"error: {function}: {(done.stderr or done.stdout).strip().splitlines()[-1]}")
    return float(done.stdout.split()[-1])


def measure(*, overrides: str, repeats: int, megabytes: int, link: str, workers: int | None, count: int, runs: int,
            batches: int, root: Path, auth_cache: int | None = None) -> dict:
    params_file = root / "params.yaml"
    params_file.write_text(compose_params(REPO, shlex.split(overrides)))
    raw = yaml.safe_load(params_file.read_text())
    for key in [k for k in os.environ if k.startswith(("MLFLOW_", "DVC_"))]:  # this run's stores only
        del os.environ[key]
    data = prepare_and_cache(params_file, raw, root, dict(os.environ))
    checkpoint = root / "checkpoint.pth"
    with checkpoint.open("wb") as out:
        out.write(os.urandom(megabytes * 2**20))  # incompressible, as weights are
    import mlflow

    from pipelines.tracking import store

    sqlite = f"sqlite:///{root / 'mlflow.db'}"
    store.experiment_id(mlflow.MlflowClient(sqlite), EXPERIMENT, artifact_location=(root / "artifacts").as_uri())
    with team(root, link=link, workers=workers, auth_cache=auth_cache) as (url, env, client):
        stores = {"sqlite": (sqlite, {}, ()), "server": (url, env, client)}
        figures = {"writers": {name: writers(uri, count=count, runs=runs, batches=batches, env=e, prefix=p)
                               for name, (uri, e, p) in stores.items()}}
        stages = {name: {"train_s": [], "evaluate_s": []} for name in stores}
        upload = {name: [] for name in stores}
        for i in range(repeats):  # alternately, so that both see the same machine
            for name, (uri, e, p) in stores.items():
                folder = root / f"{name}-{i}"
                folder.mkdir()
                done = train_and_evaluate(raw, prepared=data / "prepared", cache=data / "cache", folder=folder,
                                          store=uri, env=e, prefix=p)
                stages[name]["train_s"].append(done["seconds"]["train"])
                stages[name]["evaluate_s"].append(done["seconds"]["evaluate"])
                with _environment(e):
                    upload[name].append(round(_in(p, "_upload_s", uri, str(checkpoint), None), 2))
    import torch

    from pipelines.hardware import resolve

    precision = resolve(raw["model"]["precision"], raw["model"]["channels_last"], torch.device("cpu")).precision
    return {"config": {"overrides": overrides, "repeats": repeats, "megabytes": megabytes, "precision": precision,
                       "link": link, "auth": True, "workers": workers, "writers": count, "runs": runs,
                       "auth_cache": mlflow_server.AUTH_CACHE if auth_cache is None else auth_cache,
                       "batches": batches},
            "writers": figures["writers"], "stages": stages, "upload": upload}


@contextlib.contextmanager
def _environment(values: dict[str, str]):
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def table(figures: dict) -> str:
    c = figures["config"]
    median = statistics.median
    label = {"sqlite": "SQLite store (baseline)", "server": "tracking server on PostgreSQL, auth on"}
    link = {"netns": "through a veth link between two network namespaces, by its public name",
            "loopback": "on 127.0.0.1"}.get(c.get("link"), "")
    w = figures.get("writers")
    lines = []
    if w:
        lines += [f"{c['writers']} writers at once, {c['runs']} runs of {c['batches']} batches of 20 values each; the "
                  f"server {link}, "
                  + (f"{c['workers']} worker(s)" if c["workers"] else "its default workers (one per core, at most 4)")
                  + (f", passwords remembered {c['auth_cache']} s per worker" if c.get("auth_cache") else
                     ", every request's password checked") + ". Every value was read back.", "",
                  "| store | values | s | values/s | vs SQLite | call p50 ms | call p95 ms |", "|---|---|---|---|---|---|---|"]
        for name, f in w.items():
            lines.append(f"| {label[name]} | {f['values']} | {f['seconds']:.1f} | {f['values_per_s']:.0f} | "
                         f"{f['values_per_s'] / w['sqlite']['values_per_s']:.2f} | {f['call_p50_ms']:.0f} | "
                         f"{f['call_p95_ms']:.0f} |")
        lines.append("")
    base = figures["stages"]["sqlite"]
    base_total = median(base["train_s"]) + median(base["evaluate_s"])
    precision = f", {c['precision']}" if "precision" in c else ""
    lines += [f"`{c['overrides']}`{precision}, {c['repeats']} runs each, alternately; medians.", "",
              "| store | train s | evaluate s | both s | vs SQLite |", "|---|---|---|---|---|"]
    for name, s in figures["stages"].items():
        total = median(s["train_s"]) + median(s["evaluate_s"])
        lines.append(f"| {label[name]} | {median(s['train_s']):.1f} | {median(s['evaluate_s']):.1f} | {total:.1f} | "
                     f"{total / base_total:.2f} |")
    up = figures["upload"]
    lines += ["", f"| {c['megabytes']} MB checkpoint logged as an artifact | s | MB/s | vs local |", "|---|---|---|---|"]
    where = {"sqlite": "into the SQLite store's local folder (baseline)", "server": "uploaded through the server"}
    for name, seconds in up.items():
        s = median(seconds)
        lines.append(f"| {where[name]} | {s:.2f} | {c['megabytes'] / s:.0f} | {s / median(up['sqlite']):.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--overrides", default="profile=ci", help="Hydra overrides of the configuration (default %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="runs against each store (default %(default)s)")
    parser.add_argument("--megabytes", type=int, default=152, help="the checkpoint's size (default %(default)s)")
    parser.add_argument("--link", choices=("netns", "loopback"),
                        help="netns: server and clients in two network namespaces (the default where they can be made)")
    parser.add_argument("--workers", type=int, help="the tracking server's processes (default: its own, from the cores)")
    parser.add_argument("--auth-cache", type=int, help="the tracking server's --auth-cache seconds (default: its own)")
    parser.add_argument("--writers", type=int, default=4, help="concurrent writers (default %(default)s)")
    parser.add_argument("--runs", type=int, default=3, help="runs per writer (default %(default)s)")
    parser.add_argument("--batches", type=int, default=50, help="metric batches per run (default %(default)s)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    args = parser.parse_args(argv)
    if min(args.repeats, args.megabytes, args.writers, args.runs, args.batches) < 1:
        parser.error("--repeats, --megabytes, --writers, --runs and --batches: expected at least 1")
    link = args.link
    if link is None:
        why = netns.available()
        link = "loopback" if why else "netns"
        if why:
            print(f"note: {why}: the server and its clients share 127.0.0.1 (--link loopback)", file=sys.stderr)
    elif link == "netns" and (why := netns.available()):
        parser.error(f"--link netns: {why}")
    # SIGTERM (a stopped benchmark) unwinds like Ctrl-C: the servers, namespaces and scratch folder go with it
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    root = Path(tempfile.mkdtemp(prefix="bench_team_"))
    try:
        figures = measure(overrides=args.overrides, repeats=args.repeats, megabytes=args.megabytes, link=link,
                          workers=args.workers, count=args.writers, runs=args.runs, batches=args.batches, root=root,
                          auth_cache=args.auth_cache)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(figures) if args.json else table(figures))


if __name__ == "__main__":
    main()
    exit_now()  # without the interpreter's teardown of its modules (about 2 s of CPU with torch loaded)
