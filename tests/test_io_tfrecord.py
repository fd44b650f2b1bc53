"""The packed image format: TFRecord framing and ``tf.train.Example`` byte-identical to
TensorFlow's (the reference: protobuf's own serializer, the ``tfrecord`` package's writer and
reader, the published CRC-32C check value), TI-ACC's two tools, `IndexTFRDataset` equal to
decoding the original files with Pillow, every bad input named by file and position, and on
real gloo ranks: sharded over 2 and 3 ranks every sample once per epoch, a resume mid-epoch (at
another world size too) exactly the unseen samples.
"""

from __future__ import annotations

import json
import os
import random
import re
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from tfrecord import example_pb2
from tfrecord.reader import tfrecord_loader
from tfrecord.tools.tfrecord2idx import create_index
from tfrecord.writer import TFRecordWriter

from fleetlike.io import IndexTFRDataset, RecordError, build_index, get_data_loader
from fleetlike.io import records
from fleetlike.io.datasets import ImageReadError
from fleetlike.io.decode import Decoder
from fleetlike.io.example import ExampleError, Feature, Kind, decode_example, encode_example
from fleetlike.io.loader import Skipped
from fleetlike.io.tools import image_list, img2tfrecord
from fleetlike.testing import run_ranks

DESC = {"image/encoded": "byte", "image/class/label": "int"}


def make_tree(root: Path, per_class: int = 4, classes=("cat", "dog", "eel"), size=(24, 20)) -> None:
    rng = np.random.default_rng(0)
    for c in classes:
        (root / c).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            pixels = rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / c / f"{i}.jpg", quality=90)


def pack(tmp: Path, workers: int = 2, **tree) -> tuple[Path, Path, Path]:
    """A class tree, its list (image_list) and its records (img2tfrecord): (imgs, list, out)."""
    imgs, listing, out = tmp / "imgs", tmp / "list.txt", tmp / "out"
    make_tree(imgs, **tree)
    assert image_list.main(["--img_dir", str(imgs), "--img_list", str(listing)]) == 0
    assert img2tfrecord.main(["--img_dir", str(imgs), "--img_list", str(listing), "--tfrecords_name", "train",
                              "--dataset_type", "ImageFold", "--workers", str(workers), "--out_dir", str(out)]) == 0
    return imgs, listing, out


def pixels(image: Image.Image) -> torch.Tensor:
    return torch.from_numpy(np.asarray(image).copy())


def listed(listing: Path) -> list[tuple[str, int]]:
    return [(p, int(l)) for p, l in (line.rsplit(None, 1) for line in listing.read_text().splitlines())]


# ----------------------------------------------------------------------------------- format


def test_crc32c_and_framing_are_tensorflows():
    assert records._crc32c_python(b"123456789") == 0xE3069283  # CRC-32C's published check value
    data = bytes(random.Random(0).getrandbits(8) for _ in range(3000))
    assert records._crc32c_python(data) == records.crc32c(data)
    # the tfrecord package's writer frames records as TensorFlow does: the same bytes
    assert records.frame(data) == (len(data).to_bytes(8, "little") + TFRecordWriter.masked_crc(len(data).to_bytes(8, "little"))
                                   + data + TFRecordWriter.masked_crc(data))


def test_example_encoding_is_protobufs():
    features = {"image/encoded": b"\xff\xd8\xff" + bytes(range(256)) * 3, "image/class/label": 7,
                "neg": [-5, 2**40, 0], "f": [1.5, -2.0], "empty": Feature(Kind.INT64, []), "names": [b"a", b""]}
    ours = encode_example(features)
    theirs = example_pb2.Example()
    theirs.ParseFromString(ours)
    assert theirs.SerializeToString(deterministic=True) == ours  # byte for byte
    assert list(theirs.features.feature["neg"].int64_list.value) == [-5, 2**40, 0]
    back = decode_example(theirs.SerializeToString())
    assert back["image/encoded"] == Feature(Kind.BYTES, [features["image/encoded"]])
    assert back["neg"].values == [-5, 2**40, 0] and back["f"].values == [1.5, -2.0]
    assert back["empty"] == Feature(Kind.INT64, []) and back["names"].values == [b"a", b""]
    with pytest.raises(ValueError, match="'e'.*empty list"):
        encode_example({"e": []})


