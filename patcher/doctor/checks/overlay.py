"""rt.overlay-imports: a file of the vLLM tree replaced by another vLLM's leaves names its importers need.

A kit's whole-file overlay from an older vLLM (vcruz305's 0.30-era
``model_executor/model_loader/weight_utils.py`` on 0.34.0) drops module-level
names the rest of the installed tree imports (0.34.0's V4.1 model imports
``drop_checkpoint_cache`` from it; ``model_loader/utils.py`` imports
``finalize_model_weights``): vLLM stops at import, and the error names the
importer, not the overlay (v41-packs.md §5).

How, cheaply (nothing of vLLM is imported):

1. The suspects: each ``vllm/**.py`` whose size differs from pip's RECORD, each
   one RECORD does not list, and each of the same size whose time stamp lies
   outside the install's (older than the bulk of the tree by ten minutes, or
   newer than RECORD itself) and whose sha256 then differs. A pristine tree
   costs one RECORD read and one ``stat`` per file; no file is read.
2. The importers: every ``.py`` of the tree that holds a suspect module's last
   name as bytes (a plain substring search, no parsing), then parsed.
3. Every ``from vllm... import X`` (relative ones resolved) of a suspect, or
   into a suspect, is resolved to its target file (``resolve.module_path``)
   and checked against the names the target binds at module level
   (``resolve.top_level_names``) and its submodules. Skipped: imports under
   ``if TYPE_CHECKING:`` or in a ``try`` that catches the ImportError, targets
   with a module ``__getattr__`` or a star import, compiled modules.

FAIL for a module-level import (vLLM dies at import); WARN for one inside a
function (it fails when that code runs).
"""

from __future__ import annotations

import ast
import csv
import io
import os
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from patch_dsv4.doctor.checks.runtime import pip_install
from patch_dsv4.doctor.readers.base import FAIL, PASS, SKIP, WARN, DoctorContext, Row, check, clip
from patch_dsv4.doctor.readers.files import read_regular_file

RECORD_LIMIT = 16 << 20  # bytes of RECORD read (0.34.0's: ~0.7 MB)
SOURCE_LIMIT = 8 << 20  # bytes of one .py read
WINDOW = 600  # seconds around the bulk of the tree's time stamps that count as "installed with it"
MAX_SUSPECTS = 400  # differing files parsed (an overlay kit: a handful; more is a different vLLM altogether)
IMPORT_ERRORS = {"ImportError", "ModuleNotFoundError", "Exception", "BaseException"}


@dataclass
class Suspects:
    """The files of the tree that are not the ones pip installed."""

    changed: list[str] = field(default_factory=list)  # differ from RECORD (size, or hash)
    unlisted: list[str] = field(default_factory=list)  # not in RECORD at all
    paths: list[str] = field(default_factory=list)  # every .py looked at
    hashed: int = 0  # files whose bytes were read to decide

    @property
    def files(self) -> int:
        return len(self.paths)

    @property
    def all(self) -> list[str]:
        return self.changed + self.unlisted


@dataclass(frozen=True)
class Missing:
    importer: str  # relpath
    line: int
    module: str
    names: tuple[str, ...]
    target: str | None  # relpath of the target module, None where the module itself is missing
    lazy: bool  # inside a function


def _dist_info(root: Path, version: str | None) -> Path | None:
    found = sorted(root.glob("vllm-*.dist-info"))
    if version:
        exact = [p for p in found if p.name == f"vllm-{version}.dist-info"]
        if exact:
            return exact[0]
    return found[0] if len(found) == 1 else None


def read_record(dist_info: Path) -> dict[str, tuple[str, int | None]]:
    """RECORD's ``vllm/**.py`` rows: relpath -> (``sha256=...`` digest, size)."""
    text = read_regular_file(dist_info / "RECORD", RECORD_LIMIT).decode("utf-8")
    rows: dict[str, tuple[str, int | None]] = {}
    for row in csv.reader(io.StringIO(text)):
        if len(row) >= 3 and row[0].startswith("vllm/") and row[0].endswith(".py"):
            size = int(row[2]) if row[2].isdigit() else None
            rows[row[0]] = (row[1], size)
    return rows


def _walk(root: Path) -> dict[str, os.stat_result]:
    """Every ``vllm/**.py`` under ``root`` (site-packages) and its stat, ``__pycache__`` left out."""
    found: dict[str, os.stat_result] = {}
    stack = [root / "vllm"]
    base = len(str(root)) + 1
    while stack:
        folder = stack.pop()
        try:
            entries = list(os.scandir(folder))
        except OSError:
            continue
        for entry in entries:
            if entry.is_dir(follow_symlinks=True):
                if entry.name != "__pycache__":
                    stack.append(Path(entry.path))
            elif entry.name.endswith(".py"):
                try:
                    found[entry.path[base:]] = entry.stat()
                except OSError:
                    continue
    return found


