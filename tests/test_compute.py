"""The training-compute benchmark: padded pixels over the schedule times FLOPs per pixel, candidate / baseline."""

import json

from benchmarks import compute
from pipelines.config.load import load_params
from pipelines.data.annotation_cache import AnnotationCache, build_cache
from pipelines.data.synthetic import generate_split

from .conftest import REPO
from .proxy_fixture import with_values


def test_the_compute_ratio_is_the_product_of_the_pixel_and_flop_ratios(tmp_path):
    coco = generate_split(tmp_path / "images", split="train", size=12, seed=3, num_classes=3, min_side=96,
                          max_side=224, min_objects=1, max_objects=3)
    (tmp_path / "train.json").write_text(json.dumps(coco))
    build_cache(tmp_path / "train.json", tmp_path / "cache", image_root=str(tmp_path / "images"), drop_empty=True)
    cache = AnnotationCache(tmp_path / "cache")
    base = with_values(load_params(REPO / "params.yaml"), "model", min_size_train=[128], max_size_train=224, dfl_bins=None)
    base = with_values(with_values(base, "train", max_iter=20, ims_per_batch=4, nproc=1), "loader", aspect_grouping=True,
                       padded_shape_grouping=False)
    candidate = with_values(with_values(base, "model", dfl_bins=16), "loader", padded_shape_grouping=True)
    figures = compute.measure(base, candidate, cache)
    r = figures["ratio"]
    assert r["flops_per_pixel"] > 1  # DFL's 4 x 17 box outputs instead of 4
    assert r["padded_pixels"] < 1 and figures["candidate"]["padding"] < figures["baseline"]["padding"]
    assert r["compute"] == figures["candidate"]["compute"] / figures["baseline"]["compute"]
    assert abs(r["compute"] - r["padded_pixels"] * r["flops_per_pixel"]) < 1e-12
    same = compute.measure(base, base, cache)["ratio"]
    assert same == {"padded_pixels": 1.0, "flops_per_pixel": 1.0, "compute": 1.0}  # counted, not timed: exact
    assert "| training compute (pixels x FLOPs per pixel) |" in compute.table(figures)
