"""Rewrites that keep the behaviour of a function of vLLM's code, as a next release could write the same code.

Each :class:`Transform` is a libcst rewrite of one :class:`~tests.refactor.source.Site` (a function of the tree):
``apply(state, site, pick)`` finds the places it applies to, in a fixed order, rewrites the ``pick``-th (modulo
their number) and returns the :class:`Step` (the files it changed or created, where the function is now, what it
did), or None where it applies nowhere. Each keeps the behaviour by construction, under the preconditions it
checks (named in its docstring); every one is tested before/after on a snippet in test_transforms.py.

    rename-local          a local variable of the function, everywhere it is bound and read (closures included)
    rename-helper         a module-level function the function calls, renamed in its module; importers follow
    extract-helper        1-3 consecutive statements into a module-level function of the same module
    extract-module        the same, the function in a new module the site imports
    inline-helper         a call of a module-level function replaced by its body (its locals renamed fresh)
    move-to-mixin         the method into a mixin class in a new module, first among the class's bases
    move-to-base          the method into a new base class in a new module, between the class and its bases
    super-delegation      the method in a mixin, the class's own method ``return super().meth(...)``
    getattr-read          ``x.a`` -> ``getattr(x, "a")`` (-all: every read of the function)
    setattr-write         ``x.a = v`` -> ``setattr(x, "a", v)`` (-all: every such assignment)
    eq-to-in              ``a == b`` -> ``a in (b,)``, ``a != b`` -> ``a not in (b,)`` (a test, or a bool)
    eq-to-is              ``x.dtype == torch.<dtype>`` -> ``x.dtype is torch.<dtype>`` (dtypes are singletons)
    flag-is-true          ``if flag:`` -> ``if flag is True:`` for a local flag only ever bound to a bool
    lazy-<how>            an iterable consumed once wrapped lazily: map, generator, iter, filter(None, ...),
                          zip, enumerate, itertools.islice
    condition-flag        an ``if`` test into a local flag computed just before it
    condition-helper      an ``if`` test into a module-level function returning it
    early-return          ``if c: ...return`` + ``else: B`` -> the ``else`` dropped, B after the ``if``
    else-after-return     the inverse: the statements after ``if c: ...return`` into an ``else``
    ifexp-to-if           ``return a if c else b`` / ``x = a if c else b`` -> an ``if`` statement
"""

from __future__ import annotations

import ast
import re
import symtable
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import libcst as cst
from libcst.metadata import MetadataWrapper, ScopeProvider

from tests.refactor.source import (
    BUILTINS,
    Site,
    append_code,
    code_of,
    expression,
    fresh_name,
    function_cst,
    function_node,
    identifiers,
    insert_before,
    module_bindings,
    module_of,
    parse,
    rewrite_class,
    rewrite_function,
    span,
    statement,
    top_level,
)


# -- the model ------------------------------------------------------------------------------------------------------
class State:
    """A variant in the making: the release's files (``read``) with the variant's own texts over them."""

    def __init__(self, read: Callable[[str], str | None], files: dict[str, str] | None = None) -> None:
        self.read = read
        self.files = dict(files or {})

    def text(self, relpath: str) -> str | None:
        return self.files[relpath] if relpath in self.files else self.read(relpath)

    def then(self, step: Step) -> State:
        return State(self.read, {**self.files, **step.files})

    def new_module(self, near: str, stem: str) -> str:
        """A path for a new module in the directory of ``near`` that no file has."""
        directory = near.rsplit("/", 1)[0]
        for n in range(1, 1000):
            path = f"{directory}/_{stem}_{n}.py"
            if self.text(path) is None:
                return path
        raise AssertionError("no free module name")


@dataclass(frozen=True)
class Step:
    """What one transform did: the files it changed or created (whole texts), where the site's function is now,
    the functions it changed or made (their names must resolve), and a word on what it did."""

    files: dict[str, str]
    site: Site
    detail: str
    touched: tuple[Site, ...] = ()


class Transform:
    """A rewrite of one site; ``keeps`` says whether it keeps the behaviour (injections of a defect do not)."""

    name: str = ""
    keeps: bool = True
    patch: str | None = None  # an injection's patch (whose defect it injects); None: every patch

    def apply(self, state: State, site: Site, pick: int) -> Step | None:
        raise NotImplementedError

    def __repr__(self) -> str:
        return self.name


def choose(candidates: Sequence, pick: int):
    return candidates[pick % len(candidates)] if candidates else None


# -- libcst helpers -------------------------------------------------------------------------------------------------
class _Nth(cst.CSTTransformer):
    """Replace the ``target``-th node (in leave order) for which ``test(original)`` holds by ``make(original,
    updated)``; ``count`` says how many there were."""

    def __init__(self, test: Callable[[cst.CSTNode], bool], make: Callable | None = None, target: int = -1) -> None:
        self.test, self.make, self.target = test, make, target
        self.count = 0
        self.done: cst.CSTNode | None = None

    def on_leave(self, original, updated):
        if self.test(original):
            index = self.count
            self.count += 1
            if index == self.target and self.make is not None:
                new = self.make(original, updated)
                self.done = original
                return new
        return updated


def _count(node: cst.CSTNode, test: Callable[[cst.CSTNode], bool]) -> int:
    nth = _Nth(test)
    node.visit(nth)
    return nth.count


def _nth(node: cst.CSTNode, test, make, pick: int) -> cst.CSTNode | None:
    """``node`` with the chosen candidate rewritten (None: no candidate, or ``make`` declined it)."""
    total = _count(node, test)
    if not total:
        return None
    nth = _Nth(test, make, pick % total)
    new = node.visit(nth)
    return new if nth.done is not None and new is not None else None


def _every(node: cst.CSTNode, test, make) -> cst.CSTNode | None:
    """``node`` with every candidate rewritten (None: there is none)."""

    class All(cst.CSTTransformer):
        done = 0

        def on_leave(self, original, updated):
            if test(original):
                All.done += 1
                return make(original, updated)
            return updated

    new = node.visit(All())
    return new if All.done else None


def _rewrite(node: cst.CSTNode, test, make, pick: int, every: bool) -> cst.CSTNode | None:
    return _every(node, test, make) if every else _nth(node, test, make, pick)


def body_statements(fn: cst.FunctionDef) -> list[cst.BaseStatement]:
    return list(fn.body.body) if isinstance(fn.body, cst.IndentedBlock) else []


def docstring_count(fn: cst.FunctionDef) -> int:
    body = body_statements(fn)
    if body and isinstance(body[0], cst.SimpleStatementLine) and len(body[0].body) == 1:
        first = body[0].body[0]
        if isinstance(first, cst.Expr) and isinstance(first.value, (cst.SimpleString, cst.ConcatenatedString)):
            return 1
    return 0


def with_prelude(fn: cst.FunctionDef, lines: Sequence[str]) -> cst.FunctionDef:
    """``fn`` with statements ``lines`` first in its body (after its docstring)."""
    if not lines:
        return fn
    body = body_statements(fn)
    at = docstring_count(fn)
    new = [statement(line + "\n") for line in lines]
    return fn.with_changes(body=fn.body.with_changes(body=[*body[:at], *new, *body[at:]]))


FRAME_READERS = frozenset({"locals", "vars", "eval", "exec", "globals", "__class__"})


def _code_tree(code: str) -> ast.Module:
    return ast.parse(textwrap.dedent(code))


def _suspicious(code: str) -> bool:
    """Code whose meaning depends on where it stands: it reads its frame, or spells a private (mangled) name."""
    for node in ast.walk(_code_tree(code)):
        if isinstance(node, ast.Name) and node.id in FRAME_READERS:
            return True
        name = getattr(node, "id", None) or getattr(node, "attr", None) or getattr(node, "arg", None)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = node.name
        if isinstance(name, str) and name.startswith("__") and not name.endswith("__"):
            return True
    return False


def _uses_super(code: str) -> bool:
    """A zero-argument ``super()``: it needs the class it is written in."""
    return any(
        isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "super" and not n.args
        for n in ast.walk(_code_tree(code))
    )


def _private(name: str) -> bool:
    return name.startswith("__") and not name.endswith("__")


def _declares(code: str) -> bool:
    return any(isinstance(n, (ast.Global, ast.Nonlocal)) for n in ast.walk(_code_tree(code)))