def find_suspects(root: Path, record: dict[str, tuple[str, int | None]], record_mtime: float) -> Suspects:
    """The files that differ from RECORD, found as step 1 of the module docstring says."""
    from patch_dsv4.tree.environment import record_digest

    on_disk = _walk(root)
    suspects = Suspects(paths=sorted(on_disk))
    listed = [stat.st_mtime for rel, stat in on_disk.items() if rel in record]
    bulk = statistics.median(listed) if listed else record_mtime
    low, high = min(bulk, record_mtime) - WINDOW, max(bulk, record_mtime) + 1
    for rel in suspects.paths:
        stat = on_disk[rel]
        if rel not in record:
            suspects.unlisted.append(rel)
            continue
        digest, size = record[rel]
        if size is not None and stat.st_size != size:
            suspects.changed.append(rel)
        elif low <= stat.st_mtime <= high and size is not None:
            continue
        else:
            suspects.hashed += 1
            try:
                data = read_regular_file(root / rel, SOURCE_LIMIT)
            except OSError:
                continue
            if f"sha256={record_digest(data)}" != digest:
                suspects.changed.append(rel)
    return suspects


def module_of(relpath: str) -> str:
    module = relpath[: -len(".py")].replace("/", ".")
    return module[: -len(".__init__")] if module.endswith(".__init__") else module


def _imports(tree: ast.Module):
    """(ImportFrom node, lazy) for each ``from ... import`` that runs when it is reached: module level (in
    if/try/with bodies too) or in a function; under ``if TYPE_CHECKING:`` or a try that catches ImportError, not."""

    def guarded(node: ast.Try) -> bool:
        for handler in node.handlers:
            kinds = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
            if handler.type is None or any(
                (isinstance(k, ast.Name) and k.id in IMPORT_ERRORS)
                or (isinstance(k, ast.Attribute) and k.attr in IMPORT_ERRORS)
                for k in kinds
            ):
                return True
        return False

    def type_checking(node: ast.If) -> bool:
        test = node.test
        return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
            isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
        )

    stack: list[tuple[ast.AST, bool]] = [(node, False) for node in tree.body]
    while stack:
        node, lazy = stack.pop()
        if isinstance(node, ast.ImportFrom):
            yield node, lazy
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            stack.extend((child, True) for child in node.body)
        elif isinstance(node, ast.ClassDef):
            stack.extend((child, lazy) for child in node.body)
        elif isinstance(node, ast.If):
            if not type_checking(node):
                stack.extend((child, lazy) for child in node.body)
            stack.extend((child, lazy) for child in node.orelse)
        elif isinstance(node, ast.Try) or type(node).__name__ == "TryStar":
            if not guarded(node):
                stack.extend((child, lazy) for child in node.body)
            for handler in node.handlers:
                stack.extend((child, lazy) for child in handler.body)
            stack.extend((child, lazy) for child in node.orelse + node.finalbody)
        elif isinstance(node, (ast.With, ast.AsyncWith, ast.For, ast.While)):
            stack.extend((child, lazy) for child in node.body)


class _Tree:
    """The vLLM tree as ``resolve`` reads it (patch.Context over the files), with what a name check needs."""

    def __init__(self, root: Path, version: str):
        from patch_dsv4.patching.patch import Context

        def read(rel: str) -> bytes | None:
            try:
                return read_regular_file(root / rel, SOURCE_LIMIT)
            except OSError:
                return None

        self.root = root
        self.ctx = Context(version, None, None, read)
        self._names: dict[str, set[str] | None] = {}

    def module_file(self, module: str) -> str | None:
        from patch_dsv4.patching.resolve import module_path

        return module_path(self.ctx, module)

    def exists_otherwise(self, module: str) -> bool:
        """A module that is no .py: a compiled extension, or a namespace package (a directory)."""
        base = self.root / module.replace(".", "/")
        if base.is_dir():
            return True
        return any(base.parent.glob(f"{base.name}.*.so")) or (base.parent / f"{base.name}.so").exists()

    def names(self, relpath: str) -> set[str] | None:
        """The names ``relpath`` binds at module level; None where they cannot be known statically."""
        from patch_dsv4.patching.resolve import top_level_names

        if relpath not in self._names:
            tree = self.ctx.ast(relpath)
            if tree is None:
                self._names[relpath] = None
            else:
                opaque = any(
                    isinstance(node, ast.ImportFrom) and any(a.name == "*" for a in node.names) for node in tree.body
                )
                names = set(top_level_names(tree))
                self._names[relpath] = None if opaque or "__getattr__" in names else names
        return self._names[relpath]


