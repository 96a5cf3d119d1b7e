"""Register: the ONNX export as an MLflow model in the registry, as a new version of ``detector`` with the
alias ``candidate`` (a command, not a DVC stage: an experiment does not add a version).

``python -m stages.register`` logs ``outputs/export/model.onnx`` as a pyfunc model (models-from-code,
torch-free: ``mlflow models serve -m models:/detector@champion`` serves it), links the export's AP on the
ONNX path (``metrics/export.json``; with TTA where ``evaluate.tta`` was on) to it and registers it.
``--promote champion`` then moves the alias ``champion`` to the new version; with ``--if-better`` only if
its AP is at least the champion's on the same val data and TTA setting, else one line says why not
(exit 0). The store is the project's (``MLFLOW_TRACKING_URI`` overrides); a store that cannot be reached,
a missing ONNX file or one without its model card: one line, exit 2.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from pipelines import cli
from pipelines.config.load import load_params
from pipelines.errors import ConfigError
from pipelines.inference import registration
from pipelines.inference.card import read_card
from pipelines.tracking import store
from pipelines.tracking.registry import Registry

log = logging.getLogger("register")


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--onnx", type=Path, default=Path("outputs/export/model.onnx"),
                        help="the exported model (default: outputs/export/model.onnx)")
    parser.add_argument("--metrics", type=Path, default=Path("metrics/export.json"),
                        help="the export's figures (default: metrics/export.json)")
    parser.add_argument("--example", type=Path, default=None,
                        help="the input example image (default: the first image of the prepared val split)")
    parser.add_argument("--prepared", type=Path, default=Path("data/prepared"),
                        help="the prepared dataset, for the default example (default: data/prepared)")
    parser.add_argument("--name", default=registration.MODEL_NAME, help="registered model name (default: detector)")
    parser.add_argument("--promote", metavar="ALIAS", default=None,
                        help="move ALIAS (e.g. champion) to the new version")
    parser.add_argument("--if-better", action="store_true",
                        help="with --promote: only if its AP is at least the alias holder's (same val data and TTA)")


def main(argv: list[str] | None = None) -> None:
    args = cli.parse_args(__doc__, argv, arguments=_arguments)
    if args.if_better and not args.promote:
        raise ConfigError("--if-better: give --promote ALIAS too (e.g. --promote champion --if-better)")
    card = read_card(args.onnx)
    params = load_params(Path(args.params))
    evaluation = registration.read_evaluation(args.metrics, tta=params.evaluate.tta)
    example = args.example or registration.example_image(args.prepared)
    registry = Registry(create=True)
    done = registration.register(args.onnx, card=card, evaluation=evaluation, example=example,
                                 params_file=Path(args.params), lock_file=Path("dvc.lock"),
                                 experiment=params.tracking.experiment, name=args.name, registry=registry)
    log.info("registered %s version %s as %s: %s %.4f (logged model %s, run %s, store %s)", done.name, done.version,
             registration.CANDIDATE, evaluation.metric, evaluation.ap, done.model_id, done.run_id, registry.shown)
    if args.promote:
        _, line = registration.promote(registry, done.name, done.version, alias=args.promote, if_better=args.if_better)
        log.info("%s", line)


if __name__ == "__main__":
    cli.run(main, announce=store.announce)
