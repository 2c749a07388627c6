"""Structural fingerprints of code that ignore formatting.

Two pieces of code have the same fingerprint when they parse to the same
``ast`` tree: whitespace, line breaks, comments, redundant parentheses and
quote style do not count; any change to the code itself does. This module only
uses ``ast`` and ``hashlib``, so the fast paths never import libcst.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import textwrap


def normalize_node(node: ast.AST) -> str:
    """The canonical form of ``node``, computed once per node (trees are parsed once and never changed)."""
    cached = node.__dict__.get("_patch_dsv4_normalized")
    if cached is None:
        cached = ast.dump(node, annotate_fields=True, include_attributes=False)
        node._patch_dsv4_normalized = cached  # not a field: ast.dump never shows it
    return cached


@functools.lru_cache(maxsize=1024)
def _statements(code: str) -> tuple[str, ...]:
    tree = ast.parse(textwrap.dedent(code))
    return tuple(normalize_node(stmt) for stmt in tree.body)


def statements(code: str) -> list[str]:
    """The canonical form of each top-level statement in ``code``."""
    return list(_statements(code))


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def find_scope(tree: ast.Module, cls: str | None, func: str | None) -> ast.AST | None:
    """The class/function named by the scope, looked up in module-level code only."""
    node: ast.AST = tree
    if cls is not None:
        node = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls), None)
        if node is None:
            return None
    if func is not None:
        body = node.body  # type: ignore[attr-defined]
        node = next(
            (n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == func),
            None,
        )
    return node


def scope_fingerprint(source: str, cls: str | None, func: str | None) -> str | None:
    """Fingerprint of the enclosing function of an anchor, for the drift report."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    node = find_scope(tree, cls, func)
    if node is None:
        return None
    return digest(normalize_node(node))
