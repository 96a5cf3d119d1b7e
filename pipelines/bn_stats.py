"""BatchNorm statistics re-estimated at the test sizes (``evaluate.bn_reestimate``), before evaluation detects.

The model trains at ``model.min_size_train`` on augmented images and is tested at ``min_size_test`` and the
test-time views' sizes, so the statistics its BatchNorm layers keep (running averages over training
batches) describe other inputs than those it is tested on (FixRes, Touvron et al. 2019; PreciseBN, He et al.
2019). Here they are replaced by those of ``images`` train images as the evaluation sees them: each image
resized to the test size without augmentation, plus, with ``evaluate.tta``, each of the test-time views
(mirrored, extra scales resized from the decoded or the test-size image, as
:func:`pipelines.evaluation.detect` makes them).

The images are the first ``images`` of a permutation of the train split drawn from ``seed``, batched
``batch_size`` at a time in order of their test size (so that a batch pads little), padded as evaluation
pads them. Each batch of each view runs through the backbone (:meth:`pipelines.model.Detector.features`)
with the BatchNorm layers in training mode and ``momentum`` None, without gradients: PyTorch then keeps
the cumulative average of the batches' means and variances, which become the layers' statistics
(``torch.optim.swa_utils.update_bn``'s procedure). Nothing else in the model changes (the layers' momentum
and batch counts are put back).

Every process of the evaluation computes the same statistics from the same batches (no communication), so
the result does not depend on the number of processes, and a rerun gives the same bytes.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch
from torch import nn
from torchvision.transforms.v2 import functional as F

from .data.collate import pad_images
from .data.sizes import resized_size
from .data.transforms import TestTimeAugmentation
from .errors import ConfigError

log = logging.getLogger(__name__)


def batchnorm_layers(model: nn.Module) -> list[nn.modules.batchnorm._BatchNorm]:
    """The layers whose statistics are re-estimated: every BatchNorm that keeps running statistics."""
    return [m for m in model.modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]


def chosen_images(count: int, available: int, *, seed: int) -> np.ndarray:
    """The indices of the ``count`` train images (of ``available``), in the order ``seed`` draws them.

    Raises:
        ConfigError: more images are asked for than the train split holds (one line).
    """
    if count > available:
        raise ConfigError(f"evaluate.bn_reestimate: {count} train images asked for, the train split holds {available}")
    return np.random.default_rng(seed).permutation(available)[:count]


def _views(images: list[torch.Tensor], orig_sizes: list[tuple[int, int]], originals: list[torch.Tensor] | None,
           tta: TestTimeAugmentation | None) -> list[list[torch.Tensor]]:
    """The views of test-size ``images`` (of stored size ``orig_sizes``; ``originals``: the decoded images,
    for ``tta.source`` ``decoded``) as :func:`pipelines.evaluation.detect` makes them, each a list of images."""
    views = [images]
    if tta is None:
        return views
    if tta.flip:
        views.append([im.flip(-1) for im in images])
    sources = originals if tta.source == "decoded" else images
    for scale in tta.scales:
        scaled = [F.resize(im, list(resized_size(h, w, scale, tta.max_size)), antialias=True)
                  for im, (h, w) in zip(sources, orig_sizes)]
        views.append(scaled)
        if tta.flip:
            views.append([im.flip(-1) for im in scaled])
    return views


@torch.no_grad()
def reestimate(model, dataset, *, images: int, seed: int, min_size: int, max_size: int, batch_size: int,
               size_divisibility: int, tta: TestTimeAugmentation | None, device: torch.device) -> int:
    """Replace the BatchNorm statistics of ``model`` (a :class:`pipelines.model.Detector`) by those of
    ``images`` train images of ``dataset`` (a :class:`~pipelines.data.dataset.DetectionDataset` of the train
    split resized by the test transforms, to shorter side ``min_size``, longer at most ``max_size``) at the
    test sizes (see the module's docstring). Returns the number of
    batches that went through the backbone; the model is left in eval mode.

    Raises:
        ConfigError: the model has no BatchNorm layer, or ``images`` is more than the split holds (one line).
    """
    layers = batchnorm_layers(model)
    if not layers:
        raise ConfigError("evaluate.bn_reestimate: the model has no BatchNorm layer whose statistics could be "
                          "re-estimated (model.norm)")
    chosen = chosen_images(images, len(dataset), seed=seed)
    sizes = np.array([resized_size(int(h), int(w), min_size, max_size) for w, h in dataset.cache.sizes[chosen]])
    chosen = chosen[np.lexsort((np.arange(len(chosen)), sizes[:, 1], sizes[:, 0]))]  # by test size, stably
    momenta = [layer.momentum for layer in layers]
    tracked = [layer.num_batches_tracked.clone() for layer in layers]  # put back: only the statistics change
    start, batches = time.perf_counter(), 0
    model.eval()
    try:
        for layer in layers:
            layer.reset_running_stats()
            layer.momentum = None  # a cumulative average over the batches
            layer.train()
        for first in range(0, len(chosen), batch_size):
            indices = [int(i) for i in chosen[first:first + batch_size]]
            samples = [dataset[i] for i in indices]
            resized = [image for image, _, _ in samples]
            orig_sizes = [tuple(int(v) for v in target["orig_size"]) for _, target, _ in samples]
            originals = ([dataset.load(i)[0] for i in indices]
                         if tta is not None and tta.source == "decoded" else None)
            for view in _views(resized, orig_sizes, originals, tta):
                model.features(pad_images(view, size_divisibility).to(device))
                batches += 1
    finally:
        for layer, momentum, count in zip(layers, momenta, tracked):
            layer.momentum = momentum
            layer.num_batches_tracked.copy_(count)
        model.eval()
    log.info("BatchNorm statistics of %d layers re-estimated on %d train images at the test sizes (%d batches) in "
             "%.1f s", len(layers), len(chosen), batches, time.perf_counter() - start)
    return batches