# A ``from X import ...`` statement of a file (its indentation, its module, the rest), found without parsing.
_FROM = re.compile(rb"^([ \t]*)from[ \t]+([.\w]+)[ \t]+import[ \t]*(\([^)]*\)|[^\n]*)", re.MULTILINE)


def missing_imports(root: Path, version: str, suspects: list[str], paths: list[str]) -> tuple[list[Missing], int]:
    """The imports of a suspect, or into one, that name what the tree does not bind; and how many files were
    parsed in full. ``paths``: every .py of the tree.

    A suspect is parsed in full. Any other file is searched as bytes for a suspect module's last name; in
    those that hold one, each ``from X import`` statement (found by a pattern) whose X is a suspect module is
    parsed alone when it stands at module level; an indented one makes the file parsed in full, to tell a
    function's import from a guarded one."""
    from patch_dsv4.patching.follow import absolute_module

    tree = _Tree(root, version)
    suspect_set = set(suspects)
    suspect_modules = {module_of(rel) for rel in suspects}
    tokens = {module.rsplit(".", 1)[-1].encode() for module in suspect_modules}
    statements: list[tuple[str, ast.ImportFrom, bool]] = []  # (file, statement, lazy)
    parsed = 0

    def whole(rel: str) -> None:
        nonlocal parsed
        syntax = tree.ctx.ast(rel)
        if syntax is not None:
            parsed += 1
            statements.extend((rel, node, lazy) for node, lazy in _imports(syntax))

    for rel in suspects:
        whole(rel)
    for rel in paths:
        if rel in suspect_set:
            continue
        try:
            data = read_regular_file(root / rel, SOURCE_LIMIT)
        except OSError:
            continue
        if not any(token in data for token in tokens):
            continue
        module = module_of(rel)
        found = []
        for match in _FROM.finditer(data):
            level = len(match.group(2)) - len(match.group(2).lstrip(b"."))
            name = match.group(2).lstrip(b".").decode("ascii", "replace")
            if absolute_module(module, rel.endswith("__init__.py"), level, name or None) in suspect_modules:
                found.append(match)
        if not found:
            continue
        if any(match.group(1) for match in found):
            whole(rel)  # an indented import: its context decides whether it runs, and when
            continue
        for match in found:
            try:
                node = ast.parse(match.group(0).decode("utf-8")).body[0]
            except (SyntaxError, UnicodeDecodeError, ValueError, IndexError):
                continue
            node.lineno = data.count(b"\n", 0, match.start()) + 1
            statements.append((rel, node, False))
    found_missing: list[Missing] = []
    for rel, node, lazy in statements:
        target_module = absolute_module(module_of(rel), rel.endswith("__init__.py"), node.level, node.module)
        if target_module.split(".")[0] != "vllm":
            continue
        target = tree.module_file(target_module)
        if rel not in suspect_set and target not in suspect_set:
            continue  # two files as pip installed them: their imports are the release's own
        if target is None:
            if not tree.exists_otherwise(target_module):
                found_missing.append(Missing(rel, node.lineno, target_module, (), None, lazy))
            continue
        bound = tree.names(target)
        if bound is None:
            continue
        gone = tuple(
            alias.name
            for alias in node.names
            if alias.name not in bound
            and tree.module_file(f"{target_module}.{alias.name}") is None
            and not tree.exists_otherwise(f"{target_module}.{alias.name}")
        )
        if gone:
            found_missing.append(Missing(rel, node.lineno, target_module, gone, target, lazy))
    return sorted(found_missing, key=lambda m: (m.lazy, m.importer, m.line)), parsed


def _summary(missing: list[Missing], suspects: set[str]) -> str:
    """The row's detail: per overlaid file, the names it lacks and who imports them; then the rest."""
    by_target: dict[str, list[Missing]] = {}
    others: list[Missing] = []
    for m in missing:
        if m.target in suspects:
            by_target.setdefault(m.target, []).append(m)
        else:
            others.append(m)
    parts = []
    for target, items in by_target.items():
        names = sorted({n for m in items for n in m.names})
        shown = ", ".join(names[:8]) + (f" (and {len(names) - 8} more)" if len(names) > 8 else "")
        importers = sorted({m.importer for m in items})
        examples = _shown(items, 3)
        parts.append(
            f"{target} differs from pip's RECORD (an overlay from another vLLM) and does not define {shown}, "
            f"which {plural(len(importers), 'file')} of this vLLM import from it ("
            + "; ".join(_describe(m, suspects) for m in examples)
            + (f"; {len(items) - len(examples)} more imports" if len(items) > len(examples) else "")
            + ")"
        )
    for m in others[:3]:
        parts.append(_describe(m, suspects))
    if len(others) > 3:
        parts.append(f"{len(others) - 3} more such imports")
    return "; ".join(parts)


