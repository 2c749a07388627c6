#!/usr/bin/env python3
# ruff: noqa: E501  (the folder docstrings it writes are data, laid out as they will stand in the package)
"""Lay patch-dsv4's engine out in folders by what its modules are (issue 33, item 4): one scripted move.

Prepared and proved on a copy of the tree first (behaviour byte-identical, 12 floors, no circle); every module
main holds has its line in MOVES. A module added later is placed by RULES and listed "placed by rule": check it.

Run it once, on a clean checkout of the final tree:

    python bench/layout_move.py --repo . --dry-run   # the plan: every move, nothing written
    python bench/layout_move.py --repo . --commit    # move, rewrite, ruff, check, one commit

What it does, in this order (all decided before anything is touched; it stops at the first problem):

1. Every module under patcher/ (doctor/ included) gets its place from MOVES (one line per module) or, for a name
   it does not list, from RULES (the likely names of modules other branches add). A module neither places makes
   it stop before any change and list them: add a line to MOVES for each and run it again.
2. ``git mv`` each module into its folder, and writes each new folder's ``__init__.py`` (FOLDERS: what it holds,
   and a ``May import:`` paragraph that bench/import_map.py checks); doctor/'s and the package's own
   ``__init__`` docstrings get the layout appended.
3. Rewrites every reference in the tracked text files (.py, .md, .toml, .yml, .in, .ci/*; not anchors' JSON):
   import statements (``from patch_dsv4.fastpath import quick; from patch_dsv4.output import render`` is split by folder; relative imports under
   patcher/ become absolute), dotted names anywhere (``patch_dsv4.fastpath.quick.vouched``, ``"patch_dsv4.pipeline.commands"``
   in a test's list, monkeypatch targets, docstrings), import statements inside strings, and paths
   (``patcher/fastpath/quick.py``, ``patch_dsv4/fastpath/quick.py``, ``doctor/readers/base.py``). Each file is rewritten in one pass from
   its original text, so a new name is never rewritten again (the folder ``pipeline/`` has the old module
   ``pipeline``'s name). One code change: doctor/run.py imports its check modules from ``checks``.
4. pyproject's ``packages`` lists every subpackage; a CHANGELOG line.
5. ``ruff check --fix --select I`` (import order) and ``ruff format`` on the files it changed; a docstring or
   comment line a longer name pushed past 120 columns is broken at a space and its paragraph reflowed; then
   ``ruff check .`` and ``ruff format --check .``.
6. Checks: every module of the package imported from the moved tree, laid out as the wheel installs it
   (``--python``: the checkout's .venv by default), and every dotted name or ``from ... import`` of the package
   in the tracked text names a module or a name that is there (references already stale before the move are
   left aside).
7. With ``--commit``: ``git add -A`` and one commit. Without it the moved tree is left staged for review.

If a step after the moves fails, the tree is left as it is for a look: ``git reset --hard && git clean -fd
patcher`` returns to the checkout's commit.

A second run finds the folders there and refuses (exit 1), changing nothing.
"""

from __future__ import annotations

