"""Find the patches by walking the ``patch_dsv4.patches`` package, and hold them to the rules.

No hand-kept list: every module of the package that defines a :class:`Patch`
subclass is a patch. A patch that breaks a rule every patch must keep (an id
and a why; injected names with the ``_patch_dsv4_`` prefix, so a patched file
is recognised as ours; the marker comment in every replacement; edits that
share a scope anchor on disjoint statements and inject names of their own) is
refused here, before it can judge or write anything. Patches apply in the order of their ids.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import re
import textwrap
from functools import lru_cache

from patch_dsv4.output.errors import TransformBug
from patch_dsv4.patching.edits import ReplaceStatements, helper_source, mentions_injected
from patch_dsv4.patching.fingerprint import normalize_node
from patch_dsv4.patching.patch import INJECTED_PREFIX, Example, Patch, marker_comment

_ID = re.compile(r"[a-z][a-z0-9]*(?:-[a-z0-9]+)*")


class PatchDefinitionError(TransformBug):
    """A patch module that breaks a rule every patch must keep."""


def _refuse(patch: type[Patch], why: str) -> PatchDefinitionError:
    return PatchDefinitionError(
        f"patch {getattr(patch, 'id', patch.__name__)} ({patch.__module__}) is not well-formed",
        why,
        "fix the patch module; see README, 'Adding a patch'",
    )


def check_patch(patch: type[Patch]) -> None:
    """Raise PatchDefinitionError when ``patch`` breaks a rule (see the module docstring)."""
    pid = getattr(patch, "id", None)
    if not isinstance(pid, str) or not _ID.fullmatch(pid):
        raise _refuse(patch, f"its id {pid!r} is not lower-case words joined by dashes")
    if not getattr(patch, "title", None) or not patch.why():
        raise _refuse(patch, "it needs a title and a why (its module docstring)")
    edits = getattr(patch, "edits", ())
    if not edits:
        raise _refuse(patch, "it declares no edits")
    marker = marker_comment(pid)
    for edit in edits:
        if not isinstance(edit, ReplaceStatements):
            raise _refuse(patch, f"edit {edit!r} is not a ReplaceStatements")
        if not (edit.file.startswith("vllm/") and edit.file.endswith(".py")):
            raise _refuse(patch, f"edit {edit.label!r} names {edit.file}, not a source file of vllm/")
        if not edit.variants:
            raise _refuse(patch, f"edit {edit.label!r} has no (anchor, replacement) variant")
        for variant in edit.variants:
            try:
                anchor = ast.parse(textwrap.dedent(variant.anchor))
                replacement = ast.parse(textwrap.dedent(variant.replacement))
            except SyntaxError as exc:
                raise _refuse(patch, f"edit {edit.label!r}: a variant does not parse ({exc.msg})") from None
            if marker not in variant.replacement:
                raise _refuse(patch, f"edit {edit.label!r}: its replacement lacks the marker comment {marker!r}")
            if not mentions_injected(replacement):
                raise _refuse(patch, f"edit {edit.label!r}: its replacement calls no {INJECTED_PREFIX}* helper")
            if mentions_injected(anchor):
                raise _refuse(patch, f"edit {edit.label!r}: its anchor names an injected {INJECTED_PREFIX}* name")
        for helper in edit.helpers:
            if not inspect.isfunction(helper) or helper.__module__ != patch.__module__:
                raise _refuse(patch, f"helper {helper!r} is not a function of the patch module")
            if not helper.__name__.startswith(INJECTED_PREFIX):
                raise _refuse(patch, f"helper {helper.__name__} is not named {INJECTED_PREFIX}*")
            if f"patch-dsv4 ({pid})" not in (helper.__doc__ or ""):
                raise _refuse(
                    patch, f"helper {helper.__name__}'s docstring does not say 'Written by patch-dsv4 ({pid})'"
                )
            if helper_source(helper).lstrip().startswith("@"):
                raise _refuse(patch, f"helper {helper.__name__} is decorated; injected helpers are plain functions")


def _statement_forms(code: str, nested: bool) -> dict[str, str]:
    """Canonical form -> source of each statement of ``code``: the top-level ones, or with ``nested`` every one."""
    tree = ast.parse(textwrap.dedent(code))
    nodes = [n for n in ast.walk(tree) if isinstance(n, ast.stmt)] if nested else tree.body
    return {normalize_node(n): ast.unparse(n) for n in nodes}


def _overlap(first: ReplaceStatements, second: ReplaceStatements) -> str | None:
    """Why two edits of one scope cannot both stand there, or None when their anchors are disjoint.

    They collide when a statement one edit anchors on is part of the other's anchor or of its replacement (so
    one edit's writing would change, or repeat, what the other matches), or when both inject a name into the
    scope (each edit tells its own statements from a sibling's by the names only it writes there).
    """
    for a, b in ((first, second), (second, first)):
        for va in a.variants:
            around = _statement_forms(va.anchor, nested=True) | _statement_forms(va.replacement, nested=True)
            for vb in b.variants:
                for form, text in _statement_forms(vb.anchor, nested=False).items():
                    if form in around:
                        first_line = text.splitlines()[0]
                        return f"{b.label!r} anchors on {first_line!r}, which {a.label!r} anchors on or writes"
    shared = first.own_names() & second.own_names()
    if shared:
        return f"both write {sorted(shared)[0]} into the scope"
    return None


def check_together(patches: list[type[Patch]]) -> None:
    """Raise PatchDefinitionError when two patches share an id, or two edits of one (file, scope) overlap.

    Edits of one scope (of one patch or of several) stand together when their anchors are disjoint and each
    injects names of its own there (:func:`_overlap`): each is judged on the file as it is, and the pending
    ones are written one after the other.
    """
    ids = [p.id for p in patches]
    twice = sorted({i for i in ids if ids.count(i) > 1})
    if twice:
        raise PatchDefinitionError(f"patch ids defined twice: {', '.join(twice)}")
    seen: dict[tuple[str, str], list[tuple[str, ReplaceStatements]]] = {}
    for patch in patches:
        for edit in patch.edits:
            key = (edit.file, str(edit.scope))
            for other_id, other in seen.get(key, []):
                why = _overlap(other, edit)
                if why is not None:
                    both = f"patches {other_id} and {patch.id} both"
                    who = both if other_id != patch.id else f"patch {patch.id} twice"
                    raise PatchDefinitionError(
                        f"{who} edit {edit.file}:{edit.scope} with overlapping anchors",
                        why,
                        "give each edit statements of its own to anchor on, and names of its own to inject",
                    )
            seen.setdefault(key, []).append((patch.id, edit))


@lru_cache(maxsize=1)
def _modules() -> tuple:
    import patch_dsv4.patches as package

    found = []
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda i: i.name):
        if not info.name.startswith("_"):
            found.append(importlib.import_module(f"{package.__name__}.{info.name}"))
    return tuple(found)


@lru_cache(maxsize=1)
def _patch_classes() -> tuple[type[Patch], ...]:
    classes = []
    for module in _modules():
        for _, obj in inspect.getmembers(module, inspect.isclass):
            if issubclass(obj, Patch) and obj is not Patch and obj.__module__ == module.__name__:
                check_patch(obj)
                classes.append(obj)
    check_together(classes)
    return tuple(sorted(classes, key=lambda p: p.id))


def discover_patches() -> list[Patch]:
    """One instance of every patch in patches/, in the order they apply: by id."""
    return [cls() for cls in _patch_classes()]


def discover_examples() -> list[tuple[Patch, Example]]:
    pairs = []
    by_module = {type(p).__module__: p for p in discover_patches()}
    for module in _modules():
        for example in getattr(module, "EXAMPLES", ()):
            pairs.append((by_module[module.__name__], example))
    return pairs


def declared_files(patches: list[Patch]) -> frozenset[str]:
    """Every file the patches edit: the only files a state may name."""
    return frozenset(edit.file for patch in patches for edit in patch.edits)
