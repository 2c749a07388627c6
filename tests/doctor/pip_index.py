"""pip's index as a test sets it: a local simple index serving the versions the test names, or none at all.

Doctor asks ``pip index versions`` which FlashInfer an install fix may name (tree/pip_index.py); these make
the answer the test's, with no network: pip's configuration files are ignored and ``PIP_INDEX_URL`` points at
a directory of ``index.html`` pages listing wheel names (the wheels themselves need not exist to be listed).
"""

from __future__ import annotations

import os
from pathlib import Path

_SETTINGS = ("PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_NO_INDEX", "PIP_CONSTRAINT", "PIP_INDEX_URL")


def serve(monkeypatch, where: Path, versions: list[str], project: str = "flashinfer-python") -> None:
    """From now on in this test, pip's index serves exactly ``versions`` of ``project``."""
    page = where / "simple" / project
    page.mkdir(parents=True, exist_ok=True)
    wheel = project.replace("-", "_")
    links = "".join(f'<a href="{wheel}-{v}-py3-none-any.whl">{wheel}-{v}-py3-none-any.whl</a>\n' for v in versions)
    (page / "index.html").write_text(f"<!DOCTYPE html><html><body>\n{links}</body></html>\n")
    _isolated(monkeypatch)
    monkeypatch.setenv("PIP_INDEX_URL", (where / "simple").as_uri())


def offline(monkeypatch) -> None:
    """From now on in this test, pip has no index to ask (as on a host without a network)."""
    _isolated(monkeypatch)
    monkeypatch.setenv("PIP_NO_INDEX", "1")


def _isolated(monkeypatch) -> None:
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    for name in _SETTINGS:
        monkeypatch.delenv(name, raising=False)
