"""The ops of Scale-aware AutoAugment one by one: color (with the Gaussian blend), geometric, zoom,
and the scale-aware box selection."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torchvision.transforms import InterpolationMode
from torchvision.transforms.v2 import functional as TF

from pipelines.data.autoaug._pixels import MEAN_PIXEL
from pipelines.data.autoaug.blend import BLEND_AREA_RATIOS, WINDOW_SIGMAS, color_gaussians, paste_weights
from pipelines.data.autoaug.color import color_op_on_boxes, color_transform, enhance_factor
from pipelines.data.autoaug.geometric import affine_crop, geometric_op
from pipelines.data.autoaug.selection import scale_buckets, select_boxes, selection_probabilities
from pipelines.data.autoaug.zoom import (
    ZOOM_IN_RATIOS,
    ZOOM_OUT_RATIOS,
    resize,
    zoom_in,
    zoom_in_ratio,
    zoom_out,
    zoom_out_ratio,
)
from pipelines.policy import COLOR_OPS

SPLITS = (2048, 10240, 51200)
AREA = (7, 5, 1)  # the published area genes


pytestmark = pytest.mark.usefixtures("one_thread")


def _image(height, width, seed=0, low=0, high=256):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(low, high, (3, height, width), dtype=torch.uint8, generator=generator)


def _target(boxes, labels=None):
    boxes = torch.tensor(boxes, dtype=torch.float32).reshape(-1, 4)
    labels = torch.arange(1, len(boxes) + 1) if labels is None else torch.tensor(labels)
    return {"boxes": boxes, "labels": labels.to(torch.int64)}


def _aug_float(name, image, level):
    height, width = image.shape[-2:]
    return color_transform(name, image, level=level)((0, height, 0, width))


def _aug_uint8(name, image, level):
    return _aug_float(name, image, level).add_(0.5).to(torch.uint8)


# ---------------------------------------------------------------- color ops on the whole image


def test_enhance_factor_is_level_over_10_times_1_8_plus_0_1():
    assert [enhance_factor(level) for level in (0, 5, 10)] == pytest.approx([0.1, 1.0, 1.9])


def test_autocontrast_stretches_each_channel_and_leaves_flat_ones():
    image = _image(20, 30, low=50, high=181)
    image[2] = 77  # flat channel
    out = _aug_float("AutoContrast", image, 0)
    x = image.float()
    for c in range(2):
        lo, hi = x[c].min(), x[c].max()
        torch.testing.assert_close(out[c], (x[c] - lo) * 255 / (hi - lo))
    assert torch.equal(out[2], x[2])


def test_equalize_is_pils_algorithm_like_torchvision():
    image = _image(40, 50, high=120)  # a narrow histogram so that equalising changes it
    assert torch.equal(_aug_uint8("Equalize", image, 3), TF.equalize(image))
    flat = torch.full((3, 8, 8), 9, dtype=torch.uint8)
    assert torch.equal(_aug_uint8("Equalize", flat, 3), flat)


def test_solarize_add_adds_to_the_dark_half_only():
    image = _image(30, 30)
    out = _aug_float("SolarizeAdd", image, 10)
    x = image.float()
    added = 0.4296875 * 255
    dark = image <= 127
    torch.testing.assert_close(out[dark], x[dark] + added)
    torch.testing.assert_close(out[~dark], x[~dark])
    torch.testing.assert_close(_aug_float("SolarizeAdd", image, 5)[dark], x[dark] + added / 2)


def test_color_uses_rgb_grey_weights_for_rgb_images():
    red = torch.zeros((3, 4, 4), dtype=torch.uint8)
    red[0] = 255
    out = _aug_float("Color", red, 0)  # factor 0.1: mostly grey
    grey = 0.2989 * 255  # the red weight; the original's BGR slip would give 0.114 * 255
    torch.testing.assert_close(out[:, 0, 0], torch.tensor([grey + 0.1 * (255 - grey), 0.9 * grey, 0.9 * grey]))


def test_contrast_blends_with_the_global_mean_grey_and_clips():
    image = _image(30, 40)
    x = image.float()
    mean = (0.2989 * x[0] + 0.587 * x[1] + 0.114 * x[2]).mean()
    torch.testing.assert_close(_aug_float("Contrast", image, 10), (mean + 1.9 * (x - mean)).clamp(0, 255))
    torch.testing.assert_close(_aug_float("Contrast", image, 2), mean + 0.46 * (x - mean))


def test_brightness_scales_towards_black():
    image = _image(10, 10)
    torch.testing.assert_close(_aug_float("Brightness", image, 4), image.float() * 0.82)
    torch.testing.assert_close(_aug_float("Brightness", image, 9), (image.float() * 1.72).clamp(max=255))


def test_sharpness_matches_the_13_kernel_with_reflect_padding_also_on_sub_rectangles():
    image = _image(30, 40)
    x = image.float()[None]
    kernel = torch.tensor([[1.0, 1, 1], [1, 5, 1], [1, 1, 1]]).div(13).expand(3, 1, 3, 3)
    smooth = F.conv2d(F.pad(x, (1, 1, 1, 1), mode="reflect"), kernel, groups=3)[0]
    expected = (smooth + 1.9 * (x[0] - smooth)).clamp(0, 255)
    region = color_transform("Sharpness", image, level=10)
    torch.testing.assert_close(region((0, 30, 0, 40)), expected, atol=1e-3, rtol=0)
    # A rectangle inside the image reads its neighbours, one at the border reflects.
    torch.testing.assert_close(region((5, 17, 0, 9)), expected[:, 5:17, 0:9], atol=1e-3, rtol=0)
    torch.testing.assert_close(region((20, 30, 31, 40)), expected[:, 20:30, 31:40], atol=1e-3, rtol=0)


@pytest.mark.parametrize("name", COLOR_OPS)
def test_color_ops_use_whole_image_statistics_on_any_rectangle(name):
    image = _image(40, 60, seed=3, high=200)
    image[:, :10] = 250  # the statistics differ between the full image and the rectangle
    whole = _aug_float(name, image, 7)
    part = color_transform(name, image, level=7)((12, 30, 20, 45))
    torch.testing.assert_close(part, whole[:, 12:30, 20:45], atol=1e-3, rtol=0)


# ---------------------------------------------------------------- Gaussian blend of color ops


def test_blend_sigmas_give_the_reference_areas():
    height, width = 600, 800
    boxes = [[10, 10, 40, 30],      # 600 px: small, 6 * 2048
             [100, 100, 180, 150],  # 4000 px: medium, 2 * 6144
             [300, 300, 500, 400],  # 20000 px: large below split 2, 0.4 * 51200
             [0, 0, 400, 300]]      # 120000 px: beyond split 2, 0.4 * box
    gaussians = color_gaussians(torch.tensor(boxes, dtype=torch.float32), image_size=(height, width),
                                area_ratios=AREA, scale_splits=SPLITS)
    assert BLEND_AREA_RATIOS[7] == 6 and BLEND_AREA_RATIOS[5] == 2 and BLEND_AREA_RATIOS[1] == 0.4
    expected = [12288, 12288, 20480, 0.4 * 120000]
    for g, area, (x1, y1, x2, y2) in zip(gaussians, expected, boxes):
        assert 2 * math.pi * g.sy * g.sx == pytest.approx(area)
        assert g.sy / g.sx == pytest.approx(((y2 - y1) / height) / ((x2 - x1) / width))
        assert (g.cy, g.cx) == ((y1 + y2) / 2, (x1 + x2) / 2)


def _reference_blend(image, name, level, boxes):
    """The original's formula over the whole image (no window), clamped: G = min(1, sum of Gaussians)."""
    height, width = image.shape[-2:]
    ys = torch.arange(height, dtype=torch.float64)[:, None] + 0.5
    xs = torch.arange(width, dtype=torch.float64)[None, :] + 0.5
    g = torch.zeros(height, width, dtype=torch.float64)
    for x1, y1, x2, y2 in boxes:
        h, w = y2 - y1, x2 - x1
        area = h * w
        if area < SPLITS[0]:
            s = BLEND_AREA_RATIOS[AREA[0]] * SPLITS[0] / area
        elif area < SPLITS[1]:
            s = BLEND_AREA_RATIOS[AREA[1]] * (SPLITS[0] + SPLITS[1]) / 2 / area
        elif area < SPLITS[2]:
            s = BLEND_AREA_RATIOS[AREA[2]] * SPLITS[2] / area
        else:
            s = BLEND_AREA_RATIOS[AREA[2]]
        r = math.sqrt(s * height * width / (2 * math.pi))
        sy, sx = h / height * r, w / width * r
        g += torch.exp(-((ys - (y1 + y2) / 2) ** 2) / (2 * sy**2) - ((xs - (x1 + x2) / 2) ** 2) / (2 * sx**2))
    g = g.clamp(max=1)
    x = image.double()
    aug = _aug_float(name, image, level).double()
    return (x + g * (aug - x)).round().to(torch.uint8), g