import argparse
import ast
import fnmatch
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# -- the mapping: old path under patcher/ -> folder (or folder/new_name.py) under patcher/ -------------------------
# "." keeps a module at the package's top. A module that moves under another name says so ("pipeline/values.py").
TOP = "."
MOVES = {
    # the top: what is called from outside (the console script, python -m, the Typer app it loads, the vLLM plugin)
    "__init__.py": TOP,
    "__main__.py": TOP,
    "cli.py": TOP,
    "app.py": TOP,
    "guard.py": TOP,
    # the commands and their pipeline: the steps, and the values they pass on
    "commands.py": "pipeline",
    "drift.py": "pipeline",
    "pipeline.py": "pipeline/values.py",
    "reading.py": "pipeline",
    "judge.py": "pipeline",
    "takeover.py": "pipeline",
    "planning.py": "pipeline",
    "transaction.py": "pipeline",
    "reporting.py": "pipeline",
    # release knowledge
    "anchors_store.py": "releases",
    "release_target.py": "releases",
    "release_wheel.py": "releases",
    # what the fast paths (verify's, the guard's) import
    "quick.py": "fastpath",
    "serving.py": "fastpath",
    # the patch model
    "patch.py": "patching",
    "edits.py": "patching",
    "registry.py": "patching",
    "resolve.py": "patching",
    "rewrite.py": "patching",
    "fingerprint.py": "patching",
    "source.py": "patching",
    "follow.py": "patching",  # the call-following facility every probe uses
    # the target environment
    "environment.py": "tree",
    "fs.py": "tree",
    "mounts.py": "tree",  # mount points over site-packages, from /proc/self/mountinfo
    "state.py": "tree",
    "manifest_rules.py": "tree",
    # what a command says
    "verdicts.py": "output",
    "errors.py": "output",
    "render.py": "output",
    # doctor: the command and its writer stay; its checks, and what they read
    "doctor/__init__.py": "doctor",
    "doctor/run.py": "doctor",
    "doctor/fix_config.py": "doctor",
    "doctor/checks/config.py": "doctor/checks",
    "doctor/checks/shards.py": "doctor/checks",
    "doctor/checks/experts.py": "doctor/checks",
    "doctor/checks/dense.py": "doctor/checks",
    "doctor/checks/model.py": "doctor/checks",
    "doctor/checks/runtime.py": "doctor/checks",
    "doctor/checks/environ.py": "doctor/checks",
    "doctor/checks/host.py": "doctor/checks",
    "doctor/readers/base.py": "doctor/readers",
    "doctor/readers/family.py": "doctor/readers",  # which DeepSeek a pack is, and V4.1's config flattened as vLLM reads it
    "doctor/readers/v41_scan.py": "doctor/readers",  # what the V4.1 rows read of the headers (PackScan.v41)
    "doctor/checks/overlay.py": "doctor/checks",  # rt.overlay-imports
    "doctor/checks/v41_config.py": "doctor/checks",
    "doctor/checks/v41_tensors.py": "doctor/checks",
    "doctor/checks/v41_serving.py": "doctor/checks",
    "doctor/checks/v41_engram.py": "doctor/checks",
    "doctor/readers/source.py": "doctor/readers",  # where a pack's files come from: a directory or the Hub
    "doctor/readers/hub.py": "doctor/readers",  # the Hub, by range requests
    "doctor/readers/pack.py": "doctor/readers",
    "doctor/readers/safetensors.py": "doctor/readers",
    "doctor/readers/serving_env.py": "doctor/readers",
}
# The likely names of modules the other branches add (first match wins); MOVES overrides them. Check each one
# the plan shows as placed "by rule": a check module that reads, or a reader named like a check, needs its line.
RULES = [
    ("doctor/v41*.py", "doctor/checks"),  # V4.1's checks
    ("doctor/vision*.py", "doctor/checks"),
    ("doctor/check_*.py", "doctor/checks"),
    (
        "doctor/readers/source.py",
        "doctor/readers",
    ),  # where a pack comes from (a folder, the hub)
    ("doctor/readers/hub.py", "doctor/readers"),
    ("doctor/*_source.py", "doctor/readers"),
    ("doctor/pack_*.py", "doctor/readers"),
    (
        "follow.py",
        "patching",
    ),  # call-following: where a fix lives, followed through calls
    ("follow_*.py", "patching"),
    ("calls.py", "patching"),
    ("mounts.py", "tree"),  # files another tool owns: mount points, overlays
    ("mountinfo.py", "tree"),
    ("overlay.py", "tree"),
    ("overlays.py", "tree"),
]

