"""Compose ``conf/`` into ``params.yaml`` exactly as ``dvc exp run`` does (DVC's Hydra support).

``dvc repro`` never composes; after editing ``conf/`` run ``python -m pipelines.compose`` (with
optional Hydra overrides such as ``model=fcos_r50``) or use ``dvc exp run -S ...``.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path


def compose_params(root: str | Path = ".", overrides: list[str] | None = None) -> str:
    """The YAML text that DVC would write to ``params.yaml`` for these overrides."""
    from dvc.utils.hydra import compose_and_dump

    root = Path(root).resolve()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "params.yaml"
        compose_and_dump(out, str(root / "conf"), None, "config", str(root), list(overrides or []))
        return out.read_text()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. model=fcos_r50 train.base_lr=0.002")
    parser.add_argument("--out", default="params.yaml")
    args = parser.parse_args(argv)
    Path(args.out).write_text(compose_params(".", args.overrides))


if __name__ == "__main__":
    main()
