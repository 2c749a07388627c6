"""The statements of a function that may change what a question reads: a backward slice, so that a question about
``self.gate.bias_vl`` does not execute the other two hundred lines of a constructor.

A statement is kept when it binds a name or writes an attribute path the question reads (or a path above or
below one: writing ``self.gate`` changes ``self.gate.bias_vl``), when a call in it may write such a path (a
method of an object the path goes through, ``super()``'s, a callee handed such an object; a method of ``self``
only where its own slice writes something, asked of ``may_write``), when it returns (an exit keeps the state it
has), or when it holds a kept statement (an ``if`` keeps its test and only its kept arms). What a kept statement
reads is then read by the question too, until nothing changes. Module-level names are never written by the
function: what it reads of them is not followed.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from dataclasses import dataclass

#: Builtins that read their arguments and never write on them.
_READ_ONLY = frozenset(
    {"getattr", "hasattr", "isinstance", "issubclass", "len", "int", "str", "bool", "float", "repr", "id", "type",
     "callable", "print", "min", "max", "abs", "round", "sorted", "tuple", "list", "set", "frozenset", "dict"}
)  # fmt: skip
_COMPOUND = (ast.If, ast.For, ast.AsyncFor, ast.While, ast.With, ast.AsyncWith, ast.Try)
#: may_write(call, wanted): whether the callee of ``call`` (a method of ``self``) may write ``wanted``
MayWrite = Callable[[ast.Call, frozenset[str]], bool]


@dataclass(frozen=True)
class _Call:
    node: ast.Call
    receiver: str | None  # the path of the object a method is called on
    args: tuple[str, ...]  # the paths of the objects handed over
    sup: bool  # super().m(...)


def _path(node: ast.AST) -> str | None:
    """``self.gate.bias_vl`` (``getattr(self, "gate").bias_vl`` too) as a path of names; None for anything else."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _path(node.value)
        return f"{base}.{node.attr}" if base is not None else None
    name = getattr_name(node)
    if name is not None:
        base = _path(node.args[0])  # type: ignore[attr-defined]
        return f"{base}.{name}" if base is not None else None
    return None


def callee(call: ast.Call) -> tuple[str | None, str]:
    """(the path of what a call is made on, the name called): ``loader.load_weights(...)`` and
    ``getattr(loader, "load_weights")(...)`` alike give ``("loader", "load_weights")``, a method of an expression
    that is no path (``AutoWeightsLoader(self).load_weights``) ``("<expression>", ...)``, a base's method
    (``super().load_weights``) ``("super()", ...)``; a plain name, ``(None, name)``; anything else, ``(None, "")``."""
    func = call.func
    if isinstance(func, ast.Name):
        return None, func.id
    if isinstance(func, ast.Attribute):
        base = func.value
        if isinstance(base, ast.Call) and isinstance(base.func, ast.Name) and base.func.id == "super":
            return "super()", func.attr
        return _path(base) or "<expression>", func.attr
    name = getattr_name(func)
    if name is not None:
        return _path(func.args[0]) or "<expression>", name  # type: ignore[attr-defined]
    return None, ""


def getattr_name(node: ast.AST) -> str | None:
    """The attribute ``getattr(x, "a")`` reads (without a default: with one, the value may be the default)."""
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "getattr"
        and len(node.args) == 2
        and not node.keywords
        and isinstance(node.args[1], ast.Constant)
        and isinstance(node.args[1].value, str)
    ):
        return node.args[1].value
    return None


def _related(path: str, wanted: set[str]) -> bool:
    """Whether writing ``path`` changes something wanted: the same path, one below a wanted attribute path, or one
    a wanted path goes through. A bare name read whole (``f(self)``) depends on its binding only: what is written
    on it is wanted where a path through it is."""
    return any(path == w or ("." in w and path.startswith(w + ".")) or w.startswith(path + ".") for w in wanted)


def _written(stmt: ast.stmt) -> list[str]:
    """The names and attribute paths a statement (not its nested blocks) binds or writes."""
    targets: list[ast.AST] = []
    if isinstance(stmt, ast.Assign):
        targets = list(stmt.targets)
    elif isinstance(stmt, (ast.AnnAssign, ast.AugAssign)):
        targets = [stmt.target]
    elif isinstance(stmt, (ast.For, ast.AsyncFor)):
        targets = [stmt.target]
    elif isinstance(stmt, (ast.With, ast.AsyncWith)):
        targets = [i.optional_vars for i in stmt.items if i.optional_vars is not None]
    elif isinstance(stmt, (ast.Import, ast.ImportFrom)):
        return [a.asname or a.name.split(".")[0] for a in stmt.names]
    elif isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return [stmt.name]
    found = []
    for target in targets:
        for node in ast.walk(target):
            path = _path(node) if isinstance(node, (ast.Name, ast.Attribute)) else None
            if path is not None and isinstance(getattr(node, "ctx", None), ast.Store):
                found.append(path)
    return found


