import numpy as np
import torch

from pipelines.data.transforms import RandomHorizontalFlip, ResizeShorterSide, SampleContext, build_transforms, resized_size


def _sample(height=300, width=400):
    image = torch.randint(0, 255, (3, height, width), dtype=torch.uint8)
    target = {"boxes": torch.tensor([[10.0, 20.0, 110.0, 220.0]]), "labels": torch.tensor([3])}
    return image, target


def test_resized_size_scales_the_shorter_side_and_caps_the_longer():
    assert resized_size(300, 400, 600, 1000) == (600, 800)
    assert resized_size(300, 900, 600, 1000) == (333, 1000)
    assert resized_size(400, 300, 320, 416) == (416, 312)


def test_resize_scales_boxes_with_the_image():
    image, target = _sample()
    out, t = ResizeShorterSide([600], 1000)(image, target, SampleContext(np.random.default_rng(0)))
    assert out.shape == (3, 600, 800) and out.dtype == torch.uint8
    torch.testing.assert_close(t["boxes"], torch.tensor([[20.0, 40.0, 220.0, 440.0]]))
    assert torch.equal(t["labels"], target["labels"])


def test_resize_draws_one_of_several_sizes_from_the_rng():
    image, target = _sample()
    sizes = {ResizeShorterSide([200, 300], 1000)(image, target, SampleContext(np.random.default_rng(s)))[0].shape[1] for s in range(20)}
    assert sizes == {200, 300}


def test_flip_mirrors_pixels_and_boxes():
    image, target = _sample()
    flipped, t = RandomHorizontalFlip(1.0)(image, target, SampleContext(np.random.default_rng(0)))
    assert torch.equal(flipped, image.flip(-1))
    torch.testing.assert_close(t["boxes"], torch.tensor([[290.0, 20.0, 390.0, 220.0]]))
    same, t0 = RandomHorizontalFlip(0.0)(image, target, SampleContext(np.random.default_rng(0)))
    assert same is image and t0 is target


def test_build_transforms_resizes_then_augments():
    image, target = _sample()
    plain = build_transforms(min_sizes=[100], max_size=416)
    flipped = build_transforms(min_sizes=[100], max_size=416, augment=RandomHorizontalFlip(1.0))
    assert repr(plain) == "Compose(ResizeShorterSide(min_sizes=[100], max_size=416))"
    small, _ = plain(image, target, SampleContext(np.random.default_rng(0)))
    mirrored, _ = flipped(image, target, SampleContext(np.random.default_rng(0)))
    assert min(small.shape[-2:]) == 100 and torch.equal(mirrored, small.flip(-1))