def _first_importer(items: list[Missing]) -> Missing:
    """The importer to name first: a module-level import of a DeepSeek model (V4.1's first), else the first."""
    return _shown(items, 1)[0]


def _shown(items: list[Missing], most: int) -> list[Missing]:
    """Up to ``most`` imports, each naming a name the ones before did not, the DeepSeek models' first."""
    ranked = sorted(items, key=lambda m: (m.lazy, "/deepseek_v41/" not in m.importer, "/deepseek_v4" not in m.importer))
    shown: list[Missing] = []
    names: set[str] = set()
    for m in ranked:
        if len(shown) < most and (not shown or not set(m.names) <= names):
            shown.append(m)
            names.update(m.names)
    return shown


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _describe(m: Missing, suspects: set[str]) -> str:
    lazy = " (inside a function)" if m.lazy else ""
    if m.target is None:
        return f"{m.importer}:{m.line}{lazy} imports the module {m.module}, which this tree does not have"
    names = ", ".join(m.names[:6]) + (f" (and {len(m.names) - 6} more)" if len(m.names) > 6 else "")
    overlaid = "" if m.target in suspects else f", which {m.target} does not define ({m.importer} differs from RECORD)"
    return f"{m.importer}:{m.line}{lazy} imports {names}{overlaid}"


@check("rt.overlay-imports", needs=("runtime",))
def check_overlay_imports(ctx: DoctorContext) -> Row:
    """FAIL when a file of the vLLM tree differs from pip's RECORD (an overlay) and a module-level
    ``from vllm... import X`` of it, or into it, names what the tree does not define: ImportError at
    engine start, named by the importer (v41-packs.md §5; V34 models/deepseek_v41/nvidia/model.py:52-54,
    model_executor/model_loader/utils.py:35; VC overlays/dspark-in-checkpoint weight_utils.py @4f83af62).
    WARN for such an import inside a function."""
    runtime = ctx.runtime
    root, version = runtime.vllm_root, runtime.vllm_version
    if root is None or version is None:
        return Row("rt.overlay-imports", SKIP, "no vLLM tree located.")
    dist_info = _dist_info(root, version)
    if dist_info is None:
        return Row("rt.overlay-imports", SKIP, f"no vllm-{version}.dist-info beside {root / 'vllm'}.")
    try:
        record = read_record(dist_info)
        record_mtime = (dist_info / "RECORD").stat().st_mtime
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        return Row("rt.overlay-imports", SKIP, f"{dist_info / 'RECORD'} cannot be read ({clip(str(exc))}).")
    suspects = find_suspects(root, record, record_mtime)
    reinstall = pip_install(ctx.runtime, "--no-deps", "--force-reinstall", f"vllm=={version}")
    if not suspects.all:
        hashed = f", {suspects.hashed} hashed (time stamps apart from the install's)" if suspects.hashed else ""
        return Row(
            "rt.overlay-imports",
            PASS,
            f"all {suspects.files:,} .py files of vLLM {version} are pip's (RECORD sizes{hashed}): no overlay.",
        )
    if len(suspects.all) > MAX_SUSPECTS:
        return Row(
            "rt.overlay-imports",
            WARN,
            f"{len(suspects.all):,} of the {suspects.files:,} .py files of vLLM {version} differ from pip's RECORD "
            f"(first: {suspects.all[0]}): this is not vLLM {version} as pip installed it.",
            f"Reinstall vLLM ({reinstall}), or use the image that installed this tree.",
        )
    missing, parsed = missing_imports(root, version, suspects.all, suspects.paths)
    suspect_set = set(suspects.all)
    differing = ", ".join(suspects.all[:3]) + (f" (and {len(suspects.all) - 3} more)" if len(suspects.all) > 3 else "")
    fatal = [m for m in missing if not m.lazy]
    if missing:
        first = _first_importer(missing)
        overlay = first.target if first.target in suspect_set else first.importer
        return Row(
            "rt.overlay-imports",
            FAIL if fatal else WARN,
            _summary(missing, suspect_set)
            + (": vLLM stops at import (ImportError)." if fatal else ": it fails when that code runs."),
            f"Restore vLLM {version}'s own {overlay} ({reinstall}), or serve with the kit's own image, whose "
            "vLLM matches its overlay.",
        )
    return Row(
        "rt.overlay-imports",
        PASS,
        f"{plural(len(suspects.all), '.py file')} {'differs' if len(suspects.all) == 1 else 'differ'} from pip's "
        f"RECORD ({differing}); every import of them, or into "
        f"them ({parsed} files parsed), names what this tree defines.",
    )
