"""Publish a finished policy search (a command, not a DVC stage): ``python -m stages.publish_search``.

Copies the search's policy file (``search/outputs/policy.json``, a DVC output: in DVC's cache, not in git) and
its metrics (``search/metrics/search.json``, ``curve.json``, ``bins.json``, ``confirm.json``), as the search
pipeline (``--pipeline``) names them, into ``--out`` (``benchmarks/records/search/``, committed), and writes the
``searched`` preset (``--preset``) to read the policy file there: ``augment=searched`` then trains it in any clone,
without the search's outputs. ``make search`` runs it after the search; commit the folder and the preset with the
search's ``dvc.lock``. A missing or unfinished search, or files of two different searches, is one line,
``error: ...``, and nothing is written. Run it in the repository root.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from pipelines import cli
from pipelines.search.publish import POLICY, outputs, publish

log = logging.getLogger("publish")


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pipeline", type=Path, default=Path("search/pipeline.yaml"),
                        help="the search pipeline, whose paths name the files to publish")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/records/search"),
                        help="the committed folder the search's files are copied into")
    parser.add_argument("--preset", type=Path, default=Path("conf/augment/searched.yaml"),
                        help="the augment preset written to read the published policy file")


def main(argv: list[str] | None = None) -> None:
    args = cli.parse_args(__doc__, argv, params=False, arguments=_arguments,
                          output_folders=("out",), output_files=("preset",))
    policy = publish(outputs(args.pipeline), args.out, args.preset, policy_file=str(args.out / POLICY))
    winner = policy.get("arm", policy.get("key"))
    log.info("published %s (the confirmed winner: %s) and its metrics in %s; %s trains it with augment=%s; "
             "commit both", args.out / POLICY, winner, args.out, args.preset, args.preset.stem)


if __name__ == "__main__":
    cli.run(main)