def test_example_decoding_skips_unknown_fields_and_names_malformed_bytes():
    ours = encode_example({"image/encoded": bytes(range(200)), "image/class/label": 300})
    # field 20 (a two-byte key) beside the features, as a newer writer might add: protobuf keeps it,
    # the decoder skips it
    extended = ours + bytes([(20 << 3) | 2, 0x01, 3]) + b"abc"
    theirs = example_pb2.Example()
    theirs.ParseFromString(extended)
    assert theirs.features.feature["image/class/label"].int64_list.value == [300]
    assert decode_example(extended) == decode_example(ours)
    assert decode_example(ours)["image/encoded"].values == [bytes(range(200))]
    with pytest.raises(ExampleError, match="run past the end"):
        decode_example(ours[:-1])
    with pytest.raises(ExampleError, match="varint runs past the end"):
        decode_example(b"\x0a")  # field 1, length-delimited, and no length
    with pytest.raises(ExampleError, match="varint runs past the end"):
        decode_example(b"\x0a\x80")  # a length whose continuation byte is missing
    with pytest.raises(ExampleError, match="wire type 3"):
        decode_example(b"\x0b")


def _random_example(rng: random.Random) -> example_pb2.Example:
    """An Example of random features, serialized by protobuf (the reference) in the tests below."""
    ex = example_pb2.Example()
    for k in range(rng.randrange(0, 5)):
        feature = ex.features.feature[f"f{k}/" + "x" * rng.choice([0, 3, 130])]
        kind = rng.choice(["bytes", "int", "float", "none"])
        n = rng.choice([0, 1, 3])
        if kind == "bytes":
            feature.bytes_list.value.extend(rng.randbytes(rng.choice([0, 5, 127, 128, 300, 20000])) for _ in range(n))
        elif kind == "int":
            feature.int64_list.value.extend(rng.choice([0, 1, 127, 128, -1, 2**40, -(2**63)]) for _ in range(n))
        elif kind == "float":
            feature.float_list.value.extend(rng.choice([0.0, 1.5, -2.25]) for _ in range(n))
    return ex


def _theirs(ex: example_pb2.Example) -> dict[str, list]:
    out = {}
    for name, feature in ex.features.feature.items():
        kind = feature.WhichOneof("kind")
        out[name] = list(getattr(feature, kind).value) if kind else []
    return out


def test_example_decoding_equals_protobufs_on_random_and_reordered_messages():
    from fleetlike.io.example import _decode_canonical, _decode_general, _Irregular

    rng = random.Random(7)
    for _ in range(300):
        ex = _random_example(rng)
        data = ex.SerializeToString(deterministic=rng.random() < 0.5)
        ours = decode_example(data)
        assert {name: f.values for name, f in ours.items()} == _theirs(ex)
        assert ours == _decode_general(memoryview(data))
        # a damaged copy: the fast parser gives up or returns exactly what the general one does
        # (never features from bytes the general parser refuses), and decode_example's result or
        # error is the general parser's
        cut = bytearray(data[: rng.randrange(0, len(data) + 1)])
        if cut:
            cut[rng.randrange(len(cut))] ^= 1 << rng.randrange(8)
        try:
            canonical = _decode_canonical(memoryview(bytes(cut)))
        except (_Irregular, ExampleError, ValueError, IndexError, struct.error):
            pass
        else:
            assert canonical == _decode_general(memoryview(bytes(cut)))
        try:
            fast = decode_example(bytes(cut))
        except ExampleError as error:
            with pytest.raises(ExampleError, match=re.escape(str(error))):
                _decode_general(memoryview(bytes(cut)))
        else:
            assert fast == _decode_general(memoryview(bytes(cut)))
    # valid wire format other than protobuf's layout: the value before the key, an unpacked int64
    # list, an unknown field in a Feature; protobuf parses each, and so does the decoder
    value = bytes([0x1A, 4, 0x08, 5, 0x08, 7])  # Int64List, two unpacked values
    entry = bytes([0x12, len(value)]) + value + bytes([0x0A, 1]) + b"n"
    feature_with_extra = bytes([0x0A, 3, 0x0A, 1, 0x41, 0x78, 1])  # BytesList [b"A"], then field 15 (varint 1)
    entry2 = bytes([0x0A, 1]) + b"m" + bytes([0x12, len(feature_with_extra)]) + feature_with_extra
    features = bytes([0x0A, len(entry)]) + entry + bytes([0x0A, len(entry2)]) + entry2
    data = bytes([0x0A, len(features)]) + features
    ex = example_pb2.Example()
    ex.ParseFromString(data)
    assert {name: f.values for name, f in decode_example(data).items()} == _theirs(ex) == {"n": [5, 7], "m": [b"A"]}


