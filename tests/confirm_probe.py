"""The confirm stage's loop with a made-up training, for the kill test: ``python -m tests.confirm_probe FOLDER
[--delay S]`` prints the confirm table as JSON."""

import argparse
import hashlib
import json
import time
from pathlib import Path

from pipelines.search.confirm import Arm, confirm, table

ARMS = [Arm("sa_autoaug", {"name": "sa_autoaug"}), Arm("flip", {"name": "flip"}),
        Arm("search-1", {"name": "sa_autoaug"}, genes=(1,) * 40, scale_splits=(1, 2, 3), key="1" * 40, score=0.1)]
SEEDS = [0, 1]


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