# -- the folders' __init__ docstrings ------------------------------------------------------------------------------
FOLDERS = {
    "pipeline": """The commands and their pipeline: each command one pipeline of steps over values, written out top to bottom.

``commands`` holds status, verify, apply (and takeover) and revert, ``drift`` the judgement of a release before
it is installed (and ``anchors record``): they alone call the steps. The values the steps pass on (Snapshot,
Judgement and Judged, Plan, Committed) are defined once, in ``values``; each step imports them and no other step:

    reading      the Snapshot: the one step that reads the disk
    judge        every edit's verdict on a tree: the one step that judges
    takeover     the files to restore from another tool's edits, and the bytes that restore them
    planning     what apply or revert will write and record, as one Plan
    transaction  a plan committed as one write transaction: all files or none
    reporting    the Report, made from the snapshot or the plan, reading nothing

May import: patch_dsv4.releases, patch_dsv4.fastpath, patch_dsv4.patching, patch_dsv4.tree, patch_dsv4.output.
""",
    "releases": """Release knowledge: what is known of vLLM releases without installing or importing them.

    anchors_store   the recorded anchors of known releases (anchors/vllm-<version>.json): load, match, write
    release_target  a release to judge, from its wheel or a source tree
    release_wheel   release wheels fetched by version into a cache, and pip's bytes of installed files from them

May import: patch_dsv4.fastpath, patch_dsv4.patching, patch_dsv4.tree, patch_dsv4.output.
""",
    "fastpath": """What the fast paths import: verify's, before Typer loads, and the serve guard's, in every vLLM process.

    quick    are the recorded verdicts still true here? Hashes only, no judging (the state, RECORD, anchors/)
    serving  what a tree will serve, as one string: the fingerprint the nodes of a cluster compare

Nothing heavy at module level: no libcst, Typer, rich, importlib.metadata or packaging, not even json, re or
typing (bench/bench_guard.py times the guard's first call in a cold interpreter, imports included). This
``__init__`` imports nothing: both fast paths import it.

May import: patch_dsv4.tree (at module level, patch_dsv4.tree.manifest_rules alone), patch_dsv4.output.
""",
    "patching": """The patch model: what a patch is, how its edits find and rewrite code, and the rules every patch keeps.

    patch        Patch, Edit, Scope, Context: a patch declares its edits; a Context reads one tree's files
    edits        ReplaceStatements, the edit every patch is made of
    registry     the patches, found by walking patch_dsv4.patches, held to the rules
    resolve      static checks that injected code fits the release it is written into
    rewrite      the files as the pending edits write them (one libcst pass), proven idempotent
    fingerprint  structural fingerprints of code that ignore formatting (ast and hashlib only)
    source       Python source files decoded as Python decodes them, and written back in their own form

The patches themselves are patch_dsv4.patches (patches/), one module each.

May import: patch_dsv4.tree, patch_dsv4.output.
""",
    "tree": """The target environment: the installed vLLM found, its files read and written safely, our state in it.

    environment     the installed vLLM (and FlashInfer), found from distribution metadata alone
    fs              file operations that stay inside the environment and never leave a file half-written
    state           what patch-dsv4 keeps there: the manifest, the backups, the lock
    manifest_rules  what a manifest may say, its paths and its fields, checked without touching the disk

May import: patch_dsv4.output.
""",
    "output": """What a command says: its verdicts and report as typed values, its expected errors, and how they print.

    verdicts  Verdict, Outcome, PatchReport, Report: what the engine decides
    errors    expected failures, each with what failed, why and the command to run next; the exit statuses
    render    reports for people (text), machines (JSON, described by report.schema.json at the package's top)
              and pull requests or issues (Markdown)

May import: nothing of the package; everything else stands on it.
""",
    "doctor/checks": """Doctor's checks, one module per concern; importing one registers its checks, in report order.

doctor.run imports them in the order of its CHECK_MODULES (the pack's, the runtime's, the environment's, the
host's). Each check is one function registered with readers.base.check: it reads files, os.environ, /proc or
distribution metadata only (never imports torch, vLLM, exllamav3 or the plugin, never loads a weight, never
writes to the pack) and returns rows.

    v41_config   a DeepSeek-V4.1 pack's config, read flattened as vLLM reads it
    config       config.json and its quantization block
    shards       the shard files, the index, the links
    v41_tensors  a V4.1 pack's kind, its Engram tables, backbone, experts and vision tower, from the headers
    experts      every routed expert present, shaped as the config says, one K per layer; the trellis
                 widths and the codebook markers
    dense        the weights outside the routed experts, the MTP draft, the delegate
    model        the model keys against the serving vLLM and flags
    runtime      the serving interpreter's packages
    v41_serving  V4.1's serving: DSpark, the EP filter, the topology, the indexer top-k, the streams, FlashInfer
    v41_engram   the Engram tables against the host's memory
    overlay      files of vLLM overlaid from another vLLM, and the names their importers lack
    environ      environment variables and serve flags
    host         the GPUs, memory, page cache

May import: patch_dsv4.doctor.readers.
""",
    "doctor/readers": """What doctor's checks read, and what they are made of.

    base         the rows doctor prints, the context every check reads, the check registry
    family       which DeepSeek a pack is, and V4.1's nested config flattened as vLLM reads it
    source       where a pack's files come from: a local directory, or a repository on the Hub
    hub          a pack on the Hugging Face Hub, read by HTTP range requests (the optional extra)
    pack         the pack, read once: the shards' headers summarised, what config.json declares
    v41_scan     what the V4.1 rows read of the headers
    safetensors  safetensors shard headers, and single marker tensors, read without loading a payload
    serving_env  what doctor reads of the serving environment, without importing any of it

May import: nothing of the package outside this folder.
""",
}
DOCTOR_LAYOUT = """
Layout: ``run`` (the command) and ``fix_config`` (``--fix-config``'s writer) here; the checks in ``checks/``;
what they read, and the rows and context they share, in ``readers/``.

May import: patch_dsv4.doctor, patch_dsv4.pipeline.values, patch_dsv4.fastpath, patch_dsv4.tree, patch_dsv4.output.
"""
PACKAGE_DOC = '''"""patch-dsv4: versioned, verifiable source edits to vLLM's DeepSeek-V4 code.

The package's top holds what is called from outside: ``cli`` (the ``patch-dsv4`` console script, and
``python -m patch_dsv4`` through ``__main__``), ``app`` (the Typer command line it loads) and ``guard`` (the
vLLM plugin, entry point ``patch_dsv4.guard:check``). The engine lies in folders, each importing only folders
below it (bench/import_map.py counts the floors):

    doctor/    the doctor command: its checks/, and what they read (readers/)
    pipeline/  the commands (status, verify, apply, takeover, revert, drift) and their steps
    releases/  recorded anchors, a release to judge, release wheels
    fastpath/  what verify's fast path and the guard import: recorded verdicts by hashes, the serving fingerprint
    patching/  the patch model: Patch and its edits, the registry, code fingerprints, rewriting
    tree/      the target environment: the installed vLLM, safe file operations, our state
    output/    verdicts, reports, expected errors, and how they print

patch_dsv4.patches (patches/) holds one module per patch, patch_dsv4.anchors (anchors/) the recorded releases.
"""'''
OLD_PACKAGE_DOC = '"""patch-dsv4: versioned, verifiable source edits to vLLM\'s DeepSeek-V4 code."""'
CHANGELOG_LINE = (
    "- The engine is laid out in folders by what its modules are (pipeline/, releases/, fastpath/, patching/,\n"
    "  tree/, output/; doctor/ in checks/ and readers/), each `__init__` saying what it holds and what it may\n"
    "  import; the top keeps `cli`, `app` and `guard` (the entry points `patch_dsv4.cli:main` and\n"
    "  `patch_dsv4.guard:check` unchanged). Behaviour unchanged (bench/compare_commands.py).\n"
)
# The one code change the move needs: doctor/run.py imports its check modules by name.
SPECIAL = {
    "patcher/doctor/run.py": [('f"{__package__}.{name}"', 'f"{__package__}.checks.{name}"', 2)],
}
TEXT_SUFFIXES = {
    ".py",
    ".md",
    ".toml",
    ".yml",
    ".yaml",
    ".in",
    ".txt",
    ".cfg",
    ".sh",
    ".ini",
}
SKIP_TEXT = ("anchors/",)  # recorded data, never rewritten
PKG = "patch_dsv4"


