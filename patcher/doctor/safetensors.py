"""Read safetensors shard headers, and single 4-byte marker tensors, without loading any payload.

A shard is an 8-byte little-endian u64 ``header_len``, then ``header_len`` bytes
of UTF-8 JSON mapping each tensor name to ``{dtype, shape, data_offsets}`` (plus
an optional ``__metadata__``), then the payload. Offsets count from the end of
the header, so a tensor starts at ``8 + header_len + data_offsets[0]``.

Every way a shard can be damaged is reported as :class:`ShardError`, whose
message names the file and the reason; nothing here raises anything else for
bad input (A.4; L ``tools/mtp_overlay.py`` ``read_header``/``validate_header``).
A shard whose header is sound but whose length disagrees with it (truncated by
an interrupted download) opens anyway, with the error in ``size_error``, so its
tensor names still count.
"""

from __future__ import annotations

import json
import os
import stat
import struct
from math import prod
from pathlib import Path

DTYPE_SIZES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E4M3FN": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
    "U32": 4, "I32": 4, "F32": 4,
    "U64": 8, "I64": 8, "F64": 8,
}
# The limit the safetensors library itself enforces; a larger length is damage, not a header.
MAX_HEADER_LEN = 100_000_000


class ShardError(Exception):
    """A shard that cannot be used; ``str()`` is one line naming the file and why."""

    def __init__(self, path: Path, reason: str, *, expected_size: int | None = None, found_size: int | None = None):
        super().__init__(f"{path.name}: {reason}")
        self.path = path
        self.reason = reason
        self.expected_size = expected_size
        self.found_size = found_size


def _entry_problem(name: str, entry) -> str:
    """Why ``entry`` is not a valid tensor description (called only when the header check found it is not)."""
    if not isinstance(entry, dict):
        return f"tensor {name!r} is described by a JSON {type(entry).__name__}, not an object"
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPE_SIZES:
        return f"tensor {name!r} has an unknown dtype {dtype!r}"
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        return f"tensor {name!r} has an invalid shape {shape!r}"
    if (
        not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)
        or offsets[0] < 0 or offsets[1] < offsets[0]
    ):
        return f"tensor {name!r} has invalid data_offsets {offsets!r}"
    return (
        f"tensor {name!r} spans {offsets[1] - offsets[0]} bytes but {dtype} x {shape} "
        f"needs {DTYPE_SIZES[dtype] * prod(shape)}"
    )


class Shard:
    """One open shard: its validated header, and reads of single small tensors.

    Use as a context manager; the file is opened once, non-blocking (a FIFO
    named ``*.safetensors`` must not hang doctor) and only a regular file is read.
    """

    def __init__(self, path: Path):
        self.path = path
        self.fd = -1
        self.tensors: dict[str, dict] = {}
        self.header_len = 0
        self.file_size = 0
        self.size_error: ShardError | None = None

    def __enter__(self) -> "Shard":
        try:
            self.fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            info = os.fstat(self.fd)
        except OSError as exc:
            self.close()
            raise ShardError(self.path, f"cannot be opened ({exc.strerror or exc})") from None
        if not stat.S_ISREG(info.st_mode):
            self.close()
            raise ShardError(self.path, "is not a regular file")
        self.file_size = info.st_size
        try:
            self._read_header()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        self.tensors = {}  # a full-size header is ~0.3 MB of JSON and several MB as objects: free it now
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def _pread(self, size: int, offset: int) -> bytes:
        try:
            return os.pread(self.fd, size, offset)
        except OSError as exc:
            raise ShardError(self.path, f"cannot be read ({exc.strerror or exc})") from None

    def _fail(self, reason: str, **sizes) -> ShardError:
        return ShardError(self.path, reason, **sizes)

    def _read_header(self) -> None:
        if self.file_size < 8:
            raise self._fail(f"is {self.file_size} bytes, shorter than the 8-byte header length",
                             found_size=self.file_size)
        (header_len,) = struct.unpack("<Q", self._pread(8, 0))
        if header_len > self.file_size - 8:
            raise self._fail(
                f"header length {header_len} runs past the end of the file ({self.file_size} bytes)",
                found_size=self.file_size,
            )
        if header_len > MAX_HEADER_LEN:
            raise self._fail(f"header length {header_len} exceeds the safetensors limit of {MAX_HEADER_LEN} bytes")
        raw = self._pread(header_len, 8)
        if len(raw) != header_len:
            raise self._fail(f"header is cut short ({len(raw)} of {header_len} bytes read)")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise self._fail(f"header is not UTF-8 (bad byte at {exc.start})") from None
        del raw
        try:
            header = json.loads(text)
        except (ValueError, RecursionError) as exc:
            raise self._fail(f"header is not JSON ({exc})") from None
        del text
        if not isinstance(header, dict):
            raise self._fail(f"header is a JSON {type(header).__name__}, not an object")
        if not isinstance(header.pop("__metadata__", {}), dict):
            raise self._fail("header __metadata__ is not an object")
        max_end, sizes = 0, DTYPE_SIZES
        for name, entry in header.items():
            # Inline, not a helper: this runs for every tensor of the pack (138k); the message comes from _entry_problem
            try:
                size = sizes[entry["dtype"]]
                shape = entry["shape"]
                start, end = entry["data_offsets"]
                if type(shape) is not list:
                    raise TypeError
                for dim in shape:
                    if type(dim) is not int or dim < 0:
                        raise TypeError
                    size *= dim
                if type(start) is not int or type(end) is not int or start < 0 or end - start != size:
                    raise TypeError
            except (KeyError, TypeError, ValueError):
                raise self._fail(_entry_problem(name, entry)) from None
            if end > max_end:
                max_end = end
        expected = 8 + header_len + max_end
        if expected != self.file_size:
            state = "truncated" if self.file_size < expected else "longer than its header says"
            # The header itself is sound, so its names stay usable; the caller reports the size.
            self.size_error = self._fail(f"is {state}: expected {expected} bytes, found {self.file_size}",
                                         expected_size=expected, found_size=self.file_size)
        self.header_len = header_len
        self.tensors = header

    def read_i32(self, name: str) -> int:
        """The int32 stored at the start of tensor ``name`` (4 bytes read, nothing else)."""
        start = 8 + self.header_len + self.tensors[name]["data_offsets"][0]
        data = self._pread(4, start)
        if len(data) != 4:
            raise ShardError(self.path, f"tensor {name!r} cannot be read at byte {start}")
        return struct.unpack("<i", data)[0]