# -- scope analysis -------------------------------------------------------------------------------------------------
def _rename_in(fn: cst.FunctionDef, names: dict[str, str]) -> cst.FunctionDef | None:
    """``fn`` with the names of its own scope in ``names`` renamed wherever they are bound or read (closures,
    lambdas and comprehensions that read them included); None if a name is bound otherwise than by a plain name
    (an import, a def) or a nested scope declares it nonlocal/global."""
    wrapper = MetadataWrapper(cst.Module(body=[fn]))
    scopes = wrapper.resolve(ScopeProvider)
    func = wrapper.module.body[0]
    body = body_statements(func)
    if not body:
        return None
    scope = scopes[body[0]]
    targets: dict[int, str] = {}
    for old, new in names.items():
        for assignment in scope.assignments[old]:
            node = getattr(assignment, "node", None)
            if not isinstance(node, (cst.Name, cst.Param)):
                return None
            targets[id(node.name if isinstance(node, cst.Param) else node)] = new
            for access in assignment.references:
                if isinstance(access.node, cst.Name):
                    targets[id(access.node)] = new
                else:
                    return None

    class Rename(cst.CSTTransformer):
        def leave_Name(self, original, updated):  # noqa: N802
            new = targets.get(id(original))
            return updated.with_changes(value=new) if new else updated

    renamed = func.visit(Rename())
    return None if _declares(code_of(renamed)) else renamed


def _symbols(code: str, name: str = "__probe__") -> symtable.SymbolTable:
    top = symtable.symtable(code, "<probe>", "exec")
    return next(t for t in top.get_children() if t.get_name() == name)


def _tables(table: symtable.SymbolTable):
    yield table
    for child in table.get_children():
        yield from _tables(child)


@dataclass
class Flow:
    """The names a run of statements reads from outside it, and binds."""

    reads: set[str]
    stores: set[str]
    stored_and_read: set[str]
    top_stores: set[str]  # bound by a simple statement at the run's own level (surely bound when it ends)


def flow(statements: Sequence[cst.BaseStatement]) -> Flow:
    code = "".join(code_of(s) for s in statements)
    table = _symbols("def __probe__():\n" + textwrap.indent(code, "    ", lambda _line: True))
    reads = {s.get_name() for t in _tables(table) for s in t.get_symbols() if s.is_global() and s.is_referenced()}
    stores = {s.get_name() for s in table.get_symbols() if s.is_local() and not s.is_parameter()}
    inner_reads = {s.get_name() for t in _tables(table) for s in t.get_symbols() if s.is_free()}
    both = {s.get_name() for s in table.get_symbols() if s.is_local() and s.is_referenced()} | (inner_reads & stores)
    top: set[str] = set()
    for stmt in statements:
        if isinstance(stmt, cst.SimpleStatementLine):
            sub = _symbols("def __probe__():\n" + textwrap.indent(code_of(stmt), "    ", lambda _line: True))
            top |= {s.get_name() for s in sub.get_symbols() if s.is_assigned() or s.is_imported()}
    return Flow(reads, stores, both, top)


def _function_locals(fn: cst.FunctionDef) -> tuple[set[str], set[str]]:
    """(parameters, other locals) of a function given as a libcst node."""
    code = code_of(fn.with_changes(decorators=[]))
    table = _symbols(textwrap.dedent(code), fn.name.value)
    params = set(table.get_parameters())  # type: ignore[attr-defined]
    return params, {s.get_name() for s in table.get_symbols() if s.is_local() and not s.is_parameter()}


def _bound_before(fn: cst.FunctionDef, block_path: list[tuple[cst.CSTNode, int]], params: set[str]) -> set[str]:
    """Names surely bound when the statement at the end of ``block_path`` runs: the parameters, what the simple
    statements before it in its block and in every enclosing block bind, and the targets of enclosing loops and
    ``with`` statements."""
    bound = set(params)
    for owner, index in block_path:
        body = owner.body.body if hasattr(owner, "body") and hasattr(owner.body, "body") else []
        for stmt in body[:index]:
            if isinstance(stmt, cst.SimpleStatementLine):
                bound |= flow([stmt]).top_stores
        if isinstance(owner, cst.For):
            bound |= flow([statement(f"{code_of(owner.target)} = None\n")]).top_stores
        if isinstance(owner, cst.With):
            for item in owner.items:
                if item.asname is not None:
                    bound |= flow([statement(f"{code_of(item.asname.name)} = None\n")]).top_stores
    return bound


def blocks(fn: cst.FunctionDef) -> list[tuple[list[tuple[cst.CSTNode, int]], cst.CSTNode]]:
    """Every statement block of ``fn`` outside nested functions and classes: (path of (owner, index) from the
    function to the block's owner, the owner). The function itself is the first owner."""
    found = []

    def walk(owner: cst.CSTNode, path: list[tuple[cst.CSTNode, int]]) -> None:
        found.append((path, owner))
        body = owner.body.body if isinstance(getattr(owner, "body", None), cst.IndentedBlock) else []
        for i, stmt in enumerate(body):
            if isinstance(stmt, (cst.FunctionDef, cst.ClassDef)):
                continue
            for sub in _sub_blocks(stmt):
                walk(sub, [*path, (owner, i)])

    walk(fn, [])
    return found


def _sub_blocks(stmt: cst.CSTNode) -> list[cst.CSTNode]:
    """The nodes holding the blocks of a compound statement (each has ``.body`` as an IndentedBlock)."""
    out: list[cst.CSTNode] = []
    if isinstance(stmt, (cst.If, cst.For, cst.While, cst.With, cst.Try, cst.Else, cst.Finally, cst.ExceptHandler)):
        if isinstance(getattr(stmt, "body", None), cst.IndentedBlock):
            out.append(stmt)
    if isinstance(stmt, cst.If) and stmt.orelse is not None:
        out += _sub_blocks(stmt.orelse)
    if isinstance(stmt, (cst.For, cst.While)) and stmt.orelse is not None:
        out += _sub_blocks(stmt.orelse)
    if isinstance(stmt, cst.Try):
        for handler in stmt.handlers:
            out += _sub_blocks(handler)
        if stmt.orelse is not None:
            out += _sub_blocks(stmt.orelse)
        if stmt.finalbody is not None:
            out += _sub_blocks(stmt.finalbody)
    return out


def replace_block(fn: cst.FunctionDef, owner: cst.CSTNode, new_body: list[cst.BaseStatement]) -> cst.FunctionDef:
    class Swap(cst.CSTTransformer):
        def on_leave(self, original, updated):
            if original is owner:
                return updated.with_changes(body=updated.body.with_changes(body=new_body))
            return updated

    if owner is fn:
        return fn.with_changes(body=fn.body.with_changes(body=new_body))
    return fn.visit(Swap())


# -- module-level helpers -------------------------------------------------------------------------------------------
def import_line(module: str, names: Sequence[str]) -> str:
    return f"from {module} import {', '.join(sorted(names))}"


def _top_imports(text: str, file: str) -> dict[str, str]:
    """The names the module binds with a top-level import statement, each with an absolute import statement that
    binds it alone (so that it means the same in any module)."""
    found: dict[str, str] = {}
    for node in parse(text).body:
        if isinstance(node, ast.ImportFrom) and node.module != "__future__":
            source = _absolute(file, node)
            for alias in node.names:
                if alias.name == "*":
                    continue
                bound = alias.asname or alias.name
                as_part = f" as {alias.asname}" if alias.asname else ""
                found[bound] = f"from {source} import {alias.name}{as_part}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    found[alias.asname] = f"import {alias.name} as {alias.asname}"
                else:
                    found[alias.name.split(".")[0]] = f"import {alias.name}"
    return found


def _imports_for(text: str, file: str, names: set[str]) -> tuple[list[str], list[str]] | None:
    """How another module gets ``names`` as ``text`` (the module at ``file``) binds them: import statements (for
    what the module imports), and the names to import from the module itself when the code runs (what it defines:
    imported late, so no import cycle). None: a name nothing binds."""
    top = _top_imports(text, file)
    bound = module_bindings(text)
    head, lazy = [], []
    for name in sorted(names):
        if name in top:
            head.append(top[name])
        elif name in bound:
            lazy.append(name)
        elif name not in BUILTINS:
            return None
    return sorted(set(head)), lazy


def _site_statement_line(text: str, site: Site) -> int:
    """The first line of the module-level statement holding ``site`` (decorators included)."""
    node = top_level(parse(text), site.cls or site.func)
    assert node is not None
    return span(node)[0]


def add_import(text: str, site: Site, line: str) -> str:
    """``line`` (an import) at module level just before the statement holding ``site``."""
    return insert_before(text, _site_statement_line(text, site), line)


def _strip_annotations(fn: cst.FunctionDef) -> cst.FunctionDef:
    class Strip(cst.CSTTransformer):
        def leave_Param(self, original, updated):  # noqa: N802
            return updated.with_changes(annotation=None)

    params = fn.params.visit(Strip())
    return fn.with_changes(params=params, returns=None)


