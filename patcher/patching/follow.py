"""Follow vLLM's code from a scope to where the work is done, reading it through the probe's Context.

Probes use it to find a fix where it is, not where it once was: a method of the
class an attribute is assigned, a function imported inside a function, a
re-export in a package ``__init__``, a helper in another module. Every file is
read once, through ``ctx.ast`` (the command's snapshot); nothing is imported.

API (all results are lists: a name may have several definitions, e.g. one per
platform under ``if``/``elif``, or a conditional expression that picks a class;
each candidate is followed):

- ``f = Follower(ctx)``
- ``f.resolve(module, name)``: the definitions ``name`` has in ``module`` (dotted,
  ``vllm.models...``), following imports, relative imports, re-exports and aliases.
- ``f.function(file, cls, name)`` / ``f.method(cls_def, name)``: a function or a
  method (base classes included, left to right) as a :class:`Definition`.
- ``f.classes_of_attribute(cls_def, attr)``: the classes ``self.<attr>`` is an
  instance of, from ``self.<attr> = X(...)`` in ``__init__`` of the class or a
  base class (X a class, a local variable holding one, ``A if c else B``, or
  vLLM's ``init_vllm_registered_model(architectures=[...])``).
- ``f.frame(defn)``: a :class:`Frame` (a function with what is known of its
  ``self`` and parameters); ``f.callees(frame, call)``: the frames a call in it
  may reach (plain functions, ``self.m()``, ``self.attr.m()``, ``self.attr()``
  (the class's ``forward``), ``module.f()``, a local variable holding an
  instance), each with its parameters bound to the call's arguments.
- ``f.walk(frame, depth, follow=...)``: every frame reachable from ``frame``
  through calls ``follow(frame, call)`` accepts, with the :class:`Path` taken.
- ``Path.evidence()``: ``file:Qualified.name:line -> ...``, the path followed.
- ``calls_in(func)`` / ``attribute_loads(func, "weight")``: the calls a function makes itself, and its reads
  of an attribute (``x.weight``, ``getattr(x, "weight")``), for properties checked along a walk.
- For the evaluator (:mod:`patch_dsv4.patching.evaluate`): ``f.instances_of_attribute(cls, attr)`` (what
  ``self.<attr>`` holds, each with the call that built it), ``f.super_method(owner, self_class, name)``
  (``super().name``), ``f.external(module, name)`` (the dotted origin of another package's name),
  ``f.is_dataclass(cls)`` / ``f.dataclass_default(cls, field)``, ``f.sets_attribute(cls, name)``.
"""

from __future__ import annotations

import ast
import builtins
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from patch_dsv4.patching.patch import Context

FunctionNode = ast.FunctionDef | ast.AsyncFunctionDef
_BUILTINS = frozenset(dir(builtins))


@dataclass(frozen=True, eq=False)
class Definition:
    """A function, class or module of the tree: where it is and its node (None for a module)."""

    kind: str  # "function" | "class" | "module"
    module: str  # dotted module name
    file: str  # path relative to the tree
    qualname: str  # "Class.method", "function", "Class", or the module name
    node: ast.AST | None
    owner: Definition | None = None  # a method's class

    @property
    def line(self) -> int:
        return getattr(self.node, "lineno", 0)

    def where(self) -> str:
        return f"{self.file}:{self.qualname}:{self.line}" if self.node is not None else self.file

    def __repr__(self) -> str:
        return f"<{self.kind} {self.where()}>"


@dataclass(frozen=True)
class Value:
    """What an expression is known to be: a definition itself (a function, class or module), or an instance of a
    class (``instance=True``)."""

    defn: Definition
    instance: bool = False
    made: ast.Call | None = field(default=None, compare=False)  # the call that built the instance, where known


@dataclass(eq=False)
class Frame:
    """A function being followed: its definition, and what its names are known to hold (``self`` and the
    parameters bound from the call that reached it)."""

    defn: Definition
    names: dict[str, list[Value]] = field(default_factory=dict)
    bindings: dict[str, ast.expr] = field(default_factory=dict)  # parameter -> the caller's argument expression

    @property
    def node(self) -> FunctionNode:
        return self.defn.node  # type: ignore[return-value]


