"""The package's import map: floors, back arrows and circles, of modules and of folders, names mapped to folders.

Every ``import`` of the package's own modules is followed, at module level, inside functions (a lazy import is
still a dependency) and under ``if TYPE_CHECKING`` (a type a step names is one it depends on; ``--runtime``
leaves those out). Names map to files as pyproject's package-dir says: ``patch_dsv4.X`` is ``patcher/X``, and
``patch_dsv4.doctor.checks.X`` is ``patcher/doctor/checks/X`` (every folder under patcher/ with an
``__init__.py`` is a subpackage), ``patch_dsv4.patches.X`` is ``patches/X``, ``patch_dsv4.anchors`` is
``anchors``; a package's ``__init__`` is named by its folder.

Modules:
- circles: groups of modules that import one another, directly or not (strongly connected, more than one);
- back arrows: imports that close a circle (the edges a depth-first walk in name order finds going back up);
- floors: with the back arrows left out, the longest chain of imports from a module down to one that imports
  nothing of the package, counted in modules (a module importing nothing of ours stands on floor 1).

Folders (a module's folder is its package; the same three counts over the folders, where folder A imports
folder B when a module of A imports one of B): an import of a package's ``__init__`` that itself imports
nothing (a docstring, ``__version__``, a ``__path__`` to walk) is no arrow between folders. A folder whose
``__init__`` docstring has a paragraph starting ``May import:`` names there the folders (dotted, e.g.
``patch_dsv4.tree``; one names its subfolders too) its modules may import; any other import from it is listed
as undeclared. Package ``__init__``s that import anything at all (the fast paths import them) are listed.

    python bench/import_map.py [--checkout DIR] [--only patcher] [--runtime] [--list]
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Import package -> repository folder (pyproject's package-dir); subfolders with an __init__.py are subpackages.
PACKAGE_DIRS = {"patch_dsv4": "patcher", "patch_dsv4.patches": "patches", "patch_dsv4.anchors": "anchors"}


def modules(checkout: Path) -> dict[str, Path]:
    """Dotted name -> file, for every module of the package in ``checkout``."""
    found = {}
    for package, folder in PACKAGE_DIRS.items():
        top = checkout / folder
        for path in sorted(top.rglob("*.py")):
            parts = path.relative_to(top).with_suffix("").parts
            packages = (top.joinpath(*parts[:i]) for i in range(len(parts)))
            if not all((p / "__init__.py").is_file() for p in packages):
                continue  # a folder without __init__.py (__pycache__ too) is no subpackage
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((package, *parts))] = path
    return found


def folder_name(name: str) -> str:
    """A dotted name as the repository path it comes from (no suffix)."""
    for package, folder in sorted(PACKAGE_DIRS.items(), key=lambda kv: -len(kv[0])):
        if name == package or name.startswith(package + "."):
            return folder + name[len(package) :].replace(".", "/")
    raise ValueError(name)


def _type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(test)


def imports(name: str, path: Path, known: set[str], runtime: bool = False) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = name if path.stem == "__init__" else name.rpartition(".")[0]
    skip = {id(n) for node in ast.walk(tree) if runtime and _type_checking(node) for n in ast.walk(node)}
    out = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        targets = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        for target in targets:
            while target and target not in known:  # a name imported from a module: the module
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def imports_anything(path: Path) -> bool:
    """Whether a module has any import statement but ``from __future__``."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import) or (isinstance(node, ast.ImportFrom) and node.module != "__future__"):
            return True
    return False


def analyse(graph: dict[str, set[str]]) -> dict:
    # back arrows: a depth-first walk in name order; an edge to a module on the walk's stack goes back up
    state, back = {}, []

    def walk(node):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                back.append((node, nxt))
            elif nxt not in state:
                walk(nxt)
        state[node] = "done"

    sys.setrecursionlimit(10_000)
    for node in sorted(graph):
        if node not in state:
            walk(node)
    # circles: strongly connected components (Tarjan) of more than one module
    index, low, stack, on, circles, counter = {}, {}, [], set(), [], [0]

    def strong(node):
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                strong(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                circles.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            strong(node)
    # floors: longest chain down, the back arrows left out
    forward = {n: {m for m in graph[n] if (n, m) not in back} for n in graph}
    floor = {}

    def level(node):
        if node not in floor:
            floor[node] = 0  # guards a cycle the back arrows did not break (none: a DFS's back edges break all)
            floor[node] = 1 + max((level(m) for m in forward[node]), default=0)
        return floor[node]

    for node in graph:
        level(node)
    return {"floors": max(floor.values(), default=0), "back": back, "circles": circles, "floor": floor}


def folder_of(name: str, found: dict[str, Path]) -> str:
    """The package a module belongs to (a package's ``__init__`` belongs to the package itself)."""
    return name if found[name].stem == "__init__" else name.rpartition(".")[0]


def may_import(init: Path) -> set[str] | None:
    """The folders an ``__init__`` docstring's ``May import:`` paragraph names, or None without one."""
    doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))) or ""
    for paragraph in doc.split("\n\n"):
        if paragraph.lstrip().startswith("May import:"):
            return set(re.findall(r"\bpatch_dsv4(?:\.\w+)*", paragraph))
    return None