class Stop(Exception):
    pass


def git(repo: Path, *args: str, capture: bool = True) -> str:
    run = subprocess.run(["git", "-C", str(repo), *args], capture_output=capture, text=True, check=False)
    if run.returncode != 0:
        raise Stop(f"git {' '.join(args)} failed: {(run.stderr or '').strip()}")
    return run.stdout if capture else ""


# -- 1. the plan ---------------------------------------------------------------------------------------------------
def destination(rel: str) -> tuple[str, str] | None:
    """(new path under patcher/, how it was placed) for a module's path under patcher/, or None."""
    place, how = MOVES.get(rel), "listed"
    if place is None:
        how = "by rule"
        place = next(
            (folder for pattern, folder in RULES if fnmatch.fnmatchcase(rel, pattern)),
            None,
        )
    if place is None:
        return None
    name = rel.rpartition("/")[2]
    if place.endswith(".py"):
        return place, how
    return (name if place == TOP else f"{place}/{name}"), how


def dotted(rel: str) -> str:
    """patcher/-relative path of a module -> its dotted name (a package's __init__: the package)."""
    parts = rel[: -len(".py")].split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join([PKG, *parts])


def plan(repo: Path) -> dict:
    done = [f for f in FOLDERS if (repo / "patcher" / f / "__init__.py").exists()]
    if done:
        raise Stop(f"already laid out: patcher/{done[0]}/__init__.py exists (a second run changes nothing)")
    tracked = git(repo, "ls-files", "patcher").split("\n")
    modules = sorted(p[len("patcher/") :] for p in tracked if p.endswith(".py"))
    moves, unplaced, by_rule = {}, [], []
    for rel in modules:
        placed = destination(rel)
        if placed is None:
            unplaced.append(rel)
            continue
        new, how = placed
        if how == "by rule":
            by_rule.append((rel, new))
        if new != rel:
            moves[rel] = new
    if unplaced:
        raise Stop(
            "modules MOVES does not place (add a line for each to MOVES, then run again):\n"
            + "\n".join(f"  patcher/{rel}" for rel in unplaced)
        )
    folders = sorted({new.rpartition("/")[0] for new in moves.values() if "/" in new})
    existing = [f for f in folders if (repo / "patcher" / f / "__init__.py").exists() and f != "doctor"]
    if existing:
        raise Stop(f"already laid out: patcher/{existing[0]}/__init__.py exists (a second run changes nothing)")
    targets = {}
    for rel, new in moves.items():
        if new in targets or (new not in moves and (repo / "patcher" / new).exists()):
            raise Stop(f"two modules would be patcher/{new}")
        targets[new] = rel
    names = {dotted(rel): dotted(new) for rel, new in moves.items() if dotted(rel) != dotted(new)}
    paths = {rel[: -len(".py")]: new[: -len(".py")] for rel, new in moves.items()}
    return {
        "moves": moves,
        "names": names,
        "paths": paths,
        "by_rule": by_rule,
        "folders": folders,
    }


