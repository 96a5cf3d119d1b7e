"""Each params section's values checked on their own: one function per section, each raising at the
first value out of range through ``require`` (see :func:`pipelines.config.validate.check_values`,
which calls them in order and adds the rules across sections).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from ..errors import ConfigError
from ..policy import PUBLISHED_POLICY, decode_policy
from .backbones import BACKBONES, WEIGHTS_NORMS, weights_enum, weights_name
from .presets import group_hint
from .schema import (Augment, Confirm, DatasetFiles, Evaluate, Launch, Loader, Model, Search, SyntheticDataset, Tracking,
                     Train)

# require(ok, key, expected, value): raises ConfigError "<source>: <key>: expected <expected>, got <value>"
# unless ok.
Require = Callable[[bool, str, str, Any], None]

MIN_DFL_BINS, MAX_DFL_BINS = 2, 64  # model.dfl_bins: GFL uses 16; a box side of this model is up to ~8 strides
MAX_RESAMPLES = 100_000  # evaluate.bootstrap: enough for any interval; more only makes the stage slow


def check_dataset(dataset: DatasetFiles, require: Require) -> None:
    require(dataset.max_damaged_images >= 0, "dataset.max_damaged_images", "an integer >= 0 (images of a split)",
            dataset.max_damaged_images)


def check_synthetic(dataset: SyntheticDataset, require: Require) -> None:
    require(dataset.seed >= 0, "dataset.seed", "an integer >= 0", dataset.seed)
    require(dataset.train_size >= 1, "dataset.train_size", "at least 1 image", dataset.train_size)
    require(dataset.val_size >= 1, "dataset.val_size", "at least 1 image", dataset.val_size)
    require(1 <= dataset.num_classes <= 6, "dataset.num_classes", "1 to 6 shape classes", dataset.num_classes)
    require(dataset.min_side >= 64, "dataset.min_side", "at least 64 pixels", dataset.min_side)
    require(dataset.max_side >= dataset.min_side, "dataset.max_side", f">= dataset.min_side ({dataset.min_side})",
            dataset.max_side)
    require(dataset.min_objects >= 1, "dataset.min_objects", "at least 1", dataset.min_objects)
    require(dataset.max_objects >= dataset.min_objects, "dataset.max_objects",
            f">= dataset.min_objects ({dataset.min_objects})", dataset.max_objects)


def check_model(model: Model, require: Require) -> None:
    require(isinstance(model.channels_last, bool) or model.channels_last == "auto", "model.channels_last",
            "auto, true or false", model.channels_last)
    require(model.fpn_channels > 0 and model.fpn_channels % 32 == 0, "model.fpn_channels",
            "a positive multiple of 32 (the head's GroupNorm has 32 groups)", model.fpn_channels)
    require(model.head_convs >= 1, "model.head_convs", "at least 1", model.head_convs)
    require(len(model.min_size_train) > 0 and all(s > 0 for s in model.min_size_train), "model.min_size_train",
            "a non-empty list of positive sizes", model.min_size_train)
    require(model.max_size_train >= max(model.min_size_train), "model.max_size_train",
            f">= the largest model.min_size_train ({max(model.min_size_train)})", model.max_size_train)
    require(model.min_size_test > 0, "model.min_size_test", "a positive size", model.min_size_test)
    require(model.max_size_test >= model.min_size_test, "model.max_size_test",
            f">= model.min_size_test ({model.min_size_test})", model.max_size_test)
    require(0 <= model.score_thresh < 1, "model.score_thresh", "a value in [0, 1)", model.score_thresh)
    require(0 < model.nms_thresh <= 1, "model.nms_thresh", "a value in (0, 1]", model.nms_thresh)
    require(model.detections_per_img >= 1, "model.detections_per_img", "at least 1", model.detections_per_img)
    require(model.topk_candidates >= 1, "model.topk_candidates", "at least 1", model.topk_candidates)
    require(0 <= model.trainable_layers <= 5, "model.trainable_layers",
            "0 to 5 (ResNet stages trained, from the top; 5: all)", model.trainable_layers)
    weights = model.backbone_weights
    if weights is None:
        require(model.norm != "frozen_batchnorm", "model.norm", "batchnorm or groupnorm when model.backbone_weights "
                "is null (frozen_batchnorm from scratch keeps mean 0, variance 1: no normalisation)", model.norm)
        require(model.trainable_layers == 5, "model.trainable_layers", "5 when model.backbone_weights is null "
                "(frozen stages would keep their random weights)", model.trainable_layers)
    else:
        require(weights != "" and weights == weights.strip(), "model.backbone_weights",
                "null, a torchvision weights name or the path of a state-dict file", weights)
        name = weights_name(weights)
        if name is not None:
            enum = weights_enum(model.backbone)
            require(enum is not None, "model.backbone_weights", f"null or a state-dict file with model.backbone "
                    f"{model.backbone} (torchvision publishes no {BACKBONES[model.backbone].title} weights)", weights)
            require(name[0] in (None, enum), "model.backbone_weights",
                    f"weights of model.backbone ({model.backbone}): {enum}.{name[1]} or {name[1]}", weights)
            require(model.norm in WEIGHTS_NORMS, "model.norm", f"{' or '.join(WEIGHTS_NORMS)} with torchvision weights "
                    f"(model.backbone_weights = {weights!r} holds BatchNorm layers)", model.norm)
    require(not model.sync_batchnorm or model.norm == "batchnorm", "model.sync_batchnorm",
            f"false with model.norm {model.norm!r} (only trainable BatchNorm synchronises)", model.sync_batchnorm)
    require(model.dfl_bins is None or MIN_DFL_BINS <= model.dfl_bins <= MAX_DFL_BINS, "model.dfl_bins",
            f"null or a number of bins from {MIN_DFL_BINS} to {MAX_DFL_BINS} (distances 0..n strides per side)",
            model.dfl_bins)


def check_augment(augment: Augment, require: Require, source: str) -> None:
    require(0 <= augment.hflip_prob <= 1, "augment.hflip_prob", "a probability in [0, 1]", augment.hflip_prob)
    # (none and flip have nothing to turn off and ignore it: the search's baseline sets augment.name=flip alone)
    require(augment.off_tail is None or 0 <= augment.off_tail < 1, "augment.off_tail",
            "a fraction of train.max_iter in [0, 1)", augment.off_tail)
    if augment.name not in ("sa_autoaug", "trivial", "trivial_zoom"):
        return
    from_file = augment.policy is None and augment.policy_file.endswith(".json")  # read by the train stage
    if augment.name == "trivial":
        needed = ("scale_splits", "box_prob", "off_tail", "translate_relative")
    elif augment.name == "trivial_zoom":  # and zoom_out's fillers
        needed = ("scale_splits", "box_prob", "filler_cache_mb", "filler_pool", "filler_pool_iters", "off_tail",
                  "translate_relative")
    else:
        needed = (*(() if from_file else ("policy",)), "n_subpolicies", "scale_splits", "box_prob", "filler_cache_mb",
                  "filler_pool", "filler_pool_iters", "off_tail", "translate_relative")
    for key in needed:
        if getattr(augment, key) is None:
            raise ConfigError(f"{source}: augment.{key}: missing value (required by augment.name={augment.name})"
                              f"{group_hint('augment', augment.name)}")
    splits = augment.scale_splits
    require(len(splits) == 3 and list(splits) == sorted(set(splits)) and splits[0] > 0,
            "augment.scale_splits", "three increasing positive areas", splits)
    require(0 <= augment.box_prob <= 1, "augment.box_prob", "a probability in [0, 1]", augment.box_prob)
    if augment.name == "trivial":
        return
    require(augment.filler_cache_mb >= 0, "augment.filler_cache_mb", "a size in MB >= 0", augment.filler_cache_mb)
    require(augment.filler_pool >= 0, "augment.filler_pool", "a number of images >= 0 (0: the whole split)",
            augment.filler_pool)
    require(augment.filler_pool_iters >= 1, "augment.filler_pool_iters", "a number of iterations >= 1",
            augment.filler_pool_iters)
    if from_file or augment.name == "trivial_zoom":  # trivial_zoom: no genes (pipelines.policy.trivial_zoom_policy)
        return
    try:
        decode_policy(augment.policy, augment.n_subpolicies)  # the one check of the genes; errors name positions
    except ConfigError as err:
        raise ConfigError(f"{source}: {err}") from None


def check_loader(loader: Loader, require: Require) -> None:
    require(loader.num_workers >= 0, "loader.num_workers", "an integer >= 0", loader.num_workers)
    require(loader.size_divisibility >= 1, "loader.size_divisibility", "an integer >= 1", loader.size_divisibility)


def check_train(train: Train, require: Require) -> None:
    require(train.nproc >= 1, "train.nproc", "at least 1 process", train.nproc)
    require(train.max_iter >= 1, "train.max_iter", "at least 1 iteration", train.max_iter)
    require(0 < train.stop_at <= 1, "train.stop_at", "a fraction of train.max_iter in (0, 1]", train.stop_at)
    require(train.base_lr > 0, "train.base_lr", "a learning rate > 0", train.base_lr)
    require(0 <= train.momentum < 1, "train.momentum", "a value in [0, 1)", train.momentum)
    require(train.weight_decay >= 0, "train.weight_decay", "a value >= 0", train.weight_decay)
    require(train.norm_weight_decay >= 0, "train.norm_weight_decay", "a value >= 0", train.norm_weight_decay)
    require(list(train.steps) == sorted(set(train.steps)) and all(0 < s < train.max_iter for s in train.steps),
            "train.steps", f"strictly increasing iterations between 0 and train.max_iter ({train.max_iter})",
            train.steps)
    require(0 < train.gamma <= 1, "train.gamma", "a factor in (0, 1]", train.gamma)
    require(0 <= train.warmup_iters < train.max_iter, "train.warmup_iters",
            f"a value in [0, train.max_iter ({train.max_iter}))", train.warmup_iters)
    require(0 < train.warmup_factor <= 1, "train.warmup_factor", "a factor in (0, 1]", train.warmup_factor)
    require(train.clip_grad_norm >= 0, "train.clip_grad_norm", "a value >= 0 (0 turns clipping off)",
            train.clip_grad_norm)
    require(train.log_period >= 1, "train.log_period", "at least 1 iteration", train.log_period)
    require(train.checkpoint_period >= 1, "train.checkpoint_period", "at least 1 iteration", train.checkpoint_period)
    require(train.keep_checkpoints >= 1, "train.keep_checkpoints", "at least 1", train.keep_checkpoints)


def check_evaluate(evaluate: Evaluate, require: Require) -> None:
    require(evaluate.ims_per_batch >= 1, "evaluate.ims_per_batch", "at least 1 image", evaluate.ims_per_batch)
    require(all(s > 0 for s in evaluate.tta_scales), "evaluate.tta_scales", "positive sizes", evaluate.tta_scales)
    require(evaluate.tta_max_size >= max(evaluate.tta_scales, default=0), "evaluate.tta_max_size",
            f">= the largest evaluate.tta_scales ({max(evaluate.tta_scales, default=0)})", evaluate.tta_max_size)
    require(0 <= evaluate.bootstrap <= MAX_RESAMPLES, "evaluate.bootstrap",
            f"a number of image resamples from 0 (no intervals) to {MAX_RESAMPLES}", evaluate.bootstrap)
    require(evaluate.nms_thresh is None or 0 < evaluate.nms_thresh <= 1, "evaluate.nms_thresh",
            "null (model.nms_thresh) or a value in (0, 1]", evaluate.nms_thresh)
    require(0 < evaluate.vote_thresh <= 1, "evaluate.vote_thresh", "a value in (0, 1]", evaluate.vote_thresh)
    require(evaluate.bn_reestimate is None or evaluate.bn_reestimate >= 1, "evaluate.bn_reestimate",
            "null (off) or a number of train images >= 1", evaluate.bn_reestimate)


def check_tracking(tracking: Tracking, require: Require) -> None:
    require(bool(tracking.experiment.strip()), "tracking.experiment", "a non-empty experiment name",
            tracking.experiment)


def check_launch(launch: Launch, require: Require) -> None:
    require(launch.nodes >= 1, "launch.nodes", "at least 1 node", launch.nodes)
    require(launch.max_restarts >= 0, "launch.max_restarts", "an integer >= 0", launch.max_restarts)
    if launch.nodes > 1:
        host, _, port = launch.rdzv_endpoint.rpartition(":")
        require(bool(host) and port.isdigit() and 0 < int(port) < 65536, "launch.rdzv_endpoint",
                "HOST:PORT of the rendezvous (a port in 1..65535) when launch.nodes > 1", launch.rdzv_endpoint)
        require(bool(launch.rdzv_id.strip()), "launch.rdzv_id", "a non-empty job id", launch.rdzv_id)


def check_search(search: Search, require: Require) -> None:
    for key in ("population", "rounds", "kept", "fine_tune_iters", "candidates_at_once", "threads"):
        require(getattr(search, key) >= 1, f"search.{key}", "at least 1", getattr(search, key))
    for key in ("mutations", "crossovers", "random", "seed"):
        require(getattr(search, key) >= 0, f"search.{key}", "an integer >= 0", getattr(search, key))
    require(search.rounds == 1 or search.mutations + search.crossovers + search.random >= 1, "search.mutations",
            "at least one genome per round after the first (mutations + crossovers + random)", search.mutations)
    require(0 <= search.mutation_prob <= 1, "search.mutation_prob", "a probability in [0, 1]", search.mutation_prob)
    require(search.fine_tune_lr > 0, "search.fine_tune_lr", "a learning rate > 0", search.fine_tune_lr)
    require(0 < search.heldout_fraction < 1, "search.heldout_fraction", "a fraction in (0, 1)", search.heldout_fraction)
    require(0 < search.baseline_fraction <= 1, "search.baseline_fraction", "a fraction in (0, 1]",
            search.baseline_fraction)
    require(search.regulariser_weight >= 0, "search.regulariser_weight", "a weight >= 0 (0: no regulariser)",
            search.regulariser_weight)
    require(0 <= search.proxy_warmup_fraction < 1, "search.proxy_warmup_fraction",
            "a fraction of search.fine_tune_iters in [0, 1) (0: no warmup)", search.proxy_warmup_fraction)
    require(search.rescore_top_k >= 0, "search.rescore_top_k", "an integer >= 0 (0: no rescoring)",
            search.rescore_top_k)
    require(search.rescore_seeds >= 0, "search.rescore_seeds", "an integer >= 0", search.rescore_seeds)
    require(search.rescore_top_k == 0 or search.rescore_seeds >= 1, "search.rescore_seeds",
            f"at least 1 seed to rescore the best search.rescore_top_k ({search.rescore_top_k}) with",
            search.rescore_seeds)
    splits = search.scale_splits
    require(splits is None or splits == "auto" or (
        isinstance(splits, (list, tuple)) and len(splits) == 3
        and all(isinstance(x, int) and not isinstance(x, bool) for x in splits)
        and list(splits) == sorted(set(splits)) and splits[0] > 0),
        "search.scale_splits", "null, auto or three increasing positive areas", splits)


def check_search_space(search: Search, augment: Augment, require: Require) -> None:
    """``search.space: scale`` keeps the published policy's box-level ops, so its sub-policies."""
    published = (len(PUBLISHED_POLICY) - 10) // 6
    require(search.space != "scale" or augment.n_subpolicies in (None, published), "search.space",
            f"full with augment.n_subpolicies {augment.n_subpolicies} (scale keeps the published policy's "
            f"{published} sub-policies)", search.space)


def check_confirm(confirm: Confirm, search: Search, require: Require) -> None:
    require(confirm.top_k >= 0, "confirm.top_k", "an integer >= 0", confirm.top_k)
    # every finalist's score is a mean over seeds, as every parent's is (none is, without rescoring)
    require(search.rescore_top_k == 0 or confirm.top_k <= search.rescore_top_k, "confirm.top_k",
            f"at most search.rescore_top_k ({search.rescore_top_k}): the finalists are the rescored candidates",
            confirm.top_k)
    require(confirm.seeds >= 1, "confirm.seeds", "at least 1", confirm.seeds)
    require(0 < confirm.fraction <= 1, "confirm.fraction", "a fraction in (0, 1]", confirm.fraction)
    arms = confirm.arms
    require(all(re.fullmatch(r"\w[\w.-]*", a) and not a.startswith("searched") for a in arms)
            and len(set(arms)) == len(arms), "confirm.arms",
            "distinct augment preset names of conf/augment/ (not searched: the stage writes its policy file)", arms)
    require(confirm.top_k + len(arms) >= 1, "confirm.top_k",
            "at least one policy to confirm (top_k + the presets of confirm.arms)", confirm.top_k)
