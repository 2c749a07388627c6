"""Find the patches by walking the ``patches`` package: no hand-kept list to forget."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from functools import lru_cache

from patch_dsv4.patch import Example, Patch


@lru_cache(maxsize=1)
def _modules() -> tuple:
    import patch_dsv4.patches as patches

    found = []
    for info in sorted(pkgutil.iter_modules(patches.__path__), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue
        found.append(importlib.import_module(f"patches.{info.name}"))
    return tuple(found)


def discover_patches() -> list[Patch]:
    """One instance of every Patch subclass defined in patches/, ordered by module name."""
    result = []
    for module in _modules():
        for _, obj in inspect.getmembers(module, inspect.isclass):
            if issubclass(obj, Patch) and obj is not Patch and obj.__module__ == module.__name__:
                result.append(obj())
    ids = [p.id for p in result]
    duplicates = {i for i in ids if ids.count(i) > 1}
    if duplicates:
        raise RuntimeError(f"patch ids defined twice: {sorted(duplicates)}")
    return result


def discover_examples() -> list[tuple[Patch, Example]]:
    pairs = []
    patches_by_module = {type(p).__module__: p for p in discover_patches()}
    for module in _modules():
        for example in getattr(module, "EXAMPLES", ()):
            pairs.append((patches_by_module[module.__name__], example))
    return pairs


def declared_files(patches: list[Patch]) -> frozenset[str]:
    """Every file the patches edit: the only files a state may name."""
    from patch_dsv4.patch import Context

    empty = Context.from_texts({})
    return frozenset(edit.file for patch in patches for edit in patch.edits(empty))


def patch_digest() -> str:
    """A hash of the patch definitions and the engine that judges them.

    verify's fast path trusts recorded verdicts only if they were made by the
    same definitions; the package version does not change between commits.
    """
    import hashlib
    from pathlib import Path

    import patch_dsv4
    import patch_dsv4.patches as patches

    digest = hashlib.sha256(patch_dsv4.__version__.encode())
    for package in (patch_dsv4, patches):
        for path in sorted(Path(package.__file__).parent.glob("*.py")):
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()