@pytest.mark.parametrize("name", COLOR_OPS)
def test_windowed_blend_matches_the_whole_image_gaussians(name):
    image = _image(240, 320, seed=5, high=200)
    boxes = [[20, 30, 40, 50], [30, 40, 70, 70], [150, 100, 300, 220], [290, 5, 318, 15]]  # two overlap
    out = color_op_on_boxes(name, image, torch.tensor(boxes, dtype=torch.float32), level=8, area_ratios=AREA,
                            scale_splits=SPLITS)
    expected, g = _reference_blend(image, name, 8, boxes)
    diff = (out.int() - expected.int()).abs()
    assert diff.max() <= 1  # float32 against float64 rounding at .5
    assert (diff > 0).float().mean() < 0.01
    assert g.max() == 1.0  # the overlapping pair pushes the sum above 1: clamped
    assert not torch.equal(out, image)


@pytest.mark.parametrize("name", COLOR_OPS)
def test_color_op_changes_the_box_and_nothing_beyond_its_window(name):
    image = _image(600, 800, seed=1, low=30, high=120)
    box = [380, 290, 410, 310]  # small: blend area 12288 px, far larger than the box
    out = color_op_on_boxes(name, image, torch.tensor([box], dtype=torch.float32), level=9, area_ratios=AREA,
                            scale_splits=SPLITS)
    (g,) = color_gaussians(torch.tensor([box], dtype=torch.float32), image_size=(600, 800), area_ratios=AREA,
                           scale_splits=SPLITS)
    changed = (out != image).any(0)
    assert changed[290:310, 380:410].float().mean() > 0.5
    # Pixels beyond the window are bit for bit the input.
    y0, y1, x0, x1 = g.window(600, 800)
    outside = torch.ones(600, 800, dtype=torch.bool)
    outside[y0:y1, x0:x1] = False
    assert 0 < y0 and y1 < 600 and 0 < x0 and x1 < 800
    assert not changed[outside].any()
    assert (y1 - y0) == pytest.approx(2 * WINDOW_SIGMAS * g.sy, abs=2)
    # At the centre the blend is (almost) all augmentation.
    aug = _aug_uint8(name, image, 9)
    assert (out[:, 300, 395].int() - aug[:, 300, 395].int()).abs().max() <= 1
    # An empty selection is no change at all.
    assert color_op_on_boxes(name, image, torch.zeros((0, 4)), level=9, area_ratios=AREA, scale_splits=SPLITS) is image