# ----------------------------------------------------------------------------------- tools + dataset


def test_tools_and_dataset_equal_the_folder(tmp_path):
    imgs, listing, out = pack(tmp_path)
    entries = listed(listing)
    assert [p for p, _ in entries] == sorted(p for p, _ in entries) and {l for _, l in entries} == {0, 1, 2}
    assert sorted(os.listdir(out)) == ["train-00000-of-00002.tfrecord", "train-00001-of-00002.tfrecord", "train.index"]
    for decoder in ("pillow", "auto"):
        ds = IndexTFRDataset(out, out / "train.index", decoder=decoder)
        assert len(ds) == 12 and ds.targets == [l for _, l in entries]
        for i, (path, label) in enumerate(entries):
            image, got = ds[i]
            reference = np.asarray(Image.open(imgs / path).convert("RGB"))
            assert got == label and np.array_equal(np.asarray(image), reference), (decoder, i)
    # TI-ACC's call: (dir, index name inside it, transform); through the loader with 2 workers
    ds = IndexTFRDataset(str(out), "train.index", pixels)
    batches = list(get_data_loader(ds, 4, 1, 0, shuffle=False, num_workers=2, prefetch=1))
    assert torch.cat([y for _, y in batches]).tolist() == [l for _, l in entries]


def test_the_tools_run_as_modules_and_a_given_label_map(tmp_path):
    imgs = tmp_path / "imgs"
    make_tree(imgs, per_class=2, classes=("a", "b"))
    mapping = tmp_path / "labels.json"
    mapping.write_text(json.dumps({"a": 5, "b": 2}))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    assert image_list.main(["--img_dir", str(imgs), "--img_list", str(tmp_path / "val_list"),
                            "--label_str2int", str(mapping)]) == 0
    assert listed(tmp_path / "val_list") == [("a/0.jpg", 5), ("a/1.jpg", 5), ("b/0.jpg", 2), ("b/1.jpg", 2)]
    subprocess.run([sys.executable, "-m", "fleetlike.io.tools.img2tfrecord", "--img_dir", "imgs", "--img_list",
                    "val_list", "--tfrecords_name", "val_demo", "--dataset_type", "ImageFold"],
                   cwd=tmp_path, env=env, check=True, timeout=60)
    # the current folder by default; one file without --workers
    assert (tmp_path / "val_demo.index").is_file() and (tmp_path / "val_demo-00000-of-00001.tfrecord").is_file()
    assert IndexTFRDataset(tmp_path, tmp_path / "val_demo.index").targets == [5, 5, 2, 2]


def test_coco_records_carry_boxes(tmp_path):
    imgs = tmp_path / "coco"
    make_tree(imgs, per_class=2, classes=("val2017",))
    ann = {"images": [{"id": 42, "file_name": "val2017/0.jpg"}, {"id": 7, "file_name": "val2017/1.jpg"}],
           "annotations": [{"image_id": 42, "bbox": [1, 2, 3, 4], "category_id": 18},
                           {"image_id": 42, "bbox": [0.5, 0, 10, 9.25], "category_id": 1}]}
    (tmp_path / "instances.json").write_text(json.dumps(ann))
    img2tfrecord.img2tfrecord(imgs, tmp_path / "instances.json", "coco", "coco", out_dir=tmp_path / "out")
    ds = IndexTFRDataset(tmp_path / "out", "coco.index")
    image, target = ds[0]
    assert np.array_equal(np.asarray(image), np.asarray(Image.open(imgs / "val2017/0.jpg").convert("RGB")))
    assert target["image_id"] == 42 and target["labels"].tolist() == [18, 1]
    assert target["boxes"].tolist() == [[1, 2, 3, 4], [0.5, 0, 10, 9.25]]
    assert ds[1][1]["image_id"] == 7 and ds[1][1]["boxes"].shape == (0, 4)


