"""TFRecord framing, byte for byte as TensorFlow writes it: no TensorFlow needed.

Why: a packed file of many records is read with one ``pread`` per sample instead of an open,
a read and a close of a small file; the TFRecord framing is the one every tool around
TensorFlow, the ``tfrecord`` package and fleetlike's `IndexTFRDataset` read, so files move
between them. A record on disk is::

    uint64 length (little-endian) | uint32 masked_crc32c(length bytes) | data | uint32 masked_crc32c(data)

``masked_crc32c(x) = ((crc >> 15) | (crc << 17)) + 0xa282ead8`` (mod 2**32), crc being CRC-32C
(Castagnoli). The checksums use the ``crc32c`` package (hardware CRC) where it is installed,
else a table in Python (same values, about 100x slower: ``pip install crc32c``).

A bad record raises `RecordError` naming the file and the record's offset.

Example:
    >>> with RecordWriter("part-0.tfrecord") as w:
    ...     offset, length = w.write(b"payload")
    >>> read_record("part-0.tfrecord", offset, length)
    b'payload'
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Iterator
from types import TracebackType

__all__ = ["HEADER", "RecordError", "RecordWriter", "crc32c", "frame", "iter_records", "masked_crc",
           "parse_record", "read_record"]

#: bytes before a record's data (length and its checksum); the data's checksum follows the data
HEADER = 12
_FOOTER = 4
_LENGTH = struct.Struct("<Q")
_CRC = struct.Struct("<I")
_MASK = 0xA282EAD8


class RecordError(ValueError):
    """A record that is truncated, whose checksum fails, or that is not where the index says."""


def _table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
        table.append(crc)
    return table


_TABLE = _table()


def _crc32c_python(data: bytes | bytearray | memoryview) -> int:
    crc = 0xFFFFFFFF
    table = _TABLE
    for byte in bytes(data):
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _fast() -> Callable[[bytes], int] | None:
    try:
        from crc32c import crc32c as fast
    except ImportError:
        return None
    return fast  # type: ignore[no-any-return]


_FAST = _fast()


def crc32c(data: bytes | bytearray | memoryview) -> int:
    """CRC-32C (Castagnoli) of ``data``: the ``crc32c`` package's when installed, else Python's."""
    if _FAST is not None:
        return _FAST(data)
    return _crc32c_python(data)


def masked_crc(data: bytes | bytearray | memoryview) -> int:
    """TensorFlow's masked CRC-32C (the module docstring)."""
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + _MASK) & 0xFFFFFFFF


def frame(data: bytes) -> bytes:
    """``data`` as one framed record (header, data, checksum)."""
    length = _LENGTH.pack(len(data))
    return length + _CRC.pack(masked_crc(length)) + data + _CRC.pack(masked_crc(data))


def parse_record(raw: bytes | memoryview, path: str | os.PathLike[str], offset: int, verify: bool = True) -> memoryview:
    """The data of the framed record ``raw`` (read from ``path`` at ``offset``), checked."""
    view = memoryview(raw)
    if len(view) < HEADER + _FOOTER:
        raise RecordError(f"{os.fspath(path)}: record at offset {offset} is truncated: {len(view)} bytes, "
                          f"a record has at least {HEADER + _FOOTER}")
    (length,) = _LENGTH.unpack_from(view, 0)
    if verify and _CRC.unpack_from(view, 8)[0] != masked_crc(view[:8]):
        raise RecordError(f"{os.fspath(path)}: record at offset {offset}: the length's checksum fails (not the "
                          "start of a record, or a corrupt file); rebuild the file or its index")
    if length != len(view) - HEADER - _FOOTER:
        raise RecordError(f"{os.fspath(path)}: record at offset {offset} holds {length} bytes of data, the "
                          f"{len(view)} bytes read allow {len(view) - HEADER - _FOOTER}: truncated, or the "
                          "index does not match the file")
    data = view[HEADER : HEADER + length]
    if verify and _CRC.unpack_from(view, HEADER + length)[0] != masked_crc(data):
        raise RecordError(f"{os.fspath(path)}: record at offset {offset}: the data's checksum fails "
                          f"({length} bytes): the file is corrupt; rebuild it")
    return data


def read_record(path: str | os.PathLike[str], offset: int, length: int, verify: bool = True) -> bytes:
    """The data of the ``length``-byte framed record at ``offset`` of ``path`` (one read)."""
    with open(path, "rb") as fh:
        raw = os.pread(fh.fileno(), length, offset)
    return bytes(parse_record(raw, path, offset, verify))


def iter_records(path: str | os.PathLike[str], verify: bool = True) -> Iterator[tuple[int, int, bytes]]:
    """``(offset, framed length, data)`` of every record of ``path``, in order."""
    with open(path, "rb") as fh:
        offset = 0
        while True:
            head = fh.read(HEADER)
            if not head:
                return
            if len(head) < HEADER:
                raise RecordError(f"{os.fspath(path)}: record at offset {offset} is truncated: the file ends "
                                  f"{len(head)} bytes into its {HEADER}-byte header")
            (length,) = _LENGTH.unpack_from(head, 0)
            rest = fh.read(length + _FOOTER) if length < 1 << 40 else b""  # a corrupt length: parse_record names it
            data = parse_record(head + rest, path, offset, verify)
            total = HEADER + length + _FOOTER
            yield offset, total, bytes(data)
            offset += total


class RecordWriter:
    """Append framed records to ``path`` (created or truncated); `write` returns where each went."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._fh = open(self.path, "wb")
        self.offset = 0

    def write(self, data: bytes) -> tuple[int, int]:
        """Append one record; ``(offset, framed length)`` for the index."""
        framed = frame(data)
        self._fh.write(framed)
        at = self.offset
        self.offset += len(framed)
        return at, len(framed)

    def close(self) -> None:
        self._fh.close()

    def __enter__(self) -> RecordWriter:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