@dataclass(frozen=True)
class Hop:
    caller: Frame
    call: ast.Call
    callee: Frame


@dataclass(frozen=True)
class Path:
    """The calls followed from the start frame to ``frame``."""

    start: Frame
    hops: tuple[Hop, ...] = ()

    @property
    def frame(self) -> Frame:
        return self.hops[-1].callee if self.hops else self.start

    def evidence(self) -> str:
        steps = [self.start.defn.where()]
        steps += [f"{h.callee.defn.where()} (called at line {h.call.lineno})" for h in self.hops]
        return " -> ".join(steps)

    def names(self) -> str:
        """The functions followed, by qualified name: ``A._o_proj -> B.grouped_forward -> f``."""
        return " -> ".join([self.start.defn.qualname, *(h.callee.defn.qualname for h in self.hops)])


def absolute_module(module: str, is_package: bool, level: int, target: str | None) -> str:
    """The module a ``from`` import in ``module`` (a package when ``is_package``) reads, made absolute."""
    if not level:
        return target or ""
    package = module if is_package else module.rpartition(".")[0]
    for _ in range(level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{target}" if target else package


def _blocks(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """Statements of a body, descending into if/try/with (not into functions or classes)."""
    for stmt in body:
        yield stmt
        if isinstance(stmt, (ast.If, ast.Try, ast.With, ast.AsyncWith)):
            for name in ("body", "orelse", "finalbody"):
                yield from _blocks(getattr(stmt, name, []) or [])
            for handler in getattr(stmt, "handlers", []):
                yield from _blocks(handler.body)


def _function_statements(func: FunctionNode) -> Iterator[ast.stmt]:
    """Every statement of a function, nested functions and classes excluded."""
    stack = list(func.body)
    while stack:
        stmt = stack.pop(0)
        yield stmt
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        for name in ("body", "orelse", "finalbody"):
            block = getattr(stmt, name, None)
            if isinstance(block, list):
                stack.extend(s for s in block if isinstance(s, ast.stmt))
        for handler in getattr(stmt, "handlers", []):
            stack.extend(handler.body)
        for case in getattr(stmt, "cases", []):
            stack.extend(case.body)


def calls_in(func: FunctionNode) -> list[ast.Call]:
    """The calls a function makes itself (not those of nested functions), in source order; found once per
    function (the parsed trees are shared and never changed, so the list is kept on the node)."""
    cached = getattr(func, "_patch_dsv4_calls", None)
    if cached is None:
        found = [
            node
            for stmt in _function_statements(func)
            for node in ast.walk(stmt)
            if isinstance(node, ast.Call)
            and not isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        ]
        cached = sorted(dict.fromkeys(found), key=lambda n: (n.lineno, n.col_offset))
        func._patch_dsv4_calls = cached  # type: ignore[attr-defined]
    return list(cached)


class Follower:
    """Name resolution and call following over one Context (see the module docstring)."""

    def __init__(self, ctx: Context, max_hops: int = 6) -> None:
        self.ctx = ctx
        self.max_hops = max_hops

    # -- modules ---------------------------------------------------------------
    def module_file(self, module: str) -> str | None:
        """The file of a vLLM module; None for another package's (torch, abc...: never read, not vLLM's code)."""
        if module != "vllm" and not module.startswith("vllm."):
            return None
        base = module.replace(".", "/")
        for candidate in (f"{base}.py", f"{base}/__init__.py"):
            if self.ctx.ast(candidate) is not None:
                return candidate
        return None

    @staticmethod
    def module_of(file: str) -> str:
        return file.removesuffix(".py").replace("/", ".").removesuffix(".__init__")

    def _module(self, module: str) -> Definition | None:
        file = self.module_file(module)
        return Definition("module", module, file, module, None) if file else None

    # -- names -----------------------------------------------------------------
    def resolve(self, module: str, name: str, _seen: frozenset = frozenset()) -> list[Definition]:
        """Every definition ``name`` has at module level of ``module`` (imports and re-exports followed)."""
        if _seen:  # inside a chain of imports: the cycle guard makes it depend on the chain
            return self._resolve(module, name, _seen)
        return list(self.ctx.memo(("resolve", module, name), lambda: self._resolve(module, name)))

    def _resolve(self, module: str, name: str, _seen: frozenset = frozenset()) -> list[Definition]:
        """Every definition ``name`` has at module level of ``module`` (imports and re-exports followed)."""
        key = (module, name)
        if key in _seen or len(_seen) > 12:
            return []
        seen = _seen | {key}
        file = self.module_file(module)
        tree = self.ctx.ast(file) if file else None
        if tree is None:
            return []
        found: list[Definition] = []
        for stmt in _blocks(tree.body):
            found += self._bound_by(stmt, module, file, name, seen)
        if not found and file.endswith("/__init__.py"):  # a submodule of a package
            sub = self._module(f"{module}.{name}")
            if sub is not None:
                found.append(sub)
        if found:  # a miss is no evidence either way (a builtin, a name of another module): not recorded
            self.ctx.looked_up(file, name, True)
        return _unique(found)

    def _bound_by(self, stmt: ast.stmt, module: str, file: str, name: str, seen: frozenset) -> list[Definition]:
        """What ``stmt`` binds ``name`` to, in ``module``."""
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name == name:
            return [Definition("function", module, file, name, stmt)]
        if isinstance(stmt, ast.ClassDef) and stmt.name == name:
            return [Definition("class", module, file, name, stmt)]
        if isinstance(stmt, ast.ImportFrom):
            for alias in stmt.names:
                if (alias.asname or alias.name) == name:
                    source = absolute_module(module, file.endswith("__init__.py"), stmt.level, stmt.module)
                    return self.resolve(source, alias.name, seen)
        if isinstance(stmt, ast.Import):
            for alias in stmt.names:
                if alias.asname == name:
                    found = self._module(alias.name)
                    return [found] if found else []
        if isinstance(stmt, (ast.Assign, ast.AnnAssign)) and stmt.value is not None:
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return [v.defn for v in self._module_expr(module, stmt.value, seen) if not v.instance]
        return []

    def _module_expr(self, module: str, expr: ast.expr, seen: frozenset) -> list[Value]:
        """A module-level expression: a name, ``a.b``, ``A if c else B``, or a call of a class (an instance)."""
        if isinstance(expr, ast.Name):
            return [Value(d) for d in self.resolve(module, expr.id, seen)]
        if isinstance(expr, ast.IfExp):
            return self._module_expr(module, expr.body, seen) + self._module_expr(module, expr.orelse, seen)
        if isinstance(expr, ast.Attribute):
            return [Value(d) for v in self._module_expr(module, expr.value, seen) for d in self._member(v, expr.attr)]
        if isinstance(expr, ast.Call):
            return [
                Value(v.defn, True, expr) for v in self._module_expr(module, expr.func, seen) if v.defn.kind == "class"
            ]
        return []

    def _member(self, value: Value, attr: str) -> list[Definition]:
        if value.defn.kind == "module":
            return self.resolve(value.defn.module, attr)
        if value.defn.kind == "class":
            found = self.method(value.defn, attr)
            return [found] if found else []
        return []

    def function(self, file: str, cls: str | None, name: str) -> Definition | None:
        """The module-level function ``name`` of ``file``, or the method ``cls.name`` (bases included)."""
        module = self.module_of(file)
        tree = self.ctx.ast(file)
        if tree is None:
            return None
        if cls is None:
            node = next(
                (n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name),
                None,
            )
            self.ctx.looked_up(file, name, node is not None)
            return Definition("function", module, file, name, node) if node is not None else None
        owner = self.class_def(file, cls)
        return self.method(owner, name) if owner is not None else None

    def class_def(self, file: str, cls: str) -> Definition | None:
        tree = self.ctx.ast(file)
        node = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls), None) if tree else None
        if tree is not None:
            self.ctx.looked_up(file, cls, node is not None)
        return Definition("class", self.module_of(file), file, cls, node) if node is not None else None

    # -- classes ---------------------------------------------------------------
    def bases(self, cls: Definition) -> list[Definition]:
        """The class's base classes that the tree defines, resolved in its module, left to right."""
        found: list[Definition] = []
        for base in cls.node.bases:  # type: ignore[union-attr]
            found += [v.defn for v in self._module_expr(cls.module, base, frozenset()) if v.defn.kind == "class"]
        return found

    def mro(self, cls: Definition) -> list[Definition]:
        """The class and its bases, depth first, each once."""
        return list(self.ctx.memo(("mro", id(cls.node)), lambda: self._mro(cls)))

    def _mro(self, cls: Definition) -> list[Definition]:
        """The class and its bases, depth first, each once."""
        order: list[Definition] = []
        stack = [cls]
        while stack and len(order) < 32:
            current = stack.pop(0)
            if any(c.node is current.node for c in order):
                continue
            order.append(current)
            stack = self.bases(current) + stack
        return order

    def method(self, cls: Definition, name: str) -> Definition | None:
        """``cls.name`` as Python finds it: the class, then its bases."""
        return self.ctx.memo(("method", id(cls.node), name), lambda: self._method(cls, name))

    def _method(self, cls: Definition, name: str) -> Definition | None:
        """``cls.name`` as Python finds it: the class, then its bases."""
        for owner in self.mro(cls):
            node = next(
                (
                    n
                    for n in owner.node.body  # type: ignore[union-attr]
                    if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name
                ),
                None,
            )
            if node is not None:
                self.ctx.looked_up(owner.file, f"{owner.qualname}.{name}", True)
                return Definition("function", owner.module, owner.file, f"{owner.qualname}.{name}", node, owner)
        return None

    def classes_of_attribute(self, cls: Definition, attr: str) -> list[Definition]:
        """The classes ``self.<attr>`` is an instance of, from its assignments in ``__init__`` (class or bases)."""
        return _unique([v.defn for v in self.instances_of_attribute(cls, attr)])

    def instances_of_attribute(self, cls: Definition, attr: str) -> list[Value]:
        """What ``self.<attr>`` holds, as instances (each with the call that built it, where one did), from its
        assignments in ``__init__`` of the class or a base, or a class attribute."""
        return list(self.ctx.memo(("attribute", id(cls.node), attr), lambda: self._instances_of_attribute(cls, attr)))

    def _instances_of_attribute(self, cls: Definition, attr: str) -> list[Value]:
        found: list[Value] = []
        for owner in self.mro(cls):
            init = self.method(owner, "__init__")
            if init is not None and init.owner is not None and init.owner.node is owner.node:
                frame = Frame(init, {"self": [Value(cls, True)]})
                for stmt in _function_statements(init.node):  # type: ignore[arg-type]
                    if isinstance(stmt, (ast.Assign, ast.AnnAssign)) and stmt.value is not None:
                        targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                        if any(_is_self_attribute(t, attr) for t in targets):
                            found += [v for v in self.values(frame, stmt.value) if v.instance]
                    elif isinstance(stmt, ast.Expr) and _is_self_setattr(stmt.value, attr):
                        found += [v for v in self.values(frame, stmt.value.args[2]) if v.instance]  # type: ignore
            for stmt in owner.node.body:  # type: ignore[union-attr]
                # a class attribute: `mapper = WeightsMapper(...)`
                if isinstance(stmt, (ast.Assign, ast.AnnAssign)) and stmt.value is not None:
                    targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                    if any(isinstance(t, ast.Name) and t.id == attr for t in targets):
                        found += [v for v in self._module_expr(owner.module, stmt.value, frozenset()) if v.instance]
            if found:
                break  # the most derived class's assignment is the one that holds
        return _unique_values(found)

    def super_method(self, owner: Definition, self_class: Definition | None, name: str) -> Definition | None:
        """``super().name`` inside a method of ``owner``: the next class after ``owner`` in the MRO of the instance's
        class (``self_class``, else ``owner``) that defines ``name``."""
        order = self.mro(self_class or owner)
        index = next((i for i, c in enumerate(order) if c.node is owner.node), None)
        if index is None:
            order, index = self.mro(owner), 0
        for cls in order[index + 1 :]:
            found = self.method(cls, name)
            if found is not None and found.owner is not None and found.owner.node is cls.node:
                return found
        return None

    def external(self, module: str, name: str, func: FunctionNode | None = None) -> str | None:
        """The dotted origin of ``name`` where an import of another package binds it (``torch``, ``torch.nn``,
        ``itertools.chain``), in ``func`` or at module level of ``module``; ``builtins.<name>`` for a builtin;
        None where vLLM's own code or nothing binds it."""
        if func is None:
            return self.ctx.memo(("external", module, name), lambda: self._external(module, name, None))  # type: ignore
        return self._external(module, name, func)

    def _external(self, module: str, name: str, func: FunctionNode | None) -> str | None:
        scopes = [list(_function_statements(func))] if func is not None else []
        file = self.module_file(module)
        tree = self.ctx.ast(file) if file else None
        if tree is not None:
            scopes.append(list(_blocks(tree.body)))
        for statements_ in scopes:
            for stmt in statements_:
                origin = _imported_origin(stmt, name, module, bool(file and file.endswith("__init__.py")))
                if origin is not None:
                    return None if origin == "vllm" or origin.startswith("vllm.") else origin
                if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and stmt.name == name:
                    return None
                if isinstance(stmt, (ast.Assign, ast.AnnAssign)):
                    targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                    if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                        return None
        return f"builtins.{name}" if name in _BUILTINS else None

    def sets_attribute(self, cls: Definition, name: str) -> bool:
        """Whether the class or a base (vLLM's) sets ``name``: a class attribute, ``self.name = ...`` or
        ``setattr(self, "name", ...)`` in a method."""
        for owner in self.mro(cls):
            for node in ast.walk(owner.node):  # type: ignore[arg-type]
                if isinstance(node, (ast.Assign, ast.AnnAssign)):
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    for target in targets:
                        if isinstance(target, ast.Name) and target.id == name and node in owner.node.body:  # type: ignore
                            return True
                        if isinstance(target, ast.Attribute) and target.attr == name:
                            return True
                elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
                    if len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and node.args[1].value == name:
                        return True
        return False

    def is_dataclass(self, cls: Definition) -> bool:
        """Whether ``cls`` is declared a dataclass: its fields are the arguments that build it."""
        return _is_dataclass_node(cls.node)

    def dataclass_default(self, cls: Definition, name: str) -> ast.expr | None:
        """The default of field ``name`` of a dataclass (the class or a base): ``x: T = value`` gives ``value``,
        ``field(default=v)`` ``v``, ``field(default_factory=f)`` the call ``f()``; None when there is none."""
        for owner in self.mro(cls):
            node = owner.node
            if not _is_dataclass_node(node):
                continue
            for stmt in node.body:
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.target.id == name:
                    value = stmt.value
                    if isinstance(value, ast.Call) and ast.unparse(value.func).rsplit(".", 1)[-1] == "field":
                        for keyword in value.keywords:
                            if keyword.arg == "default":
                                return keyword.value
                            if keyword.arg == "default_factory":
                                return ast.copy_location(ast.Call(keyword.value, [], []), keyword.value)
                        return None
                    return value
        return None

    def registered_model(self, architecture: str) -> list[Definition]:
        """The class vLLM's model registry names for ``architecture`` (every platform's candidate)."""
        registry = "vllm/model_executor/models/registry.py"
        tree = self.ctx.ast(registry)
        for node in ast.walk(tree) if tree is not None else ():
            if not isinstance(node, ast.Dict):
                continue
            for key, value in zip(node.keys, node.values, strict=True):
                if (
                    isinstance(key, ast.Constant)
                    and key.value == architecture
                    and isinstance(value, ast.Tuple)
                    and len(value.elts) == 2
                    and all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in value.elts)
                ):
                    module, name = value.elts[0].value, value.elts[1].value
                    return [d for d in self.resolve(module, name) if d.kind == "class"]
        return []

    # -- expressions inside a function -----------------------------------------
    def frame(self, defn: Definition, self_class: Definition | None = None) -> Frame:
        """A frame for ``defn``; a method's ``self`` is an instance of ``self_class`` (default: its own class)."""
        names: dict[str, list[Value]] = {}
        first = _parameters(defn.node)[:1]
        if defn.owner is not None and first and not _is_static(defn.node):
            names[first[0]] = [Value(self_class or defn.owner, True)]
        return Frame(defn, names)

    def values(self, frame: Frame, expr: ast.expr, _depth: int = 0) -> list[Value]:
        """What ``expr``, read inside ``frame``, is known to be."""
        if _depth > 8:
            return []
        if isinstance(expr, ast.Name):
            return self._name(frame, expr.id, _depth)
        if isinstance(expr, ast.IfExp):
            return self.values(frame, expr.body, _depth + 1) + self.values(frame, expr.orelse, _depth + 1)
        if isinstance(expr, ast.Attribute):
            found: list[Value] = []
            for value in self.values(frame, expr.value, _depth + 1):
                if value.instance:
                    method = self.method(value.defn, expr.attr)
                    if method is not None:
                        found.append(Value(method))
                    else:
                        found += [Value(c, True) for c in self.classes_of_attribute(value.defn, expr.attr)]
                else:
                    found += [Value(d) for d in self._member(value, expr.attr)]
            return found
        if isinstance(expr, ast.Call):
            callee = ast.unparse(expr.func).rsplit(".", 1)[-1]
            if callee == "init_vllm_registered_model":
                return [Value(c, True) for arch in _architectures(expr) for c in self.registered_model(arch)]
            found = []
            for value in self.values(frame, expr.func, _depth + 1):
                if value.instance:
                    continue
                if value.defn.kind == "class":
                    found.append(Value(value.defn, True, expr))
                elif value.defn.kind == "function" and _depth < 4:
                    found += self.returned(value.defn, _depth + 1)  # a factory: the instances it returns
            return found
        return []

    def returned(self, defn: Definition, _depth: int = 0) -> list[Value]:
        """The instances a function returns, where its ``return`` statements build them (``return X(...)``), and
        the classes a factory of classes returns (``return X``: vLLM's ``self._get_indexer_cls(...)(...)``)."""
        frame = self.frame(defn)
        found: list[Value] = []
        for stmt in _function_statements(defn.node):  # type: ignore[arg-type]
            if isinstance(stmt, ast.Return) and isinstance(stmt.value, (ast.Call, ast.Name, ast.IfExp)):
                found += [v for v in self.values(frame, stmt.value, _depth + 4) if v.instance or v.defn.kind == "class"]
        return _unique_values(found)

    def _name(self, frame: Frame, name: str, depth: int) -> list[Value]:
        if name in frame.names:
            return frame.names[name]
        func = frame.node
        found: list[Value] = []
        for stmt in _function_statements(func):
            if isinstance(stmt, ast.ImportFrom):  # an import inside the function
                for alias in stmt.names:
                    if (alias.asname or alias.name) == name:
                        is_package = frame.defn.file.endswith("__init__.py")
                        source = absolute_module(frame.defn.module, is_package, stmt.level, stmt.module)
                        found += [Value(d) for d in self.resolve(source, alias.name)]
            elif isinstance(stmt, (ast.Assign, ast.AnnAssign)) and stmt.value is not None:
                targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                    found += self.values(frame, stmt.value, depth + 1)
        if found or name in _parameters(func) or name in _BUILTINS:
            return _unique_values(found)
        return [Value(d) for d in self.resolve(frame.defn.module, name)]

    # -- calls -----------------------------------------------------------------
    def callees(self, frame: Frame, call: ast.Call) -> list[Frame]:
        """The frames ``call`` (made inside ``frame``) may reach, parameters bound to its arguments."""
        frames: list[Frame] = []
        receiver = call.func.value if isinstance(call.func, ast.Attribute) else None
        for value in self.values(frame, call.func):
            defn, bound_self = value.defn, None
            if value.instance:  # calling an instance: nn.Module's forward, else __call__
                defn = self.method(value.defn, "forward") or self.method(value.defn, "__call__")
                if defn is None:
                    continue
                bound_self, receiver_expr = value.defn, call.func
            elif defn.kind == "class" or defn.kind == "module":
                continue
            else:
                receiver_expr = receiver
                if defn.owner is not None and receiver is not None:
                    bound_self = next((v.defn for v in self.values(frame, receiver) if v.instance), None)
            callee = self.frame(defn, bound_self)
            params = _parameters(defn.node)
            args: list[ast.expr] = list(call.args)
            if bound_self is not None and params and not _is_static(defn.node):
                callee.bindings[params[0]] = receiver_expr  # type: ignore[assignment]
                params = params[1:]
            elif defn.owner is not None and params and not _is_static(defn.node):
                params = params[1:]  # Class.method(obj, ...): obj is the first argument
                if args:
                    callee.bindings[_parameters(defn.node)[0]] = args[0]
                    callee.names[_parameters(defn.node)[0]] = [v for v in self.values(frame, args[0]) if v.instance]
                    args = args[1:]
            for param, arg in _bind(defn.node, params, args, call.keywords).items():
                callee.bindings[param] = arg
                known = [v for v in self.values(frame, arg) if v.instance] if not isinstance(arg, ast.Starred) else []
                if known:
                    callee.names[param] = known
            frames.append(callee)
        return frames

    def walk(
        self, start: Frame, depth: int | None = None, follow: Callable[[Frame, ast.Call], bool] | None = None
    ) -> Iterator[Path]:
        """Every frame reachable from ``start`` (itself first), breadth first, each function once per path."""
        limit = self.max_hops if depth is None else depth
        queue = [Path(start)]
        seen: set[tuple[int, int]] = set()
        while queue:
            path = queue.pop(0)
            yield path
            if len(path.hops) >= limit:
                continue
            frame = path.frame
            for call in calls_in(frame.node):
                if follow is not None and not follow(frame, call):
                    continue
                for callee in self.callees(frame, call):
                    key = id(callee.defn.node)
                    on_path = {id(path.start.defn.node), *(id(h.callee.defn.node) for h in path.hops)}
                    if key in on_path or (key, id(call)) in seen:
                        continue
                    seen.add((key, id(call)))
                    queue.append(Path(path.start, (*path.hops, Hop(frame, call, callee))))


