"""``tf.train.Example`` in protobuf's wire format, encoded and decoded here (no protobuf needed).

Why: the records of a TFRecord file are serialized ``tf.train.Example`` messages; writing the
few lines of wire format by hand keeps fleetlike free of TensorFlow and protobuf while its
files stay readable by both (and theirs by fleetlike). The messages::

    Example   { Features features = 1; }
    Features  { map<string, Feature> feature = 1; }          // entries: key = 1, value = 2
    Feature   { oneof kind { BytesList bytes_list = 1; FloatList float_list = 2; Int64List int64_list = 3; } }
    BytesList { repeated bytes value = 1; }
    FloatList { repeated float value = 1 [packed = true]; }
    Int64List { repeated int64 value = 1 [packed = true]; }

A feature is a `Feature` (its `Kind` and values) or, inferred, ``bytes`` / ``int`` / ``float`` or
a non-empty list of one of them. Decoding accepts packed and unpacked numbers (both are valid
wire format) and raises `ExampleError` naming what is malformed.

Example:
    >>> data = encode_example({"image/encoded": b"...jpeg...", "image/class/label": 3})
    >>> decode_example(data)["image/class/label"].values
    [3]
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Mapping
from typing import Any, NamedTuple

__all__ = ["ExampleError", "Feature", "Kind", "decode_example", "encode_example"]


class ExampleError(ValueError):
    """Bytes that are not a well-formed ``tf.train.Example``."""


class Kind(str, enum.Enum):
    """The three value lists a ``tf.train.Feature`` holds (its field number is the value's index)."""

    BYTES = "bytes"
    FLOAT = "float"
    INT64 = "int64"


_FIELD = {Kind.BYTES: 1, Kind.FLOAT: 2, Kind.INT64: 3}
_KIND = {v: k for k, v in _FIELD.items()}


class Feature(NamedTuple):
    """One feature: its kind and its values (a list of bytes, floats or ints)."""

    kind: Kind
    values: list[Any]


# ---------------------------------------------------------------------------------- encoding


def _varint(value: int) -> bytes:
    value &= 0xFFFFFFFFFFFFFFFF  # negative int64 as ten bytes, as protobuf writes it
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (wire type 2)."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _as_feature(name: str, value: Any) -> Feature:
    if isinstance(value, Feature):
        return Feature(Kind(value.kind), list(value.values))
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    if not values:
        raise ValueError(f"encode_example: feature {name!r} is an empty list, whose kind cannot be told; "
                         "give Feature(Kind.BYTES | Kind.FLOAT | Kind.INT64, [])")
    for kind, types in ((Kind.BYTES, (bytes, bytearray, memoryview)), (Kind.INT64, (int,)), (Kind.FLOAT, (float,))):
        if all(isinstance(v, types) and not isinstance(v, bool) for v in values):
            return Feature(kind, values)
    names = sorted({type(v).__name__ for v in values})
    raise TypeError(f"encode_example: feature {name!r} holds {names}; a feature is bytes, int or float values "
                    "of one kind (or a Feature)")


def _encode_feature(feature: Feature) -> bytes:
    if feature.kind is Kind.BYTES:
        body = b"".join(_field(1, bytes(v)) for v in feature.values)
    elif feature.kind is Kind.FLOAT:
        body = _field(1, struct.pack(f"<{len(feature.values)}f", *feature.values)) if feature.values else b""
    else:
        body = _field(1, b"".join(_varint(int(v)) for v in feature.values)) if feature.values else b""
    return _field(_FIELD[feature.kind], body)


def encode_example(features: Mapping[str, Any]) -> bytes:
    """The serialized ``tf.train.Example`` of ``features`` (name -> value; module docstring)."""
    entries = b""
    for name in sorted(features):  # a fixed order: the same features give the same bytes
        if not isinstance(name, str):
            raise TypeError(f"encode_example: feature names are str, got {name!r}")
        entry = _field(1, name.encode("utf-8")) + _field(2, _encode_feature(_as_feature(name, features[name])))
        entries += _field(1, entry)
    return _field(1, entries)


# ---------------------------------------------------------------------------------- decoding


def _read_varint(data: memoryview, pos: int, end: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= end:
            raise ExampleError("a varint runs past the end of its message")
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
        if shift >= 70:
            raise ExampleError("a varint longer than 10 bytes")


def _fields(data: memoryview, start: int, end: int) -> list[tuple[int, int, Any]]:
    """``(field number, wire type, value)``: value an int (varint, fixed) or ``(start, end)``."""
    out = []
    pos = start
    while pos < end:
        key = data[pos]
        if key < 0x80:  # one-byte key (field numbers below 16): no call, once per field of every record
            pos += 1
        else:
            key, pos = _read_varint(data, pos, end)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _read_varint(data, pos, end)
        elif wire == 1:
            if pos + 8 > end:
                raise ExampleError("a 64-bit field runs past the end of its message")
            value, pos = struct.unpack_from("<Q", data, pos)[0], pos + 8
        elif wire == 2:
            if pos < end and data[pos] < 0x80:  # a length below 128 (names, labels, small lists)
                length, pos = data[pos], pos + 1
            else:
                length, pos = _read_varint(data, pos, end)
            if pos + length > end:
                raise ExampleError(f"field {number}: {length} bytes run past the end of its message")
            value, pos = (pos, pos + length), pos + length
        elif wire == 5:
            if pos + 4 > end:
                raise ExampleError("a 32-bit field runs past the end of its message")
            value, pos = struct.unpack_from("<I", data, pos)[0], pos + 4
        else:
            raise ExampleError(f"field {number} has wire type {wire}, which an Example does not use")
        out.append((number, wire, value))
    return out


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _decode_feature(data: memoryview, start: int, end: int) -> Feature:
    feature: Feature | None = None
    for number, wire, span in _fields(data, start, end):
        if number not in _KIND or wire != 2:
            continue  # an unknown field is skipped, as protobuf does
        kind = _KIND[number]
        values: list[Any] = []
        for item_number, item_wire, item in _fields(data, *span):
            if item_number != 1:
                continue
            if kind is Kind.BYTES:
                if item_wire != 2:
                    raise ExampleError("a BytesList value is not length-delimited")
                values.append(bytes(data[item[0]:item[1]]))
            elif kind is Kind.FLOAT:
                if item_wire == 2:  # packed
                    a, b = item
                    if (b - a) % 4:
                        raise ExampleError(f"a packed FloatList of {b - a} bytes (not a multiple of 4)")
                    values.extend(struct.unpack_from(f"<{(b - a) // 4}f", data, a))
                elif item_wire == 5:
                    values.append(struct.unpack("<f", struct.pack("<I", item))[0])
                else:
                    raise ExampleError(f"a FloatList value has wire type {item_wire}")
            elif item_wire == 2:  # packed int64
                pos, stop = item
                while pos < stop:
                    value, pos = _read_varint(data, pos, stop)
                    values.append(_signed(value))
            elif item_wire == 0:
                values.append(_signed(item))
            else:
                raise ExampleError(f"an Int64List value has wire type {item_wire}")
        feature = Feature(kind, values)  # the last of a oneof wins
    return feature if feature is not None else Feature(Kind.BYTES, [])


class _Irregular(Exception):
    """Bytes the canonical parser leaves to the general one (valid or not: that one decides)."""


def _length(view: memoryview, pos: int, end: int) -> tuple[int, int]:
    """The length prefix at ``pos`` and where its payload starts; the payload must end by ``end``."""
    length = view[pos]
    if length < 0x80:
        pos += 1
    elif view[pos + 1] < 0x80:  # below 16 KiB: a JPEG's length, and every entry holding one
        length, pos = (length & 0x7F) | view[pos + 1] << 7, pos + 2
    else:
        length, pos = _read_varint(view, pos, end)
    if pos + length > end:
        raise _Irregular
    return length, pos


def _decode_canonical(view: memoryview) -> dict[str, Feature]:
    """`decode_example` for the layout TensorFlow, protobuf and `encode_example` write: every field
    length-delimited where the schema says, an entry's key before its value, one list per feature,
    packed numbers. One flat loop instead of a list of fields per message level: the per-record
    cost of a packed image reader. Anything else raises `_Irregular` (the general parser decides)."""
    out: dict[str, Feature] = {}
    end = len(view)
    pos = 0
    while pos < end:
        if view[pos] != 0x0A:  # Example.features
            raise _Irregular
        length, pos = _length(view, pos + 1, end)
        features_end = pos + length
        while pos < features_end:
            if view[pos] != 0x0A:  # Features.feature: a map entry
                raise _Irregular
            length, pos = _length(view, pos + 1, features_end)
            entry_end = pos + length
            if pos >= entry_end or view[pos] != 0x0A:  # the entry's key
                raise _Irregular
            length, pos = _length(view, pos + 1, entry_end)
            name = str(view[pos:pos + length], "utf-8")
            pos += length
            if pos >= entry_end or view[pos] != 0x12:  # the entry's value, a Feature
                raise _Irregular
            length, pos = _length(view, pos + 1, entry_end)
            if pos + length != entry_end or not length:
                raise _Irregular
            tag = view[pos]
            length, pos = _length(view, pos + 1, entry_end)
            if pos + length != entry_end:
                raise _Irregular
            values: list[Any] = []
            if tag == 0x0A:  # BytesList: repeated value = 1
                kind = Kind.BYTES
                while pos < entry_end:
                    if view[pos] != 0x0A:
                        raise _Irregular
                    length, pos = _length(view, pos + 1, entry_end)
                    values.append(bytes(view[pos:pos + length]))
                    pos += length
            elif tag == 0x1A or tag == 0x12:  # Int64List / FloatList: one packed value = 1, or empty
                kind = Kind.INT64 if tag == 0x1A else Kind.FLOAT
                if pos < entry_end:
                    if view[pos] != 0x0A:
                        raise _Irregular
                    length, pos = _length(view, pos + 1, entry_end)
                    if pos + length != entry_end:
                        raise _Irregular
                    if kind is Kind.FLOAT:
                        if length % 4:
                            raise _Irregular
                        values.extend(struct.unpack_from(f"<{length // 4}f", view, pos))
                    else:
                        while pos < entry_end:
                            value = view[pos]
                            if value < 0x80:
                                pos += 1
                            else:
                                value, pos = _read_varint(view, pos, entry_end)
                            values.append(_signed(value))
            else:
                raise _Irregular
            out[name] = Feature(kind, values)
            pos = entry_end
    return out


def decode_example(data: bytes | memoryview) -> dict[str, Feature]:
    """The features of a serialized ``tf.train.Example`` (name -> `Feature`)."""
    view = memoryview(data)
    try:
        return _decode_canonical(view)
    except (_Irregular, ExampleError, ValueError, IndexError, struct.error):  # not canonical, or malformed
        return _decode_general(view)


def _decode_general(view: memoryview) -> dict[str, Feature]:
    """Any valid wire format (fields in any order, unknown fields, unpacked numbers); malformed
    bytes raise `ExampleError` naming the fault."""
    out: dict[str, Feature] = {}
    for number, wire, span in _fields(view, 0, len(view)):
        if number != 1 or wire != 2:
            continue
        for entry_number, entry_wire, entry in _fields(view, *span):
            if entry_number != 1 or entry_wire != 2:
                continue
            name, feature = None, Feature(Kind.BYTES, [])
            for part_number, part_wire, part in _fields(view, *entry):
                if part_wire != 2:
                    continue
                if part_number == 1:
                    try:
                        name = bytes(view[part[0]:part[1]]).decode("utf-8")
                    except UnicodeDecodeError:
                        raise ExampleError("a feature name is not UTF-8") from None
                elif part_number == 2:
                    feature = _decode_feature(view, *part)
            if name is None:
                raise ExampleError("a feature map entry has no name")
            out[name] = feature
    return out

