"""The package's import map: floors, back arrows and circles, with module names mapped back to their folders.

Every ``import`` of the package's own modules is followed, at module level, inside functions (a lazy import is
still a dependency) and under ``if TYPE_CHECKING`` (a type a step names is one it depends on; ``--runtime``
leaves those out). ``patch_dsv4.X`` is read as
``patcher/X``, ``patch_dsv4.patches.X`` as ``patches/X``, ``patch_dsv4.doctor.X`` as ``patcher/doctor/X``
(pyproject's package-dir); a package's ``__init__`` is the folder's name.

- circles: groups of modules that import one another, directly or not (strongly connected, more than one);
- back arrows: imports that close a circle (the edges a depth-first walk in name order finds going back up);
- floors: with the back arrows left out, the longest chain of imports from a module down to one that imports
  nothing of the package, counted in modules (a module importing nothing of ours stands on floor 1).

    python bench/import_map.py [--checkout DIR] [--only patcher] [--runtime] [--list]
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = {"patch_dsv4.doctor": "patcher/doctor", "patch_dsv4.patches": "patches", "patch_dsv4.anchors": "anchors"}


def modules(checkout: Path) -> dict[str, Path]:
    """Dotted name -> file, for every module of the package in ``checkout``."""
    found = {}
    for package, folder in {"patch_dsv4": "patcher", **FOLDERS}.items():
        for path in sorted((checkout / folder).glob("*.py")):
            name = package if path.stem == "__init__" else f"{package}.{path.stem}"
            found[name] = path
    return found


def folder_name(name: str) -> str:
    for package, folder in sorted(FOLDERS.items(), key=lambda kv: -len(kv[0])):
        if name == package or name.startswith(package + "."):
            return folder + name[len(package) :].replace(".", "/")
    return "patcher" + name[len("patch_dsv4") :].replace(".", "/")


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkout", type=Path, default=ROOT)
    parser.add_argument("--only", help="keep only modules under this folder (e.g. patcher, for the engine alone)")
    parser.add_argument("--runtime", action="store_true", help="leave out the imports under if TYPE_CHECKING")
    parser.add_argument("--list", action="store_true", help="print each module's floor")
    args = parser.parse_args()
    found = modules(args.checkout)
    graph = {name: imports(name, path, set(found), args.runtime) for name, path in found.items()}
    if args.only:
        keep = {n for n in graph if folder_name(n).split("/")[0] == args.only and "/doctor" not in folder_name(n)}
        graph = {n: graph[n] & keep for n in keep}
    result = analyse(graph)
    print(f"{len(graph)} modules, {sum(map(len, graph.values()))} imports")
    print(f"floors: {result['floors']}")
    print(f"back arrows: {len(result['back'])}", *(f"{folder_name(a)} -> {folder_name(b)}" for a, b in result["back"]))
    print(f"circles: {len(result['circles'])}")
    for group in result["circles"]:
        print("  " + ", ".join(folder_name(n) for n in group))
    if args.list:
        for name, level in sorted(result["floor"].items(), key=lambda kv: (-kv[1], kv[0])):
            print(f"  {level:3} {folder_name(name)}")


if __name__ == "__main__":
    main()