def _is_dataclass_node(node: ast.AST | None) -> bool:
    decorators = getattr(node, "decorator_list", [])
    return "dataclass" in [ast.unparse(d).split("(")[0].rsplit(".", 1)[-1] for d in decorators]


def _is_self_setattr(call: ast.expr, attr: str) -> bool:
    """``setattr(self, "<attr>", value)``."""
    return (
        isinstance(call, ast.Call)
        and isinstance(call.func, ast.Name)
        and call.func.id == "setattr"
        and len(call.args) == 3
        and isinstance(call.args[0], ast.Name)
        and call.args[0].id == "self"
        and isinstance(call.args[1], ast.Constant)
        and call.args[1].value == attr
    )


def _is_self_attribute(target: ast.expr, attr: str) -> bool:
    return (
        isinstance(target, ast.Attribute)
        and target.attr == attr
        and isinstance(target.value, ast.Name)
        and target.value.id == "self"
    )


def _imported_origin(stmt: ast.stmt, name: str, module: str, is_package: bool) -> str | None:
    """The dotted name an import statement binds ``name`` to, or None."""
    if isinstance(stmt, ast.Import):
        for alias in stmt.names:
            if alias.asname == name:
                return alias.name
            if alias.asname is None and alias.name.split(".")[0] == name:
                return name
    if isinstance(stmt, ast.ImportFrom):
        for alias in stmt.names:
            if (alias.asname or alias.name) == name:
                return f"{absolute_module(module, is_package, stmt.level, stmt.module)}.{alias.name}"
    return None


