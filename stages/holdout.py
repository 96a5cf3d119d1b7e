"""Stage holdout (search/dvc.yaml): the train split divided into the search's training images and a
held-out part that candidates are scored on (``search.heldout_fraction``, drawn with ``search.seed``);
written as a prepared dataset whose ``val`` split is the held-out part, for the cache stage."""

from __future__ import annotations

import logging

from pipelines import cli
from pipelines.config.load import load_params
from pipelines.search.holdout import write_holdout

log = logging.getLogger("holdout")


def main(argv: list[str] | None = None) -> None:
    args = cli.parse_args(__doc__, argv, output_folders=("out",), prepared="the prepare stage's output folder",
                          out="folder for the search's prepared dataset (val: the held-out images)")
    s = load_params(args.params).search
    counts = write_holdout(args.prepared, args.out, fraction=s.heldout_fraction, seed=s.seed)
    log.info("%d train images for the search, %d held out", counts["train"], counts["heldout"])


if __name__ == "__main__":
    cli.run(main)