# ---------------------------------------------------------------- selection


def test_scale_buckets_split_by_area():
    areas = np.array([0, 2047, 2048, 10239, 10240, 51200, 1e6])
    assert scale_buckets(areas, SPLITS).tolist() == [0, 0, 1, 1, 2, 2, 2]


def test_selection_probabilities_of_the_published_policy():
    boxes = torch.tensor([[0, 0, 40, 40], [0, 0, 80, 80], [0, 0, 300, 300], [5, 5, 5, 9]], dtype=torch.float32)
    color = selection_probabilities(boxes, ratios=(7, 5, 1), box_prob=0.3, scale_splits=SPLITS)
    assert color == pytest.approx([0.3 * 7 / 13, 0.3 * 5 / 13, 0.3 / 13, 0.0])
    assert color[:3] == pytest.approx([0.162, 0.115, 0.023], abs=5e-4)
    geometric = selection_probabilities(boxes, ratios=(3, 3, 3), box_prob=0.3, scale_splits=SPLITS)
    assert geometric == pytest.approx([0.1, 0.1, 0.1, 0.0])
    assert selection_probabilities(boxes, ratios=(0, 0, 0), box_prob=0.3, scale_splits=SPLITS).tolist() == [0] * 4


@pytest.mark.parametrize("ratios, expected", [((7, 5, 1), (0.3 * 7 / 13, 0.3 * 5 / 13, 0.3 / 13)),
                                              ((3, 3, 3), (0.1, 0.1, 0.1))])