def attribute_loads(func: FunctionNode, attr: str) -> list[ast.Attribute]:
    """The reads of ``<something>.<attr>`` a function makes itself (``getattr(x, "attr")`` included as a call)."""
    found = []
    for stmt in _function_statements(func):
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        for node in ast.walk(stmt):
            if isinstance(node, ast.Attribute) and node.attr == attr and isinstance(node.ctx, ast.Load):
                found.append(node)
            elif (
                isinstance(node, ast.Call)
                and ast.unparse(node.func) == "getattr"
                and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)
                and node.args[1].value == attr
            ):
                found.append(node)  # type: ignore[arg-type]
    return sorted(dict.fromkeys(found), key=lambda n: (n.lineno, n.col_offset))


def _parameters(func: ast.AST | None) -> list[str]:
    if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return []
    a = func.args
    return [p.arg for p in (*a.posonlyargs, *a.args)]


def _is_static(func: ast.AST | None) -> bool:
    decorators = getattr(func, "decorator_list", [])
    return any(ast.unparse(d) == "staticmethod" for d in decorators)


def _bind(func: ast.AST, params: list[str], args: list[ast.expr], keywords: list[ast.keyword]) -> dict[str, ast.expr]:
    """Parameter -> argument expression, as Python binds them (stars not expanded; what cannot bind is left out)."""
    a = func.args  # type: ignore[attr-defined]
    bound: dict[str, ast.expr] = {}
    for param, arg in zip(params, args, strict=False):
        if isinstance(arg, ast.Starred):
            break
        bound[param] = arg
    names = set(params) | {p.arg for p in a.kwonlyargs}
    for keyword in keywords:
        if keyword.arg in names:
            bound[keyword.arg] = keyword.value
    return bound


