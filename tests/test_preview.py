import torch
from torchvision.io import decode_png, read_file

from pipelines.data.dataset import DetectionDataset
from pipelines.data.preview import augmentation_preview, draw_sample
from pipelines.data.transforms import RandomHorizontalFlip, build_transforms


def test_draw_sample_outlines_boxes():
    image = torch.zeros(3, 50, 60, dtype=torch.uint8)
    target = {"boxes": torch.tensor([[10.0, 10.0, 30.0, 40.0]]), "labels": torch.tensor([1])}
    drawn = draw_sample(image, target, ["a", "b"])
    assert drawn.shape == image.shape and drawn[:, 10, 10:30].sum() > 0
    assert drawn[:, 25, 20].sum() == 0  # inside the box stays untouched
    assert torch.equal(draw_sample(image, {"boxes": torch.zeros(0, 4), "labels": torch.zeros(0, dtype=torch.int64)},
                                   ["a"]), image)


def test_preview_grid_has_a_row_before_and_a_row_after(tiny_cache, tmp_path):
    plain = DetectionDataset(tiny_cache, transforms=build_transforms(min_sizes=[128], max_size=160))
    flipped = DetectionDataset(tiny_cache, transforms=build_transforms(min_sizes=[128], max_size=160,
                                                                       augment=RandomHorizontalFlip(1.0)))
    path = augmentation_preview(plain, flipped, count=3, iteration=5, path=tmp_path / "p.png")
    grid = decode_png(read_file(str(path)))
    assert grid.shape[0] == 3
    assert 2 * 128 <= grid.shape[1] <= 2 * 160 + 3 * 4 and 3 * 128 <= grid.shape[2] <= 3 * 160 + 4 * 4