def test_selection_frequencies_match_per_bucket(ratios, expected):
    # 4 boxes per bucket, drawn 20000 times.
    sides = [20, 30, 40, 44, 50, 70, 90, 100, 230, 300, 400, 500]
    boxes = torch.tensor([[0, 0, s, s] for s in sides], dtype=torch.float32)
    rng = np.random.default_rng(0)
    draws = np.stack([select_boxes(boxes, ratios=ratios, box_prob=0.3, scale_splits=SPLITS, rng=rng)
                      for _ in range(20000)])
    for bucket, p in enumerate(expected):
        freq = draws[:, 4 * bucket:4 * bucket + 4].mean()
        tolerance = 5 * math.sqrt(p * (1 - p) / (20000 * 4))
        assert abs(freq - p) < tolerance, (bucket, freq, p)
    # Boxes are drawn independently: the pair correlation is nil.
    assert abs(np.corrcoef(draws[:, 0], draws[:, 1])[0, 1]) < 0.04


# ---------------------------------------------------------------- geometric ops


def _paste_reference(before, transformed, height, width):
    """Independent paste: isotropic Gaussian with effective area h * w over the crop."""
    sigma = math.sqrt(height * width / (2 * math.pi))
    ys = torch.arange(height, dtype=torch.float64)[:, None] + 0.5 - height / 2
    xs = torch.arange(width, dtype=torch.float64)[None, :] + 0.5 - width / 2
    g = torch.exp(-(ys**2 + xs**2) / (2 * sigma**2))
    return (before.double() + g * (transformed.double() - before.double())).round()


def test_paste_weights_have_the_box_as_effective_area():
    w = paste_weights(30, 50).double()
    # Untruncated, the sum would be 2 pi sigma^2 = 30 * 50; the box cuts it at +-15 and +-25 pixels.
    sigma = math.sqrt(30 * 50 / (2 * math.pi))
    inside = math.erf(15 / (sigma * math.sqrt(2))) * math.erf(25 / (sigma * math.sqrt(2)))
    assert w.sum().item() == pytest.approx(30 * 50 * inside, rel=1e-3)
    assert w[14:16, 24:26].min() > 0.99
    assert w[0, 0].item() == pytest.approx(math.exp(-(14.5**2 + 24.5**2) / (2 * sigma**2)), rel=1e-5)


def test_hflip_flips_the_crop_and_blends_it_back():
    image = _image(60, 80, seed=2)
    target = _target([[10.0, 5.0, 40.0, 35.0], [50.0, 40.0, 70.0, 55.0]])
    out, t = geometric_op("hflip", image, target, level=3, selected=np.array([True, False]),
                          rng=np.random.default_rng(0))
    crop = image[:, 5:35, 10:40]
    expected = _paste_reference(crop, crop.flip(-1), 30, 30)
    assert (out[:, 5:35, 10:40].double() - expected).abs().max() <= 1
    outside = torch.ones(60, 80, dtype=torch.bool)
    outside[5:35, 10:40] = False
    assert torch.equal(out[:, outside], image[:, outside])
    assert t is target


@pytest.mark.parametrize("name, torchvision_kwargs", [
    ("rotate", lambda d: {"angle": d, "shear": [0.0, 0.0]}),
    ("shearX", lambda d: {"angle": 0.0, "shear": [d, 0.0]}),
    ("shearY", lambda d: {"angle": 0.0, "shear": [0.0, d]}),
])
def test_affine_crop_matches_torchvision_affine_for_one_sign(name, torchvision_kwargs):
    crop = _image(40, 60, seed=4)
    ours = affine_crop(crop, name, 12.0)
    interior = (slice(None), slice(8, 32), slice(12, 48))  # away from the fill, where torchvision's masking differs
    errors = []
    for sign in (1.0, -1.0):
        theirs = TF.affine(crop.float(), translate=[0.0, 0.0], scale=1.0, interpolation=InterpolationMode.BILINEAR,
                           fill=list(MEAN_PIXEL), **torchvision_kwargs(sign * 12.0))
        errors.append((ours[interior] - theirs[interior]).abs().max().item())
    assert min(errors) < 1e-2 and max(errors) > 10
    # A corner rotated by 30 degrees samples more than a pixel outside the crop: the mean pixel.
    corner = affine_crop(torch.full((3, 20, 20), 200, dtype=torch.uint8), "rotate", 30.0)[:, 0, 0]
    assert corner.tolist() == pytest.approx(list(MEAN_PIXEL), abs=1e-3)
    assert affine_crop(crop, name, 0.0).round().to(torch.uint8).equal(crop)


