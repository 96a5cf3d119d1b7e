"""The confirm stage's loop with a made-up training, for the kill test: ``python -m tests.confirm_probe FOLDER
[--delay S]`` prints the confirm table as JSON."""

import argparse
import hashlib
import json
import signal
import time
from pathlib import Path

from pipelines.errors import STOP_SIGNALS
from pipelines.search import full_run
from pipelines.search.confirm import Arm, confirm, table
from pipelines.tracking.lineage import PARENT_RUN_ENV

ARMS = [Arm("sa_autoaug", {"name": "sa_autoaug"}), Arm("flip", {"name": "flip"}),
        Arm("search-1", {"name": "sa_autoaug"}, genes=(1,) * 40, scale_splits=(1, 2, 3), key="1" * 40, score=0.1)]
SEEDS = [0, 1]


def train_in_this_process(monkeypatch, commands: list) -> None:
    """Make the confirm stage's launches run in this process, each command appended to ``commands``:
    ``python -m pipelines.launch --params P --run-file R stages.train ARGS`` becomes ``stages.train --params P
    --run-file R ARGS`` in the train stage's environment (each process started would import torch and
    MLflow: seconds of CPU)."""
    import sys

    from stages import train as train_stage

    def launched(command, env):
        commands.append(command)
        assert command[:3] == [sys.executable, "-m", "pipelines.launch"]
        module = command.index("stages.train")
        if PARENT_RUN_ENV in env:  # the confirm stage's parent run, where it has one
            monkeypatch.setenv(PARENT_RUN_ENV, env[PARENT_RUN_ENV])
        handlers = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}  # the stage installs its own
        try:
            train_stage.main([*command[3:module], *command[module + 1:]])
        finally:
            for signum, handler in handlers.items():
                signal.signal(signum, handler)
        return 0

    monkeypatch.setattr(full_run, "launch_process", launched)


def made_up_training(delay: float):
    """A deterministic AP per (arm, seed), written to the working folder as a training would."""
    def run(arm, seed, work):
        with (work.parent / "ran.log").open("a") as log:  # every start of a run, kept or not
            log.write(f"{arm.id}-s{seed}\n")
        time.sleep(delay)
        ap = int(hashlib.sha256(f"{arm.id}:{seed}".encode()).hexdigest()[:4], 16) / 65536
        return {"AP": ap, "APs": ap / 2, "APm": None, "APl": ap}
    return run


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("folder")
    parser.add_argument("--delay", type=float, default=0.0)
    args = parser.parse_args(argv)
    rows = confirm(ARMS, SEEDS, made_up_training(args.delay), Path(args.folder),
                   identity=lambda arm, seed, work: {"arm": arm.id, "seed": seed})
    print(json.dumps(table(ARMS, SEEDS, rows), sort_keys=True))


if __name__ == "__main__":
    main()
