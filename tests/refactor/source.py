"""Source surgery for the refactoring generator: a function or class of a file, rewritten on its own, put back.

A :class:`Site` names a function of a release (``file``, class or None, function). :func:`rewrite_function` and
:func:`rewrite_class` hand the libcst node of that function (class) to a transform and splice what it returns into
the file in place of the original lines, every other byte of the file kept; a method is parsed inside a one-line
``if True:`` block, so that its lines keep their indentation (and multi-line strings their text). Whole-file
analysis is ``ast`` and ``symtable`` (fast); libcst parses only the function or class being changed.

:func:`check_variant` is what every variant must pass before it is judged: each changed file compiles, and in a
rewrite that keeps behaviour every global name a changed function reads is bound in its module or a builtin.
"""

from __future__ import annotations

import ast
import builtins
import functools
import symtable
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import libcst as cst

BUILTINS = frozenset(dir(builtins))
#: Where the generator takes its sites: the DeepSeek-V4 and V4.1 packages (both V4.1 layouts).
PACKAGES = ("vllm/models/deepseek_v4/", "vllm/models/deepseek_v41/", "vllm/models/deepseek_v4_1/")
_WRAPPER = "if True:\n"


@dataclass(frozen=True)
class Site:
    """A function of a release: a module-level function (``cls`` None) or a method of a module-level class."""

    file: str
    cls: str | None
    func: str

    @property
    def qualname(self) -> str:
        return f"{self.cls}.{self.func}" if self.cls else self.func

    @property
    def module(self) -> str:
        return module_of(self.file)

    def __str__(self) -> str:
        return f"{self.file}:{self.qualname}"

    @classmethod
    def parse(cls, text: str) -> Site:
        """``file:Class.func`` or ``file:func`` (as ``str`` writes it)."""
        file, sep, qualname = text.rpartition(":")
        if not sep or not file.endswith(".py") or not qualname:
            raise ValueError(f"not a site (file.py:Class.func or file.py:func): {text!r}")
        owner, _, func = qualname.rpartition(".")
        return cls(file, owner or None, func)

    def key(self) -> tuple[str, str, str]:
        return (self.file, self.cls or "", self.func)


def module_of(file: str) -> str:
    return file.removesuffix(".py").replace("/", ".").removesuffix(".__init__")


def in_packages(file: str) -> bool:
    return file.startswith(PACKAGES)


@functools.lru_cache(maxsize=256)
def parse(text: str) -> ast.Module:
    """``ast.parse``, once per text. Our own trees: the engine's (``patching.patch.parse_text``) are never touched."""
    return ast.parse(text)


def top_level(tree: ast.Module, name: str) -> ast.stmt | None:
    """The first module-level def or class named ``name`` (the one the engine's ``find_scope`` finds)."""
    return next(
        (
            n
            for n in tree.body
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.name == name
        ),
        None,
    )


def function_node(tree: ast.Module, site: Site) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    owner = top_level(tree, site.cls) if site.cls else tree
    if site.cls and not isinstance(owner, ast.ClassDef):
        return None
    return next(
        (
            n
            for n in owner.body  # type: ignore[union-attr]
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == site.func
        ),
        None,
    )


def span(node: ast.stmt) -> tuple[int, int]:
    """The lines of a def or class, decorators included: (first, last), 1-based."""
    first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
    return first, node.end_lineno or node.lineno


def _lines(text: str) -> list[str]:
    lines = text.splitlines(keepends=True)
    if lines and not lines[-1].endswith(("\n", "\r")):
        lines[-1] += "\n"
    return lines


def replace_lines(text: str, first: int, last: int, chunk: str) -> str:
    lines = _lines(text)
    if chunk and not chunk.endswith("\n"):
        chunk += "\n"
    return "".join(lines[: first - 1]) + chunk + "".join(lines[last:])


def insert_before(text: str, line: int, chunk: str) -> str:
    """``chunk`` (module-level code) inserted before line ``line``, one blank line after it."""
    return replace_lines(text, line, line - 1, chunk.rstrip("\n") + "\n\n")


def append_code(text: str, chunk: str) -> str:
    """``chunk`` (module-level code) at the end of the file, after two blank lines."""
    return text.rstrip("\n") + "\n\n\n" + chunk.strip("\n") + "\n"


def _parse_chunk(text: str, node: ast.stmt) -> tuple[cst.Module, bool]:
    first, last = span(node)
    chunk = "".join(_lines(text)[first - 1 : last])
    nested = node.col_offset > 0
    return cst.parse_module(_WRAPPER + chunk if nested else chunk), nested


def _unwrap(module: cst.Module, nested: bool) -> cst.CSTNode:
    return module.body[0].body.body[0] if nested else module.body[0]  # type: ignore[attr-defined]


def _rewrap(module: cst.Module, nested: bool, new: cst.CSTNode) -> str:
    if nested:
        block = module.body[0]
        new_module = module.with_changes(
            body=[block.with_changes(body=block.body.with_changes(body=[new]))]  # type: ignore[attr-defined]
        )
        return new_module.code[len(_WRAPPER) :]
    return module.with_changes(body=[new]).code


