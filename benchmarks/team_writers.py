"""Concurrent writers of one tracking store, as ``benchmarks.team`` runs them: each process logs its runs as the
tracker does (params, then metrics in batches) and prints one JSON line with its call times.

    python -m benchmarks.team_writers --uri URI --experiment detection --runs 3 --batches 50 --tag w0

``--check`` instead reads every run tagged with ``--tag`` back and prints how many of the values each writer
logged are present (the benchmark asserts all of them).
"""

from __future__ import annotations

import argparse
import json
import time

PARAMS = 10  # per run
METRICS = 4  # per step
STEPS = 5  # per batch: METRICS * STEPS values per log_batch call, as the tracker flushes a log period's steps


def write(uri: str, experiment: str, *, runs: int, batches: int, tag: str) -> dict:
    """Log ``runs`` runs of ``batches`` metric batches each into ``experiment``; the seconds per call."""
    import mlflow
    from mlflow.entities import Metric, Param

    from pipelines.tracking import store

    client = mlflow.MlflowClient(uri)
    experiment_id = store.experiment_id(client, experiment)
    calls = []
    values = 0
    began, start = time.time(), time.perf_counter()
    for r in range(runs):
        run_id = client.create_run(experiment_id, tags={"benchmark": tag}).info.run_id
        client.log_batch(run_id, params=[Param(f"p{i}", str(i)) for i in range(PARAMS)])
        for b in range(batches):
            metrics = [Metric(f"m{k}", float(b * STEPS + s + k), int(time.time() * 1000), b * STEPS + s)
                       for s in range(STEPS) for k in range(METRICS)]
            t = time.perf_counter()
            client.log_batch(run_id, metrics=metrics)
            calls.append(time.perf_counter() - t)
            values += len(metrics)
        client.set_terminated(run_id)
    return {"tag": tag, "seconds": time.perf_counter() - start, "start": began, "end": time.time(), "values": values,
            "calls_s": calls}


def check(uri: str, experiment: str, *, tag: str) -> dict:
    """How many runs tagged ``tag`` exist and how many metric values and params they hold."""
    import mlflow

    client = mlflow.MlflowClient(uri)
    found = client.search_runs([client.get_experiment_by_name(experiment).experiment_id],
                               filter_string=f"tags.benchmark = '{tag}'", max_results=1000)
    values = sum(len(client.get_metric_history(run.info.run_id, f"m{k}")) for run in found for k in range(METRICS))
    return {"tag": tag, "runs": len(found), "values": values, "params": sum(len(run.data.params) for run in found)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--uri", required=True)
    parser.add_argument("--experiment", default="detection")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--batches", type=int, default=50)
    parser.add_argument("--tag", required=True)
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    if args.check:
        print(json.dumps(check(args.uri, args.experiment, tag=args.tag)))
    else:
        print(json.dumps(write(args.uri, args.experiment, runs=args.runs, batches=args.batches, tag=args.tag)))


if __name__ == "__main__":
    main()