def _dedent_def(fn: cst.FunctionDef) -> cst.FunctionDef:
    """``fn`` as a module-level function (no leading blank lines or comments above it)."""
    return fn.with_changes(leading_lines=[])


def site_function(state: State, site: Site) -> tuple[str, cst.FunctionDef] | None:
    text = state.text(site.file)
    if text is None:
        return None
    fn = function_cst(text, site)
    if fn is None or isinstance(fn, cst.FunctionDef) and fn.asynchronous is not None:
        return None
    return text, fn


# -- rename ---------------------------------------------------------------------------------------------------------
class RenameLocal(Transform):
    """A local variable (bound by plain assignment, ``for``, ``with``; never a parameter, an import or a def) gets a
    fresh name, in every binding and read, closures included. Not where the function reads its frame."""

    name = "rename-local"

    def apply(self, state, site, pick):
        found = site_function(state, site)
        if found is None:
            return None
        text, fn = found
        if _suspicious(code_of(fn)):
            return None
        params, others = _function_locals(fn)
        candidates = sorted(others)
        old = choose(candidates, pick)
        if old is None:
            return None
        new = fresh_name(old, identifiers(text))
        renamed = _rename_in(fn, {old: new})
        if renamed is None:
            return None
        out = rewrite_function(text, site, lambda _fn: renamed)
        return Step({site.file: out}, site, f"{old} -> {new}", (site,)) if out else None


def _position_edits(text: str, edits: list[tuple[int, int, int, str]]) -> str:
    """``text`` with each (line, start, end, replacement) applied; columns are UTF-8 byte offsets (ast's)."""
    lines = text.splitlines(keepends=True)
    for line, start, end, new in sorted(edits, reverse=True):
        raw = lines[line - 1].encode()
        lines[line - 1] = (raw[:start] + new.encode() + raw[end:]).decode()
    return "".join(lines)


def _global_name_uses(text: str, name: str) -> list[tuple[int, int, int]] | None:
    """Where the module reads or binds ``name`` as a global (line, start, end), the def's own name included;
    None where a function binds the name locally too (renaming there would change which one it means)."""
    tree = parse(text)
    top = symtable.symtable(text, "<module>", "exec")
    for table in _tables(top):
        if table is top:
            continue
        for sym in table.get_symbols():
            if sym.get_name() == name and (sym.is_local() or sym.is_free()) and table.get_type() != "class":
                return None
    spots = []
    lines = text.splitlines()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id == name:
            spots.append((node.lineno, node.col_offset, node.end_col_offset))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            raw = lines[node.lineno - 1].encode()
            m = re.compile(rb"(?:async\s+)?(?:def|class)\s+(" + re.escape(name.encode()) + rb")\b").search(
                raw, node.col_offset
            )
            if m is None:
                return None
            spots.append((node.lineno, m.start(1), m.end(1)))
        elif isinstance(node, (ast.Global, ast.Nonlocal)) and name in node.names:
            return None
    return spots


class RenameHelper(Transform):
    """A module-level function of the site's module that the site calls gets a fresh name wherever the module
    reads it; modules of the package that import it import the new name under the old one."""

    name = "rename-helper"

    def __init__(self, package_files: Callable[[], Sequence[str]] = tuple) -> None:
        self.package_files = package_files

    def apply(self, state, site, pick):
        text = state.text(site.file)
        tree = parse(text) if text is not None else None
        node = function_node(tree, site) if tree is not None else None
        if node is None:
            return None
        helpers = {n.name for n in tree.body if isinstance(n, ast.FunctionDef) and not n.decorator_list}
        called = sorted(
            {
                c.func.id
                for c in ast.walk(node)
                if isinstance(c, ast.Call) and isinstance(c.func, ast.Name) and c.func.id in helpers
            }
            - {site.func}
        )
        old = choose(called, pick)
        if old is None or (old.startswith("__") and not old.endswith("__")):
            return None
        spots = _global_name_uses(text, old)
        if not spots or f'"{old}"' in text or f"'{old}'" in text:
            return None  # a string may name it (__all__, getattr): renaming would not follow
        new = fresh_name(old.rstrip("_") if old.strip("_") else old, identifiers(text))
        files = {site.file: _position_edits(text, [(ln, a, b, new) for ln, a, b in spots])}
        module = module_of(site.file)
        for other in self.package_files():
            if other == site.file or other in files:
                continue
            other_text = state.text(other)
            if other_text is None or old not in other_text:
                continue
            if any(isinstance(n, ast.Attribute) and n.attr == old for n in ast.walk(parse(other_text))):
                return None  # module.old read as an attribute: an import alias would not cover it
            edits = []
            for imp in parse(other_text).body:
                if isinstance(imp, ast.ImportFrom) and _absolute(other, imp) == module:
                    for alias in imp.names:
                        if alias.name == old:
                            spelled = f"{new} as {alias.asname or old}"
                            edits.append((alias.lineno, alias.col_offset, alias.end_col_offset, spelled))
            if edits:
                files[other] = _position_edits(other_text, edits)
        touched = site if site.func != old else Site(site.file, site.cls, new)
        return Step(files, touched, f"{old} -> {new}", (touched, Site(site.file, None, new)))


