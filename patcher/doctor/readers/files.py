"""Reading what a pack or an environment hands doctor, bounded: regular files only, values echoed clipped,
JSON refused before it would balloon. The floor of doctor's readers: it imports nothing of the package."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

ECHO_LIMIT = 200  # characters of a value from the input that a row repeats


def shown(text: str) -> str:
    """``text`` with every character a terminal would act on or hide (controls, format characters such as
    bidirectional overrides, line separators) written as a Python escape, so that a name or message read
    from a pack or a server prints as what it is, on one line."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() or c == " " else _escape(c) for c in text)


def _escape(char: str) -> str:
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def clip(text: str, limit: int = ECHO_LIMIT) -> str:
    """``text`` cut to ``limit`` characters, saying how long it was, its control characters shown escaped
    (:func:`shown`): for values echoed from the input."""
    text = shown(text)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text):,} characters)"


def json_cost(raw: bytes) -> int:
    """An upper bound, in bytes, of what ``json.loads(raw)`` allocates (the text it decodes included), from
    counts of the bytes that open containers and separate values; used to refuse input it would balloon on
    (a 60 MB list of empty lists is 1.5 GB of objects)."""
    width = 1 if raw.isascii() else 4
    return (
        (1 + 2 * width) * len(raw)
        + 240 * _count(raw, b"{")
        + 64 * _count(raw, b"[")
        + 96 * (_count(raw, b",") + _count(raw, b":"))
        + 40 * _count(raw, b'"')
    )


def json_cost_over(raw: bytes, limit: int) -> bool:
    """Whether ``json_cost(raw)`` is more than ``limit``. Each of the bytes it weighs but '{' weighs at most 96,
    so a count of '{' alone bounds it; where that bound is within ``limit`` (a safetensors header of up to
    ~1 MB: one '{' per tensor, ~100 bytes) the other four counts, each a pass over every byte, are spared."""
    width = 1 if raw.isascii() else 4
    if (1 + 2 * width + 96) * len(raw) + (240 - 96) * raw.count(b"{") <= limit:
        return False
    return json_cost(raw) > limit


def _count(raw: bytes, byte: bytes) -> int:
    """``raw.count(byte)``; a byte that is rare (a '{' or '[' of an index) is found by memchr, a few times faster
    than the count's walk over every byte."""
    count, at = 0, raw.find(byte)
    while at >= 0:
        count += 1
        if count == 64:  # not rare
            return count + raw.count(byte, at + 1)
        at = raw.find(byte, at + 1)
    return count


def json_depth_over(value, limit: int) -> bool:
    """Whether ``value`` (parsed JSON) nests dicts and lists more than ``limit`` deep (iterative: one iterator
    per level held, whatever the width)."""

    def items(container):
        return iter(container.values() if isinstance(container, dict) else container)

    if not isinstance(value, (dict, list)):
        return False
    stack = [items(value)]
    while stack:
        if len(stack) > limit:
            return True
        for child in stack[-1]:
            if isinstance(child, (dict, list)):
                stack.append(items(child))
                break
        else:
            stack.pop()
    return False


def read_regular_file(path: Path, limit: int = 64 << 20) -> bytes:
    """The bytes of ``path`` if it is a regular file of at most ``limit`` bytes; else OSError.

    Opened non-blocking, so a FIFO or device under a pack's file name cannot hang doctor.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        if info.st_size > limit:
            raise OSError(errno.EFBIG, f"{info.st_size:,} bytes, more than the {limit:,} doctor reads")
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)
