"""From an MLflow run to its DVC experiment, and back: ``python -m stages.lineage RUN_OR_EXP``.

* an MLflow run id (32 hex digits): prints the run's git commit, DVC experiment and params hash, and
  the commands that restore its experiment (``dvc exp apply NAME``, or ``git checkout COMMIT`` then
  ``dvc checkout``);
* a DVC experiment name, a git revision or ``workspace``: prints the MLflow runs that
  ``metrics/run.json`` names there (falling back to runs tagged with the experiment name) with
  their URLs in the MLflow UI: the tracking server's (``MLFLOW_TRACKING_URI``), else ``http://127.0.0.1:5000``,
  where ``mlflow ui`` serves by default.

Run it in the repository root; not a DVC stage. The store is the pipeline's (``MLFLOW_TRACKING_URI``
overrides). Anything unknown is one line, ``error: ...``, with exit code 2.
"""

from __future__ import annotations

import argparse

from pipelines import cli
from pipelines.tracking.lineage import RUN_ID, describe_experiment, describe_run
from pipelines.tracking.store import get_run


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("name", help="an MLflow run id, a DVC experiment name, a git revision or 'workspace'")
    name = parser.parse_args(argv).name
    run = get_run(name) if RUN_ID.fullmatch(name) else None
    print(describe_run(run) if run is not None else describe_experiment(name))


if __name__ == "__main__":
    cli.run(main)
