"""Predict: run a trained detector on image files, folders, globs, lists of paths and videos (a command, not a
DVC stage).

``python -m stages.predict SOURCE... --model outputs/train/model_final.pth --out DIR`` writes into DIR
(replaced only once complete) an annotated copy of each input at its relative path, ``predictions.json``
(COCO results), ``coco.json`` (the images and categories they refer to) and ``summary.json``. MODEL is a
train stage's ``.pth`` (PyTorch; its params from ``dvc.lock``'s train entry, or from ``--params``), an
exported ``.onnx`` (ONNX Runtime in fp32 on the CPU; resize, pixel cap and categories from its model card,
``--params`` only for ``--tta``'s settings and the COCO evaluator), or an MLflow model that ``stages.register``
logged (``models:/detector@champion``, ``models:/detector/3``, or a local folder holding ``MLmodel``: the
ONNX file inside it, on the same ONNX backend). An input that cannot be read is skipped
with one line and listed in ``summary.json`` (``--strict``: the run stops instead, exit 2, nothing written).
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from pipelines import cli
from pipelines.build.model import USE_PRECISIONS
from pipelines.config.load import load_params
from pipelines.config.schema import Evaluate
from pipelines.data.transforms import TestTimeAugmentation, build_transforms
from pipelines.errors import ConfigError
from pipelines.fileio import atomic_dir
from pipelines.inference import model_source, onnx_backend, runner, sources, torch_backend
from pipelines.inference.backend import describe
from pipelines.inference.ground_truth import GroundTruth
from pipelines.inference.outputs import Outputs

log = logging.getLogger("predict")


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("sources", nargs="+", metavar="SOURCE",
                        help="image or video file, folder (recursive), glob (quoted), or .txt list of paths")
    parser.add_argument("--params", type=Path, default=None,
                        help="the params the model was trained with (default: dvc.lock's train entry)")
    parser.add_argument("--score", type=float, default=None, help="score threshold (default: model.score_thresh)")
    parser.add_argument("--vis-thresh", type=float, default=0.3, help="boxes drawn from this score (default 0.3)")
    parser.add_argument("--tta", action="store_true", help="test-time augmentation as evaluate.tta_* says")
    parser.add_argument("--batch", type=int, default=1, help="images (or frames) per call (default 1)")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda where present)")
    parser.add_argument("--precision", choices=USE_PRECISIONS, default="auto",
                        help="auto: native bf16 or fp32 on this machine (default); fp32; as-trained: stored")
    parser.add_argument("--coco-gt", type=Path, default=None,
                        help="COCO ground truth: image ids by file name, and the 12 COCO figures printed")
    parser.add_argument("--vid-stride", type=int, default=1, help="use every Nth video frame (default 1)")
    parser.add_argument("--strict", action="store_true", help="stop at the first input that cannot be read")


def main(argv: list[str] | None = None) -> None:
    args = cli.parse_args(__doc__, argv, params=False, arguments=_arguments, output_folders=("out",),
                          model="the model: a .pth, an exported .onnx, models:/detector@ALIAS, an MLflow model folder",
                          out="output folder (replaced when the run is complete)")
    _check(args)
    backend, device, evaluate, (min_size, max_size, divisibility, max_pixels) = _model(args)
    backend.compute.announce(log)
    ground_truth = GroundTruth(args.coco_gt) if args.coco_gt is not None else None
    if ground_truth is not None:
        ground_truth.check_categories(backend.categories, str(args.model))
    inputs = sources.expand(args.sources, exclude=args.out)
    if not inputs:
        raise ConfigError(f"SOURCE {' '.join(args.sources)}: no image or video found")
    tta = (TestTimeAugmentation(tuple(evaluate.tta_scales), evaluate.tta_max_size, evaluate.tta_flip,
                                evaluate.tta_source) if args.tta else None)
    settings = runner.Settings(
        transforms=build_transforms(min_sizes=[min_size], max_size=max_size), size_divisibility=divisibility,
        tta=tta, max_pixels=max_pixels, device=device, batch=args.batch, vid_stride=args.vid_stride,
        vis_thresh=args.vis_thresh, strict=args.strict)
    with atomic_dir(args.out) as folder:
        outputs = Outputs(folder, categories=backend.categories, ground_truth=ground_truth)
        report = runner.Runner(backend, outputs, settings).run(inputs)
        scorer = evaluate.backend if evaluate is not None else "pycocotools"
        metrics = ground_truth.score(outputs.predictions, backend=scorer) if ground_truth else None
        if metrics is not None:
            log.info("COCO box metrics on %d images of %s:\n%s", len(ground_truth.matched), args.coco_gt,
                     metrics.summary)
        outputs.finish({"model": str(args.model), "model_params": backend.params_source,
                        "iteration": backend.iteration, **describe(backend), "device": str(device), "tta": args.tta,
                        "vis_thresh": args.vis_thresh, "batch": args.batch, "vid_stride": args.vid_stride,
                        "inputs": len(inputs), **report.as_dict(),
                        **({"coco_gt": str(args.coco_gt), "metrics": metrics.stats} if metrics else {})})
    log.info("%d images, %d videos (%d frames), %d detections, %d skipped: %s", report.images, report.videos,
             report.frames, report.detections, len(report.skipped), args.out)


def _model(args: argparse.Namespace):
    """The backend ``--model`` names (an MLflow model, or a file by its suffix), the device it runs on, the
    ``evaluate`` params section (None for an ONNX model without ``--params``) and the model's test resize
    ``(min_size, max_size, size_divisibility, max_image_pixels)``.

    Raises:
        CheckpointError: the model file cannot be used. ConfigError: the params or ``--device`` cannot.
        TrackingError: a ``models:/`` model that does not exist, or a registry that cannot be reached.
    """
    if model_source.is_mlflow_model(args.model):
        _onnx_options(args)
        with model_source.local_onnx(args.model) as onnx_file:  # a registered model's is downloaded, then removed
            return _onnx(args, onnx_file)
    if onnx_backend.is_onnx(args.model):
        _onnx_options(args)
        return _onnx(args, args.model)
    device = torch_backend.choose_device(args.device)
    backend, p = torch_backend.load(args.model, device=device, precision=args.precision, params_file=args.params,
                                    score_thresh=args.score)
    return backend, device, p.evaluate, (p.model.min_size_test, p.model.max_size_test, p.loader.size_divisibility,
                                         p.dataset.max_image_pixels)


def _onnx_options(args: argparse.Namespace) -> None:
    if args.device not in (None, "cpu"):
        raise ConfigError(f"--device {args.device}: an .onnx model runs on the CPU (ONNX Runtime); "
                          "use --device cpu")
    if args.tta and args.params is None:
        raise ConfigError("--tta with an .onnx model: give --params FILE (its evaluate.tta_* settings)")


def _onnx(args: argparse.Namespace, onnx_file: Path):
    backend = onnx_backend.load(onnx_file, score_thresh=args.score)
    evaluate: Evaluate | None = load_params(args.params).evaluate if args.params is not None else None
    card = backend.card
    return backend, torch_backend.choose_device("cpu"), evaluate, (card.min_size_test, card.max_size_test,
                                                                   card.size_divisibility, card.max_image_pixels)


def _check(args: argparse.Namespace) -> None:
    for option, value, fits, expected in (("--batch", args.batch, args.batch >= 1, "a whole number, at least 1"),
                                          ("--vid-stride", args.vid_stride, args.vid_stride >= 1,
                                           "a whole number, at least 1"),
                                          ("--score", args.score, args.score is None or 0 <= args.score <= 1,
                                           "a score from 0 to 1"),
                                          ("--vis-thresh", args.vis_thresh, 0 <= args.vis_thresh <= 1,
                                           "a score from 0 to 1")):
        if not fits:
            raise ConfigError(f"{option}: expected {expected}, got {value}")


if __name__ == "__main__":
    cli.run(main)
