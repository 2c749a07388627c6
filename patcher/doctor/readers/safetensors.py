"""Read safetensors shard headers, and single 4-byte marker tensors, without loading any payload.

A shard is an 8-byte little-endian u64 ``header_len``, then ``header_len`` bytes
of UTF-8 JSON mapping each tensor name to ``{dtype, shape, data_offsets}`` (plus
an optional ``__metadata__``), then the payload. Offsets count from the end of
the header, so a tensor starts at ``8 + header_len + data_offsets[0]``.

A header is called valid only where the safetensors library (0.8, its Rust
reader) accepts it, and its rules are matched here (tests/doctor/test_safetensors.py
checks each against the library itself):

- at most 100,000,000 bytes of UTF-8; strict JSON (serde_json: no NaN, no lone
  surrogate escape, no number beyond the f64 range, at most 127 nested
  containers), spaces and tabs, CR and LF around it (writers pad with spaces);
- an object: ``__metadata__`` at most once, null or a map of strings to strings;
  each other member a tensor, the last of a repeated name winning;
- a tensor: an object with ``dtype``, ``shape`` and ``data_offsets`` once each
  (other fields are read and ignored), or the list ``[dtype, shape, data_offsets]``;
  ``dtype`` one of :data:`DTYPE_BITS` (or ``{"F32": null}``); ``shape`` a list of
  u64 whose running product stays within 64 bits; ``data_offsets`` two u64;
  the span ``end - begin`` exactly ``dtype x shape`` bits / 8 (sub-byte dtypes must
  fill whole bytes);
- sorted by ``data_offsets``, the tensors follow each other from 0 with no gap and
  no overlap, and the last one ends where the file does.

Every way a shard can be damaged is reported as :class:`ShardError`, whose
message names the file, the tensor where there is one, and the reason; nothing
here raises anything else for bad input (A.4; L ``tools/mtp_overlay.py``
``read_header``/``validate_header``). A shard whose header is sound but whose
length disagrees with it (truncated by an interrupted download) opens anyway,
with the error in ``size_error``, so its tensor names still count.

Cost: a header like those the library writes, up to 16 MB, is parsed by
``json.loads`` after cheap checks on its bytes prove that Python's reading and
the library's agree (:func:`_canonical_tensors`); any other header is read by
:class:`_Reader`, a chunk at a time, with the same verdict. Either way one shard
costs at most :data:`ENTRY_MEMORY` of tensor entries and a few MB besides, and
a :class:`Budget` bounds the work of a whole pack: a header that asks for more
is a ShardError that says doctor's limit was reached (the real pack's 48
headers use a few percent of it).
"""

from __future__ import annotations

import json
import os
import re
import stat
import struct
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from patch_dsv4.doctor.readers.files import clip, json_cost_over

