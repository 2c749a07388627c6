"""Find the patches by walking the ``patches`` package: no hand-kept list to forget."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from functools import lru_cache

from patcher.patch import Example, Patch


@lru_cache(maxsize=1)
def _modules() -> tuple:
    import patches

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