# -- 3. rewriting --------------------------------------------------------------------------------------------------
class Rewriter:
    def __init__(self, names: dict[str, str], paths: dict[str, str]):
        self.names = names
        alternatives = "|".join(re.escape(n[len(PKG) + 1 :]) for n in sorted(names, key=len, reverse=True))
        self.dotted_re = re.compile(rf"(?<![\w.]){PKG}\.({alternatives})(?![\w])")
        self.import_re = re.compile(
            rf"(?<![\w.])from ({PKG}(?:\.\w+)*) import (\w+(?: as \w+)?(?:, *\w+(?: as \w+)?)*)"
        )
        path_alts = "|".join(re.escape(p) for p in sorted(paths, key=len, reverse=True) if p != "__init__")
        self.paths = paths
        self.path_re = re.compile(rf"(?<![\w.-])(patcher|{PKG})/({path_alts})\.py(?![\w])")
        doctor = {p[len("doctor/") :]: n for p, n in paths.items() if p.startswith("doctor/")}
        self.doctor_paths = doctor
        doctor_alts = "|".join(re.escape(p) for p in sorted(doctor, key=len, reverse=True) if p != "__init__")
        self.doctor_re = re.compile(rf"(?<![\w/.-])doctor/({doctor_alts})\.py(?![\w])") if doctor_alts else None

    def regroup(self, module: str, aliases: list[tuple[str, str | None]]) -> list[tuple[str, list[str]]] | None:
        """``from module import aliases`` as statements grouped by new module, or None when nothing moves."""
        moved = module in self.names  # the module itself moved: the names in it stay together
        changed = moved
        module = self.names.get(module, module)
        groups: dict[str, list[str]] = {}
        for name, asname in aliases:
            full = f"{module}.{name}"
            if not moved and full in self.names:
                new_parent, _, leaf = self.names[full].rpartition(".")
                alias = asname or (name if leaf != name else None)
                groups.setdefault(new_parent, []).append(leaf + (f" as {alias}" if alias else ""))
                changed = True
            else:
                groups.setdefault(module, []).append(name + (f" as {asname}" if asname else ""))
        return list(groups.items()) if changed else None

    def rewrite(self, text: str, module: str | None, is_py: bool) -> str:
        """One pass over ``text``: every edit is located on the original text, then all are applied at once."""
        edits: list[tuple[int, int, str]] = []
        starts = _line_starts(text)
        if is_py:
            tree = ast.parse(text)
            for node in ast.walk(tree):
                if not isinstance(node, ast.ImportFrom):
                    continue
                base = node.module or ""
                if node.level:
                    if module is None:
                        continue  # a relative import outside the package (tests/): nothing of ours moves under it
                    package = module.split(".") if module.endswith("__init__") else module.split(".")[:-1]
                    package = [p for p in package if p != "__init__"]
                    base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
                if base != PKG and not base.startswith(PKG + "."):
                    continue
                aliases = [(a.name, a.asname) for a in node.names]
                groups = self.regroup(base, aliases)
                if groups is None and not node.level:
                    continue
                groups = groups or [(base, [n + (f" as {a}" if a else "") for n, a in aliases])]
                start = starts[node.lineno - 1] + node.col_offset
                end = starts[node.end_lineno - 1] + node.end_col_offset
                written = [n + (f" as {a}" if a else "") for n, a in aliases]
                if len(groups) == 1 and groups[0][1] == written:  # only the module changes: comments kept
                    head = text.index(" import", start)
                    edits.append((start + len("from "), head, groups[0][0]))
                    continue
                if "#" in text[start:end]:
                    raise Stop(f"line {node.lineno}: a comment inside an import that splits: rewrite it by hand")
                line_head = text[starts[node.lineno - 1] : start]
                joiner = "\n" + line_head if not line_head.strip() else "; "
                new = joiner.join(f"from {m} import {', '.join(names)}" for m, names in groups)
                edits.append((start, end, new))
        taken = sorted(edits)

        def free(a: int, b: int) -> bool:
            return all(b <= s or a >= e for s, e, _ in taken)

        for match in self.import_re.finditer(text):  # import statements inside strings (tests run code in children)
            if not free(match.start(), match.end()):
                continue
            aliases = []
            for part in match.group(2).split(","):
                name, _, asname = part.strip().partition(" as ")
                aliases.append((name, asname or None))
            groups = self.regroup(match.group(1), aliases)
            if groups is not None:
                new = "; ".join(f"from {m} import {', '.join(names)}" for m, names in groups)
                edits.append((match.start(), match.end(), new))
                taken.append((match.start(), match.end(), new))
        for match in self.dotted_re.finditer(text):
            if free(match.start(), match.end()):
                edits.append((match.start(), match.end(), self.names[f"{PKG}.{match.group(1)}"]))
        for match in self.path_re.finditer(text):
            if free(match.start(), match.end()):
                edits.append(
                    (
                        match.start(),
                        match.end(),
                        f"{match.group(1)}/{self.paths[match.group(2)]}.py",
                    )
                )
        if self.doctor_re is not None:
            for match in self.doctor_re.finditer(text):
                if free(match.start(), match.end()):
                    edits.append(
                        (
                            match.start(),
                            match.end(),
                            f"{self.doctor_paths[match.group(1)]}.py",
                        )
                    )
        out, last = [], 0
        for start, end, new in sorted(edits):
            if start < last:
                raise Stop("overlapping rewrites (a bug of this script)")
            out += [text[last:start], new]
            last = end
        return "".join(out) + text[last:]


def _line_starts(text: str) -> list[int]:
    starts, at = [0], 0
    for line in text.splitlines(keepends=True):
        at += len(line)
        starts.append(at)
    return starts


def text_files(repo: Path) -> list[str]:
    out = []
    for rel in git(repo, "ls-files").split("\n"):
        if not rel or rel.startswith(SKIP_TEXT):
            continue
        if Path(rel).suffix in TEXT_SUFFIXES or rel.startswith(".ci/") or rel in ("MANIFEST.in",):
            out.append(rel)
    return out


# -- the check: every reference to the package names something that is there ---------------------------------------
_REF = re.compile(rf"(?<![\w.]){PKG}((?:\.\w+)+)")
_FROM = re.compile(
    rf"(?<![\w.])from ({PKG}(?:\.\w+)*) import \(?\s*(\w+(?:\s+as\s+\w+)?(?:\s*,\s*\w+(?:\s+as\s+\w+)?)*)"
)  # noqa: E501