def signature(func: FunctionNode, drop_first: bool = False) -> inspect.Signature:
    """The function's signature (defaults stand in as 0), for checking a call binds."""
    a = func.args
    params = []
    positional = [*a.posonlyargs, *a.args]
    defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    pairs = list(zip(positional, defaults, strict=True))
    start = 1 if drop_first and pairs else 0
    for i, (arg, default) in enumerate(pairs):
        if i < start:
            continue
        kind = inspect.Parameter.POSITIONAL_ONLY if i < len(a.posonlyargs) else inspect.Parameter.POSITIONAL_OR_KEYWORD
        params.append(inspect.Parameter(arg.arg, kind, default=inspect.Parameter.empty if default is None else 0))
    if a.vararg:
        params.append(inspect.Parameter(a.vararg.arg, inspect.Parameter.VAR_POSITIONAL))
    for arg, default in zip(a.kwonlyargs, a.kw_defaults, strict=True):
        params.append(
            inspect.Parameter(
                arg.arg, inspect.Parameter.KEYWORD_ONLY, default=inspect.Parameter.empty if default is None else 0
            )
        )
    if a.kwarg:
        params.append(inspect.Parameter(a.kwarg.arg, inspect.Parameter.VAR_KEYWORD))
    return inspect.Signature(params)


def _architectures(call: ast.Call) -> list[str]:
    for keyword in call.keywords:
        if keyword.arg == "architectures" and isinstance(keyword.value, (ast.List, ast.Tuple)):
            return [e.value for e in keyword.value.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    return []


def _unique(defs: list[Definition]) -> list[Definition]:
    out: list[Definition] = []
    for d in defs:
        if not any(o.node is d.node and o.file == d.file and o.kind == d.kind for o in out):
            out.append(d)
    return out


def _unique_values(values: list[Value]) -> list[Value]:
    out: list[Value] = []
    for v in values:
        if not any(o.defn.node is v.defn.node and o.defn.file == v.defn.file and o.instance == v.instance for o in out):
            out.append(v)
    return out
