"""Where vLLM keeps DeepSeek-V4.1: the same code in two package names.

vLLM 0.30.0-0.34.0 on PyPI ship it as ``vllm/models/deepseek_v41/``; the
nightlies and the ``deepseekv41-flash-*`` images as ``vllm/models/deepseek_v4_1/``
(imports then read ``vllm.models.deepseek_v4_1``). A patch that fixes V4.1 edits
the same scope in both, one edit per layout, so that each has its own verdict.
Not a patch module (the leading underscore keeps discovery away).
"""

from __future__ import annotations

import ast

#: (package directory, what the edit's label says about it), release layout first.
LAYOUTS = (
    ("vllm/models/deepseek_v41", "V4.1"),
    ("vllm/models/deepseek_v4_1", "V4.1, nightly layout"),
)
#: The V4.1 configuration class and its file (not a subclass of V4's).
V41_CONFIG = "vllm/transformers_utils/configs/deepseek_v41.py"


def in_layouts(relpath: str) -> tuple[tuple[str, str], ...]:
    """``relpath`` (relative to the V4.1 package) in each layout: (file, label suffix)."""
    return tuple((f"{package}/{relpath}", tag) for package, tag in LAYOUTS)


def imported_from(tree: ast.Module, file: str, name: str) -> str | None:
    """The vLLM file that ``file`` (parsed: ``tree``) imports ``name`` from at module level, under its own name;
    None where it does not. V4.1's files call V4's shared code this way (``from vllm.models.deepseek_v4... import``)."""
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and any(a.name == name and a.asname is None for a in node.names):
            package = file.split("/")[: -node.level] if node.level else []
            module = "/".join([*package, *(node.module or "").split(".")]).strip("/")
            if module.split("/")[0] == "vllm":
                return module + ".py"
    return None
