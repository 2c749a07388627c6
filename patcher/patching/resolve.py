"""Static checks that injected code fits the release it is written into.

Every name the injected code reads must be defined by that code, be a builtin,
or be defined at module level of the target file; every ``from vllm... import
name`` must name something the target tree defines; every call to a function
of vLLM must bind to that release's signature. All of it is read with ``ast``
from the target tree: nothing of vLLM is imported.
"""

from __future__ import annotations

import ast
import builtins
import textwrap
from collections.abc import Iterable

from patch_dsv4.patching.follow import Follower, absolute_module, signature
from patch_dsv4.patching.patch import Context

_BUILTINS = set(dir(builtins))


def module_path(ctx: Context, module: str) -> str | None:
    return Follower(ctx).module_file(module)


def top_level_names(tree: ast.Module) -> dict[str, ast.AST]:
    """The names bound at module level (under ``if TYPE_CHECKING:`` and try-import blocks too), each to the
    statement that binds it first in breadth-first order; computed once per parsed tree (do not mutate)."""
    cached = getattr(tree, "_patch_dsv4_names", None)
    if cached is None:
        cached = _top_level_names(tree)
        tree._patch_dsv4_names = cached  # type: ignore[attr-defined]
    return cached


def _top_level_names(tree: ast.Module) -> dict[str, ast.AST]:
    # Breadth first, as ast.walk visits them: a handler's body sits one level below its ``try``'s other blocks.
    names: dict[str, ast.AST] = {}
    level: list[ast.AST] = list(tree.body)
    while level:
        below: list[ast.AST] = []
        for node in level:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.setdefault(node.name, node)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                for alias in node.names:
                    names.setdefault((alias.asname or alias.name).split(".")[0], node)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    for sub in ast.walk(target):
                        if isinstance(sub, ast.Name):
                            names.setdefault(sub.id, node)
            elif isinstance(node, ast.If):
                below += [*node.body, *node.orelse]
            elif isinstance(node, ast.Try):
                below += [*node.body, *node.handlers, *node.orelse, *node.finalbody]
            elif isinstance(node, ast.ExceptHandler):
                below += node.body
        level = below
    return names


def _free_names(tree: ast.Module) -> set[str]:
    bound: set[str] = set()
    used: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (used if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                bound.add((alias.asname or alias.name).split(".")[0])
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return used - bound - _BUILTINS


def _resolve_function(ctx: Context, module: str, name: str):
    """The signature ``module.name`` binds a call to (a function's, or a class's ``__init__`` without ``self``), or
    None where the name does not lead to one definition there (the shared facility, patcher/patching/follow.py, resolves
    it)."""
    follower = Follower(ctx)
    found = follower.resolve(module, name)
    if len(found) != 1:
        return None
    (defn,) = found
    if defn.kind == "function":
        return signature(defn.node)
    if defn.kind == "class":
        # A constructor call binds to __init__ (without self); an inherited one is not checked.
        init = next((n for n in defn.node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
        return signature(init, drop_first=True) if init is not None else None
    return None


def local_names(scope: ast.AST) -> set[str]:
    """Names bound inside a function (its parameters and assignments)."""
    names: set[str] = set()
    for node in ast.walk(scope):
        if isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            names.add(node.id)
    return names


def check_injected(
    ctx: Context, target_file: str, sources: Iterable[str], scope_names: set[str] = frozenset()
) -> list[str]:
    """Problems with injected code in ``target_file`` of this release; empty when it fits.

    ``scope_names`` are the locals of the function the code is written into.
    """
    problems: list[str] = []
    target_tree = ctx.ast(target_file)
    if target_tree is None:
        return problems
    target_names = top_level_names(target_tree)
    target_module = target_file[: -len(".py")].replace("/", ".").removesuffix(".__init__")
    imported: dict[str, tuple[str, str]] = {}  # local name -> (module, name)
    for node in target_tree.body:
        if isinstance(node, ast.ImportFrom) and node.module is not None:
            for alias in node.names:
                imported[alias.asname or alias.name] = (
                    absolute_module(target_module, target_file.endswith("__init__.py"), node.level, node.module),
                    alias.name,
                )
    trees = [ast.parse(textwrap.dedent(source)) for source in sources]
    injected_defs = {name for tree in trees for name in top_level_names(tree)}
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                module = absolute_module(target_module, target_file.endswith("__init__.py"), node.level, node.module)
                if not module.startswith("vllm"):
                    continue
                path = module_path(ctx, module)
                if path is None:
                    problems.append(f"imports from {module}, which this release does not have")
                    continue
                defined = top_level_names(ctx.ast(path) or ast.Module(body=[], type_ignores=[]))
                for alias in node.names:
                    if alias.name not in defined and module_path(ctx, f"{module}.{alias.name}") is None:
                        problems.append(f"imports {alias.name} from {module}, which does not define it")
                    imported[alias.asname or alias.name] = (module, alias.name)
        for name in sorted(_free_names(tree)):
            if (
                name not in target_names
                and name not in imported
                and name not in scope_names
                and name not in injected_defs
            ):
                problems.append(f"uses {name}, which {target_file} does not define")
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
                continue
            origin = imported.get(node.func.id)
            if origin is None or not origin[0].startswith("vllm"):
                continue
            if any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords):
                continue
            func = _resolve_function(ctx, *origin)
            if func is None:
                continue
            try:
                func.bind(*node.args, **{k.arg: k.value for k in node.keywords})
            except TypeError as exc:
                problems.append(f"calls {origin[0]}.{origin[1]} in a way this release's signature rejects: {exc}")
    return problems
