"""Stage cache: convert each prepared split into a memory-mappable annotation cache.

Training drops images without a usable box (as maskrcnn-benchmark does); val keeps every image. A split's
cache is rebuilt only when its source JSON, its settings or the cache format changed, or when the
cache on disk is missing, truncated or fails its checksums.
"""

from __future__ import annotations

import json
import logging

from pipelines import cli
from pipelines.data.annotation_cache import build_cache, stale_reason
from pipelines.errors import DatasetError
from pipelines.fileio import file_problem, file_sha256

log = logging.getLogger("cache")


def main(argv: list[str] | None = None) -> None:
    args = cli.parse_args(__doc__, argv, params=False, output_folders=("out",),
                          prepared="output folder of the prepare stage",
                          out="folder for the caches, one per split")

    manifest_path = args.prepared / "dataset.json"
    if problem := (manifest_path.exists() and file_problem(manifest_path)):  # a FIFO would block the read
        raise DatasetError(f"{manifest_path}: {problem}; run the prepare stage")
    try:
        splits = json.loads(manifest_path.read_text())["splits"]
        entries = {split: (entry["annotations"], entry["images"]) for split, entry in splits.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise DatasetError(f"{manifest_path}: missing or unreadable ({err}); run the prepare stage") from None

    for split, (annotation_file, images) in entries.items():
        source = args.prepared / annotation_file
        if not source.is_file():
            raise DatasetError(f"{source}: annotations of split {split!r} not found; run the prepare stage")
        settings = {"source_sha256": file_sha256(source), "image_root": images, "drop_empty": split == "train"}
        reason = stale_reason(args.out / split, **settings)
        if reason is None:
            log.info("%s: cache up to date", split)
            continue
        log.info("%s: building the cache (%s)", split, reason)
        meta = build_cache(source, args.out / split, **settings)
        log.info("%s: cached %d images, %d boxes", split, meta["num_images"], meta["num_boxes"])


if __name__ == "__main__":
    cli.run(main)