# ----------------------------------------------------------------------------------- interoperability


def test_the_tfrecord_package_reads_ours_record_for_record(tmp_path):
    imgs, listing, out = pack(tmp_path, workers=3)
    entries = listed(listing)
    index = [line.split() for line in (out / "train.index").read_text().splitlines()[1:]]
    read = []
    for name in sorted({f for f, *_ in index}):
        # its own index of the file (offset, length) equals ours
        create_index(str(out / name), str(tmp_path / "i"))
        theirs = [line.split() for line in (tmp_path / "i").read_text().splitlines()]
        assert theirs == [[o, n] for f, o, n, _ in index if f == name]
        read += list(tfrecord_loader(str(out / name), None, DESC))
    assert len(read) == len(entries)
    for record, (path, label) in zip(read, entries):
        assert bytes(record["image/encoded"]) == (imgs / path).read_bytes()
        assert int(record["image/class/label"][0]) == label


def test_we_read_the_tfrecord_packages_files(tmp_path):
    make_tree(tmp_path / "imgs", per_class=3)
    files = sorted((tmp_path / "imgs").rglob("*.jpg"))
    (tmp_path / "rec").mkdir()
    writer = TFRecordWriter(str(tmp_path / "rec" / "theirs.tfrecord"))
    for k, f in enumerate(files):
        writer.write({"image/encoded": (f.read_bytes(), "byte"), "image/class/label": (k * 3 - 4, "int")})
    writer.close()
    assert build_index(tmp_path / "rec", ["theirs.tfrecord"], tmp_path / "rec" / "theirs.index") == len(files)
    ds = IndexTFRDataset(tmp_path / "rec", "theirs.index", decoder="pillow")
    for k, f in enumerate(files):
        assert ds.record(k)["image/encoded"].values == [f.read_bytes()]
        image, label = ds[k]
        assert label == k * 3 - 4 and np.array_equal(np.asarray(image), np.asarray(Image.open(f).convert("RGB")))


# ----------------------------------------------------------------------------------- bad input


def test_bad_records_and_indexes_are_named(tmp_path):
    _, _, out = pack(tmp_path, workers=0)
    record = out / "train-00000-of-00001.tfrecord"
    index = out / "train.index"
    lines = index.read_text().splitlines()
    _, off3, len3, _ = lines[4].split()  # sample 3
    raw = bytearray(record.read_bytes())
    raw[int(off3) + int(len3) - 10] ^= 0xFF  # a flipped bit inside sample 3's image
    record.write_bytes(bytes(raw))
    ds = IndexTFRDataset(out, index)
    ds[2]
    with pytest.raises(RecordError, match=rf"{record}: record at offset {off3}: the data's checksum fails"):
        ds[3]
    skipping = IndexTFRDataset(out, index, on_error="skip")
    assert isinstance(skipping[3], Skipped) and str(record) in skipping[3].path
    # an offset that is not a record's start
    shifted = out / "shifted.index"
    shifted.write_text(lines[0] + "\n" + lines[2].replace(f" {lines[2].split()[1]} ", " 5 ") + "\n")
    with pytest.raises(RecordError, match=rf"{record}: record at offset 5: the length's checksum fails"):
        IndexTFRDataset(out, shifted)[0]
    # truncated file: the index points past it (found when the dataset is built)
    record.write_bytes(bytes(raw[: int(off3) + 20]))
    with pytest.raises(RecordError, match=rf"sample 3 points past the end of {record}: offset {off3}"):
        IndexTFRDataset(out, index)
    # a line that does not parse, with its file and line number
    bad = out / "bad.index"
    bad.write_text("\n".join(lines[:3] + ["train-00000-of-00001.tfrecord 12 x 0"]) + "\n")
    with pytest.raises(ValueError, match=rf"{bad}:4: .*must be integers"):
        IndexTFRDataset(out, bad)
    bad.write_text(lines[0] + "\nmissing.tfrecord 0 20 1\n")
    with pytest.raises(FileNotFoundError, match="missing.tfrecord"):
        IndexTFRDataset(out, bad)