# Each dtype the library knows, in bits per element (F4 and the F6 formats pack several values per byte).
DTYPE_BITS = {
    "BOOL": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8,
    "F8_E5M2FNUZ": 8,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "C64": 64,
    "F64": 64,
    "I64": 64,
    "U64": 64,
}
DTYPE_SIZES = {name: bits // 8 for name, bits in DTYPE_BITS.items() if bits % 8 == 0}  # bytes, whole-byte dtypes
# The limit the safetensors library itself enforces; a larger length is damage, not a header.
MAX_HEADER_LEN = 100_000_000
U64_MAX = (1 << 64) - 1
MAX_DEPTH = 127  # serde_json's recursion limit, which the library keeps: deeper containers are refused

# doctor's own limits, far above a real pack (48 headers of ~0.3 MB, 138k tensors, ~3k per shard).
ENTRY_MEMORY = 112 << 20  # estimated bytes of tensor entries kept for one shard (a real one: 2 MB; 138k tensors: 97)
MAX_PACK_TENSORS = 1_000_000  # tensors read in one pack
MAX_PACK_STEPS = 1_000_000  # JSON values of ignored fields read one by one (~1 us each), in one pack
MAX_NAME_BYTES = 4096  # one tensor name
MAX_NUMBER_LEN = 1024  # one JSON number, in characters
FAST_HEADER_LEN = 16 << 20  # headers up to this size may take json.loads
CHUNK = 1 << 20  # the exact reader reads this much at a time
MARKER_WINDOW = 64 << 10  # markers within this span of each other are read together
ENTRY_COST = 640  # estimated bytes of one tensor entry as json.loads builds it, besides its name and dims


class ShardError(Exception):
    """A shard that cannot be used; ``str()`` is one line naming the file and why."""

    def __init__(self, path: Path, reason: str, *, expected_size: int | None = None, found_size: int | None = None):
        super().__init__(f"{path.name}: {reason}")
        self.path = path
        self.reason = reason
        self.expected_size = expected_size
        self.found_size = found_size


@dataclass
class Budget:
    """What is left of doctor's limits for one pack (one Budget is shared by all of its shards)."""

    tensors: int = MAX_PACK_TENSORS
    steps: int = MAX_PACK_STEPS


def _name(name: str) -> str:
    """A tensor name as messages quote it: repr, cut to 200 characters."""
    return repr(clip(name))


def _span_bits(dtype: str, shape: list[int]) -> int | None:
    """Bits of ``dtype x shape`` as the library counts them, or None where its 64-bit arithmetic overflows."""
    count = 1
    for dim in shape:
        count *= dim
        if count > U64_MAX:
            return None
    bits = count * DTYPE_BITS[dtype]
    return None if bits > U64_MAX else bits


def _size_problem(name: str, dtype: str, shape: list[int], start: int, end: int) -> str | None:
    """Why a tensor's span is not its dtype x shape (None when it is)."""
    if end < start:
        return f"tensor {_name(name)} has data_offsets [{start}, {end}] that end before they begin"
    bits = _span_bits(dtype, shape)
    if bits is None:
        return f"tensor {_name(name)} has a shape whose size overflows 64 bits ({dtype} x {_dims(shape)})"
    if bits % 8:
        return f"tensor {_name(name)} is {dtype} x {_dims(shape)}, {bits} bits: not a whole number of bytes"
    if end - start != bits // 8:
        return f"tensor {_name(name)} spans {end - start} bytes but {dtype} x {_dims(shape)} needs {bits // 8}"
    return None


def _dims(shape: list[int]) -> str:
    if len(shape) <= 8:
        return str(list(shape))
    return f"[{', '.join(map(str, shape[:4]))}, ... ({len(shape)} dimensions)]"


def _layout_problem(spans: list[tuple[int, int, str]]) -> tuple[str | None, int]:
    """(why the spans sorted by offset do not follow each other from 0, or None; where the last one ends)."""
    end = 0
    for start, stop, _ in spans:  # in header order first: the library writes them sorted
        if start != end:
            break
        end = stop
    else:
        return None, end
    spans = sorted(spans)
    end, previous = 0, None
    for start, stop, name in spans:
        if start > end:
            where = f"the tensor before it, {_name(previous)}, ends at {end}" if previous else "the data begins at 0"
            return f"tensor {_name(name)} begins at byte {start} of the data but {where}: a gap", end
        if start < end:
            return f"tensor {_name(name)} begins at byte {start}, inside {_name(previous)} (which ends at {end})", end
        end, previous = stop, name
    return None, end


# --------------------------------------------------------------------------- the fast path


def _canonical_tensors(raw: bytes) -> tuple[dict, list] | str | None:
    """The tensors (and their spans) of a header as the library writes it, when it is valid; a reason when
    it is not JSON at all; None when the exact reader must decide.

    What ``json.loads`` refuses the library refuses too (its JSON is no looser), so
    that verdict stands. Its acceptance is trusted only where the two cannot
    differ: ASCII (so UTF-8 is no question), no ``\\u`` (surrogates), no ``-0`` (an
    int to Python, a float to serde), and, after parsing, every member a tensor of
    exactly ``dtype``/``shape``/``data_offsets`` (keys repeated in the text, which
    Python merges in silence, show as more ``:`` in the text than members and
    fields kept, or more of those three strings than tensors).
    """
    if json_cost_over(raw, ENTRY_MEMORY):
        return None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return f"header is not UTF-8 (bad byte at {exc.start})"
    try:
        header = json.loads(text)
    except (ValueError, RecursionError) as exc:
        return f"header is not JSON ({clip(str(exc))})"
    del text
    # (a single byte is found by memchr: the two-byte searches, 10x slower, run only where it is there)
    if (
        type(header) is not dict
        or not raw.isascii()
        or (b"\\" in raw and b"\\u" in raw)
        or (b"-" in raw and b"-0" in raw)
    ):
        return None
    metadata = header.pop("__metadata__", ())
    if metadata is not None and metadata != ():
        if type(metadata) is not dict or any(type(v) is not str for v in metadata.values()):
            return None
    count = len(header)
    # Each member and field that json.loads kept is one ':' of the text; one more means a key it merged.
    colons = 4 * count + (0 if metadata == () else 1 + len(metadata or ()))
    if raw.count(b":") != colons or not (
        raw.count(b'"dtype"') == raw.count(b'"shape"') == raw.count(b'"data_offsets"') == count
    ):
        return None
    sizes, cursor, most = DTYPE_SIZES, 0, U64_MAX >> 3
    # Inline, not a helper: this runs for every tensor of the pack (138k). Any doubt goes to the exact reader:
    # sub-byte dtypes, tensors out of offset order, and the rare shapes whose 64-bit arithmetic needs following
    # dimension by dimension (more than 16, or a 0 among several: the library refuses an overflow before it).
    # An unknown field or a missing one shows in the count of ':' above, or as a KeyError here.
    for entry in header.values():
        try:
            size = sizes[entry["dtype"]]
            shape = entry["shape"]
            start, end = entry["data_offsets"]
            if type(shape) is not list or len(shape) > 16:
                return None
            for dim in shape:
                if type(dim) is not int or dim < 0:
                    return None
                size *= dim
            if type(start) is not int or type(end) is not int or start != cursor or end - start != size:
                return None
            if size > most or (not size and len(shape) > 1):
                return None
        except (KeyError, TypeError, ValueError):
            return None
        cursor = end
    return header, [(0, cursor, "")]  # in offset order, back to back: the layout is sound


# --------------------------------------------------------------------------- the exact reader

_WS = re.compile(rb"[ \t\n\r]*")
_NUMBER = re.compile(rb"(-?)(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?")
_UTF8 = (
    rb"[\xc2-\xdf][\x80-\xbf]|\xe0[\xa0-\xbf][\x80-\xbf]|[\xe1-\xec\xee\xef][\x80-\xbf]{2}|\xed[\x80-\x9f][\x80-\xbf]"
    rb"|\xf0[\x90-\xbf][\x80-\xbf]{2}|[\xf1-\xf3][\x80-\xbf]{3}|\xf4[\x80-\x8f][\x80-\xbf]{2}"
)
# An escape as serde_json takes it: a surrogate only as a high-low pair.
_ESCAPE = (
    rb'\\["\\/bfnrt]|\\u(?![dD][89a-fA-F])[0-9a-fA-F]{4}|\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2}'
)
_STRING_BODY = re.compile(rb"(?:[\x20\x21\x23-\x5b\x5d-\x7f]+|" + _UTF8 + rb"|" + _ESCAPE + rb")*")
# The same, one character per repetition: inside a larger pattern a nested quantifier would backtrack exponentially.
_STRING = rb'"(?:[\x20\x21\x23-\x5b\x5d-\x7f]|' + _UTF8 + rb"|" + _ESCAPE + rb')*"'
LONGEST_CHAR = 12  # a surrogate pair escape: the longest unit of a string's body
# A canonical member, ``"name": {"dtype": "X", "shape": [...], "data_offsets": [a, b]}``, as the library writes it.
_W = rb"[ \t\n\r]*"
_UINT_TOKEN = rb"(?:0|[1-9][0-9]{0,19})(?![0-9.eE])"  # a u64 as serde reads one (a 20-digit one may be past it)
_CANONICAL = re.compile(
    rb'%s"([\x20\x21\x23-\x5b\x5d-\x7f]{0,4096})"%s:%s\{%s"dtype"%s:%s"([A-Z0-9_]{1,16})"%s,%s"shape"%s:%s'
    rb"\[%s((?:%s%s(?:,%s%s%s)*)?)\]%s,%s"
    rb'"data_offsets"%s:%s\[%s(%s)%s,%s(%s)%s\]%s\}'
    % (
        (_W,) * 10
        + (_W, _UINT_TOKEN, _W, _W, _UINT_TOKEN, _W, _W, _W)
        + (_W, _W, _W, _UINT_TOKEN, _W, _W, _UINT_TOKEN, _W, _W)
    )
)
CANONICAL_WINDOW = 8192  # a canonical member is matched only when this much of the header is in memory


@cache
def _units() -> dict[tuple[bool, bool], re.Pattern]:
    """Patterns that each check one ``value,`` unit of an ignored field in a single match (``"key": value,``
    inside an object), keyed by (inside a list, containers allowed): the value a scalar, or a container of
    scalars where one more level of nesting is allowed. Every piece is bounded, so a match that fails costs
    little; what they do not take is read token by token. Compiled on first use: real headers never need them."""
    string = rb'"(?:[\x20\x21\x23-\x5b\x5d-\x7f]|' + _UTF8 + rb"|" + _ESCAPE + rb'){0,256}"'
    # Numbers within the f64 range whatever their digits: no exponent, at most 300 integer digits.
    scalar = _W + rb"(?:" + string + rb"|-?(?:0|[1-9][0-9]{0,299})(?:\.[0-9]{1,300})?|true|false|null)" + _W
    member = _W + string + _W + rb":" + scalar
    flat = rb"(?:%s|%s\[(?:%s(?:,%s){0,63}|%s)\]%s|%s\{(?:%s(?:,%s){0,63}|%s)\}%s)" % (
        scalar,
        _W,
        scalar,
        scalar,
        _W,
        _W,
        _W,
        member,
        member,
        _W,
        _W,
    )
    key = _W + string + _W + rb":"
    return {
        (True, False): re.compile(scalar + rb","),
        (False, False): re.compile(key + scalar + rb","),
        (True, True): re.compile(flat + rb","),
        (False, True): re.compile(key + flat + rb","),
    }


def _finite(match: re.Match) -> bool:
    """Whether a JSON number is within the range serde_json reads (it refuses those that round to infinity)."""
    text = match.group(0)
    if match.group(3) is None and match.group(4) is None and len(text) <= 400:
        try:
            float(int(text))
        except OverflowError:
            return False
        return True
    return float(text) not in (float("inf"), float("-inf"))


class _Reader:
    """One header read in chunks, parsed into the same tensor entries ``json.loads`` gives, with the library's
    verdict; never more than two chunks of it in memory at once."""

    def __init__(self, shard: Shard, length: int, budget: Budget):
        self.shard, self.budget = shard, budget
        self.buf, self.pos, self.base = b"", 0, 0
        self.next, self.stop = 8, 8 + length
        self.memory = 0

    # ---- bytes

    def fail(self, reason: str) -> ShardError:
        return ShardError(self.shard.path, reason)

    def more(self) -> bool:
        """Read the next chunk behind what is left unread; False at the end of the header."""
        if self.next >= self.stop:
            return False
        size = min(CHUNK, self.stop - self.next)
        data = self.shard._pread(size, self.next)
        if len(data) != size:
            raise self.fail(f"header is cut short ({self.next - 8 + len(data)} of {self.stop - 8} bytes read)")
        self.next += size
        self.base += self.pos
        self.buf = self.buf[self.pos :] + data
        self.pos = 0
        return True

    def window(self, size: int) -> None:
        """Have at least ``size`` unread bytes in memory, or all that is left."""
        while len(self.buf) - self.pos < size and self.more():
            pass

    def syntax(self, expected: str) -> ShardError:
        self.window(1)
        where = self.base + self.pos
        if self.pos >= len(self.buf):
            return self.fail(f"header is not JSON (it ends where {expected} should be)")
        found = self.buf[self.pos]
        if found >= 0x80:
            return self.fail(
                f"header is not UTF-8 or not JSON (byte {found:#04x} at {where}, where {expected} should be)"
            )
        return self.fail(f"header is not JSON ({chr(found)!r} at byte {where}, where {expected} should be)")

    def peek(self) -> int | None:
        """The next byte that is not white space (None at the end)."""
        while True:
            self.pos = _WS.match(self.buf, self.pos).end()
            if self.pos < len(self.buf) or not self.more():
                return self.buf[self.pos] if self.pos < len(self.buf) else None

    def expect(self, char: bytes, what: str) -> None:
        if self.peek() != char[0]:
            raise self.syntax(what)
        self.pos += 1

    def step(self, cost: int = 1) -> None:
        self.budget.steps -= cost
        if self.budget.steps < 0:
            raise self.fail(
                f"header holds more ignored JSON values than doctor reads in one pack ({MAX_PACK_STEPS:,}); "
                "a real header has none"
            )

    # ---- values

    def string(self, keep: int) -> str | None:
        """The JSON string at the cursor (its quote not yet read): its text when at most ``keep`` bytes long,
        else None (it is still read to its end and checked)."""
        self.pos += 1
        pieces, size = [], 0
        while True:
            self.window(LONGEST_CHAR + 1)
            buf = self.buf
            end = _STRING_BODY.match(buf, self.pos).end()
            if end < len(buf) and buf[end] == 0x22:
                break
            if len(buf) - end <= LONGEST_CHAR and self.next < self.stop:  # it may go on in the next chunk
                size += end - self.pos
                if size <= keep:
                    pieces.append(buf[self.pos : end])
                self.pos = end
                self.more()
                continue
            self.pos = end
            if end >= len(buf):
                raise self.fail("header is not JSON (it ends inside a string)")
            found = buf[end]
            if found < 0x20:
                raise self.fail(
                    f"header is not JSON (control character {found:#04x} in a string at byte {self.base + end})"
                )
            if found == 0x5C:
                raise self.fail(f"header is not JSON (an invalid or lone surrogate escape at byte {self.base + end})")
            raise self.fail(f"header is not UTF-8 (bad byte at {self.base + end})")
        size += end - self.pos
        if size <= keep:
            pieces.append(buf[self.pos : end])
        self.pos = end + 1
        if size > keep:
            return None
        text = b"".join(pieces)
        if b"\\" in text:
            return json.loads(b'"' + text + b'"')
        return text.decode("utf-8")

    def number(self) -> re.Match:
        self.window(MAX_NUMBER_LEN + 1)
        match = _NUMBER.match(self.buf, self.pos)
        if match is None:
            raise self.syntax("a value")
        if match.end() - self.pos > MAX_NUMBER_LEN:
            raise self.fail(f"header has a number of more than {MAX_NUMBER_LEN} characters, more than doctor reads")
        self.pos = match.end()
        return match

    def literal(self) -> str:
        self.window(5)
        for word in (b"true", b"false", b"null"):
            if self.buf.startswith(word, self.pos):
                self.pos += len(word)
                return word.decode()
        raise self.syntax("a value")

    def kind(self) -> str:
        """What the value at the cursor is, in words, without reading it."""
        char = self.peek()
        if char in (0x2D, *range(0x30, 0x3A)):
            self.window(MAX_NUMBER_LEN + 1)
            match = _NUMBER.match(self.buf, self.pos)
            if match and (match.group(3) or match.group(4)):
                return "float"
            return "negative int" if match and match.group(1) else "int"
        kind = {0x22: "str", 0x5B: "list", 0x7B: "object", 0x74: "bool", 0x66: "bool", 0x6E: "null"}.get(char)
        if kind is None:
            raise self.syntax("a value")
        return kind

    def uint(self, what: str) -> int:
        """A u64 (the library's usize): an integer token, no sign, no fraction, no exponent."""
        char = self.peek()
        if char is None or not 0x30 <= char <= 0x39:
            raise self.fail(f"{what} is a JSON {self.kind()}, not an unsigned integer")
        match = self.number()
        if match.group(3) or match.group(4):
            raise self.fail(f"{what} is a JSON float, not an unsigned integer")
        value = int(match.group(0)) if len(match.group(0)) <= 20 else U64_MAX + 1
        if value > U64_MAX:
            raise self.fail(f"{what} is more than 64 bits")
        return value

    def skip_value(self, depth: int) -> None:
        """Read and check one JSON value the library ignores (an unknown field of a tensor), nested at ``depth``."""
        closers: list[int] = []  # 0x5D or 0x7D for each container open
        while True:
            self.step()
            char = self.peek()
            if char in (0x5B, 0x7B):
                if depth + len(closers) > MAX_DEPTH:
                    raise self.fail(f"header nests containers more than {MAX_DEPTH} deep, which the library refuses")
                self.pos += 1
                closers.append(char + 2)
                if self.peek() == char + 2:
                    self.pos += 1
                    closers.pop()
                else:
                    self._run(closers, depth)
                    if char == 0x7B:
                        self._key()
                    continue
            elif char == 0x22:
                self.string(0)
            elif char is not None and (char == 0x2D or 0x30 <= char <= 0x39):
                if not _finite(self.number()):
                    raise self.fail("header has a number beyond the f64 range, which the library refuses")
            else:
                self.literal()
            while closers:  # after a value: the next one of its container, or the container's end
                char = self.peek()
                if char == 0x2C:
                    self.pos += 1
                    self._run(closers, depth)
                    if closers[-1] == 0x7D:
                        self._key()
                    break
                if char != closers[-1]:
                    raise self.syntax(f"',' or {chr(closers[-1])!r}")
                self.pos += 1
                closers.pop()
            if not closers:
                return

    def _key(self) -> None:
        if self.peek() != 0x22:
            raise self.syntax("a key")
        self.string(0)
        self.expect(b":", "':'")

    def _run(self, closers: list[int], depth: int) -> None:
        """Skip the ``value,`` units at the cursor that one pattern can check (see :func:`_units`); a unit
        repeated verbatim, as fillers are, is skipped by comparing bytes, thousands at a time."""
        in_list = closers[-1] == 0x5D
        unit = _units()[(in_list, depth + len(closers) <= MAX_DEPTH)]
        while True:
            self.window(CHUNK)
            match = unit.match(self.buf, self.pos)
            if match is None:
                return
            text = match.group(0)
            self.pos = match.end()
            self.step(1 + len(text) // 64)
            block = text * (8192 // len(text) + 1)
            while True:
                if len(self.buf) - self.pos < len(block):
                    self.window(CHUNK)
                if self.buf.startswith(block, self.pos):
                    self.pos += len(block)
                elif self.buf.startswith(text, self.pos):
                    self.pos += len(text)
                else:
                    break

    # ---- the header

    def header(self) -> tuple[dict, list]:
        char = self.peek()
        if char != 0x7B:
            if char is None:
                raise self.fail("header is not JSON (it is empty)")
            raise self.fail(f"header is a JSON {self.kind()}, not an object")
        self.pos += 1
        tensors: dict[str, dict] = {}
        metadata = False
        if self.peek() == 0x7D:
            self.pos += 1
        else:
            while True:
                metadata = self._member(tensors, metadata) or metadata
                char = self.peek()
                if char == 0x2C:
                    self.pos += 1
                    continue
                if char == 0x7D:
                    self.pos += 1
                    break
                raise self.syntax("',' or '}'")
        if self.peek() is not None:
            raise self.fail(f"header is not JSON (more after its closing brace, at byte {self.base + self.pos})")
        spans = [(entry["data_offsets"][0], entry["data_offsets"][1], name) for name, entry in tensors.items()]
        return tensors, spans

    def _member(self, tensors: dict, metadata: bool) -> bool:
        """One member of the header: a tensor into ``tensors``, or ``__metadata__`` (then True)."""
        if self.peek() != 0x22:
            raise self.syntax("a tensor name")
        self.window(CANONICAL_WINDOW)
        match = _CANONICAL.match(self.buf, self.pos)
        if match is not None:
            entry = self._canonical(*match.groups())
            if entry is not None:
                self.pos = match.end()
                self._keep(match.group(1).decode("ascii"), entry, tensors)
                return False
        name = self.string(MAX_NAME_BYTES)
        if name is None:
            raise self.fail(f"header has a tensor name of more than {MAX_NAME_BYTES} bytes, more than doctor reads")
        self.expect(b":", "':'")
        if name == "__metadata__":
            if metadata:
                raise self.fail("header has __metadata__ twice, which the library refuses")
            self._metadata()
            return True
        self._keep(name, self._entry(name), tensors)
        return False

    def _canonical(self, name: bytes, dtype: bytes, shape: bytes, start: bytes, end: bytes) -> dict | None:
        """The entry of a canonical member (its numbers well formed by the pattern), None where one is past 64
        bits or the dtype unknown (then it is read token by token, for the message)."""
        dims = [int(d) for d in shape.split(b",")] if shape else []
        start, end = int(start), int(end)
        dtype = dtype.decode("ascii")
        if dtype not in DTYPE_BITS or end > U64_MAX or (dims and max(dims) > U64_MAX) or name == b"__metadata__":
            return None
        return self._checked(name.decode("ascii"), dtype, dims, start, end)

    def _keep(self, name: str, entry: dict, tensors: dict) -> None:
        if name not in tensors:
            self.budget.tensors -= 1
            if self.budget.tensors < 0:
                raise self.fail(f"the pack has more than {MAX_PACK_TENSORS:,} tensors, more than doctor reads")
        self.memory += ENTRY_COST + len(name) + 8 * len(entry["shape"])
        if self.memory > ENTRY_MEMORY:
            raise self.fail(
                f"header describes more than doctor keeps of one shard ({ENTRY_MEMORY >> 20} MB of tensor entries, "
                f"{len(tensors):,} tensors read); a real shard needs a few MB"
            )
        tensors[name] = entry

    def _metadata(self) -> None:
        char = self.peek()
        if char == 0x6E and self.literal() == "null":  # the library reads null as no metadata
            return
        if char != 0x7B:
            raise self.fail(f"header __metadata__ is a JSON {self.kind()}, not an object")
        self.pos += 1
        if self.peek() == 0x7D:
            self.pos += 1
            return
        while True:
            if self.peek() != 0x22:
                raise self.syntax("a key")
            self.string(0)
            self.expect(b":", "':'")
            if self.peek() != 0x22:
                raise self.fail(f"header __metadata__ holds a JSON {self.kind()} where a string should be")
            self.string(0)
            char = self.peek()
            if char == 0x2C:
                self.pos += 1
                continue
            if char == 0x7D:
                self.pos += 1
                return
            raise self.syntax("',' or '}'")

    def _entry(self, name: str) -> dict:
        """One tensor's description, either form the library takes, checked."""
        fields: dict[str, object] = {}
        char = self.peek()
        if char == 0x7B:
            self.pos += 1
            if self.peek() == 0x7D:
                self.pos += 1
            else:
                while True:
                    if self.peek() != 0x22:
                        raise self.syntax("a key")
                    key = self.string(32)
                    self.expect(b":", "':'")
                    if key in ("dtype", "shape", "data_offsets"):
                        if key in fields:
                            raise self.fail(f"tensor {_name(name)} has {key} twice, which the library refuses")
                        fields[key] = self._field(name, key)
                    else:
                        self.skip_value(3)
                    char = self.peek()
                    if char == 0x2C:
                        self.pos += 1
                        continue
                    if char == 0x7D:
                        self.pos += 1
                        break
                    raise self.syntax("',' or '}'")
            missing = [key for key in ("dtype", "shape", "data_offsets") if key not in fields]
            if missing:
                raise self.fail(f"tensor {_name(name)} has no {missing[0]}")
        elif char == 0x5B:
            self.pos += 1
            items = 0
            if self.peek() != 0x5D:
                for key in ("dtype", "shape", "data_offsets"):
                    fields[key] = self._field(name, key)
                    items += 1
                    char = self.peek()
                    if char != 0x2C or items == 3:
                        break
                    self.pos += 1
            else:
                char = 0x5D
            if char == 0x2C:
                raise self.fail(
                    f"tensor {_name(name)} is described by a list of more than 3 items, not "
                    "[dtype, shape, data_offsets]"
                )
            if char != 0x5D:
                raise self.syntax("',' or ']'")
            if items < 3:
                raise self.fail(
                    f"tensor {_name(name)} is described by a list of {items} items, not [dtype, shape, data_offsets]"
                )
            self.pos += 1
        else:
            raise self.fail(f"tensor {_name(name)} is described by a JSON {self.kind()}, not an object")
        start, end = fields["data_offsets"]
        return self._checked(name, fields["dtype"], fields["shape"], start, end)

    def _checked(self, name: str, dtype: str, shape: list[int], start: int, end: int) -> dict:
        problem = _size_problem(name, dtype, shape, start, end)
        if problem:
            raise self.fail(problem)
        return {"dtype": dtype, "shape": shape, "data_offsets": [start, end]}

    def _field(self, name: str, key: str):
        char = self.peek()
        if key == "dtype":
            if char == 0x22:
                dtype = self.string(32)
            elif char == 0x7B:  # serde's other form of a unit variant: {"F32": null}
                self.pos += 1
                if self.peek() != 0x22:
                    raise self.fail(f"tensor {_name(name)} has a dtype that is not a string or a one-key map")
                dtype = self.string(32)
                self.expect(b":", "':'")
                if self.peek() != 0x6E or self.literal() != "null":
                    raise self.fail(f"tensor {_name(name)} has a dtype map whose value is not null")
                if self.peek() != 0x7D:
                    raise self.fail(f"tensor {_name(name)} has a dtype map with more than one key")
                self.pos += 1
            else:
                raise self.fail(f"tensor {_name(name)} has a dtype that is a JSON {self.kind()}, not a string")
            if dtype not in DTYPE_BITS:
                raise self.fail(f"tensor {_name(name)} has an unknown dtype {clip(dtype or '(a long string)')!r}")
            return dtype
        if char != 0x5B:
            raise self.fail(f"tensor {_name(name)} has {key} that is a JSON {self.kind()}, not a list")
        self.pos += 1
        values: list[int] = []
        if key == "data_offsets":
            while self.peek() != 0x5D:
                if values:
                    self.expect(b",", "',' or ']'")
                values.append(self.uint(f"tensor {_name(name)} data_offsets[{len(values)}]"))
                if len(values) > 2:
                    raise self.fail(f"tensor {_name(name)} has data_offsets of more than 2 items")
            self.pos += 1
            if len(values) != 2:
                raise self.fail(f"tensor {_name(name)} has data_offsets of {len(values)} items, not 2")
            return values
        count = 1
        if self.peek() == 0x5D:
            self.pos += 1
            return values
        while True:
            dim = self.uint(f"tensor {_name(name)} shape[{len(values)}]")
            values.append(dim)
            count *= dim
            if count > U64_MAX:
                raise self.fail(f"tensor {_name(name)} has a shape whose size overflows 64 bits")
            if len(values) > 64:
                self.step()  # a real shape has a few dimensions: a long one counts as ignored values do
            if len(values) & 4095 == 0 and self.memory + 8 * len(values) > ENTRY_MEMORY:
                raise self.fail(f"tensor {_name(name)} has a shape of more dimensions than doctor keeps")
            char = self.peek()
            if char == 0x2C:
                self.pos += 1
                continue
            if char == 0x5D:
                self.pos += 1
                return values
            raise self.syntax("',' or ']'")


# --------------------------------------------------------------------------- shards


class Shard:
    """One open shard: its validated header, and reads of single small tensors.

    Use as a context manager; the file is opened once, non-blocking (a FIFO
    named ``*.safetensors`` must not hang doctor) and only a regular file is read.
    ``budget`` is the pack's (a fresh one when omitted).
    """

    reads_data = True  # single tensor values (read_i32) can be read; a Hub shard reads its header only

    def __init__(self, path: Path, budget: Budget | None = None):
        self.path = path
        self.budget = Budget() if budget is None else budget
        self.fd = -1
        self.tensors: dict[str, dict] = {}
        self.header_len = 0
        self.file_size = 0
        self.size_error: ShardError | None = None

    def __enter__(self) -> Shard:
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
            raise self._fail(
                f"is {self.file_size} bytes, shorter than the 8-byte header length", found_size=self.file_size
            )
        (header_len,) = struct.unpack("<Q", self._pread(8, 0))
        if header_len > self.file_size - 8:
            raise self._fail(
                f"header length {header_len} runs past the end of the file ({self.file_size} bytes)",
                found_size=self.file_size,
            )
        if header_len > MAX_HEADER_LEN:
            raise self._fail(f"header length {header_len} exceeds the safetensors limit of {MAX_HEADER_LEN} bytes")
        found = None
        if header_len <= FAST_HEADER_LEN:
            raw = self._pread(header_len, 8)
            if len(raw) != header_len:
                raise self._fail(f"header is cut short ({len(raw)} of {header_len} bytes read)")
            found = _canonical_tensors(raw)
            del raw
            if isinstance(found, str):
                raise self._fail(found)
            if found is not None:
                self.budget.tensors -= len(found[0])
                if self.budget.tensors < 0:
                    raise self._fail(f"the pack has more than {MAX_PACK_TENSORS:,} tensors, more than doctor reads")
        if found is None:
            found = _Reader(self, header_len, self.budget).header()
        tensors, spans = found
        problem, data_end = _layout_problem(spans)
        if problem:
            raise self._fail(problem)
        expected = 8 + header_len + data_end
        if expected != self.file_size:
            state = "truncated" if self.file_size < expected else "longer than its header says"
            # The header itself is sound, so its names stay usable; the caller reports the size.
            self.size_error = self._fail(
                f"is {state}: expected {expected} bytes, found {self.file_size}",
                expected_size=expected,
                found_size=self.file_size,
            )
        self.header_len = header_len
        self.tensors = tensors

    def read_i32s(self, starts: list[int]) -> list[int | None]:
        """The int32 at each data offset of ``starts`` (a tensor's ``data_offsets[0]``), None where the file ends
        first: read a window of up to MARKER_WINDOW bytes at a time, so thousands of markers packed together cost
        a few reads."""
        base = 8 + self.header_len
        values: dict[int, int | None] = {}
        order = sorted(set(starts))
        i = 0
        while i < len(order):
            first = order[i]
            j = i
            while j + 1 < len(order) and order[j + 1] + 4 - first <= MARKER_WINDOW:
                j += 1
            data = self._pread(order[j] + 4 - first, base + first)
            for start in order[i : j + 1]:
                at = start - first
                values[start] = struct.unpack_from("<i", data, at)[0] if at + 4 <= len(data) else None
            i = j + 1
        return [values[start] for start in starts]

    def read_i32(self, name: str) -> int:
        """The int32 stored at the start of tensor ``name`` (4 bytes read, nothing else)."""
        start = 8 + self.header_len + self.tensors[name]["data_offsets"][0]
        data = self._pread(4, start)
        if len(data) != 4:
            raise ShardError(self.path, f"tensor {_name(name)} cannot be read at byte {start}")
        return struct.unpack("<i", data)[0]