def _package_names(repo: Path) -> dict[str, set[str] | None]:
    """Dotted name -> the names a package offers (its submodules, what its __init__ assigns), None for a module."""
    roots = {PKG: repo / "patcher", f"{PKG}.patches": repo / "patches", f"{PKG}.anchors": repo / "anchors"}
    out: dict[str, set[str] | None] = {}
    for top_name, top in roots.items():
        for init in top.rglob("__init__.py"):
            if "__pycache__" in init.parts:
                continue
            name = ".".join([top_name, *init.parent.relative_to(top).parts])
            offers = (
                {"__file__", "__path__", "__name__", "__doc__"}
                | {p.stem for p in init.parent.glob("*.py")}
                | {p.name for p in init.parent.iterdir() if (p / "__init__.py").is_file()}
            )
            for node in ast.parse(init.read_text(encoding="utf-8")).body:
                for target in getattr(node, "targets", []) + [getattr(node, "target", None)]:
                    if isinstance(target, ast.Name):
                        offers.add(target.id)
                if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                    offers.add(node.name)
            out[name] = offers
            for module in init.parent.glob("*.py"):
                if module.stem != "__init__":
                    out[f"{name}.{module.stem}"] = None
    out[PKG].update({"patches", "anchors"})
    return out


def stale_references(repo: Path) -> set[tuple[str, str]]:
    """(file, reference) for every dotted name or import of the package in the tracked text that names nothing."""
    names = _package_names(repo)

    def resolves(parts: list[str]) -> bool:
        current = PKG
        for part in parts:
            offers = names.get(current)
            if offers is None:
                return True  # a module: the rest are its attributes
            if part not in offers:
                return False
            current = f"{current}.{part}"
        return True

    found = set()
    for rel in text_files(repo):
        path = repo / rel
        if not path.is_file():
            continue
        text = path.read_text(encoding="utf-8")
        for match in _REF.finditer(text):
            if not resolves(match.group(1).split(".")[1:]):
                found.add((rel, PKG + match.group(1)))
        for match in _FROM.finditer(text):
            module = match.group(1).split(".")[1:]
            for alias in re.split(r"\s*,\s*", match.group(2).strip()):
                name = alias.split()[0]
                if not resolves([*module, name]):
                    found.add((rel, f"from {match.group(1)} import {name}"))
    return found


# -- the steps -----------------------------------------------------------------------------------------------------
def _moved(the_plan: dict, rel: str) -> str:
    inner = rel[len("patcher/") :]
    return f"patcher/{the_plan['moves'][inner]}" if rel.startswith("patcher/") and inner in the_plan["moves"] else rel


def check_special(repo: Path) -> None:
    for rel, replacements in SPECIAL.items():
        text = (repo / rel).read_text(encoding="utf-8")
        for old, _new, count in replacements:
            if text.count(old) != count:
                raise Stop(f"{rel}: expected {count} of {old!r}, found {text.count(old)}: update SPECIAL for it")


def apply_plan(repo: Path, the_plan: dict) -> list[str]:
    moves, names, paths = the_plan["moves"], the_plan["names"], the_plan["paths"]
    rewriter = Rewriter(names, paths)
    files = text_files(repo)
    # the rewrites are decided on the original files (their old module names), then written after the moves
    new_texts: dict[str, str] = {}
    for rel in files:
        path = repo / rel
        text = path.read_text(encoding="utf-8")
        module = dotted(rel[len("patcher/") :]) if rel.startswith("patcher/") and rel.endswith(".py") else None
        if module is not None and rel.endswith("__init__.py"):
            module += ".__init__"
        try:
            new = rewriter.rewrite(text, module, rel.endswith(".py"))
        except Stop as stop:
            raise Stop(f"{rel}: {stop}") from None
        for old, replacement, _count in SPECIAL.get(rel, []):
            new = new.replace(old, replacement)
        if new != text:
            new_texts[rel] = new
    for folder in the_plan["folders"]:
        (repo / "patcher" / folder).mkdir(parents=True, exist_ok=True)
    for rel, new in moves.items():
        git(repo, "mv", f"patcher/{rel}", f"patcher/{new}")
    changed = []
    for rel, text in new_texts.items():
        moved = f"patcher/{moves[rel[len('patcher/') :]]}" if rel[len("patcher/") :] in moves else rel
        (repo / moved).write_text(text, encoding="utf-8")
        changed.append(moved)
    for folder in the_plan["folders"]:
        init = repo / "patcher" / folder / "__init__.py"
        if folder == "doctor":
            continue
        if folder not in FOLDERS:
            raise Stop(f"no docstring for the new folder patcher/{folder}: add it to FOLDERS")
        init.write_text('"""' + FOLDERS[folder].rstrip("\n") + '\n"""\n', encoding="utf-8")
        changed.append(str(init.relative_to(repo)))
    doctor_init = repo / "patcher/doctor/__init__.py"
    text = doctor_init.read_text(encoding="utf-8")
    end = text.index('"""', 3)
    doctor_init.write_text(text[:end].rstrip("\n") + "\n" + DOCTOR_LAYOUT + text[end:], encoding="utf-8")
    package_init = repo / "patcher/__init__.py"
    text = package_init.read_text(encoding="utf-8")
    if OLD_PACKAGE_DOC in text:
        package_init.write_text(text.replace(OLD_PACKAGE_DOC, PACKAGE_DOC), encoding="utf-8")
    else:
        print("note: patcher/__init__.py's docstring is not the one this script knows; the layout is not added")
    changed += ["patcher/doctor/__init__.py", "patcher/__init__.py"]
    pyproject(repo)
    changelog(repo)
    git(repo, "add", "-A", "patcher")
    return sorted(set(changed))