def _header(stmt: ast.stmt) -> list[ast.AST]:
    """The parts of a statement evaluated outside its nested blocks (a test, an iterable, a value)."""
    if isinstance(stmt, (ast.If, ast.While)):
        return [stmt.test]
    if isinstance(stmt, (ast.For, ast.AsyncFor)):
        return [stmt.iter, stmt.target]
    if isinstance(stmt, (ast.With, ast.AsyncWith)):
        return [i.context_expr for i in stmt.items]
    if isinstance(stmt, ast.Try):
        return []
    return [stmt]


def _raw_reads(parts: list[ast.AST]) -> set[str]:
    """The names and attribute paths read in ``parts``, each whole (``self.gate.bias_vl``, not ``self``)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(getattr(node, "ctx", None), ast.Store):
            return  # a target: what it binds is the statement's write, not a read
        if isinstance(node, (ast.Name, ast.Attribute)) or getattr_name(node) is not None:
            path = _path(node)
            if path is not None:
                found.add(path)  # a write of a prefix (``gate = ...``) is related to it
                return
        for child in ast.iter_child_nodes(node):
            visit(child)

    for part in parts:
        visit(part)
    return found


def _calls(parts: list[ast.AST]) -> tuple[_Call, ...]:
    """The calls in ``parts`` that may write on an object: every call but the read-only builtins."""
    found = []
    for part in parts:
        for node in ast.walk(part):
            if not isinstance(node, ast.Call) or (isinstance(node.func, ast.Name) and node.func.id in _READ_ONLY):
                continue
            func, receiver, sup = node.func, None, False
            if isinstance(func, ast.Attribute):
                inner = func.value
                sup = isinstance(inner, ast.Call) and isinstance(inner.func, ast.Name) and inner.func.id == "super"
                receiver = _path(inner)
            args = tuple(
                p
                for a in (*node.args, *(k.value for k in node.keywords))
                if (p := _path(a.value if isinstance(a, ast.Starred) else a)) is not None
            )
            found.append(_Call(node, receiver, args, sup))
    return tuple(found)


def _info(stmt: ast.stmt) -> tuple[tuple[str, ...], frozenset[str], tuple[_Call, ...]]:
    """What a statement (its header, for a compound one) writes, reads and calls; once per node (the parsed
    trees are shared and never changed)."""
    found = stmt.__dict__.get("_patch_dsv4_focus")
    if found is None:
        parts = _header(stmt)
        found = (tuple(_written(stmt)), frozenset(_raw_reads(parts)), _calls(parts))
        stmt._patch_dsv4_focus = found  # type: ignore[attr-defined]
    return found


@dataclass
class _Slice:
    wanted: set[str]
    aliases: dict[str, str]
    first: str | None  # the function's first parameter (``self``)
    may_write: MayWrite | None
    touch_only: set[int]  # statements kept only for what their calls may write (their values are not read)
    anchored: frozenset[int] = frozenset()  # statements kept whatever they write (a loop whose iterable is asked)

    def canon(self, path: str) -> str:
        """``gate.bias_vl`` as ``self.gate.bias_vl`` where ``gate = self.gate``."""
        head, dot, rest = path.partition(".")
        return f"{self.aliases[head]}{dot}{rest}" if head in self.aliases else path

    def through(self, path: str, whole: bool) -> bool:
        """Whether a wanted path goes through the object at ``path`` (or is it, for ``whole``)."""
        canon = self.canon(path)
        return any((whole and w == canon) or w.startswith(canon + ".") for w in self.wanted)

    def writes(self, calls: tuple[_Call, ...]) -> bool:
        """Whether one of the calls may write something wanted."""
        for call in calls:
            own_method = call.receiver is not None and call.receiver == self.first
            if call.sup or (call.receiver is not None and self.through(call.receiver, whole=True)):
                if (call.sup or own_method) and self.may_write is not None:
                    if self.may_write(call.node, frozenset(self.wanted)):
                        return True
                    continue
                return True
            if any(self.through(arg, whole=False) for arg in call.args):
                return True
        return False

    def keep(
        self, body: list[ast.stmt], returns: bool, jumps: bool = False, exits: bool = False
    ) -> tuple[list[ast.stmt], set[str]]:
        """The kept statements of ``body`` and what they read. ``returns``: the function's result is read (its
        returns and what they return are kept); ``exits``: its returns are kept for the state they leave (where
        a kept write could come after one); ``jumps``: the enclosing loop holds a kept write (its ``break`` and
        ``continue`` decide whether it runs)."""
        kept: list[ast.stmt] = []
        reads: set[str] = set()
        for stmt in body:
            written, read, calls = _info(stmt)
            own = any(_related(self.canon(w), self.wanted) for w in written) or self.writes(calls)
            own = own or id(stmt) in self.anchored
            if isinstance(stmt, _COMPOUND):
                inner_jumps = jumps
                if isinstance(stmt, (ast.For, ast.AsyncFor, ast.While)):  # its jumps matter where it holds a write
                    inner_jumps = any(self.keep(getattr(stmt, n, []) or [], returns, False, exits)[0]
                                      for n in ("body", "orelse"))  # fmt: skip
                inner: dict[str, list[ast.stmt]] = {}
                for name in ("body", "orelse", "finalbody"):
                    block = getattr(stmt, name, None)
                    if block:
                        inner[name], more = self.keep(block, returns, inner_jumps, exits)
                        reads |= more if inner[name] else set()
                handlers = []
                for handler in getattr(stmt, "handlers", []):
                    h_body, more = self.keep(handler.body, returns, jumps, exits)
                    if h_body:
                        reads |= more
                        handlers.append(ast.ExceptHandler(handler.type, handler.name, h_body))
                if any(inner.values()) or handlers or own:
                    reads |= {self.canon(r) for r in read}
                    kept.append(_copy(stmt, inner, handlers))
                continue
            jump = jumps and isinstance(stmt, (ast.Break, ast.Continue))
            leave = (returns or exits) and isinstance(stmt, (ast.Return, ast.Raise))  # a raise ends its path too
            writes = any(_related(self.canon(w), self.wanted) for w in written)
            if own or jump or leave:
                kept.append(stmt)
                if own or (returns and not isinstance(stmt, ast.Raise)):  # a return kept for its state only:
                    # what it returns is not read; what a raise raises never is
                    reads |= {self.canon(r) for r in read} - {w for w in written if "." not in w}
                if own and not writes:
                    self.touch_only.add(id(stmt))
        return kept, reads


def _scope(func: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[frozenset[str], dict[str, str]]:
    """The function's own names (parameters, and what it binds) and its locals bound to an attribute path
    (``gate = self.gate``), once per node."""
    found = func.__dict__.get("_patch_dsv4_scope")
    if found is None:
        args = func.args
        local = {a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)}
        local |= {a.arg for a in (args.vararg, args.kwarg) if a is not None}
        aliases: dict[str, str] = {}
        for stmt in func.body:
            for node in ast.walk(stmt):
                if isinstance(node, ast.stmt):
                    local |= {w.split(".", 1)[0] for w in _written(node)}
                if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                    path = _path(node.value) if isinstance(node.value, ast.Attribute) else None
                    if path is not None:
                        aliases[node.targets[0].id] = path
        found = (frozenset(local), aliases)
        func._patch_dsv4_scope = found  # type: ignore[attr-defined]
    return found


@dataclass(frozen=True)
class Focused:
    """A function's statements for a question: ``body``, and the statements (by id) kept only for what their
    calls may write (their values are not read)."""

    body: list[ast.stmt]
    touch_only: frozenset[int]
    wanted: frozenset[str]  # what the kept statements read, the question's paths included


def focus(
    func: ast.FunctionDef | ast.AsyncFunctionDef,
    wanted: set[str],
    returns: bool = True,
    may_write: MayWrite | None = None,
    anchored: frozenset[int] = frozenset(),
) -> Focused:
    """The body of ``func`` with only the statements that may change ``wanted`` (names and attribute paths of its
    locals and parameters), and what those read, kept; with ``returns``, its returns and what they read too.
    Compound statements are rebuilt with their kept arms; the tree itself is never changed. The statements
    ``anchored`` (by id) are kept whatever they write: a question reads what they see."""
    local, aliases = _scope(func)
    params = [a.arg for a in (*func.args.posonlyargs, *func.args.args)]
    state = _Slice(set(wanted), aliases, params[0] if params else None, may_write, set(), anchored)
    while True:
        state.touch_only = set()
        writes, _ = state.keep(func.body, False)  # the writes alone: returns matter only before one of them
        kept, reads = state.keep(func.body, returns, exits=bool(writes))
        grown = state.wanted | {r for r in reads if r.split(".", 1)[0] in local}
        if grown == state.wanted:
            return Focused(kept, frozenset(state.touch_only), frozenset(state.wanted))
        state.wanted = grown


def _copy(stmt: ast.stmt, blocks: dict[str, list[ast.stmt]], handlers: list[ast.ExceptHandler]) -> ast.stmt:
    """A shallow copy of a compound statement with its blocks replaced (``pass`` where one is emptied)."""
    fields = {name: getattr(stmt, name) for name in stmt._fields}
    for name in ("body", "orelse", "finalbody"):
        if name in fields:
            block = blocks.get(name, [])
            fields[name] = block if block or name != "body" else [ast.copy_location(ast.Pass(), stmt)]
    if "handlers" in fields:
        fields["handlers"] = handlers
    copy = type(stmt)(**fields)
    copy._patch_dsv4_original = original(stmt)  # type: ignore[attr-defined] # what questions name it by
    return ast.copy_location(copy, stmt)


def original(stmt: ast.AST) -> ast.AST:
    """The statement of the parsed tree a slice's copy stands for (itself where it is one)."""
    return stmt.__dict__.get("_patch_dsv4_original", stmt)
