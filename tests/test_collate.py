import torch

from pipelines.data.collate import BatchCollator, pad_images


def test_pads_to_a_multiple_of_size_divisibility_with_zeros():
    a = torch.full((3, 50, 70), 7, dtype=torch.uint8)
    b = torch.full((3, 64, 33), 9, dtype=torch.uint8)
    batch = BatchCollator(32)([(a, {"x": 1}, 4), (b, {"x": 2}, 8)])
    assert batch.images.shape == (2, 3, 64, 96)
    assert batch.images.dtype == torch.uint8
    assert batch.image_sizes == [(50, 70), (64, 33)]
    assert batch.indices == [4, 8]
    assert torch.equal(batch.images[0, :, :50, :70], a)
    assert torch.equal(batch.images[1, :, :64, :33], b)
    assert batch.images[0, :, 50:].sum() == 0 and batch.images[0, :, :, 70:].sum() == 0
    assert batch.images[1, :, :, 33:].sum() == 0


def test_no_divisibility_keeps_the_largest_size():
    images = [torch.ones(3, 10, 20), torch.ones(3, 15, 5)]
    assert pad_images(images, 1).shape == (2, 3, 15, 20)
    assert pad_images(images, 32).shape == (2, 3, 32, 32)
    assert pad_images([torch.ones(3, 64, 32)], 32).shape == (1, 3, 64, 32)
