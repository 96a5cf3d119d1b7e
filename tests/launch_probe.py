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
    parser.add_argument("--fail", choices=["none", "user-error-on-rank-1", "bug-on-rank-1", "sigkill-rank-1", "sleep"])
    parser.add_argument("--done-file", help="rank 0 creates it as its last act")
    args = parser.parse_args(argv)
    distributed.init_from_env()
    rank = distributed.get_rank()
    _barrier()
    if rank == 1 and args.fail == "user-error-on-rank-1":
        raise DatasetError("images/x.jpg: image id 7: unreadable image (probe)")
    if rank == 1 and args.fail == "bug-on-rank-1":
        raise ZeroDivisionError("division by zero (probe)")
    if rank == 1 and args.fail == "sigkill-rank-1":
        os.kill(os.getpid(), signal.SIGKILL)
    if args.fail != "none":
        time.sleep(60)  # "sleep": until the launcher stops the group  # rank 0 is still busy when rank 1 fails: the launcher must stop it
    _barrier()
    distributed.shutdown()
    if rank == 0 and args.done_file:
        open(args.done_file, "w").close()


if __name__ == "__main__":
    cli.run(main)
