"""The torch-free pre-processing of the ONNX path against training's decoder and test resize."""

from __future__ import annotations

import io
import logging

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.transforms.v2 import functional as F

from pipelines.data import transforms
from pipelines.data.collate import pad_images
from pipelines.data.decode import decode_image
from pipelines.errors import ImageError
from pipelines.inference import preprocess


def _pixels(height: int, width: int, seed: int = 0) -> np.ndarray:
    """A smooth image with edges (a gradient and a few rectangles): what resizing filters disagree on."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    image = np.stack([x * 255 // max(1, width - 1), y * 255 // max(1, height - 1), (x + y) % 256], axis=2)
    for _ in range(4):
        y0, x0 = rng.integers(0, height - 4), rng.integers(0, width - 4)
        image[y0:y0 + rng.integers(2, height // 2), x0:x0 + rng.integers(2, width // 2)] = rng.integers(0, 256, 3)
    return image.astype(np.uint8)


@pytest.mark.parametrize("mode", ["RGB", "L", "RGBA", "LA", "P", "I;16"])
def test_png_decodes_as_trainings_decoder(tmp_path, mode):
    rgb = _pixels(24, 40)
    if mode == "I;16":
        image = Image.fromarray((rgb[:, :, 0].astype(np.uint16) * 257 + 3))
    elif mode == "P":
        image = Image.fromarray(rgb).quantize(16)
    else:
        image = Image.fromarray(rgb).convert(mode)
    path = tmp_path / "a.png"
    image.save(path)
    ours = preprocess.decode(path, max_pixels=10**6).pixels
    theirs = decode_image(path).permute(1, 2, 0).numpy()
    np.testing.assert_array_equal(ours, theirs)


def test_jpeg_cmyk_and_gif_decode_as_trainings_decoder(tmp_path):
    Image.fromarray(_pixels(48, 64)).save(tmp_path / "a.jpg", quality=90)
    Image.fromarray(_pixels(48, 64)).convert("CMYK").save(tmp_path / "cmyk.jpg", quality=90)
    frames = [Image.fromarray(_pixels(16, 20, seed)).convert("P") for seed in range(3)]
    frames[0].save(tmp_path / "b.gif", save_all=True, append_images=frames[1:])
    for name in ("a.jpg", "cmyk.jpg", "b.gif"):
        ours = preprocess.decode(tmp_path / name, max_pixels=10**6).pixels.astype(int)
        theirs = decode_image(tmp_path / name).permute(1, 2, 0).numpy().astype(int)
        assert ours.shape == theirs.shape
        assert np.abs(ours - theirs).max() <= 1, name  # both libjpeg-turbo's slow integer IDCT


def test_pil_resize_is_close_to_trainings_resize():
    """PIL's bilinear resize against torchvision's antialiased one (the test transform's), shrinking and
    enlarging: within one grey level, not equal; the export's parity measures what that does to the AP."""
    for (height, width), size in (((480, 640), (320, 427)), ((200, 300), (320, 480))):
        image = _pixels(height, width)
        ours = preprocess.resize(image, size).astype(int)
        theirs = F.resize(torch.from_numpy(image).permute(2, 0, 1), list(size), antialias=True)
        difference = np.abs(ours - theirs.permute(1, 2, 0).numpy().astype(int))
        assert difference.mean() < 0.01 and difference.max() <= 1, (size, difference.mean(), difference.max())


def test_real_photos_decode_as_training_reads_them(coco_real):
    """The real COCO JPEGs (one greyscale): PIL's pixels are training's decoder's; resized for the test
    they are within one grey level of training's resize."""
    _, folder = coco_real
    for path in sorted(folder.glob("*.jpg"))[:12]:
        ours = preprocess.decode(path, max_pixels=10**8).pixels
        theirs = decode_image(path)
        np.testing.assert_array_equal(ours, theirs.permute(1, 2, 0).numpy())
        size = transforms.resized_size(*ours.shape[:2], 320, 416)
        resized = F.resize(theirs, list(size), antialias=True).permute(1, 2, 0).numpy()
        assert np.abs(preprocess.resize(ours, size).astype(int) - resized.astype(int)).max() <= 1, path.name


def test_prepare_pads_like_the_loader():
    images = [_pixels(48, 64), _pixels(64, 40, seed=1)]
    batch = preprocess.prepare(images, min_size=32, max_size=50, size_divisibility=32)
    assert batch.orig_sizes == [(48, 64), (64, 40)]
    assert batch.image_sizes == [transforms.resized_size(48, 64, 32, 50), transforms.resized_size(64, 40, 32, 50)]
    assert batch.images.dtype == np.uint8 and batch.images.shape == (2, 3, 64, 64)
    resized = [torch.from_numpy(preprocess.resize(im, size)).permute(2, 0, 1) for im, size in zip(images, batch.image_sizes)]
    np.testing.assert_array_equal(batch.images, pad_images(resized, 32).numpy())


def test_bytes_and_paths_decode_alike(tmp_path):
    path = tmp_path / "a.png"
    Image.fromarray(_pixels(20, 30)).save(path)
    np.testing.assert_array_equal(preprocess.decode(path.read_bytes(), max_pixels=10**6).pixels,
                                  preprocess.decode(path, max_pixels=10**6).pixels)


def test_exif_orientation_is_reported_not_applied(tmp_path, caplog):
    exif = Image.Exif()
    exif[0x0112] = 6
    path = tmp_path / "r.jpg"
    Image.fromarray(_pixels(24, 32)).save(path, exif=exif.tobytes())
    with caplog.at_level(logging.WARNING, logger="pipelines.inference.preprocess"):
        decoded = preprocess.decode(path, max_pixels=10**6)
    assert decoded.orientation == 6 and decoded.size == (24, 32)  # as stored, as training reads it
    assert [r.getMessage() for r in caplog.records] == [
        f"{path}: EXIF orientation 6: read as stored, without rotation, as training reads images"]


def test_bad_images_give_one_line_naming_them(tmp_path):
    big = tmp_path / "big.png"
    Image.new("L", (400, 300)).save(big)
    text = tmp_path / "text.jpg"
    text.write_text("not an image\n")
    empty = tmp_path / "empty.jpg"
    empty.write_bytes(b"")
    good = io.BytesIO()
    Image.fromarray(_pixels(64, 64)).save(good, format="JPEG")
    truncated = tmp_path / "truncated.jpg"
    truncated.write_bytes(good.getvalue()[: len(good.getvalue()) // 2])
    folder = tmp_path / "folder.jpg"
    folder.mkdir()
    cases = {
        big: f"{big}: 400x300 pixels (0.1 megapixels) is more than dataset.max_image_pixels (100000); raise that "
             "param to read this image",
        text: f"{text}: unreadable image (not a JPEG, PNG, WebP or GIF file)",
        empty: f"{empty}: empty file",
        folder: f"{folder}: not a regular file (a folder)",
        tmp_path / "missing.png": f"{tmp_path / 'missing.png'}: image file not found",
    }
    for path, message in cases.items():
        with pytest.raises(ImageError) as caught:
            preprocess.decode(path, max_pixels=100_000)
        assert str(caught.value) == message
    with pytest.raises(ImageError, match=r"^<bytes>: 400x300 pixels"):
        preprocess.decode(big.read_bytes(), max_pixels=100_000)
    with pytest.raises(ImageError) as caught:
        preprocess.decode(truncated, max_pixels=100_000)
    assert str(caught.value).startswith(f"{truncated}: unreadable image (") and "\n" not in str(caught.value)