def function_cst(text: str, site: Site) -> cst.FunctionDef | None:
    node = function_node(parse(text), site)
    if node is None:
        return None
    module, nested = _parse_chunk(text, node)
    return _unwrap(module, nested)  # type: ignore[return-value]


def rewrite_function(text: str, site: Site, transform: Callable[[cst.FunctionDef], cst.CSTNode | None]) -> str | None:
    """The file with ``site``'s function replaced by what ``transform`` makes of its libcst node (None: the
    transform does not apply). The replacement may be a FlattenSentinel (several statements) or RemovalSentinel."""
    node = function_node(parse(text), site)
    if node is None:
        return None
    module, nested = _parse_chunk(text, node)
    new = transform(_unwrap(module, nested))  # type: ignore[arg-type]
    if new is None:
        return None
    first, last = span(node)
    if isinstance(new, cst.RemovalSentinel):
        return replace_lines(text, first, last, "")
    return replace_lines(text, first, last, _rewrap(module, nested, new))


def rewrite_class(text: str, cls: str, transform: Callable[[cst.ClassDef], cst.CSTNode | None]) -> str | None:
    node = top_level(parse(text), cls)
    if not isinstance(node, ast.ClassDef):
        return None
    module, nested = _parse_chunk(text, node)
    new = transform(_unwrap(module, nested))  # type: ignore[arg-type]
    if new is None:
        return None
    first, last = span(node)
    return replace_lines(text, first, last, _rewrap(module, nested, new))


def code_of(node: cst.CSTNode) -> str:
    return cst.Module(body=[]).code_for_node(node)


def statement(code: str) -> cst.BaseStatement:
    (stmt,) = cst.parse_module(code).body
    return stmt


def expression(code: str) -> cst.BaseExpression:
    return cst.parse_expression(code)


# -- names ------------------------------------------------------------------------------------------------------
def fresh_name(base: str, taken: set[str]) -> str:
    """``base`` with the first suffix that no name in ``taken`` has."""
    for n in range(1, 1000):
        name = f"{base}_{n}"
        if name not in taken:
            return name
    raise AssertionError("no fresh name")


def identifiers(text: str) -> set[str]:
    """Every identifier the file spells (names, attributes, arguments, defs): a new name must be none of them."""
    found = set()
    for node in ast.walk(parse(text)):
        for field in ("id", "name", "attr", "arg"):
            value = getattr(node, field, None)
            if isinstance(value, str):
                found.add(value)
        if isinstance(node, ast.alias):
            found.add((node.asname or node.name).split(".")[0])
    return found


def _tables(table: symtable.SymbolTable) -> Iterator[symtable.SymbolTable]:
    yield table
    for child in table.get_children():
        yield from _tables(child)


def _function_table(top: symtable.SymbolTable, site: Site) -> symtable.SymbolTable | None:
    owner = top
    if site.cls:
        owner = next((t for t in top.get_children() if t.get_type() == "class" and t.get_name() == site.cls), None)
        if owner is None:
            return None
    return next((t for t in owner.get_children() if t.get_type() == "function" and t.get_name() == site.func), None)


def module_bindings(text: str, path: str = "<module>") -> set[str]:
    """The names the module binds at its top level (defs, classes, assignments, imports)."""
    top = symtable.symtable(text, path, "exec")
    return {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported() or s.is_namespace()}


def global_reads(text: str, site: Site, path: str = "<module>") -> set[str] | None:
    """The global names ``site``'s function (its nested functions, lambdas and comprehensions included) reads."""
    top = symtable.symtable(text, path, "exec")
    table = _function_table(top, site)
    if table is None:
        return None
    return {s.get_name() for t in _tables(table) for s in t.get_symbols() if s.is_global() and s.is_referenced()}


def unresolved(text: str, site: Site, path: str = "<module>") -> set[str]:
    """The global names ``site``'s function reads that neither its module binds nor Python builds in."""
    reads = global_reads(text, site, path) or set()
    return reads - module_bindings(text, path) - BUILTINS


def local_names(text: str, site: Site) -> tuple[set[str], set[str]]:
    """(parameters, other names the function binds) of ``site``'s function, its own scope only."""
    table = _function_table(symtable.symtable(text, "<module>", "exec"), site)
    if table is None:
        return set(), set()
    params = set(table.get_parameters())  # type: ignore[attr-defined]
    assigned = {s.get_name() for s in table.get_symbols() if s.is_local() and not s.is_parameter()}
    return params, assigned


# -- the checks every variant passes -----------------------------------------------------------------------------
class InvalidVariant(Exception):
    """A generated variant that is not valid Python, or whose changed functions read names nothing binds."""


def check_compiles(files: dict[str, str]) -> None:
    for path, text in files.items():
        try:
            compile(text, path, "exec", dont_inherit=True)
        except (SyntaxError, ValueError) as exc:
            raise InvalidVariant(f"{path} does not compile: {exc}") from None


def check_names(files: dict[str, str], functions: dict[Site, set[str]]) -> None:
    """Every global ``functions`` (site -> names it may leave unresolved, as the release did) reads is bound."""
    for site, allowed in functions.items():
        text = files.get(site.file)
        if text is None:
            continue
        missing = unresolved(text, site, site.file) - allowed
        if missing:
            raise InvalidVariant(f"{site} reads {', '.join(sorted(missing))}, which nothing binds")