def pyproject(repo: Path) -> None:
    path = repo / "pyproject.toml"
    text = path.read_text(encoding="utf-8")
    match = re.search(r"^packages = \[([^\]]*)\]", text, re.MULTILINE)
    if not match:
        raise Stop("pyproject.toml: no [tool.setuptools] packages = [...] line")
    listed = re.findall(r'"([^"]+)"', match.group(1))
    found = sorted(
        ".".join([PKG, *init.parent.relative_to(repo / "patcher").parts])
        for init in (repo / "patcher").rglob("__init__.py")
        if "__pycache__" not in init.parts
    )
    others = [
        p for p in listed if p != PKG and not p.startswith(PKG + ".") or p in (f"{PKG}.patches", f"{PKG}.anchors")
    ]
    ordered = [p for p in found if p not in others] + [p for p in listed if p not in found and p not in others]
    ordered += others
    body = "".join(f'    "{p}",\n' for p in ordered)
    path.write_text(
        text[: match.start()] + f"packages = [\n{body}]" + text[match.end() :],
        encoding="utf-8",
    )


def changelog(repo: Path) -> None:
    path = repo / "CHANGELOG.md"
    text = path.read_text(encoding="utf-8")
    anchor = "### Changed (house)\n"
    if anchor not in text:
        print("note: CHANGELOG.md has no '### Changed (house)' heading; add the line by hand:\n" + CHANGELOG_LINE)
        return
    path.write_text(text.replace(anchor, anchor + CHANGELOG_LINE, 1), encoding="utf-8")


# -- long lines: a longer name can push a docstring or comment line past 120 columns -------------------------------
LIMIT = 120
_NOT_PROSE = re.compile(r"^(?:[-*|] |\d+\. |>>>|\"\"\"|\'\'\'|\w+ {2,})")


def _docstring_lines(tree: ast.AST) -> set[int]:
    """0-based line numbers inside docstrings (module, class, function)."""
    out = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            value = body[0].value
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                out.update(range(body[0].lineno - 1, body[0].end_lineno))
    return out


def reflow(text: str, flagged: list[int]) -> tuple[str, list[int]]:
    """Each flagged (1-based) line of a docstring or a whole-line comment broken at a space, the rest carried into
    the next line of its paragraph (or a new line): the lines it cannot, returned."""
    lines = text.split("\n")
    docs = _docstring_lines(ast.parse(text))
    left = []
    for number in sorted(flagged, reverse=True):
        i = number - 1
        comment = lines[i].lstrip().startswith("#")
        if not comment and i not in docs:
            left.append(number)
            continue
        while len(lines[i]) > LIMIT:
            line = lines[i]
            indent = len(line) - len(line.lstrip())
            lead = " " * indent + ("# " if comment else "")
            brk = line.rfind(" ", len(lead) + 1, LIMIT + 1)
            if brk <= len(lead):
                left.append(i + 1)
                break
            head, tail = line[:brk].rstrip(), line[brk + 1 :]
            nxt = lines[i + 1] if i + 1 < len(lines) else ""
            body = nxt[indent:]
            same = nxt.strip() and len(nxt) - len(nxt.lstrip()) == indent and (i + 1 in docs or comment)
            if comment:
                same = same and body.startswith("# ") and not _NOT_PROSE.match(body[2:])
            else:
                same = same and not _NOT_PROSE.match(body) and '"""' not in tail and "'''" not in tail
            lines[i] = head
            if same:
                lines[i + 1] = lead + tail + " " + body[len(lead) - indent :]
            else:
                lines.insert(i + 1, lead + tail)
                docs = {d + 1 if d > i else d for d in docs} | ({i + 1} if i in docs else set())
            i += 1
    return "\n".join(lines), left


def fix_long_lines(repo: Path, ruff: str, files: list[str]) -> list[str]:
    """Reflow the E501 lines of ``files`` until none is left or no progress; the lines left, as file:line."""
    import json

    left: list[str] = []
    for _round in range(50):
        out = subprocess.run(
            [
                ruff,
                "check",
                "--select",
                "E501",
                "--output-format",
                "json",
                "--quiet",
                *files,
            ],
            cwd=repo,
            check=False,
            capture_output=True,
            text=True,
        ).stdout
        found: dict[str, list[int]] = {}
        for item in json.loads(out or "[]"):
            rel = str(Path(item["filename"]).resolve().relative_to(repo))
            found.setdefault(rel, []).append(item["location"]["row"])
        left = []
        progress = False
        for rel, rows in found.items():
            path = repo / rel
            text = path.read_text(encoding="utf-8")
            new, stuck = reflow(text, rows)
            left += [f"{rel}:{row}" for row in stuck]
            if new != text:
                path.write_text(new, encoding="utf-8")
                progress = True
        if not found or not progress:
            break
    return left


