"""A stage-like module for the launcher tests: ``python -m tests.launch_probe --params P --fail MODE``."""

import argparse
import os
import signal
import time

import torch.distributed

from pipelines import cli, distributed
from pipelines.errors import DatasetError


def _barrier():
    if distributed.is_initialized():
        torch.distributed.barrier()


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--params")
    parser.add_argument("--fail", choices=["none", "user-error", "bug", "sigkill", "sleep"],
                        help="what the last rank does (the others wait)")
    parser.add_argument("--done-file", help="rank 0 creates it as its last act")
    parser.add_argument("--run-file", help="rank 0 opens an MLflow run and names it there while it runs, as a stage does")
    args = parser.parse_args(argv)
    distributed.init_from_env()
    rank = distributed.get_rank()
    if rank == 0 and args.run_file:
        import mlflow

        from pipelines.tracking.run import write_run_file

        run = mlflow.MlflowClient().create_run("0")  # the store's Default experiment
        write_run_file(args.run_file, run_id=run.info.run_id, experiment="Default", status="running")
    last = rank == distributed.get_world_size() - 1
    _barrier()
    if last and args.fail == "user-error":
        raise DatasetError("images/x.jpg: image id 7: unreadable image (probe)")
    if last and args.fail == "bug":
        raise ZeroDivisionError("division by zero (probe)")
    if last and args.fail == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if args.fail != "none":
        time.sleep(60)  # "sleep": until the launcher stops the group; else the
        # others are still busy when the last rank fails: the launcher must stop them
    _barrier()
    distributed.shutdown()
    if rank == 0 and args.done_file:
        open(args.done_file, "w").close()


if __name__ == "__main__":
    cli.run(main)