@pytest.mark.parametrize("name", ["hflip", "rotate", "shearX", "shearY"])
def test_in_place_geometric_ops_change_only_selected_boxes_and_keep_the_target(name):
    image = _image(80, 100, seed=6)
    target = _target([[5, 5, 45, 35], [60, 40, 95, 75]])
    out, t = geometric_op(name, image, target, level=10, selected=np.array([False, True]),
                          rng=np.random.default_rng(1))
    inside = torch.zeros(80, 100, dtype=torch.bool)
    inside[40:75, 60:95] = True
    changed = (out != image).any(0)
    assert changed[inside].float().mean() > 0.5
    assert not changed[~inside].any()
    assert t is target and torch.equal(t["boxes"], target["boxes"])
    # Nothing selected: nothing at all.
    same, t0 = geometric_op(name, image, target, level=10, selected=np.array([False, False]),
                            rng=np.random.default_rng(1))
    assert same is image and t0 is target


@pytest.mark.parametrize("name, axis", [("translateX", 0), ("translateY", 1)])
def test_translate_pastes_a_shifted_copy_and_appends_its_box(name, axis):
    image = _image(200, 240, seed=7)
    target = _target([[90, 80, 130, 110], [5, 5, 20, 20]], labels=[4, 9])
    offsets = set()
    for seed in range(8):
        out, t = geometric_op(name, image, target, level=5, selected=np.array([True, False]),
                              rng=np.random.default_rng(seed))
        assert torch.equal(t["boxes"][:2], target["boxes"]) and t["labels"].tolist() == [4, 9, 4]
        shift = (t["boxes"][2] - target["boxes"][0]).tolist()
        d = int(shift[axis])
        assert abs(d) == 60 and shift[1 - axis] == 0 and shift[axis + 2] == d and shift[3 - axis] == 0
        offsets.add(d)
        dx, dy = (d, 0) if axis == 0 else (0, d)
        # The copy carries the source crop, blended with the paste Gaussian.
        source = image[:, 80:110, 90:130]
        before = image[:, 80 + dy:110 + dy, 90 + dx:130 + dx]
        pasted = out[:, 80 + dy:110 + dy, 90 + dx:130 + dx]
        assert (pasted.double() - _paste_reference(before, source.float(), 30, 40)).abs().max() <= 1
        assert (pasted[:, 13:17, 18:22].int() - source[:, 13:17, 18:22].int()).abs().max() <= 3
        # The object stays where it was (the copy does not overlap it at 60 px).
        assert torch.equal(out[:, 80:110, 90:130], image[:, 80:110, 90:130])
        changed = (out != image).any(0)
        changed[80 + dy:110 + dy, 90 + dx:130 + dx] = False
        assert not changed.any()
    assert offsets == {60, -60}  # the sign flips with probability 0.5


def test_translate_clips_a_copy_at_the_border_or_drops_it():
    image = _image(100, 100, seed=8)
    # Shifted by +-48 px: box 0 keeps 60% inside on one side, box 1 keeps 25% on one side.
    target = _target([[20, 10, 100, 30], [0, 50, 64, 70]], labels=[1, 2])
    results = {}
    for seed in range(10):
        out, t = geometric_op("translateX", image, target, level=4, selected=np.array([True, True]),
                              rng=np.random.default_rng(seed))
        boxes = t["boxes"]
        assert ((boxes[:, 2] > boxes[:, 0]) & (boxes[:, 3] > boxes[:, 1])).all()
        assert (boxes[:, :2] >= 0).all() and (boxes[:, 2:] <= 100).all()
        assert len(t["labels"]) == len(boxes)
        results[tuple(map(tuple, boxes[2:].tolist()))] = t["labels"][2:].tolist()
    # +48: box 0 -> [68, 10, 148, 30] keeps 32 / 80 < 50%: dropped; box 1 -> [48, 50, 112, 70] keeps 52 / 64.
    # -48: box 0 -> [-28, 10, 52, 30] keeps 52 / 80; box 1 -> [-48, 50, 16, 70] keeps 16 / 64: dropped.
    assert results == {((48.0, 50.0, 100.0, 70.0),): [2], ((0.0, 10.0, 52.0, 30.0),): [1]}


