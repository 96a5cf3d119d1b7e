"""``python -m pipelines.config --params FILE``: validate a params file before ``torchrun`` starts
processes; one line per problem, exit code 2."""

from __future__ import annotations

from .. import cli
from .load import load_params


def main(argv: list[str] | None = None) -> None:
    """``python -m pipelines.config``: validate ``params.yaml`` before ``torchrun`` starts processes."""
    load_params(cli.parse_args("Validate params.yaml; one line per problem, exit code 2.", argv).params)


if __name__ == "__main__":
    cli.run(main)
