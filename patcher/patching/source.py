"""Python source files decoded as Python decodes them, and written back in their own form.

A file's encoding comes from its BOM or PEP 263 coding line (``tokenize``'s
rule), and its newline convention is whatever its lines end with: a patched
file keeps its encoding, its BOM and its newlines, and only the anchored lines
change.
"""

from __future__ import annotations

import codecs
import io
import tokenize
from dataclasses import dataclass


class SourceError(ValueError):
    """Bytes that are not a Python source file Python could read."""


@dataclass(frozen=True)
class Source:
    text: str  # decoded, newlines exactly as in the file
    encoding: str  # the codec name, e.g. "utf-8", "iso-8859-1"
    bom: bool

    def encode(self, text: str) -> bytes:
        """``text`` as this file would store it."""
        data = text.encode(self.encoding)
        return (codecs.BOM_UTF8 + data) if self.bom else data


def decode_source(data: bytes) -> Source:
    """Decode ``data`` the way the interpreter would; SourceError when it cannot be."""
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
    except SyntaxError as exc:
        raise SourceError(f"its coding declaration is not usable ({exc.msg})") from None
    bom = encoding == "utf-8-sig"
    body = data[len(codecs.BOM_UTF8) :] if bom else data
    codec = "utf-8" if bom else encoding
    try:
        text = body.decode(codec)
    except (UnicodeDecodeError, LookupError) as exc:
        raise SourceError(f"it is not valid {codec} ({exc.reason if hasattr(exc, 'reason') else exc})") from None
    return Source(text, codec, bom)