def test_level_zero_moves_nothing():
    image = _image(50, 50)
    target = _target([[10, 10, 30, 30]])
    for name in ("rotate", "shearX", "shearY", "translateX", "translateY"):
        out, t = geometric_op(name, image, target, level=0, selected=np.array([True]), rng=np.random.default_rng(0))
        assert out is image and t is target


def test_unknown_op_names_fail_loudly():
    with pytest.raises(ValueError, match="unknown geometric op 'zoom'"):
        geometric_op("zoom", _image(4, 4), _target([]), level=1, selected=np.zeros(0, bool),
                     rng=np.random.default_rng())
    with pytest.raises(ValueError, match="unknown color op 'Posterize'"):
        color_transform("Posterize", _image(4, 4), level=1)


# ---------------------------------------------------------------- zoom


def test_zoom_ratio_tables():
    assert zoom_in_ratio(3) == pytest.approx(1.2) and zoom_out_ratio(9) == pytest.approx(0.5)
    assert ZOOM_IN_RATIOS[0] == pytest.approx(1.05) and ZOOM_IN_RATIOS[-1] == pytest.approx(1.5)
    assert ZOOM_OUT_RATIOS[0] == pytest.approx(0.95) and len(ZOOM_OUT_RATIOS) == len(ZOOM_IN_RATIOS) == 10


@pytest.mark.parametrize("size, new_size", [((100, 140), (50, 70)), ((101, 139), (50, 69)), ((60, 80), (72, 96)),
                                            ((61, 83), (91, 124)), ((7, 5), (14, 10)), ((37, 29), (3, 2))])
@pytest.mark.parametrize("layout", ["planar", "interleaved"])
def test_zoom_resamples_by_nearest_neighbour_like_the_original(size, new_size, layout):
    # The original resizes with F.interpolate(mode="nearest"); so does this, for either memory layout.
    image = _image(*size, seed=14)
    expected = F.interpolate(image[None], size=new_size, mode="nearest")[0]
    if layout == "interleaved":  # as decoded images are stored
        image = image.permute(1, 2, 0).contiguous().permute(2, 0, 1)
    out = resize(image, new_size)
    assert out.is_contiguous() and torch.equal(out, expected)


def test_zoom_in_computes_the_crop_of_the_nearest_neighbour_enlargement():
    image = _image(61, 83, seed=15)
    target = _target([[10, 10, 50, 40]])
    enlarged = F.interpolate(image[None], size=(91, 124), mode="nearest")[0]  # ratio 1.5
    for seed in range(6):
        out, _ = zoom_in(image, target, ratio=1.5, rng=np.random.default_rng(seed))
        rng = np.random.default_rng(seed)
        top, left = int(rng.integers(0, 91 - 61)), int(rng.integers(0, 124 - 83))
        assert torch.equal(out, enlarged[:, top:top + 61, left:left + 83])


def _find_offset(enlarged, out):
    height, width = out.shape[-2:]
    for top in range(enlarged.shape[-2] - height + 1):
        for left in range(enlarged.shape[-1] - width + 1):
            if torch.equal(enlarged[:, top:top + height, left:left + width], out):
                return top, left
    raise AssertionError("output is not a crop of the enlarged image")


def test_zoom_in_enlarges_crops_and_keeps_boxes_with_half_their_area():
    image = _image(100, 100, seed=9)
    target = _target([[0, 0, 20, 20], [40, 40, 60, 60], [70, 10, 100, 40]], labels=[3, 5, 7])
    enlarged = resize(image, (150, 150))
    seen_kept = set()
    for seed in range(12):
        out, t = zoom_in(image, target, ratio=1.5, rng=np.random.default_rng(seed))
        assert out.shape == image.shape and out.dtype == torch.uint8
        top, left = _find_offset(enlarged, out)
        assert 0 <= top < 50 and 0 <= left < 50
        scaled = target["boxes"] * 1.5 - torch.tensor([left, top, left, top])
        clipped = torch.stack([scaled[:, 0].clamp(0, 100), scaled[:, 1].clamp(0, 100),
                               scaled[:, 2].clamp(0, 100), scaled[:, 3].clamp(0, 100)], 1)
        area = lambda b: (b[:, 2] - b[:, 0]).clamp(min=0) * (b[:, 3] - b[:, 1]).clamp(min=0)
        keep = area(clipped) >= 0.5 * area(scaled)
        torch.testing.assert_close(t["boxes"], clipped[keep])
        assert t["labels"].tolist() == target["labels"][keep].tolist()
        seen_kept.add(tuple(keep.tolist()))
    assert len(seen_kept) > 1  # the offset matters: boxes are dropped for some and kept for others


