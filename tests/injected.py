"""Take injected code out of a patched file, to run it as vLLM would."""

from __future__ import annotations

import ast
from pathlib import Path


def load_function(path: Path, name: str, namespace: dict | None = None):
    """Compile the module-level function ``name`` of ``path`` (as written there) and return it."""
    tree = ast.parse(Path(path).read_text())
    nodes = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name]
    assert len(nodes) == 1, f"{path} defines {name} {len(nodes)} times"
    module = ast.Module(body=nodes, type_ignores=[])
    scope = dict(namespace or {})
    exec(compile(module, str(path), "exec"), scope)  # noqa: S102 - our own injected code
    return scope[name]