def _absolute(file: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = module_of(file) if file.endswith("__init__.py") else module_of(file).rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


# -- extract / inline -----------------------------------------------------------------------------------------------
_FORBIDDEN_IN_EXTRACT = (
    cst.Return,
    cst.Yield,
    cst.Await,
    cst.Global,
    cst.Nonlocal,
    cst.NamedExpr,
    cst.Del,
    cst.FunctionDef,
    cst.ClassDef,
)


def _has(nodes: Sequence[cst.CSTNode], kinds) -> bool:
    class Find(cst.CSTVisitor):
        hit = False

        def on_visit(self, node):
            if isinstance(node, kinds):
                Find.hit = True
            return not Find.hit

    for node in nodes:
        node.visit(Find())
    return Find.hit


def _loose_jumps(nodes: Sequence[cst.CSTNode]) -> bool:
    """A ``break`` or ``continue`` that leaves the run (not inside a loop of the run)."""

    class Find(cst.CSTVisitor):
        depth = 0
        hit = False

        def visit_For(self, node):  # noqa: N802
            self.depth += 1

        def leave_For(self, node):  # noqa: N802
            self.depth -= 1

        def visit_While(self, node):  # noqa: N802
            self.depth += 1

        def leave_While(self, node):  # noqa: N802
            self.depth -= 1

        def visit_Break(self, node):  # noqa: N802
            if not self.depth:
                self.hit = True

        def visit_Continue(self, node):  # noqa: N802
            if not self.depth:
                self.hit = True

    finder = Find()
    for node in nodes:
        node.visit(finder)
    return finder.hit


@dataclass
class _Run:
    owner: cst.CSTNode
    path: list[tuple[cst.CSTNode, int]]
    start: int
    stop: int
    inputs: list[str]
    outputs: list[str]
    globals_read: set[str]


def _runs(fn: cst.FunctionDef) -> list[tuple[list[tuple[cst.CSTNode, int]], cst.CSTNode, int, int]]:
    """Runs of 1-3 consecutive statements of one block, in a fixed order: (path, block owner, start, stop)."""
    runs = []
    skip = docstring_count(fn)
    for path, owner in blocks(fn):
        size = len(owner.body.body)
        first = skip if owner is fn else 0
        for start in range(first, size):
            for length in (1, 2, 3):
                if start + length <= size:
                    runs.append((path, owner, start, start + length))
    return runs


def _extractable(fn: cst.FunctionDef, names: tuple[set[str], set[str]], run) -> _Run | None:
    """The run as a function of its inputs returning its outputs, or None where it cannot be one."""
    path, owner, start, stop = run
    if isinstance(owner, cst.Try):
        return None  # a handler may read what the run bound before it raised
    params, locals_ = names
    stmts = list(owner.body.body)[start:stop]
    code = "".join(code_of(s) for s in stmts)
    if _has(stmts, _FORBIDDEN_IN_EXTRACT) or _loose_jumps(stmts) or _uses_super(code) or _suspicious(code):
        return None
    run_flow = flow(stmts)
    inputs = run_flow.reads & (params | locals_)
    if inputs - _bound_before(fn, [*path, (owner, start)], params):
        return None
    later, bound_outside = _outside(fn, owner, start, stop)
    if run_flow.stored_and_read & (bound_outside | params):
        return None  # bound both inside and outside the run and read in it: which value it reads is unclear
    outputs = (run_flow.stores & later) | (run_flow.stores & params)
    if outputs - run_flow.top_stores:
        return None  # bound only on some paths through the run
    return _Run(owner, path, start, stop, sorted(inputs), sorted(outputs), run_flow.reads - inputs)


def _first_fitting(candidates: Sequence, pick: int, fits: Callable, tries: int = 24):
    """``fits(c)`` of the ``pick``-th candidate (modulo their number), else of the next ones in turn: the first
    that is not None (at most ``tries`` looked at, so a big function costs little)."""
    if not candidates:
        return None
    for k in range(min(tries, len(candidates))):
        found = fits(candidates[(pick + k) % len(candidates)])
        if found is not None:
            return found
    return None


def _outside(fn: cst.FunctionDef, owner: cst.CSTNode, start: int, stop: int) -> tuple[set[str], set[str]]:
    """(the names the function reads, the names it binds) outside statements ``start:stop`` of ``owner``'s block."""
    body = list(owner.body.body)
    holed = replace_block(fn, owner, [*body[:start], statement("pass\n"), *body[stop:]])
    code = textwrap.dedent(code_of(holed.with_changes(decorators=[])))
    table = _symbols(code, fn.name.value)
    reads = {s.get_name() for t in _tables(table) for s in t.get_symbols() if s.is_referenced() or s.is_free()}
    bound = {s.get_name() for s in table.get_symbols() if s.is_local() and not s.is_parameter()}
    return reads, bound


def _call_statement(helper: str, run: _Run) -> cst.BaseStatement:
    call = f"{helper}({', '.join(run.inputs)})"
    if not run.outputs:
        return statement(call + "\n")
    targets = ", ".join(run.outputs)
    return statement(f"{targets} = {call}\n")


def _helper_def(helper: str, run: _Run, stmts: Sequence[cst.BaseStatement], prelude: Sequence[str]) -> str:
    body = [statement(line + "\n") for line in prelude] + list(stmts)
    if run.outputs:
        body.append(statement(f"return {', '.join(run.outputs)}\n"))
    fn = cst.FunctionDef(
        name=cst.Name(helper),
        params=cst.Parameters(params=[cst.Param(cst.Name(n)) for n in run.inputs]),
        body=cst.IndentedBlock(body=body),
    )
    return cst.Module(body=[fn]).code


class ExtractHelper(Transform):
    """1-3 consecutive statements (no return, yield, await, global, walrus, del, def, zero-argument super(),
    break or continue leaving them) become ``def helper(inputs): ...; return outputs``: inputs are the function's
    names they read (each surely bound there), outputs the names they bind that the function reads elsewhere (each
    bound on every path through them). ``other_module``: the helper lives in a new module the site's module
    imports; it imports what the original module imports, and what the module defines when it is called."""

    def __init__(self, other_module: bool = False) -> None:
        self.other_module = other_module
        self.name = "extract-module" if other_module else "extract-helper"

    def apply(self, state, site, pick):
        found = site_function(state, site)
        if found is None:
            return None
        text, fn = found
        names = _function_locals(fn)
        run = _first_fitting(_runs(fn), pick, lambda r: _extractable(fn, names, r))
        if run is None:
            return None
        taken = identifiers(text)
        helper = fresh_name(f"_{site.func.strip('_')}_part", taken)
        stmts = list(run.owner.body.body)[run.start : run.stop]
        body = list(run.owner.body.body)
        new_fn = replace_block(fn, run.owner, [*body[: run.start], _call_statement(helper, run), *body[run.stop :]])
        out = rewrite_function(text, site, lambda _fn: new_fn)
        if out is None:
            return None
        lines = f"lines {run.start + 1}-{run.stop} of a block"
        if not self.other_module:
            helper_code = _helper_def(helper, run, stmts, ())
            touched = (site, Site(site.file, None, helper))
            return Step({site.file: append_code(out, helper_code)}, site, f"{helper}: {lines}", touched)
        imports = _imports_for(text, site.file, run.globals_read)
        if imports is None:
            return None
        head, lazy = imports
        path = state.new_module(site.file, "refactor_helpers")
        prelude = [import_line(site.module, lazy)] if lazy else []
        header = "".join(line + "\n" for line in head) + ("\n\n" if head else "")
        new_text = header + _helper_def(helper, run, stmts, prelude)
        out = add_import(out, site, import_line(module_of(path), [helper]))
        touched = (site, Site(path, None, helper))
        return Step({site.file: out, path: new_text}, site, f"{helper} in {path}: {lines}", touched)


def _single_target(stmt: cst.CSTNode) -> tuple[str, cst.BaseExpression] | None:
    """(how the statement uses a value, the value) for ``x = v``, ``return v``, ``v``: the contexts a call may be
    inlined in without changing what runs before it."""
    if not isinstance(stmt, cst.SimpleStatementLine) or len(stmt.body) != 1:
        return None
    small = stmt.body[0]
    if isinstance(small, cst.Assign) and len(small.targets) == 1 and isinstance(small.targets[0].target, cst.Name):
        return f"{small.targets[0].target.value} = ", small.value
    if isinstance(small, cst.Return) and small.value is not None:
        return "return ", small.value
    if isinstance(small, cst.Expr):
        return "", small.value
    return None


class InlineHelper(Transform):
    """A statement ``x = f(...)`` / ``return f(...)`` / ``f(...)`` whose ``f`` is a plain module-level function (of
    the site's module, or imported from a module of the package): its body replaces the call, its parameters bound
    to the arguments first, every name it binds renamed fresh, its final ``return e`` giving the value. ``f`` has
    no other return, no yield, no decorator, no ``*args``/``**kwargs``; the call passes no starred argument and binds
    every parameter without a default; what ``f`` reads from its module is imported inside the site's function
    where it is not the same module."""

    name = "inline-helper"

    def __init__(self, resolve_import: Callable[[State, Site, str], tuple[str, str] | None] | None = None) -> None:
        self.resolve_import = resolve_import or _imported_from

    def apply(self, state, site, pick):
        found = site_function(state, site)
        if found is None:
            return None
        text, fn = found

        def callee_of(stmt) -> tuple[str, cst.Call] | None:
            use = _single_target(stmt)
            if use is None or not isinstance(use[1], cst.Call) or not isinstance(use[1].func, cst.Name):
                return None
            return use[0], use[1]

        candidates = []
        for _path, owner in blocks(fn):
            for i, stmt in enumerate(owner.body.body):
                hit = callee_of(stmt)
                if hit is None:
                    continue
                source = self._callee(state, site, text, hit[1].func.value)
                if source is None:
                    continue
                callee = function_cst(*source)
                if callee is not None and self._inlinable(callee) and _bind(callee, hit[1]) is not None:
                    candidates.append((owner, i, hit[0], hit[1], source, callee))
        chosen = choose(candidates, pick)
        if chosen is None:
            return None
        owner, index, use, call, (callee_text, callee_site), callee = chosen
        name = call.func.value
        bindings = _bind(callee, call)
        if bindings is None:
            return None
        taken = identifiers(text) | identifiers(callee_text)
        params, locals_ = _function_locals(callee)
        fresh = {}
        for local in sorted(params | locals_):
            fresh[local] = fresh_name(local, taken)
            taken.add(fresh[local])
        renamed = _rename_in(callee, fresh)
        if renamed is None:
            return None
        body = body_statements(renamed)[docstring_count(renamed) :]
        last = body[-1]
        final = _single_target(last)
        if final is None or not final[0].startswith("return"):
            return None
        lines = [statement(f"{fresh[p]} = {code_of(arg)}\n") for p, arg in bindings.items()]
        lines += body[:-1]
        lines.append(statement(f"{use}{code_of(final[1])}\n") if use else statement(code_of(final[1]) + "\n"))
        prelude: list[str] = []
        callee_reads = _global_reads(callee_text, callee_site) or set()
        own_params, own_locals = _function_locals(fn)
        if callee_reads & (own_params | own_locals):
            return None  # the site binds a name the callee reads from its module: inlined, it would read the site's
        if callee_site.file != site.file:
            reads = callee_reads - BUILTINS
            own_reads = _reads_of(fn)
            need = []
            for read in sorted(reads):
                if read not in own_reads:
                    need.append(read)
                elif _import_source(text, site.file, read) != _import_source(callee_text, callee_site.file, read):
                    return None  # the two modules mean different things by it
                elif _import_source(text, site.file, read) is None:
                    return None
            imports = _imports_for(callee_text, callee_site.file, set(need))
            if imports is None:
                return None
            head, lazy = imports
            prelude += head
            if lazy:
                prelude.append(import_line(callee_site.module, lazy))
        current = list(owner.body.body)
        new_fn = replace_block(fn, owner, [*current[:index], *lines, *current[index + 1 :]])
        new_fn = with_prelude(new_fn, prelude)
        out = rewrite_function(text, site, lambda _fn: new_fn)
        return Step({site.file: out}, site, f"{name}() inlined", (site,)) if out else None

    def _callee(self, state, site, text, name) -> tuple[str, Site] | None:
        tree = parse(text)
        node = top_level(tree, name)
        if isinstance(node, ast.FunctionDef):
            return text, Site(site.file, None, name)
        where = self.resolve_import(state, site, name)
        if where is None:
            return None
        file, real = where
        other = state.text(file)
        if other is None or not isinstance(top_level(parse(other), real), ast.FunctionDef):
            return None
        return other, Site(file, None, real)

    @staticmethod
    def _inlinable(callee: cst.FunctionDef) -> bool:
        if callee.decorators or callee.asynchronous is not None:
            return False
        params = callee.params
        if params.star_kwarg is not None or isinstance(params.star_arg, cst.Param):
            return False
        body = body_statements(callee)[docstring_count(callee) :]
        if not body or _has(body, (cst.Yield, cst.Await, cst.Global, cst.Nonlocal, cst.FunctionDef, cst.ClassDef)):
            return False
        returns = _count(cst.Module(body=body), lambda n: isinstance(n, cst.Return))
        if returns != 1 or not isinstance(body[-1], cst.SimpleStatementLine):
            return False
        code = "".join(code_of(s) for s in body)
        return not _uses_super(code) and not _suspicious(code)


def _import_source(text: str, file: str, name: str) -> str | None:
    """``module.attr`` a module's top-level import binds ``name`` to (absolute), or None."""
    for node in parse(text).body:
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    return f"{_absolute(file, node)}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if (alias.asname or alias.name.split(".")[0]) == name:
                    return alias.name if alias.asname else alias.name.split(".")[0]
    return None


def _imported_from(state: State, site: Site, name: str) -> tuple[str, str] | None:
    """(file, name there) of a module of the package ``site``'s module imports ``name`` from."""
    text = state.text(site.file)
    for node in parse(text).body:
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    module = _absolute(site.file, node)
                    file = module.replace(".", "/") + ".py"
                    if state.text(file) is not None:
                        return file, alias.name
    return None


def _global_reads(text: str, site: Site) -> set[str] | None:
    from tests.refactor.source import global_reads

    return global_reads(text, site)


def _reads_of(fn: cst.FunctionDef) -> set[str]:
    code = textwrap.dedent(code_of(fn.with_changes(decorators=[])))
    table = _symbols(code, fn.name.value)
    return {s.get_name() for t in _tables(table) for s in t.get_symbols() if s.is_referenced()}


def _bind(callee: cst.FunctionDef, call: cst.Call) -> dict[str, cst.BaseExpression] | None:
    """Parameter -> argument, as Python binds ``call`` to ``callee`` (None: a starred argument, a missing or
    unknown one, or a default that is not a constant)."""
    params = callee.params
    positional = [*params.posonly_params, *params.params]
    keyword_only = list(params.kwonly_params)
    bound: dict[str, cst.BaseExpression] = {}
    args = list(call.args)
    if any(a.star for a in args):
        return None
    plain = [a for a in args if a.keyword is None]
    if len(plain) > len(positional):
        return None
    for param, arg in zip(positional, plain, strict=False):
        bound[param.name.value] = arg.value
    names = {p.name.value for p in [*positional, *keyword_only]}
    for arg in args:
        if arg.keyword is not None:
            if arg.keyword.value not in names or arg.keyword.value in bound:
                return None
            bound[arg.keyword.value] = arg.value
    for param in [*positional, *keyword_only]:
        if param.name.value not in bound:
            if param.default is None or not isinstance(
                param.default, (cst.Integer, cst.Float, cst.SimpleString, cst.Name)
            ):
                return None
            if isinstance(param.default, cst.Name) and param.default.value not in ("None", "True", "False"):
                return None
            bound[param.name.value] = param.default
    # the order Python evaluates them in: the call's arguments as written, then the defaults
    written = [p.name.value for p, _ in zip(positional, plain, strict=False)]
    written += [a.keyword.value for a in args if a.keyword is not None]
    order = written + [p.name.value for p in [*positional, *keyword_only] if p.name.value not in written]
    return {name: bound[name] for name in order}


# -- methods into other classes -------------------------------------------------------------------------------------
def _method_parts(state: State, site: Site):
    """(text, class node (ast), method (libcst)) for a plain method the generator may move; None otherwise."""
    if not site.cls:
        return None
    found = site_function(state, site)
    if found is None:
        return None
    text, fn = found
    if _suspicious(code_of(fn)):
        return None
    cls = top_level(parse(text), site.cls)
    if not isinstance(cls, ast.ClassDef) or cls.col_offset != 0:
        return None
    first_stmt = cls.body[0]
    if first_stmt.col_offset != 4:
        return None
    return text, cls, fn


def _moved_method(text: str, site: Site, fn: cst.FunctionDef) -> tuple[list[str], cst.FunctionDef] | None:
    """The method as a new module of the package holds it: (import lines for the module's top, the method with
    its annotations dropped and what the original module defines imported inside it)."""
    method = _strip_annotations(fn)
    reads = (_global_reads(text, site) or set()) - {"__class__"}
    decorators = {n.value for d in fn.decorators for n in names_in(d.decorator)}
    imports = _imports_for(text, site.file, reads | decorators)
    if imports is None:
        return None
    head, lazy = imports
    if set(lazy) & decorators:
        return None  # a decorator defined in the module: it must exist when the class body runs
    if lazy:
        method = with_prelude(method, [import_line(site.module, lazy)])
    return head, method


def names_in(node: cst.CSTNode) -> list[cst.Name]:
    found = []

    class Collect(cst.CSTVisitor):
        def visit_Name(self, n):  # noqa: N802
            found.append(n)

    node.visit(Collect())
    return found


def _class_code(name: str, bases: str, method: cst.FunctionDef, head: list[str]) -> str:
    header = "from __future__ import annotations\n\n" + "".join(line + "\n" for line in head)
    cls = cst.ClassDef(
        name=cst.Name(name),
        bases=[cst.Arg(expression(b)) for b in bases.split(", ")] if bases else [],
        body=cst.IndentedBlock(body=[method.with_changes(leading_lines=[])]),
        lpar=cst.LeftParen() if bases else cst.MaybeSentinel.DEFAULT,
        rpar=cst.RightParen() if bases else cst.MaybeSentinel.DEFAULT,
    )
    return header.rstrip("\n") + "\n\n\n" + cst.Module(body=[cls]).code


class MoveMethod(Transform):
    """The method leaves its class for a class of a new module of the same package: a mixin first among the
    class's bases (``mixin``), or a base between the class and its bases (``base``; the bases must be names the
    module imports, and the class takes no keywords). Python finds it first there, as it found it in the class;
    zero-argument ``super()`` in it skips to the same next class. ``delegate``: the mixin holds the method, and the
    class keeps ``def m(<same parameters>): return super().m(<the same arguments>)``."""

    def __init__(self, how: str) -> None:
        assert how in ("mixin", "base", "delegate")
        self.how = how
        self.name = {"mixin": "move-to-mixin", "base": "move-to-base", "delegate": "super-delegation"}[how]

    def apply(self, state, site, pick):
        parts = _method_parts(state, site)
        if parts is None:
            return None
        text, cls, fn = parts
        if self.how == "delegate" and fn.decorators:
            return None  # a property or a static method does not delegate so
        moved = _moved_method(text, site, fn)
        if moved is None:
            return None
        head, method = moved
        path = state.new_module(site.file, f"refactor_{site.cls.lower()}")
        new_cls = fresh_name(f"{site.cls}{'Base' if self.how == 'base' else 'Mixin'}", identifiers(text))
        if self.how == "base":
            if cls.keywords or not cls.bases:
                return None
            top = _top_imports(text, site.file)
            base_names = [ast.unparse(b) for b in cls.bases]
            roots = {b.split(".")[0] for b in base_names}
            if any(root not in top for root in roots):
                return None
            head = sorted(set(head) | {top[r] for r in roots})
            module_text = _class_code(new_cls, ", ".join(base_names), method, head)
        else:
            module_text = _class_code(new_cls, "", method, head)

        def change_class(node: cst.ClassDef) -> cst.ClassDef:
            body = []
            for member in node.body.body:
                if isinstance(member, cst.FunctionDef) and member.name.value == site.func:
                    if self.how == "delegate":
                        body.append(_delegating(member))
                    continue
                body.append(member)
            if not body:
                body = [statement("pass\n")]
            new_base = cst.Arg(cst.Name(new_cls))
            bases = [new_base] if self.how == "base" else [new_base, *node.bases]
            return node.with_changes(
                body=node.body.with_changes(body=body),
                bases=[b.with_changes(comma=cst.MaybeSentinel.DEFAULT) for b in bases],
                lpar=cst.LeftParen(),
                rpar=cst.RightParen(),
            )

        out = rewrite_class(text, site.cls, change_class)
        if out is None:
            return None
        out = add_import(out, site, import_line(module_of(path), [new_cls]))
        moved_site = Site(path, new_cls, site.func)
        touched = (moved_site, site) if self.how == "delegate" else (moved_site,)
        new_site = site if self.how == "delegate" else moved_site
        return Step({site.file: out, path: module_text}, new_site, f"{site.func} into {new_cls} ({path})", touched)


def _delegating(fn: cst.FunctionDef) -> cst.FunctionDef:
    """``def m(<fn's parameters>): return super().m(<them>)``."""
    params = fn.params
    args = [p.name.value for p in [*params.posonly_params, *params.params][1:]]
    if isinstance(params.star_arg, cst.Param):
        args.append(f"*{params.star_arg.name.value}")
    args += [f"{p.name.value}={p.name.value}" for p in params.kwonly_params]
    if params.star_kwarg is not None:
        args.append(f"**{params.star_kwarg.name.value}")
    body = statement(f"return super().{fn.name.value}({', '.join(args)})\n")
    return fn.with_changes(body=cst.IndentedBlock(body=[body]), decorators=[])


# -- attribute spellings --------------------------------------------------------------------------------------------
def _store_attributes(fn: cst.FunctionDef) -> set[int]:
    """The Attribute nodes of ``fn`` that are written, deleted or augmented (not plain reads)."""
    found: set[int] = set()

    class Collect(cst.CSTVisitor):
        def visit_AssignTarget(self, node):  # noqa: N802
            found.add(id(node.target))

        def visit_AnnAssign(self, node):  # noqa: N802
            found.add(id(node.target))

        def visit_AugAssign(self, node):  # noqa: N802
            found.add(id(node.target))

        def visit_Del(self, node):  # noqa: N802
            found.add(id(node.target))

        def visit_For(self, node):  # noqa: N802
            found.add(id(node.target))

        def visit_CompFor(self, node):  # noqa: N802
            found.add(id(node.target))

        def visit_AsName(self, node):  # noqa: N802
            found.add(id(node.name))

        def visit_Element(self, node):  # noqa: N802
            pass

    fn.visit(Collect())
    return found


class GetattrRead(Transform):
    """``x.a`` read (not written, deleted or augmented; ``a`` not a private name) -> ``getattr(x, "a")``; with
    ``every``, each such read of the function at once."""

    def __init__(self, every: bool = False) -> None:
        self.every = every
        self.name = "getattr-read-all" if every else "getattr-read"

    def apply(self, state, site, pick):
        found = site_function(state, site)
        if found is None:
            return None
        text, fn = found
        stores = _store_attributes(fn)
        targets_in_tuples: set[int] = set()

        class Tuples(cst.CSTVisitor):
            def visit_AssignTarget(self, node):  # noqa: N802
                for sub in _attributes(node.target):
                    targets_in_tuples.add(id(sub))

            def visit_For(self, node):  # noqa: N802
                for sub in _attributes(node.target):
                    targets_in_tuples.add(id(sub))

        fn.visit(Tuples())
        in_imports: set[int] = set()  # in import statements and f-strings: left as they are

        class Imports(cst.CSTVisitor):
            def visit_Import(self, node):  # noqa: N802
                in_imports.update(id(a) for a in _all_attributes(node))

            def visit_ImportFrom(self, node):  # noqa: N802
                in_imports.update(id(a) for a in _all_attributes(node))

            def visit_FormattedString(self, node):  # noqa: N802
                in_imports.update(id(a) for a in _all_attributes(node))  # a quote inside an f-string ends it

        fn.visit(Imports())

        def test(node) -> bool:
            return (
                isinstance(node, cst.Attribute)
                and id(node) not in stores
                and id(node) not in targets_in_tuples
                and id(node) not in in_imports
                and not _private(node.attr.value)
            )

        def make(original, updated):
            return cst.Call(
                func=cst.Name("getattr"),
                args=[cst.Arg(updated.value), cst.Arg(cst.SimpleString(f'"{original.attr.value}"'))],
            )

        new = _rewrite(fn, test, make, pick, self.every)
        if new is None:
            return None
        out = rewrite_function(text, site, lambda _fn: new)
        return Step({site.file: out}, site, "getattr", (site,)) if out else None


def _all_attributes(node: cst.CSTNode) -> list[cst.Attribute]:
    found: list[cst.Attribute] = []

    class Collect(cst.CSTVisitor):
        def visit_Attribute(self, a):  # noqa: N802
            found.append(a)

    node.visit(Collect())
    return found


def _attributes(node: cst.CSTNode) -> list[cst.Attribute]:
    """Attribute nodes that are store targets inside a tuple/list target (``a.x, b = ...``)."""
    if isinstance(node, (cst.Tuple, cst.List)):
        return [a for el in node.elements for a in _attributes(el.value)]
    if isinstance(node, cst.StarredElement):
        return _attributes(node.value)
    return [node] if isinstance(node, cst.Attribute) else []


class SetattrWrite(Transform):
    """``x.a = v`` (one target, ``a`` not a private name) -> ``setattr(x, "a", v)``; with ``every``, each such
    assignment of the function at once."""

    def __init__(self, every: bool = False) -> None:
        self.every = every
        self.name = "setattr-write-all" if every else "setattr-write"

    def apply(self, state, site, pick):
        found = site_function(state, site)
        if found is None:
            return None
        text, fn = found

        def test(node) -> bool:
            if not isinstance(node, cst.SimpleStatementLine) or len(node.body) != 1:
                return False
            small = node.body[0]
            return (
                isinstance(small, cst.Assign)
                and len(small.targets) == 1
                and isinstance(small.targets[0].target, cst.Attribute)
                and not _private(small.targets[0].target.attr.value)
            )

        def make(original, updated):
            assign = updated.body[0]
            target = assign.targets[0].target
            call = cst.Call(
                func=cst.Name("setattr"),
                args=[
                    cst.Arg(target.value),
                    cst.Arg(cst.SimpleString(f'"{target.attr.value}"')),
                    cst.Arg(assign.value),
                ],
            )
            return updated.with_changes(body=[cst.Expr(call)])

        new = _rewrite(fn, test, make, pick, self.every)
        if new is None:
            return None
        out = rewrite_function(text, site, lambda _fn: new)
        return Step({site.file: out}, site, "setattr", (site,)) if out else None


# -- tests ----------------------------------------------------------------------------------------------------------
TORCH_DTYPES = frozenset(
    {
        "float8_e4m3fn",
        "float8_e5m2",
        "float8_e4m3fnuz",
        "bfloat16",
        "float16",
        "half",
        "float32",
        "float",
        "float64",
        "double",
        "int8",
        "uint8",
        "int16",
        "int32",
        "int",
        "int64",
        "long",
        "bool",
    }
)


def _is_dtype(node: cst.BaseExpression) -> bool:
    return (
        isinstance(node, cst.Attribute)
        and isinstance(node.value, cst.Name)
        and node.value.value == "torch"
        and node.attr.value in TORCH_DTYPES
    )


def _reads_dtype(node: cst.BaseExpression) -> bool:
    return isinstance(node, cst.Attribute) and node.attr.value == "dtype"


def bool_valued(node: cst.BaseExpression, flags: frozenset[str] = frozenset()) -> bool:
    """Whether ``node`` evaluates to a bool whatever its operands hold: ``not``, ``is``, ``in``, ``isinstance``,
    ``hasattr``, ``callable``, ``bool()``, ``str.startswith``/``endswith``, a comparison of a dtype with a torch
    dtype or of anything with a string constant, and ``and``/``or`` of such; ``flags`` are names known to hold one."""
    if isinstance(node, cst.UnaryOperation) and isinstance(node.operator, cst.Not):
        return True
    if isinstance(node, cst.Name):
        return node.value in flags or node.value in ("True", "False")
    if isinstance(node, cst.BooleanOperation):
        return bool_valued(node.left, flags) and bool_valued(node.right, flags)
    if isinstance(node, cst.Comparison) and len(node.comparisons) == 1:
        op = node.comparisons[0].operator
        right = node.comparisons[0].comparator
        if isinstance(op, (cst.Is, cst.IsNot, cst.In, cst.NotIn)):
            return True
        if isinstance(op, (cst.Equal, cst.NotEqual)):
            sides = (node.left, right)
            return any(isinstance(s, cst.SimpleString) for s in sides) or (
                any(_is_dtype(s) for s in sides) and any(_reads_dtype(s) or _is_dtype(s) for s in sides)
            )
        return False
    if isinstance(node, cst.Call):
        func = node.func
        if isinstance(func, cst.Name) and func.value in ("isinstance", "hasattr", "callable", "bool", "issubclass"):
            return True
        if isinstance(func, cst.Attribute) and func.attr.value in ("startswith", "endswith", "isdigit"):
            return True
    return False


def _boolean_contexts(fn: cst.CSTNode) -> set[int]:
    """Expressions whose value is only used as a truth value: tests of if/while/assert/conditional expressions,
    operands of and/or/not."""
    found: set[int] = set()

    class Collect(cst.CSTVisitor):
        def visit_If(self, node):  # noqa: N802
            found.add(id(node.test))

        def visit_While(self, node):  # noqa: N802
            found.add(id(node.test))

        def visit_Assert(self, node):  # noqa: N802
            found.add(id(node.test))

        def visit_IfExp(self, node):  # noqa: N802
            found.add(id(node.test))

        def visit_BooleanOperation(self, node):  # noqa: N802
            if id(node) in found:
                found.update((id(node.left), id(node.right)))

        def visit_UnaryOperation(self, node):  # noqa: N802
            if isinstance(node.operator, cst.Not):
                found.add(id(node.expression))

    fn.visit(Collect())
    return found


class EqToIn(Transform):
    """``a == b`` -> ``a in (b,)`` and ``a != b`` -> ``a not in (b,)``, where the comparison is only tested for
    truth or is a bool anyway (:func:`bool_valued`)."""

    name = "eq-to-in"

    def apply(self, state, site, pick):
        found = site_function(state, site)
        if found is None:
            return None
        text, fn = found
        contexts = _boolean_contexts(fn)

        def test(node) -> bool:
            return (
                isinstance(node, cst.Comparison)
                and len(node.comparisons) == 1
                and isinstance(node.comparisons[0].operator, (cst.Equal, cst.NotEqual))
                and (id(node) in contexts or bool_valued(node))
            )

        def make(original, updated):
            target = updated.comparisons[0]
            negated = isinstance(target.operator, cst.NotEqual)
            op = (
                cst.NotIn(
                    whitespace_before=cst.SimpleWhitespace(" "),
                    whitespace_between=cst.SimpleWhitespace(" "),
                    whitespace_after=cst.SimpleWhitespace(" "),
                )
                if negated
                else cst.In(whitespace_before=cst.SimpleWhitespace(" "), whitespace_after=cst.SimpleWhitespace(" "))
            )
            single = cst.Tuple(elements=[cst.Element(target.comparator, comma=cst.Comma())])
            return updated.with_changes(comparisons=[cst.ComparisonTarget(op, single)])

        new = _nth(fn, test, make, pick)
        if new is None:
            return None
        out = rewrite_function(text, site, lambda _fn: new)
        return Step({site.file: out}, site, "== as in", (site,)) if out else None


class EqToIs(Transform):
    """``x.dtype == torch.<dtype>`` -> ``x.dtype is torch.<dtype>`` (and ``!=`` -> ``is not``): torch's dtypes are
    singletons, so equality is identity."""

    name = "eq-to-is"

    def apply(self, state, site, pick):
        found = site_function(state, site)
        if found is None:
            return None
        text, fn = found

        def test(node) -> bool:
            if not (isinstance(node, cst.Comparison) and len(node.comparisons) == 1):
                return False
            target = node.comparisons[0]
            sides = (node.left, target.comparator)
            return (
                isinstance(target.operator, (cst.Equal, cst.NotEqual))
                and any(_is_dtype(s) for s in sides)
                and any(_reads_dtype(s) for s in sides)
            )

        def make(original, updated):
            target = updated.comparisons[0]
            space = cst.SimpleWhitespace(" ")
            op = (
                cst.IsNot(whitespace_before=space, whitespace_between=space, whitespace_after=space)
                if isinstance(target.operator, cst.NotEqual)
                else cst.Is(whitespace_before=space, whitespace_after=space)
            )
            return updated.with_changes(comparisons=[target.with_changes(operator=op)])

        new = _nth(fn, test, make, pick)
        if new is None:
            return None
        out = rewrite_function(text, site, lambda _fn: new)
        return Step({site.file: out}, site, "== as is", (site,)) if out else None


def _flags(fn: cst.FunctionDef) -> frozenset[str]:
    """Local names every binding of which is a bool-valued expression."""
    values: dict[str, list[cst.BaseExpression]] = {}
    others: set[str] = set()

    class Collect(cst.CSTVisitor):
        def visit_Assign(self, node):  # noqa: N802
            for target in node.targets:
                if isinstance(target.target, cst.Name):
                    values.setdefault(target.target.value, []).append(node.value)
                else:
                    others.update(n.value for n in names_in(target.target))

        def visit_AugAssign(self, node):  # noqa: N802
            others.update(n.value for n in names_in(node.target))

        def visit_AnnAssign(self, node):  # noqa: N802
            others.update(n.value for n in names_in(node.target))

        def visit_For(self, node):  # noqa: N802
            others.update(n.value for n in names_in(node.target))

        def visit_AsName(self, node):  # noqa: N802
            others.update(n.value for n in names_in(node.name))

        def visit_NamedExpr(self, node):  # noqa: N802
            others.update(n.value for n in names_in(node.target))

    fn.visit(Collect())
    params, _ = _function_locals(fn)
    flags: frozenset[str] = frozenset()
    for _ in range(3):
        flags = frozenset(
            name
            for name, exprs in values.items()
            if name not in others and name not in params and all(bool_valued(e, flags) for e in exprs)
        )
    return flags


class FlagIsTrue(Transform):
    """``if flag:`` -> ``if flag is True:`` where ``flag`` is a local only ever bound to a bool."""

    name = "flag-is-true"

    def apply(self, state, site, pick):
        found = site_function(state, site)
        if found is None:
            return None
        text, fn = found
        flags = _flags(fn)
        if not flags:
            return None

        def test(node) -> bool:
            return isinstance(node, cst.If) and isinstance(node.test, cst.Name) and node.test.value in flags

        def make(original, updated):
            space = cst.SimpleWhitespace(" ")
            return updated.with_changes(
                test=cst.Comparison(
                    updated.test,
                    [cst.ComparisonTarget(cst.Is(whitespace_before=space, whitespace_after=space), cst.Name("True"))],
                )
            )

        new = _nth(fn, test, make, pick)
        if new is None:
            return None
        out = rewrite_function(text, site, lambda _fn: new)
        return Step({site.file: out}, site, "flag is True", (site,)) if out else None


# -- lazy wrappers --------------------------------------------------------------------------------------------------
#: Calls that iterate their first argument once, whatever it is.
#: (Not ``dict``: a mapping and the pairs it would be wrapped into differ.)
ITERATING = frozenset({"sorted", "list", "tuple", "set", "frozenset", "enumerate", "iter", "any", "all", "sum"})
#: Methods that iterate their argument once: vLLM's loaders (``load_weights``) and weight mappers (``<...>mapper
#: .apply``) take the weight stream so, and ``str.join``/``list.extend``.
ITERATING_METHODS = frozenset({"load_weights", "apply", "join", "extend"})
#: Consumers whose items are (name, tensor) pairs, never false: filter(None, ...) keeps every one.
PAIR_CONSUMERS = frozenset({"load_weights", "apply"})

LAZY = {
    "map": "map(lambda {t}: {t}, {e})",
    "genexp": "({t} for {t} in {e})",
    "iter": "iter({e})",
    "filter": "filter(None, {e})",
    "zip": "({t} for ({t},) in zip({e}))",
    "enumerate": "({t} for _, {t} in enumerate({e}))",
    "islice": "itertools.islice({e}, None)",
}


class LazyWrapper(Transform):
    """An iterable consumed once (a ``for`` loop's or a comprehension's iterable, the argument of a call that
    iterates it, ``yield from``) wrapped in a lazy iterator that yields the same items in the same order.
    ``filter(None, ...)`` only where the items are (name, tensor) pairs or unpacked tuples (never false)."""

    def __init__(self, how: str) -> None:
        assert how in LAZY
        self.how = how
        self.name = f"lazy-{how}"

    def apply(self, state, site, pick):
        found = site_function(state, site)
        if found is None:
            return None
        text, fn = found
        sites: dict[int, bool] = {}  # id(expression) -> its items are never false

        class Collect(cst.CSTVisitor):
            def visit_For(self, node):  # noqa: N802
                sites[id(node.iter)] = isinstance(node.target, (cst.Tuple, cst.List))

            def visit_CompFor(self, node):  # noqa: N802
                sites[id(node.iter)] = isinstance(node.target, (cst.Tuple, cst.List))

            def visit_Call(self, node):  # noqa: N802
                func = node.func
                name = func.value if isinstance(func, cst.Name) else None
                method = func.attr.value if isinstance(func, cst.Attribute) else None
                if not node.args or node.args[0].star or node.args[0].keyword is not None:
                    return
                if method == "apply" and not code_of(func.value).endswith("mapper"):
                    return  # another object's apply (a quant method's takes a layer)
                if name in ITERATING or method in ITERATING_METHODS:
                    sites[id(node.args[0].value)] = method in PAIR_CONSUMERS

        fn.visit(Collect())
        wanted = {k for k, pairs in sites.items() if self.how != "filter" or pairs}

        def test(node) -> bool:
            return id(node) in wanted

        taken = identifiers(text)
        item = fresh_name("item", taken)
        template = LAZY[self.how]

        def make(original, updated):
            return expression(template.format(t=item, e=code_of(updated)))

        new = _nth(fn, test, make, pick)
        if new is None:
            return None
        if self.how == "islice":
            new = with_prelude(new, ["import itertools"])
        out = rewrite_function(text, site, lambda _fn: new)
        return Step({site.file: out}, site, self.name, (site,)) if out else None


# -- conditions and returns -----------------------------------------------------------------------------------------
def _elifs(fn: cst.CSTNode) -> set[int]:
    found: set[int] = set()

    class Collect(cst.CSTVisitor):
        def visit_If(self, node):  # noqa: N802
            if isinstance(node.orelse, cst.If):
                found.add(id(node.orelse))

    fn.visit(Collect())
    return found


class ConditionFlag(Transform):
    """An ``if`` (not an ``elif``) whose test holds no walrus: ``flag = <test>`` just before it, ``if flag:``; with
    ``helper``, ``def _cond(inputs): return <test>`` in the module and ``if _cond(inputs):`` (the test's names
    surely bound there; no zero-argument super())."""

    def __init__(self, helper: bool = False) -> None:
        self.helper = helper
        self.name = "condition-helper" if helper else "condition-flag"

    def apply(self, state, site, pick):
        found = site_function(state, site)
        if found is None:
            return None
        text, fn = found
        elifs = _elifs(fn)
        candidates = []
        for path, owner in blocks(fn):
            for i, stmt in enumerate(owner.body.body):
                if isinstance(stmt, cst.If) and id(stmt) not in elifs and not _has([stmt.test], (cst.NamedExpr,)):
                    candidates.append((path, owner, i, stmt))
        chosen = choose(candidates, pick)
        if chosen is None:
            return None
        path, owner, index, node = chosen
        taken = identifiers(text)
        body = list(owner.body.body)
        extra: dict[str, str] = {}
        if not self.helper:
            flag = fresh_name("condition", taken)
            bind = statement(f"{flag} = {_one_line(code_of(node.test))}\n")
            new_stmts = [bind, node.with_changes(test=cst.Name(flag))]
            detail = f"if {flag}"
        else:
            test_code = _one_line(code_of(node.test))
            if _uses_super(test_code) or _suspicious(test_code) or _has([node.test], (cst.Yield, cst.Await)):
                return None
            params, locals_ = _function_locals(fn)
            reads = flow([statement(f"_ = {test_code}\n")]).reads
            inputs = sorted(reads & (params | locals_))
            if set(inputs) - _bound_before(fn, [*path, (owner, index)], params):
                return None
            name = fresh_name(f"_{site.func.strip('_')}_condition", taken)
            extra[site.file] = f"def {name}({', '.join(inputs)}):\n    return {test_code}\n"
            new_stmts = [node.with_changes(test=expression(f"{name}({', '.join(inputs)})"))]
            detail = f"if {name}()"
        new_fn = replace_block(fn, owner, [*body[:index], *new_stmts, *body[index + 1 :]])
        out = rewrite_function(text, site, lambda _fn: new_fn)
        if out is None:
            return None
        touched = [site]
        if self.helper:
            out = append_code(out, extra[site.file])
            touched.append(Site(site.file, None, detail.split()[1].rstrip("()")))
        return Step({site.file: out}, site, detail, tuple(touched))


def _exits(block: cst.BaseSuite) -> bool:
    """Whether a block always leaves the function or raises (its last statement returns or raises)."""
    body = list(block.body) if isinstance(block, cst.IndentedBlock) else []
    if not body:
        return False
    last = body[-1]
    if isinstance(last, cst.SimpleStatementLine):
        return any(isinstance(s, (cst.Return, cst.Raise)) for s in last.body)
    if isinstance(last, cst.If) and isinstance(last.orelse, cst.Else):
        return _exits(last.body) and _exits(last.orelse.body)
    return False


class EarlyReturn(Transform):
    """``if c: A  else: B`` where A always returns or raises -> ``if c: A`` followed by B (``reverse``: the
    statements after such an ``if`` without ``else`` moved into its ``else``)."""

    def __init__(self, reverse: bool = False) -> None:
        self.reverse = reverse
        self.name = "else-after-return" if reverse else "early-return"

    def apply(self, state, site, pick):
        found = site_function(state, site)
        if found is None:
            return None
        text, fn = found
        elifs = _elifs(fn)
        candidates = []
        for _path, owner in blocks(fn):
            body = list(owner.body.body)
            for i, stmt in enumerate(body):
                if not isinstance(stmt, cst.If) or id(stmt) in elifs or not _exits(stmt.body):
                    continue
                if not self.reverse and isinstance(stmt.orelse, cst.Else):
                    candidates.append((owner, i))
                if self.reverse and stmt.orelse is None and i + 1 < len(body):
                    candidates.append((owner, i))
        chosen = choose(candidates, pick)
        if chosen is None:
            return None
        owner, index = chosen
        body = list(owner.body.body)
        node = body[index]
        if not self.reverse:
            rest = list(node.orelse.body.body)
            new_body = [*body[:index], node.with_changes(orelse=None), *rest, *body[index + 1 :]]
        else:
            rest = body[index + 1 :]
            new_body = [*body[:index], node.with_changes(orelse=cst.Else(body=cst.IndentedBlock(body=rest)))]
        new_fn = replace_block(fn, owner, new_body)
        out = rewrite_function(text, site, lambda _fn: new_fn)
        return Step({site.file: out}, site, self.name, (site,)) if out else None


def _one_line(code: str) -> str:
    """An expression's code as a statement can hold it: parenthesized where it spans lines."""
    return f"({code})" if "\n" in code else code


class IfExpToIf(Transform):
    """``return a if c else b`` -> ``if c: return a`` + ``return b``; ``x = a if c else b`` -> ``if c: x = a``
    ``else: x = b`` (one plain name as target)."""

    name = "ifexp-to-if"

    def apply(self, state, site, pick):
        found = site_function(state, site)
        if found is None:
            return None
        text, fn = found
        candidates = []
        for _path, owner in blocks(fn):
            for i, stmt in enumerate(owner.body.body):
                use = _single_target(stmt)
                if use is not None and use[0] and isinstance(use[1], cst.IfExp):
                    candidates.append((owner, i, use))
        chosen = choose(candidates, pick)
        if chosen is None:
            return None
        owner, index, (how, value) = chosen
        test, a, b = (_one_line(code_of(part)) for part in (value.test, value.body, value.orelse))
        if how == "return ":
            new = [statement(f"if {test}:\n    return {a}\n"), statement(f"return {b}\n")]
        else:
            new = [statement(f"if {test}:\n    {how}{a}\nelse:\n    {how}{b}\n")]
        body = list(owner.body.body)
        new_fn = replace_block(fn, owner, [*body[:index], *new, *body[index + 1 :]])
        out = rewrite_function(text, site, lambda _fn: new_fn)
        return Step({site.file: out}, site, self.name, (site,)) if out else None


def keeping(package_files: Callable[[], Sequence[str]] = tuple) -> tuple[Transform, ...]:
    """Every behaviour-keeping transform, in a fixed order (Hypothesis draws from it)."""
    return (
        RenameLocal(),
        RenameHelper(package_files),
        ExtractHelper(),
        ExtractHelper(other_module=True),
        InlineHelper(),
        MoveMethod("mixin"),
        MoveMethod("base"),
        MoveMethod("delegate"),
        GetattrRead(),
        GetattrRead(every=True),
        SetattrWrite(),
        SetattrWrite(every=True),
        EqToIn(),
        EqToIs(),
        FlagIsTrue(),
        *(LazyWrapper(how) for how in LAZY),
        ConditionFlag(),
        ConditionFlag(helper=True),
        EarlyReturn(),
        EarlyReturn(reverse=True),
        IfExpToIf(),
    )