def folders(graph: dict[str, set[str]], found: dict[str, Path]) -> tuple[dict[str, set[str]], dict]:
    """The folder graph, and per folder arrow the module imports that make it."""
    leaves = {n for n, p in found.items() if p.stem == "__init__" and not imports_anything(p)}
    fgraph: dict[str, set[str]] = {folder_of(n, found): set() for n in graph}
    why: dict[tuple[str, str], list[tuple[str, str]]] = {}
    for a, targets in graph.items():
        for b in targets:
            fa, fb = folder_of(a, found), folder_of(b, found)
            if fa != fb and b not in leaves:
                fgraph[fa].add(fb)
                why.setdefault((fa, fb), []).append((a, b))
    return fgraph, why


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkout", type=Path, default=ROOT)
    parser.add_argument("--only", help="keep only modules under this folder (patcher: the engine, doctor/ left out)")
    parser.add_argument("--runtime", action="store_true", help="leave out the imports under if TYPE_CHECKING")
    parser.add_argument("--list", action="store_true", help="print each module's floor")
    args = parser.parse_args()
    found = modules(args.checkout)
    graph = {name: imports(name, path, set(found), args.runtime) for name, path in found.items()}
    if args.only:
        only = args.only.rstrip("/")
        keep = {
            n
            for n in graph
            if (folder_name(n) + "/").startswith(only + "/")
            and not (only == "patcher" and folder_name(n).startswith("patcher/doctor"))
        }
        graph = {n: graph[n] & keep for n in keep}
    result = analyse(graph)
    print(f"{len(graph)} modules, {sum(map(len, graph.values()))} imports")
    print(f"floors: {result['floors']}")
    print(f"back arrows: {len(result['back'])}", *(f"{folder_name(a)} -> {folder_name(b)}" for a, b in result["back"]))
    print(f"circles: {len(result['circles'])}")
    for group in result["circles"]:
        print("  " + ", ".join(folder_name(n) for n in group))

    fgraph, why = folders(graph, found)
    fresult = analyse(fgraph)
    members: dict[str, list[str]] = {f: [] for f in fgraph}
    for name in graph:
        if found[name].stem != "__init__":
            members[folder_of(name, found)].append(name)
    print(f"folders: {len(fgraph)} (floor among folders, modules without __init__, folder)")
    for folder in sorted(fgraph, key=lambda f: (-fresult["floor"][f], folder_name(f))):
        print(f"  {fresult['floor'][folder]:3} {len(members[folder]):3}  {folder_name(folder)}/")
    print(f"folder floors: {fresult['floors']}")
    print(f"folder back arrows: {len(fresult['back'])}")
    for a, b in fresult["back"]:
        shown = ", ".join(f"{folder_name(x)} -> {folder_name(y)}" for x, y in sorted(why[(a, b)]))
        print(f"  {folder_name(a)}/ -> {folder_name(b)}/ ({shown})")
    print(f"folder circles: {len(fresult['circles'])}")
    for group in fresult["circles"]:
        print("  " + ", ".join(folder_name(n) + "/" for n in group))
    undeclared = []
    for folder in sorted(fgraph):
        allowed = may_import(found[folder]) if folder in found else None
        if allowed is None:
            continue
        for target in sorted(fgraph[folder]):
            if not any(target == a or target.startswith(a + ".") for a in allowed):
                undeclared += [f"{folder_name(x)} -> {folder_name(y)}" for x, y in sorted(why[(folder, target)])]
    ruled = sum(1 for f in fgraph if f in found and may_import(found[f]) is not None)
    print(f"undeclared imports: {len(undeclared)} (of the {ruled} folders whose __init__ says what it may import)")
    for line in undeclared:
        print("  " + line)
    inits = sorted(folder_name(n) for n in graph if found[n].stem == "__init__" and imports_anything(found[n]))
    print(f"package __init__s that import: {len(inits)}", *inits)
    if args.list:
        for name, level in sorted(result["floor"].items(), key=lambda kv: (-kv[1], kv[0])):
            print(f"  {level:3} {folder_name(name)}")


if __name__ == "__main__":
    main()
