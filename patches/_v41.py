"""Where vLLM keeps DeepSeek-V4.1: the same code in two package names.

vLLM 0.30.0-0.33.0 on PyPI ship it as ``vllm/models/deepseek_v41/``; the
nightlies and the ``deepseekv41-flash-*`` images as ``vllm/models/deepseek_v4_1/``
(imports then read ``vllm.models.deepseek_v4_1``). A patch that fixes V4.1 edits
the same scope in both, one edit per layout, so that each has its own verdict.
Not a patch module (the leading underscore keeps discovery away).
"""

from __future__ import annotations

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
