"""Stage export: the trained detector as ONNX, with its model card and its parity measured on the val split.

Writes ``model.onnx`` and ``model.json`` (the card: categories, input contract, thresholds, exporter,
training run, git commit, the weights' md5) into ``--out`` and the parity figures into ``--metrics``:
``max_abs_diff``, ``match_rate``, ``ap_torch``, ``ap_onnx``, ``ap_torch_tta``, ``ap_onnx_tta``
(:mod:`pipelines.inference.parity`; the test-time views are ``evaluate.tta_*``'s, whether or not
``evaluate.tta`` is on), with ``val_fingerprint`` (the first 16 hex digits of the val annotations'
SHA-256) and the training run's ``mlflow_run_id``. The graph is fp32 whatever precision training used.
The AP figures are pycocotools' (the reference), whatever ``evaluate.backend`` says. Parity missed: one
line naming the figures, and nothing written.
"""

from __future__ import annotations

import logging

from pipelines import cli
from pipelines.build import data as build_data
from pipelines.build import model as build_model
from pipelines.config.load import load_params
from pipelines.data.annotation_cache import AnnotationCache
from pipelines.data.dataset import DetectionDataset
from pipelines.errors import CheckpointError
from pipelines.fileio import atomic_dir, file_md5, write_json
from pipelines.hardware import threads_per_process
from pipelines.inference import onnx_export, parity
from pipelines.inference.onnx_runtime import OnnxDetector
from pipelines.inference.torch_backend import choose_device
from pipelines.tracking.lineage import git_commit
from pipelines.tracking.run import read_run_id

log = logging.getLogger("export")


def main(argv: list[str] | None = None) -> None:
    args = cli.parse_args(__doc__, argv, output_folders=("out",), output_files=("metrics",),
                          cache="annotation cache folder (val split inside)",
                          prepared="prepared dataset (val.json is the ground truth)",
                          model="model_final.pth of the train stage", train_run="run.json of the train stage",
                          out="folder for model.onnx and model.json", metrics="the parity figures (JSON)")
    p = load_params(args.params)
    device = choose_device("cpu")
    cache = AnnotationCache(args.cache / "val", verify=True)
    detector, _, iteration = build_model.trained_detector(p, args.model, categories=cache.categories,
                                                          split=args.cache / "val", device=device, precision="fp32")
    build_model.use_evaluate(detector, p)  # the card carries evaluation's post-processing
    training_run_id = read_run_id(args.train_run)
    provenance = {"mlflow_run_id": training_run_id, "git_commit": git_commit(), "weights_md5": file_md5(args.model)}
    with atomic_dir(args.out) as folder:
        log.info("exporting %s (iteration %d) to ONNX, fp32", args.model, iteration)
        onnx_export.export(detector, folder / "model.onnx", categories=cache.categories,
                           min_size_test=p.model.min_size_test, max_size_test=p.model.max_size_test,
                           size_divisibility=p.loader.size_divisibility, max_image_pixels=p.dataset.max_image_pixels,
                           provenance=provenance)
        runtime = OnnxDetector(folder / "model.onnx", threads=threads_per_process(1))
        dataset = DetectionDataset(cache, transforms=build_data.test_transforms(p), seed=p.seed, skip_crowd=False)
        loader = build_data.test_loader(p, dataset, rank=0, world_size=1)
        paths = {int(cache.image_ids[i]): cache.image_path(i) for i in range(len(cache))}
        figures = parity.measure(detector, runtime, loader, image_paths=paths, ground_truth=args.prepared / "val.json",
                                 category_ids=cache.category_ids, tta=build_data.test_time_augmentation(p, always=True),
                                 size_divisibility=p.loader.size_divisibility, coco_backend="pycocotools")
        log.info("parity on %d val images: head outputs within %.2e, %d detections %.4f matched; AP torch %s, "
                 "onnx %s; with test-time views torch %s, onnx %s", len(cache), figures.max_abs_diff,
                 figures.detections, figures.match_rate, _ap(figures.ap_torch), _ap(figures.ap_onnx),
                 _ap(figures.ap_torch_tta), _ap(figures.ap_onnx_tta))
        if failures := figures.failures():
            raise CheckpointError(f"{args.model}: the ONNX export misses parity: {'; '.join(failures)}; "
                                  f"nothing written to {args.out}")
    write_json(args.metrics, {**figures.as_dict(), "val_fingerprint": str(cache.meta.get("source_sha256"))[:16],
                              "mlflow_run_id": training_run_id})


def _ap(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"


if __name__ == "__main__":
    cli.run(main)