def test_zoom_in_returns_the_input_when_no_box_survives():
    image = _image(100, 100)
    target = _target([[98, 98, 100, 100]])  # at most 44% of it stays in any crop
    for seed in range(5):
        out, t = zoom_in(image, target, ratio=1.5, rng=np.random.default_rng(seed))
        assert out is image and t is target


def _fillers():
    fillers = []
    for k, (height, width) in enumerate([(80, 120), (60, 60), (100, 90)]):
        boxes = [[10, 10, 30, 40], [width - 25, height - 30, width - 1, height - 2], [0, 0, width, height]]
        labels = [10 * (k + 1) + i for i in range(3)]
        fillers.append((_image(height, width, seed=20 + k), _target(boxes, labels=labels)))
    return fillers


def test_zoom_out_builds_a_mosaic_of_the_image_and_three_fillers():
    image = _image(100, 140, seed=10)
    target = _target([[10, 20, 50, 60], [100, 60, 140, 100]], labels=[1, 2])
    fillers = _fillers()
    out, t = zoom_out(image, target, ratio=0.5, fillers=fillers)
    assert out.shape == image.shape and out.dtype == torch.uint8
    assert torch.equal(out[:, :50, :70], resize(image, (50, 70)))
    assert torch.equal(out[:, :50, 70:], resize(fillers[0][0], (50, 70)))
    assert torch.equal(out[:, 50:, :70], resize(fillers[1][0], (50, 70)))
    assert torch.equal(out[:, 50:, 70:], resize(fillers[2][0], (50, 70)))
    expected = [[5, 10, 25, 30], [50, 30, 70, 50]]  # own boxes, halved
    for k, (top, left) in enumerate([(0, 70), (50, 0), (50, 70)]):
        fh, fw = fillers[k][0].shape[-2:]
        for x1, y1, x2, y2 in fillers[k][1]["boxes"].tolist():
            sx, sy = 70 / fw, 50 / fh
            expected.append([x1 * sx + left, y1 * sy + top, x2 * sx + left, y2 * sy + top])
    torch.testing.assert_close(t["boxes"], torch.tensor(expected), atol=1e-4, rtol=0)
    assert t["labels"].tolist() == [1, 2, 10, 11, 12, 20, 21, 22, 30, 31, 32]


def test_zoom_out_keeps_filler_boxes_with_half_their_area_in_their_region():
    image = _image(100, 100, seed=11)
    target = _target([[10, 10, 50, 50]])
    # ratio 0.75: the fillers are shrunk to 75 x 75 but the right region is only 25 wide.
    filler = (_image(75, 75, seed=12), _target([[0, 0, 20, 20], [10, 30, 40, 50], [30, 0, 60, 10]], labels=[5, 6, 7]))
    out, t = zoom_out(image, target, ratio=0.75, fillers=[filler] * 3)
    right = t["boxes"][1:][t["boxes"][1:, 1] < 75]
    right = right[right[:, 0] >= 75]
    # Box [10, 30, 40, 50] keeps 15 of 30 columns (50%): kept, clipped; [30, 0, 60, 10] keeps nothing.
    assert right.tolist() == [[75.0, 0.0, 95.0, 20.0], [85.0, 30.0, 100.0, 50.0]]
    assert torch.equal(out[:, :75, 75:], filler[0][:, :75, :25])


def test_zoom_out_without_fillers_keeps_the_size_and_fills_with_the_mean_pixel():
    image = _image(101, 140, seed=13)
    target = _target([[10, 20, 50, 60]], labels=[4])
    out, t = zoom_out(image, target, ratio=0.5, fillers=[])
    assert out.shape == image.shape
    assert torch.equal(out[:, :50, :70], resize(image, (50, 70)))
    mean = torch.tensor([round(m) for m in MEAN_PIXEL], dtype=torch.uint8)
    assert (out[:, 50:, :] == mean.view(3, 1, 1)).all() and (out[:, :, 70:] == mean.view(3, 1, 1)).all()
    torch.testing.assert_close(t["boxes"], torch.tensor([[5.0, 20 * 50 / 101, 25.0, 60 * 50 / 101]]))
    assert t["labels"].tolist() == [4]
