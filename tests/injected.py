"""Take patched vLLM code out of a patched file, to run it on CPU as vLLM would.

Our own helpers are imported from the patch modules; what needs taking out of
a patched file is vLLM's code around them (a method, a loader branch) as the
patch left it.
"""

from __future__ import annotations

import ast
from pathlib import Path


def function_node(path: Path, cls: str | None, name: str) -> ast.FunctionDef:
    """The ``def name`` of ``path`` at module level, or in class ``cls``."""
    tree = ast.parse(Path(path).read_text())
    body = tree.body
    if cls is not None:
        (klass,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls]
        body = klass.body
    (func,) = [n for n in body if isinstance(n, ast.FunctionDef) and n.name == name]
    return func


def load_method(path: Path, cls: str | None, name: str, namespace: dict):
    """``cls.name`` (or the module-level ``name``) as written in ``path``, compiled as a plain function."""
    module = ast.Module(body=[function_node(path, cls, name)], type_ignores=[])
    scope = dict(namespace)
    exec(compile(module, str(path), "exec"), scope)  # noqa: S102 - the patched vLLM code under test
    return scope[name]
