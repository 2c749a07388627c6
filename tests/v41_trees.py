"""DeepSeek-V4.1 in the nightly layout, built from a real release tree.

vLLM 0.30.0-0.33.0 ship V4.1 as ``vllm/models/deepseek_v41/``; the nightlies and
the ``deepseekv41-flash-*`` images as ``vllm/models/deepseek_v4_1/``, the same
code, its imports reading ``vllm.models.deepseek_v4_1`` (notes/v41.md). The
builder moves the package of a writable test copy (tests/releases.py
``copy_tree``) to the nightly name, rewrites the imports of every Python file of
the tree that names it, and rewrites the dist-info RECORD to match, as pip would
have written it for such a build. Nothing of vLLM is kept here.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from patch_dsv4.tree.environment import record_digest

RELEASE_PACKAGE = "vllm/models/deepseek_v41"
NIGHTLY_PACKAGE = "vllm/models/deepseek_v4_1"
_IMPORT = re.compile(r"\bvllm\.models\.deepseek_v41\b")


def nightly_layout(tree: Path) -> Path:
    """Turn the release layout of ``tree`` (a copy_tree copy) into the nightly one, in place; returns ``tree``."""
    source, dest = tree / RELEASE_PACKAGE, tree / NIGHTLY_PACKAGE
    assert source.is_dir() and not dest.exists(), f"{tree} holds no release-layout V4.1 package"
    shutil.move(str(source), str(dest))
    rewritten = set()
    for root, dirs, files in os.walk(tree / "vllm"):
        if Path(root).is_symlink():
            dirs[:] = []
            continue
        dirs[:] = [d for d in dirs if d != "__pycache__" and not (Path(root) / d).is_symlink()]
        for name in files:
            path = Path(root) / name
            if not name.endswith(".py"):
                continue
            text = path.read_text(encoding="utf-8")
            new = _IMPORT.sub("vllm.models.deepseek_v4_1", text)
            if new != text:
                path.unlink()  # a hard link into the shared cache: write a file of our own
                path.write_text(new, encoding="utf-8")
                rewritten.add(path.relative_to(tree).as_posix())
    (dist_info,) = tree.glob("vllm-*.dist-info")
    record = dist_info / "RECORD"
    out = []
    for line in record.read_text().splitlines():
        path = line.split(",", 1)[0]
        if path.startswith(RELEASE_PACKAGE + "/"):
            path = NIGHTLY_PACKAGE + path[len(RELEASE_PACKAGE) :]
            if path.endswith(".pyc"):
                continue
            line = f"{path},{line.split(',', 1)[1]}"
        if path in rewritten or path.startswith(NIGHTLY_PACKAGE + "/") and (tree / path).is_file():
            data = (tree / path).read_bytes()
            line = f"{path},sha256={record_digest(data)},{len(data)}"
        out.append(line)
    record.unlink()
    record.write_text("\n".join(out) + "\n")
    return tree