def test_undecodable_image_is_named(tmp_path):
    (tmp_path / "imgs" / "a").mkdir(parents=True)
    (tmp_path / "imgs" / "a" / "x.jpg").write_bytes(b"\xff\xd8\xff not a jpeg")
    (tmp_path / "list").write_text("a/x.jpg 0\n")
    img2tfrecord.img2tfrecord(tmp_path / "imgs", tmp_path / "list", "t", "ImageFold", out_dir=tmp_path)
    with pytest.raises(ImageReadError, match=r"t-00000-of-00001.tfrecord: record at offset 0 \(sample 0\)"):
        IndexTFRDataset(tmp_path, "t.index")[0]


def test_tools_name_bad_lines_missing_images_and_refuse_overwriting_inputs(tmp_path, capsys):
    imgs = tmp_path / "imgs"
    make_tree(imgs, per_class=2, classes=("a",))
    args = ["--img_dir", str(imgs), "--dataset_type", "ImageFold", "--out_dir", str(tmp_path)]
    (tmp_path / "list").write_text("a/0.jpg 0\n\na/1.jpg\n")
    assert img2tfrecord.main(args + ["--img_list", str(tmp_path / "list"), "--tfrecords_name", "t"]) == 2
    assert f"{tmp_path / 'list'}:3: cannot parse 'a/1.jpg'" in capsys.readouterr().err
    (tmp_path / "list").write_text("a/0.jpg 0\n\na/9.jpg 1\n")
    assert img2tfrecord.main(args + ["--img_list", str(tmp_path / "list"), "--tfrecords_name", "t"]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'list'}:3: image '{imgs / 'a/9.jpg'}' cannot be read" in err
    assert not list(tmp_path.glob("t*"))  # nothing half-written
    # the index would replace the list it reads
    (tmp_path / "t.index").write_text("a/0.jpg 0\n")
    assert img2tfrecord.main(args + ["--img_list", str(tmp_path / "t.index"), "--tfrecords_name", "t"]) == 2
    assert "would destroy that input" in capsys.readouterr().err and (tmp_path / "t.index").read_text() == "a/0.jpg 0\n"
    # a record file named as an image it packs
    (tmp_path / "l2").write_text("x-00000-of-00001.tfrecord 0\n")
    (imgs / "x-00000-of-00001.tfrecord").write_bytes((imgs / "a/0.jpg").read_bytes())
    assert img2tfrecord.main(["--img_dir", str(imgs), "--img_list", str(tmp_path / "l2"), "--tfrecords_name", "x",
                              "--dataset_type", "ImageFold", "--out_dir", str(imgs)]) == 2
    assert "would destroy that input" in capsys.readouterr().err
    # image_list: the list cannot be an image, nor the label map it reads
    before = (imgs / "a/0.jpg").read_bytes()
    assert image_list.main(["--img_dir", str(imgs), "--img_list", str(imgs / "a/0.jpg")]) == 2
    assert "would destroy that input" in capsys.readouterr().err and (imgs / "a/0.jpg").read_bytes() == before
    (tmp_path / "m.json").write_text('{"a": 0}')
    assert image_list.main(["--img_dir", str(imgs), "--img_list", str(tmp_path / "m.json"),
                            "--label_str2int", str(tmp_path / "m.json")]) == 2
    assert "would destroy that input" in capsys.readouterr().err
    assert image_list.main(["--img_dir", str(imgs), "--img_list", str(tmp_path / "o"),
                            "--label_str2int", str(tmp_path / "none.json")]) == 2
    (tmp_path / "m.json").write_text('{"b": 0}')
    assert image_list.main(["--img_dir", str(imgs), "--img_list", str(tmp_path / "o"),
                            "--label_str2int", str(tmp_path / "m.json")]) == 2
    assert "['a']" in capsys.readouterr().err


