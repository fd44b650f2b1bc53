"""ImageListDataset / ImageFolder decode with Pillow as Pillow does; bad lists, labels and images
are named (file, line, index, path); ``on_error="skip"`` counts and reports at the pass's end;
the transforms match numpy / Pillow references.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from fleetlike.io import (
    CenterCrop,
    Compose,
    ConvertImageDtype,
    ImageFolder,
    ImageListDataset,
    ImageReadError,
    Normalize,
    PILToTensor,
    RandomHorizontalFlip,
    RandomResizedCrop,
    Resize,
    ToTensor,
    get_data_loader,
)


def make_images(root: Path, n: int = 8, classes: int = 3, size=(20, 14)) -> list[tuple[str, int]]:
    """``n`` random RGB JPEGs under root/class_k/; returns the (relative path, label) list."""
    rng = np.random.default_rng(0)
    entries = []
    for i in range(n):
        label = i % classes
        rel = f"class_{label}/img {i:03d}.jpg"  # a space in the name: the label is the last field
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(root / rel, quality=90)
        entries.append((rel, label))
    return entries


def write_list(path: Path, entries) -> Path:
    path.write_text("".join(f"{p} {label}\n" for p, label in entries) + "\n")
    return path


def test_image_list_decodes_as_pillow(tmp_path):
    entries = make_images(tmp_path)
    ds = ImageListDataset(tmp_path, write_list(tmp_path / "train.txt", entries), transform=ToTensor(), num_classes=3)
    assert len(ds) == 8 and ds.targets == [label for _, label in entries]
    for i, (rel, label) in enumerate(entries):
        x, y = ds[i]
        reference = np.asarray(Image.open(tmp_path / rel).convert("RGB"), dtype=np.float32) / 255
        assert y == label and x.shape == (3, 14, 20)
        np.testing.assert_allclose(x.permute(1, 2, 0).numpy(), reference, rtol=0, atol=1e-6)
    folder = ImageFolder(tmp_path, transform=ToTensor())
    assert folder.classes == ["class_0", "class_1", "class_2"]
    assert sorted((Path(p).as_posix(), y) for p, y in folder.samples) == sorted(entries)
    batch = next(iter(get_data_loader(folder, 4, 1, 0, shuffle=False, prefetch=1)))
    assert batch[0].shape == (4, 3, 14, 20)


@pytest.mark.parametrize("line, message", [
    ("justapath\n", r"train.txt:2: cannot parse 'justapath'"),
    ("a.jpg one\n", r"train.txt:2: label 'one' in 'a.jpg one' is not an int"),
    ("a.jpg 3\n", r"train.txt:2: label 3 in 'a.jpg 3' is outside \[0, 3\)"),
    ("a.jpg -1\n", r"train.txt:2: label -1 .* is outside"),
    ("../../etc/passwd 0\n", r"train.txt:2: path '../../etc/passwd' leaves the data root"),
    ("/etc/passwd 0\n", r"train.txt:2: path '/etc/passwd' leaves the data root"),
    ("a/../../b.jpg 0\n", r"train.txt:2: path 'a/../../b.jpg' leaves the data root"),
    (b"caf\xe9.jpg 0\n", r"train.txt:2: byte 0xe9 at column 4 is not UTF-8"),
])
def test_bad_list_lines_are_named(tmp_path, line, message):
    path = tmp_path / "train.txt"
    path.write_bytes(b"ok.jpg 0\n" + (line if isinstance(line, bytes) else line.encode()))
    with pytest.raises(ValueError, match=message):
        ImageListDataset(tmp_path, path, num_classes=3)


def test_bad_images_raise_or_are_skipped_and_reported(tmp_path, caplog):
    entries = make_images(tmp_path, n=6)
    (tmp_path / "broken.jpg").write_bytes(b"not a jpeg at all")
    entries[2] = ("broken.jpg", 1)
    entries[4] = ("missing.jpg", 0)
    lst = write_list(tmp_path / "l.txt", entries)
    ds = ImageListDataset(tmp_path, lst, transform=ToTensor())
    with pytest.raises(ImageReadError, match=r"sample 2: cannot read image .*broken.jpg"):
        ds[2]
    with pytest.raises(ImageReadError, match=r"sample 4: cannot read image .*missing.jpg"):
        ds[4]
    skipping = ImageListDataset(tmp_path, lst, transform=ToTensor(), on_error="skip")
    loader = get_data_loader(skipping, 3, 1, 0, shuffle=False, prefetch=2)
    with caplog.at_level(logging.WARNING, logger="fleetlike"):
        sizes = [len(y) for _, y in loader]
    assert sizes == [2, 2]  # one bad sample in each batch of 3
    assert [(s.index, Path(s.path).name) for s in loader.skipped] == [(2, "broken.jpg"), (4, "missing.jpg")]
    assert "2 sample(s) could not be read and were skipped" in caplog.text
    with pytest.raises(ValueError, match="'raise', 'skip'"):
        ImageListDataset(tmp_path, lst, on_error="ignore")


def test_transforms_match_references():
    rng = np.random.default_rng(1)
    array = rng.integers(0, 256, (30, 40, 3), dtype=np.uint8)
    image = Image.fromarray(array)
    t = ToTensor()(image)
    np.testing.assert_allclose(t.numpy(), array.transpose(2, 0, 1) / 255.0, atol=1e-6)
    n = Normalize([0.5, 0.4, 0.3], [0.2, 0.25, 0.5])(t)
    ref = (array.transpose(2, 0, 1) / 255.0 - np.array([0.5, 0.4, 0.3])[:, None, None]) / np.array([0.2, 0.25, 0.5])[:, None, None]
    np.testing.assert_allclose(n.numpy(), ref, atol=1e-5)
    assert Resize(15)(image).size == (20, 15)  # shorter side (height 30) -> 15, aspect kept
    assert Resize((10, 12))(image).size == (12, 10)
    np.testing.assert_array_equal(np.asarray(CenterCrop(10)(image)), array[10:20, 15:25])
    np.testing.assert_array_equal(np.asarray(RandomHorizontalFlip(1.0)(image)), array[:, ::-1])
    torch.manual_seed(0)
    a = RandomResizedCrop(16)(image)
    torch.manual_seed(0)
    left, top, w, h = RandomResizedCrop(16).box(40, 30)
    ref_crop = image.crop((left, top, left + w, top + h)).resize((16, 16), Image.BILINEAR)
    assert a.size == (16, 16) and np.array_equal(np.asarray(a), np.asarray(ref_crop))
    assert 0 <= left and left + w <= 40 and 0 <= top and top + h <= 30
    u8 = PILToTensor()(image)
    assert u8.dtype == torch.uint8 and torch.equal(u8, torch.from_numpy(array).permute(2, 0, 1))
    assert torch.equal(ConvertImageDtype()(u8), t) and torch.equal(ToTensor()(u8), t)
    assert torch.equal(RandomHorizontalFlip(1.0)(u8), u8.flip(-1))
    pipeline = Compose([Resize(20), CenterCrop(16), ToTensor()])
    assert pipeline(image).shape == (3, 16, 16)
    with pytest.raises(ValueError, match="size=0"):
        CenterCrop(0)
    assert isinstance(pipeline(image), torch.Tensor)


def test_transforms_give_the_same_from_the_decoded_array_as_from_its_image():
    from fleetlike.io import Decoder
    from fleetlike.io.transforms import takes_arrays
    import io as _io

    rng = np.random.default_rng(2)
    buf = _io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (30, 40, 3), dtype=np.uint8)).save(buf, "JPEG", quality=90)
    png = _io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (30, 40), dtype=np.uint8)).save(png, "PNG")
    for data, mode in ((buf.getvalue(), "RGB"), (buf.getvalue(), "L"), (png.getvalue(), "RGB"), (png.getvalue(), "L")):
        for name in ("auto", "pillow"):
            decoder = Decoder(name, mode)
            array, image = decoder.array(data), decoder(data)
            assert array.dtype == np.uint8 and array.shape == (30, 40, 3 if mode == "RGB" else 1)
            assert np.array_equal(array.reshape(np.asarray(image).shape), np.asarray(image))
    decoder = Decoder("auto")
    pipelines = [PILToTensor(), ToTensor(), Compose([CenterCrop(20), ToTensor()]),
                 Compose([CenterCrop((50, 44)), PILToTensor()]),  # larger than the image: zero padding
                 Compose([RandomResizedCrop(16), RandomHorizontalFlip(), ToTensor(), Normalize([0.5] * 3, [0.2] * 3)]),
                 Compose([RandomResizedCrop((30, 40), scale=(1, 1), ratio=(4 / 3, 4 / 3)), RandomHorizontalFlip(1.0),
                          PILToTensor()]),
                 Compose([Resize(20), CenterCrop(16), RandomHorizontalFlip(), PILToTensor()])]
    for pipeline in pipelines:
        assert takes_arrays(pipeline)
        for seed in range(12):
            torch.manual_seed(seed)
            x = pipeline(decoder.array(buf.getvalue()))
            torch.manual_seed(seed)
            y = pipeline(decoder(buf.getvalue()))
            assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), (pipeline, seed)
    # a pipeline that ends on an image, or passes it to another library's transform, gets the image
    assert not takes_arrays(CenterCrop(3)) and not takes_arrays(Compose([CenterCrop(3)]))
    assert not takes_arrays(Compose([lambda x: x, ToTensor()])) and not takes_arrays(None)
    with pytest.raises(ValueError, match="not mode='RGBA'"):
        Decoder("auto", "RGBA").array(buf.getvalue())


def test_datasets_decode_to_the_array_when_the_transform_takes_it(tmp_path, monkeypatch):
    from fleetlike.io import Decoder

    entries = make_images(tmp_path)
    lst = write_list(tmp_path / "train.txt", entries)
    through_image = Compose([lambda image: image, PILToTensor()])  # not array-taking: the PIL image
    reference = [ImageListDataset(tmp_path, lst, transform=through_image)[i] for i in range(len(entries))]
    monkeypatch.setattr(Decoder, "__call__", lambda self, data: pytest.fail("the PIL image was made"))
    direct = ImageListDataset(tmp_path, lst, transform=PILToTensor())
    for i, (x, y) in enumerate(reference):
        got = direct[i]
        assert got[1] == y and torch.equal(got[0], x)


def test_io_imports_without_pillow_and_says_how_to_install_it(tmp_path):
    """Pillow is an optional extra: the sampler and loader work without it; decoding names the extra."""
    write_list(tmp_path / "l.txt", [("a.jpg", 0)])
    code = (
        "import sys; sys.modules['PIL'] = None\n"
        "import torch\n"
        "from fleetlike.io import get_data_loader, ImageListDataset\n"
        "ds = torch.utils.data.TensorDataset(torch.arange(6))\n"
        "assert [b[0].tolist() for b in get_data_loader(ds, 3, 1, 0, shuffle=False)] == [[0, 1, 2], [3, 4, 5]]\n"
        f"images = ImageListDataset({str(tmp_path)!r}, {str(tmp_path / 'l.txt')!r})\n"
        "try:\n    images[0]\nexcept ImportError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert out.returncode == 0, out.stderr
    assert "pip install 'fleetlike[vision]'" in out.stdout