def run(cmd: list[str], repo: Path, check: bool = True) -> int:
    shown = [c for c in cmd if not c.endswith(".py")]
    print("+ " + " ".join(shown) + (f" ({len(cmd) - len(shown)} files)" if len(shown) < len(cmd) else ""))
    code = subprocess.run(cmd, cwd=repo, check=False).returncode
    if check and code != 0:
        raise Stop(f"{' '.join(cmd)} failed (exit {code})")
    return code


def import_everything(repo: Path, python: str) -> None:
    """Every module of the package imported from the moved tree, laid out as the wheel installs it."""
    with tempfile.TemporaryDirectory() as tmp:
        pkg = Path(tmp) / PKG
        ignore = shutil.ignore_patterns("__pycache__")
        shutil.copytree(repo / "patcher", pkg, ignore=ignore)
        shutil.copytree(repo / "patches", pkg / "patches", ignore=ignore)
        shutil.copytree(repo / "anchors", pkg / "anchors", ignore=ignore)
        names = sorted(
            ".".join([PKG, *p.relative_to(pkg).with_suffix("").parts]).removesuffix(".__init__")
            for p in pkg.rglob("*.py")
            if p.name != "__main__.py"
        )
        code = (
            f"import importlib, sys; sys.path.insert(0, {tmp!r}); import {PKG}; "
            f"assert {PKG}.__file__.startswith({tmp!r}); "
            f"[importlib.import_module(n) for n in {names!r}]; print(len({names!r}), 'modules import')"
        )
        if subprocess.run([python, "-c", code], cwd=tmp, check=False).returncode != 0:
            raise Stop("a module of the moved tree does not import (above)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--repo",
        type=Path,
        default=Path.cwd(),
        help="the checkout to lay out (default: .)",
    )
    parser.add_argument("--dry-run", action="store_true", help="print the plan, change nothing")
    parser.add_argument("--commit", action="store_true", help="commit the result (one commit)")
    parser.add_argument(
        "--python",
        help="the interpreter that imports the moved tree (default: REPO/.venv)",
    )
    parser.add_argument(
        "--ruff",
        help="the ruff to run (default: REPO/.venv/bin/ruff, else ruff on PATH)",
    )
    args = parser.parse_args()
    repo = args.repo.resolve()
    try:
        the_plan = plan(repo)
        check_special(repo)
        for rel, new in sorted(the_plan["moves"].items(), key=lambda kv: kv[1]):
            print(f"  patcher/{rel:24} -> patcher/{new}")
        for rel, new in the_plan["by_rule"]:
            print(f"placed by rule (check it): patcher/{rel} -> patcher/{new}")
        if args.dry_run:
            print(f"{len(the_plan['moves'])} moves into {', '.join(the_plan['folders'])}; nothing changed (--dry-run)")
            return 0
        if git(repo, "status", "--porcelain", "--untracked-files=no").strip():
            raise Stop(f"{repo} has uncommitted changes: commit or stash them first")
        stale_before = stale_references(repo)
        changed = apply_plan(repo, the_plan)
        ruff = args.ruff or (str(repo / ".venv/bin/ruff") if (repo / ".venv/bin/ruff").exists() else "ruff")
        py = [c for c in changed if c.endswith(".py") and (repo / c).exists()]
        run([ruff, "check", "--fix", "--select", "I", "--quiet", *py], repo)
        run([ruff, "format", "--quiet", *py], repo)
        long_lines = fix_long_lines(repo, ruff, py)
        if long_lines:
            print("lines over 120 columns the script cannot break (fix them by hand, then commit):")
            print("\n".join(f"  {x}" for x in long_lines))
        run([ruff, "check", "."], repo)
        run([ruff, "format", "--check", "."], repo)
        python = args.python or (str(repo / ".venv/bin/python") if (repo / ".venv/bin/python").exists() else None)
        import_everything(repo, python or sys.executable)
        stale = sorted(stale_references(repo) - {(_moved(the_plan, f), r) for f, r in stale_before})
        if stale:
            raise Stop(
                "references that name nothing in the moved tree (fix them, then commit):\n"
                + "\n".join(f"  {f}: {r}" for f, r in stale)
            )
        print("every reference to the package names a module or a name that is there")
        for folder in the_plan["folders"]:
            doc = (repo / "patcher" / folder / "__init__.py").read_text(encoding="utf-8")
            stems = [m.stem for m in (repo / "patcher" / folder).glob("*.py") if m.stem != "__init__"]
            listed = [s for s in stems if re.search(rf"\b{s}\b", doc)]
            for stem in sorted(set(stems) - set(listed)) if listed else []:
                print(f"note: patcher/{folder}/__init__.py does not name {stem}.py: describe it there")
        if args.commit:
            git(repo, "add", "-A")
            message = (
                "Lay the engine out in folders by what its modules are (issue 33 item 4), by "
                "/work/wt/briefs/layout_move.py: git mv of each module, every import, dotted name and path "
                "rewritten, each folder's __init__ saying what it holds and may import; behaviour unchanged"
            )
            git(repo, "commit", "-q", "-m", message)
            print(git(repo, "log", "--oneline", "-1").strip())
        else:
            print("moved and checked; not committed (pass --commit, or review `git status` and commit)")
        return 0
    except Stop as stop:
        print(f"layout_move: {stop}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