def test_decoder_choice_and_fallback():
    import io as _io

    pixels = np.random.default_rng(1).integers(0, 255, (9, 11, 3), dtype=np.uint8)
    png, jpeg = _io.BytesIO(), _io.BytesIO()
    Image.fromarray(pixels).save(png, "PNG")
    Image.fromarray(pixels).save(jpeg, "JPEG")
    auto = Decoder("auto")
    assert auto.name == "simplejpeg"  # installed with the test extra: the faster one is chosen
    assert np.array_equal(np.asarray(auto(png.getvalue())), pixels)  # not a JPEG: Pillow
    assert np.asarray(auto(jpeg.getvalue())).shape == (9, 11, 3)
    assert Decoder("pillow").name == "pillow" and Decoder("auto", mode="RGBA").name == "pillow"
    gray = Decoder("auto", mode="L")(jpeg.getvalue())
    assert gray.mode == "L" and gray.size == (11, 9)
    with pytest.raises(ValueError, match="decoder='turbo' is not a decoder"):
        Decoder("turbo")


def test_packed_records_decode_to_the_array_when_the_transform_takes_it(tmp_path, monkeypatch):
    from fleetlike.io import Compose, PILToTensor

    _, _, out = pack(tmp_path, per_class=3)
    through_image = IndexTFRDataset(out, "train.index", Compose([lambda image: image, PILToTensor()]))
    reference = [through_image[i] for i in range(len(through_image))]
    monkeypatch.setattr(Decoder, "__call__", lambda self, data: pytest.fail("the PIL image was made"))
    direct = IndexTFRDataset(out, "train.index", PILToTensor())
    for i, (x, y) in enumerate(reference):
        got = direct[i]
        assert got[1] == y and torch.equal(got[0], x)


# ----------------------------------------------------------------------------------- ranks

N_SAMPLES = 19  # batch 4, tail even: 10/9 and 7/6/6 samples, the same batch count per rank


def _epoch_and_resume(role, out, stop):
    """One full epoch over this rank's share; then the same epoch stopped after ``stop``
    batches: (all labels of the epoch, those before the stop, the loader state there)."""
    ds = IndexTFRDataset(out, "train.index", pixels)
    loader = get_data_loader(ds, 4, role.world_size, role.rank, seed=5, tail="even", prefetch=1)
    loader.set_epoch(3)
    full = [int(i) for _, y in loader for i in y]
    loader.set_epoch(3)
    first = []
    for step, (_, y) in enumerate(loader):
        first += [int(i) for i in y]
        if step + 1 == stop:
            break
    return full, first, loader.state_dict()


def _rest(role, out, state):
    ds = IndexTFRDataset(out, "train.index", pixels)
    loader = get_data_loader(ds, 4, role.world_size, role.rank, seed=5, tail="even", prefetch=1)
    loader.load_state_dict(state)
    loader.set_epoch(3)
    return [int(i) for _, y in loader for i in y]


def _ids(tmp: Path) -> Path:
    """Records whose labels are their sample numbers, so a label names the sample."""
    imgs = tmp / "imgs"
    make_tree(imgs, per_class=N_SAMPLES, classes=("a",), size=(8, 8))
    (tmp / "list").write_text("".join(f"a/{i}.jpg {i}\n" for i in range(N_SAMPLES)))
    img2tfrecord.img2tfrecord(imgs, tmp / "list", "train", "ImageFold", workers=2, out_dir=tmp / "out")
    return tmp / "out"


@pytest.mark.timeout(180)
def test_sharded_ranks_read_every_sample_once_and_resume_with_the_unseen(tmp_path):
    out = _ids(tmp_path)
    for world in (2, 3):
        results = run_ranks(_epoch_and_resume, world, out, 1, timeout=90)
        fulls = [r[0] for r in results]
        assert sorted(i for f in fulls for i in f) == list(range(N_SAMPLES)), world  # each once
        seen = [i for r in results for i in r[1]]
        assert len(seen) == 4 * world and all(r[1] == r[0][:4] for r in results)
        # the state is the job's position: resume at the same and at the other world size
        for resume_world in (world, 5 - world):
            rest = run_ranks(_rest, resume_world, out, results[0][2], timeout=90)
            after = [i for r in rest for i in r]
            assert sorted(seen + after) == list(range(N_SAMPLES)), (world, resume_world)
            if resume_world == world:
                assert [r[0][4:] for r in results] == rest  # exactly the uninterrupted order
