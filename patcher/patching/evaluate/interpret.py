"""The evaluator's engine: Python functions executed over what is known of their values, under one case.

:class:`Run` executes a function of vLLM's statement by statement. A test whose value the case decides takes one
arm; an unknown one takes both, and what either arm does is kept with its :class:`Reach` (MAYBE). Calls are
followed through the shared facility (:mod:`patch_dsv4.patching.follow`): eagerly when they carry what the
question tracks (the weights, a case's object, a watched ``self``), on demand otherwise (a helper whose result
a test reads). What cannot be evaluated becomes an ``Unknown`` value naming the construct and its line; where it
touches what is tracked, it is recorded as an event, and a question that meets one proves nothing.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from dataclasses import dataclass, field

from patch_dsv4.patching.evaluate import tables
from patch_dsv4.patching.evaluate.cases import ANY, Case
from patch_dsv4.patching.evaluate.focus import focus as focus_on
from patch_dsv4.patching.evaluate.focus import getattr_name, original
from patch_dsv4.patching.evaluate.values import (
    MISSING,
    NONE,
    UNSET,
    Closure,
    Const,
    Def,
    Ext,
    Inst,
    Made,
    OneOf,
    Raises,
    Reach,
    Repeated,
    Seq,
    Setting,
    Stream,
    Thing,
    Unknown,
    V,
    contains,
    equal,
    identical,
    one_of,
    options,
    truth,
)
from patch_dsv4.patching.follow import _BUILTINS as _BUILTIN_NAMES
from patch_dsv4.patching.follow import Definition, Follower, _function_statements, _parameters

FunctionNode = ast.FunctionDef | ast.AsyncFunctionDef
#: A question's sink: given the call and its arguments, whether the call is where the tracked value is meant to go
#: (the loader, the FP8 GEMM, a quant method's ``apply``); sinks are recorded, never followed.
Sink = Callable[[ast.Call, list[V]], bool]
_STR_METHODS = frozenset(
    {
        "startswith",
        "endswith",
        "split",
        "rsplit",
        "replace",
        "strip",
        "lstrip",
        "rstrip",
        "lower",
        "upper",
        "partition",
        "rpartition",
        "removeprefix",
        "removesuffix",
        "count",
        "find",
        "join",
        "format",
    }
)


@dataclass(frozen=True)
class Bound(V):
    """A method of a value that is not vLLM's code (``name.startswith``, ``mapping.extend``, ``weights.sort``)."""

    recv: V
    attr: str

    @property
    def tracked(self) -> bool:  # type: ignore[override]
        return self.recv.tracked


@dataclass(frozen=True)
class Partial(V):
    """``functools.partial(func, *args)``."""

    func: V
    args: tuple[V, ...]

    @property
    def tracked(self) -> bool:  # type: ignore[override]
        return self.func.tracked or any(a.tracked for a in self.args)


@dataclass(frozen=True)
class Pending(V):
    """The result of a call of vLLM's code that carries nothing tracked: evaluated when something reads it."""

    defn: Definition
    bound: V | None
    args: tuple[V, ...]
    kwargs: tuple[tuple[str, V], ...]


@dataclass(frozen=True)
class Deferred(V):
    """A call of a module-level function whose arguments carry nothing tracked: the callee is resolved (its module
    read) only when something reads the result."""

    node: ast.Call
    defn: Definition  # the function the call is in
    args: tuple[V, ...]
    kwargs: tuple[tuple[str, V], ...]


@dataclass(frozen=True)
class Hop:
    caller: Definition
    call: ast.Call
    callee: Definition


@dataclass(frozen=True)
class Where:
    """A node in a function reached through ``path`` (the calls followed from the start)."""

    defn: Definition
    node: ast.AST
    path: tuple[Hop, ...] = ()

    @property
    def line(self) -> int:
        return getattr(self.node, "lineno", self.defn.line)

    def at(self) -> str:
        return f"{self.defn.file}:{self.defn.qualname}:{self.line}"

    def names(self) -> str:
        """The functions followed: ``A.load_weights -> WeightsMapper.apply``."""
        start = self.path[0].caller if self.path else self.defn
        return " -> ".join([start.qualname, *(h.callee.qualname for h in self.path)])

    def evidence(self) -> str:
        start = self.path[0].caller if self.path else self.defn
        steps = [start.where()] + [f"{h.callee.where()} (called at line {h.call.lineno})" for h in self.path]
        return " -> ".join(steps)


@dataclass(frozen=True)
class Event:
    """Something a question is about, met on the way: ``holds`` (the weights held whole at ``text``), ``unknown``
    (a construct that could not be evaluated touches what is tracked), ``raises`` (an attribute the object lacks
    is read), ``sink`` (a sink call), ``yield`` (a generator yields what it was given)."""

    kind: str
    text: str
    reach: Reach
    where: Where
    value: V | None = None


@dataclass
class _State:
    env: dict[str, V]
    reach: Reach

    def copy(self, reach: Reach | None = None) -> _State:
        return _State(dict(self.env), self.reach if reach is None else reach)


@dataclass
class _Frame:
    defn: Definition
    node: FunctionNode | ast.Lambda
    path: tuple[Hop, ...]
    depth: int
    self_class: Definition | None = None
    outer: dict[str, V] = field(default_factory=dict)  # a closure's view of its defining function
    caller_paths: dict[str, str] = field(default_factory=dict)  # parameter -> the caller's expression path
    exits: list[_State] = field(default_factory=list)  # the states at each return (for attributes written)
    returns: list[tuple[Reach, V]] = field(default_factory=list)
    loops: list[list[_State]] = field(default_factory=list)  # states at break/continue, per open loop
    generator: bool = False
    out: list[Stream] = field(default_factory=list)  # what a generator yields of the weights
    item: V | None = None  # the case's first item, for the first loop over the weights
    wanted: frozenset[str] | None = None  # what the question reads of this frame (None: everything)
    touch_only: frozenset[int] = frozenset()  # statements run only for what their calls may write
    statement: ast.stmt | None = None  # the statement being run
    consumed: bool = False  # a loop took every item of the weights without yielding
    raised: list[Raises] = field(default_factory=list)  # what made a statement raise


def _where_text(frame: _Frame, node: ast.AST) -> str:
    return f"{frame.defn.file}:{frame.defn.qualname}:{getattr(node, 'lineno', frame.defn.line)}"


def _short(node: ast.AST, limit: int = 60) -> str:
    """The node's source, cut to ``limit`` (kept on the node: the parsed trees are shared and never changed)."""
    text = node.__dict__.get("_patch_dsv4_text")
    if text is None:
        text = ast.unparse(node)
        node._patch_dsv4_text = text  # type: ignore[attr-defined]
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _own_nodes(func: ast.AST):
    stack = list(ast.iter_child_nodes(func))
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        yield node
        stack.extend(ast.iter_child_nodes(node))


def is_generator(func: ast.AST) -> bool:
    cached = getattr(func, "_patch_dsv4_generator", None)
    if cached is None:
        cached = any(isinstance(n, (ast.Yield, ast.YieldFrom)) for n in _own_nodes(func))
        func._patch_dsv4_generator = cached  # type: ignore[attr-defined]
    return cached


class Run:
    """One function executed under one case (see the module docstring). Read its ``events``, ``reach_of(node)``,
    ``result`` (what the function returns) and ``exit`` (its names and written attributes at the end)."""

    def __init__(
        self,
        follower: Follower,
        case: Case = ANY,
        sink: Sink | None = None,
        max_depth: int = 6,
        budget: int = 300,
        lazy: bool = False,
    ) -> None:
        self.follower = follower
        self.case = case
        self.sink = sink
        self.max_depth = max_depth
        self.budget = budget
        self.events: list[Event] = []
        self.followed: list[Where] = []
        self._reach: dict[int, Reach] = {}
        self.lazy = lazy  # results of calls that carry nothing tracked stay unevaluated unless forced at the end
        self._computing: set[tuple] = set()
        self._quiet = 0
        self.result: V = NONE
        self.exit: dict[str, V] = {}
        self.settings_read: dict[str, bool] = {}  # setting -> whether it is a vllm.envs attribute
        self.iterated: dict[int, V] = {}  # loop node -> what it iterates
        self.item_loop: ast.AST | None = None  # the loop that took the case's item
        self.generators: list[Where] = []  # generators the weights went through, yielding as they go
        self.compared: dict[int, tuple[ast.Compare, V]] = {}  # comparison node -> (node, its value, joined)
        self.built: dict[int, dict[str, V]] = {}  # a call -> its keyword arguments
        self.sources: dict[str, list[ast.expr]] = {}  # an attribute path -> the expressions assigned it

    # -- entry ---------------------------------------------------------------------------------------------
    def start(
        self,
        defn: Definition,
        bind: dict[str, str] | None = None,
        self_value: V | None = None,
        given: dict[str, V] | None = None,
        focus: set[str] | None = None,
        anchored: frozenset[int] = frozenset(),
    ) -> Run:
        """Execute ``defn``; its parameters take the case's roles of their names (or the values ``given``),
        ``bind`` maps more of its expressions (``self.wo_a``) to roles; ``self`` is ``self_value`` (default: an
        instance of its class). With ``focus`` (names and attribute paths, ``self.gate.bias_vl``), only the
        statements that may change them run (:mod:`~patch_dsv4.patching.evaluate.focus`)."""
        node = defn.node
        params = _parameters(node) + [a.arg for a in node.args.kwonlyargs]  # type: ignore[union-attr]
        env: dict[str, V] = {}
        first = params[0] if params and defn.owner is not None else None
        for name in params:
            role = (given or {}).get(name) or self.case.role(name)
            env[name] = role if role is not None else Unknown(f"parameter {name} of {defn.qualname}")
        if first is not None:
            base = self_value if self_value is not None else Inst(defn.owner)  # type: ignore[arg-type]
            attrs = []
            for expr, role in (bind or {}).items():
                value = self.case.role(role)
                if expr.startswith(f"{first}.") and value is not None and isinstance(base, Inst):
                    attrs.append((expr[len(first) + 1 :], self.as_instances(base.cls, expr[len(first) + 1 :], value)))
            if isinstance(base, Inst) and attrs:
                base = Inst(base.cls, base.attrs + tuple(attrs), base.made, base.watched)  # type: ignore[arg-type]
            env[first] = base
        frame = _Frame(defn, node, (), 0, self_class=_class_of(env.get(first)) if first else None)  # type: ignore[arg-type]
        frame.generator = is_generator(node)
        frame.item = self.case.item
        frame.wanted = frozenset(focus) if focus is not None else None
        # a question of a focus reads the state at the exits, never the result
        body, frame.touch_only, frame.wanted = self._body(
            defn, node, frame.wanted, frame.self_class, returns=False, anchored=anchored
        )
        state = self._block(body, _State(env, Reach.YES), frame)
        self.result, self.exit = self._finish(frame, state)
        return self

    def as_instances(self, cls: Definition, attr: str, role: V) -> V:
        """A case's object as what ``self.<attr>`` of ``cls`` is built as: an instance of each class vLLM assigns
        it, with the case's attributes (its methods are then followed); the case's object itself where no class is
        known."""
        found = self.follower.instances_of_attribute(cls, attr)
        if not found or not isinstance(role, Thing):
            return role
        return one_of(*(Inst(v.defn, role.attrs, v.made) for v in found))

    def _body(
        self,
        defn: Definition,
        func,
        wanted: frozenset[str] | None,
        self_class: Definition | None,
        returns=True,
        anchored: frozenset[int] = frozenset(),
    ) -> tuple[list[ast.stmt], frozenset[int], frozenset[str] | None]:
        """The statements of ``func`` to run (all of them, or those that may change ``wanted``, and its returns
        where its result is read), those kept only for what their calls may write, and all it reads of its own
        objects (what calls it makes must keep)."""
        if wanted is None or isinstance(func, ast.Lambda) or func is None:
            return getattr(func, "body", []), frozenset(), None
        key = ("focus", id(func), wanted, id(self_class.node) if self_class is not None else None, returns, anchored)
        found = self._shared(
            key,
            lambda: focus_on(
                func, set(wanted), returns=returns, may_write=self._may_write(defn, self_class), anchored=anchored
            ),
            None,
        )
        return found.body, found.touch_only, found.wanted

    def _may_write(self, defn: Definition, self_class: Definition | None):
        """For the slice of ``defn``: whether a method of ``self`` (or ``super()``'s) it calls may write the
        wanted paths, from that method's own slice (nothing it writes is wanted: its call is not run)."""
        first = _first_param(defn.node)

        def check(call: ast.Call, wanted: frozenset[str]) -> bool:
            func = call.func
            if self_class is None or first is None or not isinstance(func, ast.Attribute):
                return True
            if isinstance(func.value, ast.Call):
                owner = defn.owner
                method = self.follower.super_method(owner, self_class, func.attr) if owner is not None else None
            else:
                method = self.follower.method(self_class, func.attr)
            callee_first = _first_param(method.node) if method is not None else None
            if method is None or callee_first is None:
                return True
            translated = frozenset(
                callee_first + w[len(first) :] for w in wanted if w == first or w.startswith(first + ".")
            )
            key = ("may write", id(method.node), translated, id(self_class.node))
            return self._shared(  # a cycle: it may
                key,
                lambda: bool(
                    focus_on(
                        method.node,  # type: ignore[arg-type]
                        set(translated),
                        returns=False,
                        may_write=self._may_write(method, self_class),
                    ).body
                ),
                True,
            )

        return check

    def _shared(self, key: tuple, compute, cycle):
        """``compute()``, once per context for ``key``, shared by every run: through the context's memo, so that a
        result reused replays the files its computing read (a probe's reads stay whole: a release's record names
        them), and the settings it read. ``cycle`` while it is being computed (recursion)."""
        if key in self._computing:
            return cycle
        self._computing.add(key)

        def run():
            before = set(self.settings_read)
            value = compute()
            return value, {k: v for k, v in self.settings_read.items() if k not in before}

        try:
            value, settings = self.follower.ctx.memo(("evaluate", *key), run)
        finally:
            self._computing.discard(key)
        self.settings_read.update(settings)  # type: ignore[arg-type]
        return value

    def reach_of(self, node: ast.AST) -> Reach | None:
        """Whether the statement or call ``node`` runs (None: the run never came to it)."""
        return self._reach.get(id(node))

    def of(self, kind: str) -> list[Event]:
        return [e for e in self.events if e.kind == kind]

    def force(self, value: V, final: bool = False) -> V:
        """``value`` with every pending call evaluated (in a lazy run, only where ``final``: a question's last
        read; elsewhere such a result is unknown)."""
        if self.lazy and not final:
            return value
        if isinstance(value, Pending):
            return self._resolve(value)
        if isinstance(value, Deferred):
            return self._resolve_deferred(value)
        if isinstance(value, OneOf) and any(isinstance(o, (Pending, Deferred, Seq)) for o in value.options):
            return one_of(*(self.force(o, final) for o in value.options))
        if isinstance(value, Seq) and any(isinstance(i, (Pending, Deferred, OneOf)) for i in value.items):
            return Seq(value.kind, tuple(self.force(i, final) for i in value.items))
        return value

    # -- events --------------------------------------------------------------------------------------------
    def _event(self, kind: str, text: str, reach: Reach, frame: _Frame, node: ast.AST, value: V | None = None):
        if self._quiet or reach is Reach.NO:
            return
        self.events.append(Event(kind, text, reach, Where(frame.defn, node, frame.path), value))

    def _mark(self, node: ast.AST, reach: Reach) -> None:
        node = original(node)  # a slice's copy counts as the statement of the tree
        found = self._reach.get(id(node))
        self._reach[id(node)] = reach if found is None else found.also(reach)

    # -- statements ----------------------------------------------------------------------------------------
    def _block(self, body: list[ast.stmt], state: _State, frame: _Frame) -> _State:
        for stmt in body:
            self._mark(stmt, state.reach)
            if state.reach is Reach.NO:
                continue  # not executed; its calls stay unmarked unless a run reaches them
            frame.statement = stmt
            state = self._statement(stmt, state, frame)
        return state

    def _statement(self, stmt: ast.stmt, st: _State, frame: _Frame) -> _State:  # noqa: C901 - one case per kind
        if isinstance(stmt, ast.Expr):
            value = self._expr(stmt.value, st, frame)
            return self._after(value, st, frame, stmt)
        if isinstance(stmt, (ast.Assign, ast.AnnAssign)):
            if stmt.value is None:
                return st
            value = self._expr(stmt.value, st, frame)
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            for target in targets:
                self._assign(target, value, st, frame, stmt)
                path = self._path(target, st) if isinstance(target, ast.Attribute) else None
                if path is not None and not self._quiet:
                    self.sources.setdefault(path, []).append(stmt.value)
                if isinstance(target, ast.Name):  # `gate = self.gate`: writes through gate are writes to self.gate
                    path = self._path(stmt.value, st) if isinstance(stmt.value, (ast.Name, ast.Attribute)) else None
                    st.env.pop(f"<alias>{target.id}", None)
                    if path is not None and "." in path:
                        st.env[f"<alias>{target.id}"] = Const(path)
            return self._after(value, st, frame, stmt)
        if isinstance(stmt, ast.AugAssign):
            value = self._expr(stmt.value, st, frame)
            old = self._expr(stmt.target, st, frame) if not isinstance(stmt.target, ast.Subscript) else None
            new = self._binop(stmt.op, old, value, st, frame, stmt) if old is not None else Unknown("augmented")
            self._assign(stmt.target, new, st, frame, stmt)
            return st
        if isinstance(stmt, ast.Return):
            value = self._expr(stmt.value, st, frame) if stmt.value is not None else NONE
            if isinstance(value, Raises):
                return self._after(value, st, frame, stmt)
            frame.returns.append((st.reach, value))
            frame.exits.append(st.copy())
            return _State(st.env, Reach.NO)
        if isinstance(stmt, ast.If):
            return self._branch(stmt.test, stmt.body, stmt.orelse, st, frame)
        if isinstance(stmt, (ast.For, ast.AsyncFor)):
            return self._for(stmt, st, frame)
        if isinstance(stmt, ast.While):
            test = self._test(stmt.test, st, frame)
            if test == "raises":
                return _State(st.env, Reach.NO)
            body = self._loop_body(stmt.body, st.copy(st.reach.when(None if test is True else test)), frame)
            return self._join(st, body) if test is not True else self._join(st.copy(Reach.MAYBE), body)
        if isinstance(stmt, (ast.With, ast.AsyncWith)):
            for item in stmt.items:
                value = self._expr(item.context_expr, st, frame)
                if item.optional_vars is not None:
                    self._assign(item.optional_vars, Unknown("a context manager's value"), st, frame, stmt)
                if isinstance(value, Raises):
                    return _State(st.env, Reach.NO)
            return self._block(stmt.body, st, frame)
        if isinstance(stmt, ast.Try) or type(stmt).__name__ == "TryStar":
            entry = st.copy()
            body = self._block(stmt.body, st, frame)  # type: ignore[attr-defined]
            out = self._block(stmt.orelse, body, frame)  # type: ignore[attr-defined]
            for handler in stmt.handlers:  # type: ignore[attr-defined]
                handled = self._block(handler.body, entry.copy(entry.reach.when(None)), frame)
                out = self._join(out, handled)
            return self._block(stmt.finalbody, out, frame)  # type: ignore[attr-defined]
        if isinstance(stmt, ast.Raise):
            return _State(st.env, Reach.NO)
        if isinstance(stmt, (ast.Break, ast.Continue)):
            if frame.loops:
                frame.loops[-1].append(st.copy())
            return _State(st.env, Reach.NO)
        if isinstance(stmt, ast.Assert):
            test = self._test(stmt.test, st, frame)
            return _State(st.env, Reach.NO) if test is False and st.reach is Reach.YES else st
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            for alias in stmt.names:
                name = alias.asname or alias.name.split(".")[0]
                st.env[name] = self._imported(stmt, alias, frame)
            return st
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            st.env[stmt.name] = Closure(stmt, frame.defn)
            frame.outer = {**frame.outer}  # closures see the names as they are when called
            return st
        if isinstance(stmt, ast.Delete):
            for target in stmt.targets:
                if isinstance(target, ast.Name):
                    st.env.pop(target.id, None)
            return st
        if isinstance(stmt, ast.Match):
            self._expr(stmt.subject, st, frame)
            out = st.copy()
            for case in stmt.cases:
                out = self._join(out, self._block(case.body, st.copy(st.reach.when(None)), frame))
            return out
        return st  # pass, global, nonlocal, class definitions

    def _after(self, value: V, st: _State, frame: _Frame, stmt: ast.stmt) -> _State:
        """A statement whose evaluation raises ends the path (an exception leaves the function)."""
        if isinstance(value, Raises) and st.reach is not Reach.NO:
            if not frame.raised:
                frame.raised.append(value)
            if not value.told:
                self._event("raises", value.why, st.reach, frame, stmt)
            if st.reach is Reach.YES:
                return _State(st.env, Reach.NO)
        return st

    def _branch(self, test_node: ast.expr, body: list, orelse: list, st: _State, frame: _Frame) -> _State:
        test = self._test(test_node, st, frame)
        if test == "raises":
            return _State(st.env, Reach.NO)
        left = self._left(frame)
        yes = self._block(body, st.copy(st.reach.when(test)), frame)  # type: ignore[arg-type]
        yes_raised = yes.reach is Reach.NO and self._left(frame) == left
        left = self._left(frame)
        no = self._block(orelse, st.copy(st.reach.when(None if test is None else not test)), frame)
        no_raised = no.reach is Reach.NO and self._left(frame) == left
        if test is None and st.reach is not Reach.NO and yes_raised != no_raised:
            # an arm that only raises is no way through: what completes went by the other one
            return _State((no if yes_raised else yes).env, st.reach)
        return self._join(yes, no)

    @staticmethod
    def _left(frame: _Frame) -> tuple[int, int]:
        """How many paths have left so far by a return, a break or a continue (an arm that ends without adding
        one raised)."""
        return len(frame.exits), sum(len(jumps) for jumps in frame.loops)

    def _join(self, a: _State, b: _State) -> _State:
        if a.reach is Reach.NO:
            return b
        if b.reach is Reach.NO:
            return a
        env = {}
        for name in set(a.env) | set(b.env):
            left, right = a.env.get(name, UNSET), b.env.get(name, UNSET)
            if name.startswith("<alias>"):
                if left == right:
                    env[name] = left
                continue
            env[name] = one_of(left, right)
        return _State(env, a.reach.also(b.reach))

    def _for(self, stmt: ast.For | ast.AsyncFor, st: _State, frame: _Frame) -> _State:
        iterable = self.force(self._expr(stmt.iter, st, frame))
        if not self._quiet:
            found = self.iterated.get(id(original(stmt)))
            self.iterated[id(original(stmt))] = iterable if found is None else one_of(found, iterable)
        if isinstance(iterable, Raises):
            return _State(st.env, Reach.NO)
        streams = [o for o in options(iterable) if isinstance(o, Stream)]
        body_reach = st.reach.when(None)
        if streams:
            item: V = Unknown("an item of the weights")
            if frame.item is not None:
                item, frame.item, body_reach = frame.item, None, st.reach  # the case's first item: the body runs
                if self.item_loop is None:
                    self.item_loop = original(stmt)
            yields = any(isinstance(n, (ast.Yield, ast.YieldFrom)) for s in stmt.body for n in ast.walk(s))
            if yields:
                frame.out += [Stream(s.state, s.via) for s in streams]
                if not self._quiet and frame.generator:
                    self.generators.append(Where(frame.defn, stmt, frame.path))
            else:
                frame.consumed = True
                verb = "yields one" if frame.generator else "returns"
                self._event(
                    "holds",
                    f"{frame.defn.qualname} takes every item of the weights before it {verb} "
                    f"({_where_text(frame, stmt)})",
                    st.reach,
                    frame,
                    stmt,
                )
        elif isinstance(iterable, Seq):
            if not iterable.items:
                body_reach = Reach.NO
            item = one_of(*iterable.items) if iterable.items else NONE
        elif isinstance(iterable, Repeated):
            item = iterable.item
        else:
            item = Unknown(f"an item of {_short(stmt.iter)}")
        inside = st.copy(body_reach)
        self._assign(stmt.target, item, inside, frame, stmt)
        body = self._loop_body(stmt.body, inside, frame)
        out = self._join(st, body)
        return self._block(stmt.orelse, out, frame)

    def _loop_body(self, body: list[ast.stmt], st: _State, frame: _Frame) -> _State:
        frame.loops.append([])
        end = self._block(body, st, frame)
        for jumped in frame.loops.pop():
            end = self._join(end, jumped)
        return end

    # -- assignment ----------------------------------------------------------------------------------------
    def _assign(self, target: ast.expr, value: V, st: _State, frame: _Frame, stmt: ast.stmt) -> None:
        if isinstance(target, ast.Name):
            st.env[target.id] = value
        elif isinstance(target, (ast.Tuple, ast.List)):
            starred = any(isinstance(t, ast.Starred) for t in target.elts)
            streams = [o for o in options(value) if isinstance(o, Stream)]
            if streams:
                self._event(
                    "holds", f"{_short(stmt)} unpacks every item at {_where_text(frame, stmt)}", st.reach, frame, stmt
                )
                for element in target.elts:
                    inner = element.value if isinstance(element, ast.Starred) else element
                    self._assign(inner, Stream("holds", streams[0].via), st, frame, stmt)
                return
            items = value.items if isinstance(value, Seq) and not starred else None
            for index, element in enumerate(target.elts):
                if isinstance(element, ast.Starred):
                    self._assign(element.value, Unknown("starred target"), st, frame, stmt)
                elif items is not None and len(items) == len(target.elts):
                    self._assign(element, items[index], st, frame, stmt)
                else:
                    part = self._subscript(value, Const(index), st, frame, stmt)
                    self._assign(element, part, st, frame, stmt)
        elif isinstance(target, ast.Attribute):
            path = self._path(target, st)
            if path is not None:
                self._write(path, value, st)
        elif isinstance(target, ast.Starred):
            self._assign(target.value, value, st, frame, stmt)

    def _write(self, path: str, value: V, st: _State) -> None:
        for key in [k for k in st.env if k.startswith(path + ".")]:
            del st.env[key]
        st.env[path] = value  # a write on one arm only meets the other arm's value at the join

    def _path(self, node: ast.expr, st: _State) -> str | None:
        """The expression as a path of names (``self.gate.bias_vl``), locals bound to one followed (``gate =
        self.gate``); None for anything else."""
        if isinstance(node, ast.Name):
            alias = st.env.get(f"<alias>{node.id}")
            return alias.value if isinstance(alias, Const) else node.id  # type: ignore[return-value]
        if isinstance(node, ast.Attribute):
            base = self._path(node.value, st)
            return f"{base}.{node.attr}" if base is not None else None
        name = getattr_name(node)  # getattr(self, "gate"): self.gate
        if name is not None:
            base = self._path(node.args[0], st)  # type: ignore[attr-defined]
            return f"{base}.{name}" if base is not None else None
        return None

    # -- expressions ---------------------------------------------------------------------------------------
    def _test(self, node: ast.expr, st: _State, frame: _Frame) -> bool | None | str:
        """The truth of a test (None: unknown; "raises": its evaluation raises)."""
        value = self.force(self._expr(node, st, frame))
        if isinstance(value, Raises):
            self._event("raises", value.why, st.reach, frame, node)
            return "raises" if st.reach is Reach.YES else None
        return truth(value)

    def _expr(self, node: ast.expr | None, st: _State, frame: _Frame) -> V:  # noqa: C901 - one case per kind
        if node is None:
            return NONE
        if isinstance(node, ast.Constant):
            return (
                Const(node.value)
                if isinstance(node.value, (str, int, float, bool, bytes, type(None)))
                else (Unknown("constant"))
            )
        if isinstance(node, ast.Name):
            return self._name(node.id, st, frame)
        if isinstance(node, ast.Attribute):
            path = self._path(node, st)
            if path is not None and path in st.env:
                return st.env[path]
            return self._attribute(self._expr(node.value, st, frame), node.attr, st, frame, node)
        if isinstance(node, ast.Call):
            return self._call(node, st, frame)
        if isinstance(node, ast.Compare):
            return self._compare(node, st, frame)
        if isinstance(node, ast.BoolOp):
            return self._boolop(node, st, frame)
        if isinstance(node, ast.UnaryOp):
            operand = self.force(self._expr(node.operand, st, frame))
            if isinstance(operand, Raises):
                return operand
            if isinstance(node.op, ast.Not):
                value = truth(operand)
                return (
                    Const(not value, src=getattr(operand, "src", None) or node)
                    if value is not None
                    else (Unknown(f"not {_short(node.operand)}"))
                )
            if isinstance(operand, Const) and isinstance(operand.value, (int, float)):
                return Const(-operand.value if isinstance(node.op, ast.USub) else operand.value)
            return Unknown(_short(node))
        if isinstance(node, ast.IfExp):
            test = self._test(node.test, st, frame)
            if test == "raises":
                return Raises(f"{_short(node.test)} raises")
            parts = []
            if test is not False:
                parts.append(self._expr(node.body, st.copy(st.reach.when(test)), frame))  # type: ignore[arg-type]
            if test is not True:
                parts.append(self._expr(node.orelse, st.copy(st.reach.when(None if test is None else not test)), frame))
            return one_of(*parts)
        if isinstance(node, ast.NamedExpr):
            value = self._expr(node.value, st, frame)
            st.env[node.target.id] = value
            return value
        if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
            return self._display(node, st, frame)
        if isinstance(node, ast.Dict):
            return self._dict(node, st, frame)
        if isinstance(node, (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
            return self._comprehension(node, st, frame)
        if isinstance(node, ast.Subscript):
            base = self._expr(node.value, st, frame)
            index = self._expr(node.slice, st, frame) if not isinstance(node.slice, ast.Slice) else Unknown("slice")
            return self._subscript(base, index, st, frame, node)
        if isinstance(node, ast.BinOp):
            left, right = self._expr(node.left, st, frame), self._expr(node.right, st, frame)
            return self._binop(node.op, left, right, st, frame, node)
        if isinstance(node, ast.JoinedStr):
            return self._fstring(node, st, frame)
        if isinstance(node, ast.Lambda):
            return Closure(node, frame.defn)
        if isinstance(node, ast.Starred):
            return self._expr(node.value, st, frame)
        if isinstance(node, (ast.Await, ast.Yield, ast.YieldFrom)):
            return self._yield(node, st, frame)
        for sub in ast.iter_child_nodes(node):
            if isinstance(sub, ast.expr):
                self._expr(sub, st, frame)
        return Unknown(f"{_short(node)} at {_where_text(frame, node)}")

    def _yield(self, node: ast.Await | ast.Yield | ast.YieldFrom, st: _State, frame: _Frame) -> V:
        value = self._expr(node.value, st, frame) if node.value is not None else NONE
        if isinstance(node, ast.YieldFrom):
            frame.out += [s for s in options(value) if isinstance(s, Stream)]
        if isinstance(node, (ast.Yield, ast.YieldFrom)):
            self._event("yield", _short(node), st.reach, frame, node, value)
        return Unknown("what a yield receives")

    def _name(self, name: str, st: _State, frame: _Frame) -> V:
        if name in st.env:
            return st.env[name]
        if name in frame.outer:
            return frame.outer[name]
        return self.module_value(
            frame.defn.module, name, frame.node if isinstance(frame.node, ast.FunctionDef) else None
        )

    def module_value(self, module: str, name: str, func: FunctionNode | None = None, depth: int = 0) -> V:
        """What ``name`` is at module level of ``module``: vLLM's definitions (an instance a module builds
        included, through its imports), another package's object, a constant; a name bound nowhere (a snippet
        that leaves its imports out) reads as another package's object of that name."""

        def compute() -> V:
            settings = self._settings_import(module, name)
            if settings is not None:  # vllm.envs: its attributes are the user's settings, its file is not read
                return settings
            found = self.follower.resolve(module, name)
            if found:
                return one_of(*(Def(d) for d in found))
            value = self._module_binding(module, name, depth)
            if value is None:
                origin = self.follower.external(module, name)
                value = Ext(origin) if origin is not None else (Ext(name) if depth == 0 else Unknown(name))
            return value

        return self._shared(("module value", module, name, depth == 0), compute, Unknown(name))

    def _settings_import(self, module: str, name: str) -> V | None:
        """``name`` where ``module`` binds it to a settings module (``from vllm import envs``)."""
        from patch_dsv4.patching.follow import absolute_module

        file = self.follower.module_file(module)
        tree = self.follower.ctx.ast(file) if file else None
        for stmt in _module_bindings(tree).get(name, ()) if tree is not None else ():
            if isinstance(stmt, ast.ImportFrom):
                for alias in stmt.names:
                    if (alias.asname or alias.name) == name:
                        source = absolute_module(module, file.endswith("__init__.py"), stmt.level, stmt.module)
                        if f"{source}.{alias.name}" in tables.SETTINGS_MODULES:
                            return Def(Definition("module", f"{source}.{alias.name}", "", alias.name, None))
            if isinstance(stmt, ast.Import):
                for alias in stmt.names:
                    if alias.asname == name and alias.name in tables.SETTINGS_MODULES:
                        return Def(Definition("module", alias.name, "", alias.name, None))
        return None

    def _module_binding(self, module: str, name: str, depth: int) -> V | None:
        """``name`` bound at module level by an assignment (evaluated there: a constant, an instance) or by an
        import from another vLLM module (followed there); None where neither binds it."""
        from patch_dsv4.patching.follow import absolute_module

        file = self.follower.module_file(module)
        tree = self.follower.ctx.ast(file) if file else None
        for stmt in _module_bindings(tree).get(name, ()) if tree is not None and depth < 8 else ():
            if isinstance(stmt, (ast.Assign, ast.AnnAssign)) and stmt.value is not None:
                targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                    frame = _Frame(Definition("module", module, file, module, None), ast.Lambda(), (), self.max_depth)
                    return self._expr(stmt.value, _State({}, Reach.YES), frame)
            if isinstance(stmt, ast.ImportFrom):
                for alias in stmt.names:
                    if (alias.asname or alias.name) == name:
                        source = absolute_module(module, file.endswith("__init__.py"), stmt.level, stmt.module)
                        if f"{source}.{alias.name}" in tables.SETTINGS_MODULES:
                            return Def(Definition("module", f"{source}.{alias.name}", "", alias.name, None))
                        if source == "vllm" or source.startswith("vllm."):
                            return self.module_value(source, alias.name, depth=depth + 1)
            if isinstance(stmt, ast.Import):
                for alias in stmt.names:
                    if alias.asname == name and alias.name in tables.SETTINGS_MODULES:
                        return Def(Definition("module", alias.name, "", alias.name, None))
        return None

    def _imported(self, stmt: ast.Import | ast.ImportFrom, alias: ast.alias, frame: _Frame) -> V:
        """What an import inside a function binds."""
        from patch_dsv4.patching.follow import absolute_module

        if isinstance(stmt, ast.ImportFrom):
            source = absolute_module(
                frame.defn.module, frame.defn.file.endswith("__init__.py"), stmt.level, stmt.module
            )
            if f"{source}.{alias.name}" in tables.SETTINGS_MODULES:
                return Def(Definition("module", f"{source}.{alias.name}", "", alias.name, None))
            if source == "vllm" or source.startswith("vllm."):
                return self.module_value(source, alias.name, depth=1)
            return Ext(f"{source}.{alias.name}")
        if alias.asname and alias.name in tables.SETTINGS_MODULES:
            return Def(Definition("module", alias.name, "", alias.name, None))
        dotted = alias.name if alias.asname else alias.name.split(".")[0]
        if dotted == "vllm" or dotted.startswith("vllm."):
            found = self.follower._module(dotted)  # noqa: SLF001 - the facility's module definitions
            return Def(found) if found is not None else Unknown(dotted)
        return Ext(dotted)

    def _attribute(self, base: V, attr: str, st: _State, frame: _Frame, node: ast.AST) -> V:  # noqa: C901
        base = self.force(base)
        if isinstance(base, OneOf):
            return one_of(*(self._attribute(o, attr, st, frame, node) for o in base.options))
        if isinstance(base, Raises):
            return base
        if isinstance(base, Thing):
            value = base.attr(attr)
            return (
                Raises(f"reads {_short(node)} ({base.what} has no {attr}) at {_where_text(frame, node)}")
                if (value is MISSING)
                else value
            )
        if isinstance(base, Ext):
            if base.name in tables.SETTINGS_UNBOUND:
                self.settings_read[attr] = True
                return self.case.setting(Setting(attr))
            return Ext(f"{base.name}.{attr}")
        if isinstance(base, Def):
            defn = base.defn
            if defn.kind == "module":
                if defn.module in tables.SETTINGS_MODULES:
                    self.settings_read[attr] = True
                    return self.case.setting(Setting(attr))
                found = self.follower.resolve(defn.module, attr)
                return one_of(*(Def(d) for d in found)) if found else Unknown(f"{defn.module}.{attr}")
            if defn.kind == "class":
                method = self.follower.method(defn, attr)
                return Def(method) if method is not None else Unknown(f"{defn.qualname}.{attr}")
            return Unknown(f"{defn.qualname}.{attr}")
        if isinstance(base, Inst):
            if base.watched:  # what a watched object holds is watched too (a method may write on self.gate)
                return _watched(self._instance_value(base, attr, frame, node))
            return self._instance_value(base, attr, frame, node)
        if isinstance(base, (Const, Seq, Stream, Made, Repeated, Setting, Unknown, Bound, Partial, Closure)):
            return Bound(base, attr)
        return Unknown(f"{_short(node)}")

    def _instance_value(self, base: Inst, attr: str, frame: _Frame, node: ast.AST) -> V:
        """An attribute of an instance: what is known it holds, its method (bound), else what it is built with."""
        known = base.known(attr)
        if known is not None:
            if known is MISSING:
                return Raises(
                    f"reads {_short(node)} (the {base.cls.qualname} has no {attr}) at {_where_text(frame, node)}"
                )
            return known
        method = self.follower.method(base.cls, attr)
        if method is not None:
            return Def(method, bound=base)
        return self._instance_attribute(base, attr)

    def _instance_attribute(self, inst: Inst, attr: str) -> V:
        """An attribute of an instance: a dataclass field's default where the call that built it passed none, or
        what ``__init__`` assigns it (an instance of a vLLM class); else unknown."""
        if inst.made is not None:
            passed = {k.arg for k in inst.made.keywords}
            if attr not in passed and not inst.made.args and None not in passed:
                default = self.follower.dataclass_default(inst.cls, attr)
                if default is not None:
                    frame = _Frame(
                        Definition("module", inst.cls.module, inst.cls.file, inst.cls.module, None),
                        ast.Lambda(),
                        (),
                        self.max_depth,
                    )
                    return self._expr(default, _State({}, Reach.YES), frame)
        found = self.follower.instances_of_attribute(inst.cls, attr)
        if found:
            return one_of(*(Inst(v.defn, made=v.made) for v in found))
        value = self.class_value(inst.cls, attr)
        if value is not None:
            return value
        if inst.closed and not self.follower.sets_attribute(inst.cls, attr):
            return Raises(f"reads {attr} (the {inst.cls.qualname} never sets it)")
        return Unknown(f"{inst.cls.qualname}.{attr}")

    def class_value(self, cls: Definition, name: str) -> V | None:
        """A class attribute (``hf_to_vllm_mapper = make_mapper("fp4")``), evaluated in its module; None where no
        class of the MRO assigns it."""
        for owner in self.follower.mro(cls):
            for stmt in owner.node.body:  # type: ignore[union-attr]
                if isinstance(stmt, (ast.Assign, ast.AnnAssign)) and stmt.value is not None:
                    targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                    if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                        frame = _Frame(
                            Definition("module", owner.module, owner.file, owner.module, None),
                            ast.Lambda(),
                            (),
                            self.max_depth,
                        )
                        return self.force(self._expr(stmt.value, _State({}, Reach.YES), frame))
        return None

    def _subscript(self, base: V, index: V, st: _State, frame: _Frame, node: ast.AST) -> V:
        base, index = self.force(base), self.force(index)
        if isinstance(base, Raises):
            return base
        if isinstance(base, Stream):
            self._event(
                "unknown",
                f"{_short(node)} at {_where_text(frame, node)} (an iterator has no items by index)",
                st.reach,
                frame,
                node,
            )
            return Unknown(_short(node))
        if isinstance(base, Ext) and base.name in tables.SETTINGS_MAPPINGS and isinstance(index, Const):
            self.settings_read[str(index.value)] = False
            value = self.case.setting(Setting(str(index.value)))
            return Raises(f"{base.name}[{index.value!r}] is unset") if value == NONE else value
        if isinstance(index, Const):
            if isinstance(base, Seq):
                if base.kind == "dict":
                    for pair in base.items:
                        if isinstance(pair, Seq) and equal(pair.items[0], index) is True:
                            return pair.items[1]
                    return Unknown(_short(node))
                if isinstance(index.value, int) and -len(base.items) <= index.value < len(base.items):
                    return base.items[index.value]
            if isinstance(base, Const) and isinstance(base.value, (str, tuple)):
                try:
                    return Const(base.value[index.value])  # type: ignore[index]
                except (IndexError, TypeError):
                    return Unknown(_short(node))
            if isinstance(base, Repeated):
                return base.item
        return Unknown(_short(node))

    def _binop(self, op: ast.operator, left: V, right: V, st: _State, frame: _Frame, node: ast.AST) -> V:
        left, right = self.force(left), self.force(right)
        for side in (left, right):
            if isinstance(side, Raises):
                return side
        if isinstance(left, Const) and isinstance(right, Const):
            try:
                return Const(_OPERATORS[type(op)](left.value, right.value))
            except (KeyError, TypeError, ValueError, ZeroDivisionError, OverflowError):
                return Unknown(_short(node))
        if isinstance(op, ast.Add) and isinstance(left, Seq) and isinstance(right, Seq):
            return Seq(left.kind, left.items + right.items)
        if isinstance(op, ast.Add) and isinstance(left, (Seq, Repeated)) and isinstance(right, (Seq, Repeated)):
            items = [i for s in (left, right) for i in (s.items if isinstance(s, Seq) else (s.item,))]
            return Repeated("list", one_of(*items)) if items else Seq("list", ())
        if any(isinstance(o, Stream) for o in (*options(left), *options(right))):
            self._event(
                "holds" if isinstance(op, ast.Add) else "unknown",
                f"{_short(node)} at {_where_text(frame, node)}",
                st.reach,
                frame,
                node,
            )
            return Stream("holds" if isinstance(op, ast.Add) else "unknown")
        return Unknown(_short(node))

    def _fstring(self, node: ast.JoinedStr, st: _State, frame: _Frame) -> V:
        parts = []
        for value in node.values:
            if isinstance(value, ast.Constant):
                parts.append(str(value.value))
                continue
            inner = self.force(self._expr(value.value, st, frame))  # type: ignore[attr-defined]
            if isinstance(inner, Const) and value.format_spec is None and value.conversion == -1:  # type: ignore
                parts.append(str(inner.value))
            else:
                parts.append("{" + ast.unparse(value.value) + "}")  # type: ignore[attr-defined]
        return Const("".join(parts))

    def _display(self, node: ast.List | ast.Tuple | ast.Set, st: _State, frame: _Frame) -> V:
        kind = {ast.List: "list", ast.Tuple: "tuple", ast.Set: "set"}[type(node)]
        items: list[V] = []
        repeated: list[V] = []
        for element in node.elts:
            value = self._expr(element, st, frame)
            if isinstance(element, ast.Starred):
                value = self.force(value)
                if any(isinstance(o, Stream) for o in options(value)):
                    self._event("holds", f"{_short(node)} at {_where_text(frame, node)}", st.reach, frame, node)
                    return Stream("holds", next(o for o in options(value) if isinstance(o, Stream)).via)
                if isinstance(value, Seq):
                    items += value.items
                else:
                    repeated.append(value.item if isinstance(value, Repeated) else Unknown("starred"))
                continue
            items.append(value)
        if repeated:
            return Repeated(kind, one_of(*items, *repeated))
        return Seq(kind, tuple(items), Where(frame.defn, node, frame.path))

    def _dict(self, node: ast.Dict, st: _State, frame: _Frame) -> V:
        pairs: list[V] = []
        for key, value in zip(node.keys, node.values, strict=True):
            evaluated = self.force(self._expr(value, st, frame))
            if key is None:  # {**mapping}
                if any(isinstance(o, Stream) for o in options(evaluated)):
                    self._event("holds", f"{_short(node)} at {_where_text(frame, node)}", st.reach, frame, node)
                    return Stream("holds")
                if isinstance(evaluated, Seq) and evaluated.kind == "dict":
                    pairs += evaluated.items
                else:
                    return Repeated("dict", Unknown("mapping"))
                continue
            pairs.append(Seq("pair", (self._expr(key, st, frame), evaluated)))
        return Seq("dict", tuple(pairs))

    def _comprehension(
        self, node: ast.ListComp | ast.SetComp | ast.DictComp | ast.GeneratorExp, st: _State, frame: _Frame
    ) -> V:
        first = node.generators[0]
        iterable = self.force(self._expr(first.iter, st, frame))
        streams = [o for o in options(iterable) if isinstance(o, Stream)]
        kind = {ast.ListComp: "list", ast.SetComp: "set", ast.DictComp: "dict", ast.GeneratorExp: "generator"}[
            type(node)
        ]
        inner = st.copy(st.reach.when(None))
        if streams:
            self._assign(first.target, Unknown("an item of the weights"), inner, frame, node)  # type: ignore
            self._elements(node, inner, frame)
            if kind == "generator":
                return Stream(streams[0].state, (*streams[0].via, "a generator expression"))
            self._event("holds", f"{_short(node)} at {_where_text(frame, node)}", st.reach, frame, node)
            return Stream("holds", streams[0].via)
        if isinstance(iterable, Seq) and len(node.generators) == 1 and len(iterable.items) <= 64:
            items = []
            for item in iterable.items:
                each = st.copy()
                self._assign(first.target, item, each, frame, node)  # type: ignore[arg-type]
                tests = [self._test(t, each, frame) for t in first.ifs]
                if any(t is False for t in tests):
                    continue
                value = self._elements(node, each, frame)
                if any(t is not True for t in tests):
                    return Repeated(kind, value)
                items.append(value)
            return Seq(kind if kind != "generator" else "tuple", tuple(items))
        item = iterable.item if isinstance(iterable, Repeated) else Unknown(f"an item of {_short(first.iter)}")
        self._assign(first.target, item, inner, frame, node)  # type: ignore[arg-type]
        value = self._elements(node, inner, frame)
        if isinstance(value, Made) and kind == "list":
            return Made(f"list of {value.kind}", value.where)
        return Repeated(kind, value)

    def _elements(self, node, st: _State, frame: _Frame) -> V:
        for generator in node.generators[1:]:
            self._assign(generator.target, Unknown("an item"), st, frame, node)
        for generator in node.generators:
            for test in generator.ifs:
                self._expr(test, st, frame)
        if isinstance(node, ast.DictComp):
            return Seq("pair", (self._expr(node.key, st, frame), self._expr(node.value, st, frame)))
        return self._expr(node.elt, st, frame)

    def _compare(self, node: ast.Compare, st: _State, frame: _Frame) -> V:
        left = self.force(self._expr(node.left, st, frame))
        result: bool | None = True
        for op, right_node in zip(node.ops, node.comparators, strict=True):
            right = self.force(self._expr(right_node, st, frame))
            for side in (left, right):
                if isinstance(side, Raises):
                    return side
            if isinstance(op, (ast.Eq, ast.NotEq)):
                found = equal(left, right)
                found = found if found is None or isinstance(op, ast.Eq) else not found
            elif isinstance(op, (ast.Is, ast.IsNot)):
                found = identical(left, right)
                found = found if found is None or isinstance(op, ast.Is) else not found
            elif (
                isinstance(op, (ast.In, ast.NotIn))
                and isinstance(right, Ext)
                and isinstance(left, Const)
                and (right.name in tables.SETTINGS_MAPPINGS)
            ):
                self.settings_read[str(left.value)] = False
                value = self.case.setting(Setting(str(left.value)))
                found = None if isinstance(value, Setting) else value != NONE
                found = found if found is None or isinstance(op, ast.In) else not found
            elif isinstance(op, (ast.In, ast.NotIn)):
                found = contains(right, left)
                found = found if found is None or isinstance(op, ast.In) else not found
            elif isinstance(left, Const) and isinstance(right, Const):
                try:
                    found = bool(_OPERATORS[type(op)](left.value, right.value))
                except TypeError:
                    found = None
            else:
                found = None
            if found is False:
                return self._compared(node, Const(False, src=node))
            if found is None:
                result = None
            left = right
        return self._compared(
            node, Const(True, src=node) if result else Unknown(f"`{_short(node)}` at {_where_text(frame, node)}")
        )

    def _compared(self, node: ast.Compare, value: V) -> V:
        if not self._quiet:
            found = self.compared.get(id(node))
            self.compared[id(node)] = (node, value if found is None else one_of(found[1], value))
        return value

    def _boolop(self, node: ast.BoolOp, st: _State, frame: _Frame) -> V:
        """``a and b`` / ``a or b`` as Python gives it: the first operand that decides, else the last; an operand
        whose truth is unknown may be the result too."""
        is_and = isinstance(node.op, ast.And)
        reach = st.reach
        possible: list[V] = []
        value: V = NONE
        for operand in node.values:
            value = self.force(self._expr(operand, st.copy(reach), frame))
            if isinstance(value, Raises):
                return value if reach is Reach.YES and not possible else one_of(*possible, Unknown("raises"))
            found = truth(value)
            if found is (not is_and):  # `or` with a true operand, `and` with a false one: it is the result
                return one_of(*possible, value)
            if found is None:
                possible.append(value)
                reach = reach.when(None)
        return one_of(*possible, value) if possible and possible[-1] is not value else value

    # -- calls ---------------------------------------------------------------------------------------------
    def _call(self, node: ast.Call, st: _State, frame: _Frame) -> V:
        self._mark(node, st.reach)
        func = node.func
        if isinstance(func, ast.Name) and func.id == "super" and not node.args:
            return _Super(frame.defn, st.env.get(_first_param(frame.node)), frame.self_class)
        callee: V | None = None
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Call):
            inner = func.value
            if isinstance(inner.func, ast.Name) and inner.func.id == "super" and not inner.args:
                self._mark(inner, st.reach)
                receiver = st.env.get(_first_param(frame.node))
                owner = frame.defn.owner
                method = self.follower.super_method(owner, frame.self_class, func.attr) if owner is not None else None
                callee = Def(method, bound=receiver) if method is not None else Unknown(f"super().{func.attr}")
        args, kwargs = self._arguments(node, st, frame)
        everything = [*args, *kwargs.values()]
        raised = next((v for v in everything if isinstance(v, Raises)), None)
        if raised is not None:  # an argument raises: the call is never made
            return raised
        if not self._quiet:
            self.built[id(node)] = {**self.built.get(id(node), {}), **kwargs}
        if isinstance(func, ast.Attribute) and func.attr in _REGISTERS and args and isinstance(args[0], Const):
            path = self._path(func.value, st)  # x.register_parameter("a", value): x.a
            if path is not None and len(args) > 1:
                self._write(f"{path}.{args[0].value}", args[1], st)
                return NONE
        if self.sink is not None and not self._quiet and self.sink(node, everything):
            self._event("sink", _short(node), st.reach, frame, node, Seq("arguments", tuple(everything)))
            return Unknown(f"{_short(node.func)}()")
        if callee is None:
            if not self._quiet and not any(v.tracked for v in everything) and self._static(func, st, frame):
                return Deferred(node, frame.defn, tuple(args), tuple(sorted(kwargs.items())))
            callee = self.force(self._expr(func, st, frame))
        if isinstance(callee, Raises):
            return callee
        if isinstance(callee, OneOf):
            return one_of(*(self._dispatch_one(o, node, args, kwargs, st, frame) for o in callee.options))
        return self._dispatch_one(callee, node, args, kwargs, st, frame)

    def _static(self, func: ast.expr, st: _State, frame: _Frame) -> bool:
        """Whether ``func`` names a module-level object (not a local, not a builtin): its module need not be read
        before the result is."""
        if isinstance(func, ast.Attribute):
            return self._static(func.value, st, frame)
        return (
            isinstance(func, ast.Name)
            and func.id not in st.env
            and func.id not in frame.outer
            and func.id not in _BUILTIN_NAMES
            and self.follower.external(frame.defn.module, func.id) is None  # another package's: cheap to read now
            and self._bound_in(frame.defn.module, func.id)  # bound nowhere: another package's too
        )

    def _bound_in(self, module: str, name: str) -> bool:
        """Whether module-level code of ``module`` binds ``name`` (an import, an assignment, a def or a class)."""
        file = self.follower.module_file(module)
        tree = self.follower.ctx.ast(file) if file else None
        return tree is not None and name in _module_bindings(tree)

    def _arguments(self, node: ast.Call, st: _State, frame: _Frame) -> tuple[list[V], dict[str, V]]:
        args: list[V] = []
        for arg in node.args:
            value = self._expr(arg, st, frame)
            if isinstance(arg, ast.Starred):
                value = self.force(value)
                if any(isinstance(o, Stream) for o in options(value)):
                    self._event(
                        "holds",
                        f"{_short(node)} unpacks every item (*) at {_where_text(frame, node)}",
                        st.reach,
                        frame,
                        node,
                    )
                    args.append(Stream("holds"))
                elif isinstance(value, Seq):
                    args += value.items
                else:
                    args.append(_Star(value))
                continue
            args.append(value)
        kwargs: dict[str, V] = {}
        for keyword in node.keywords:
            value = self._expr(keyword.value, st, frame)
            if keyword.arg is None:
                if any(isinstance(o, Stream) for o in options(self.force(value))):
                    self._event(
                        "holds",
                        f"{_short(node)} unpacks every item (**) at {_where_text(frame, node)}",
                        st.reach,
                        frame,
                        node,
                    )
                kwargs["**"] = value
            else:
                kwargs[keyword.arg] = value
        return args, kwargs

    def _dispatch_one(
        self, callee: V, node: ast.Call, args: list[V], kwargs: dict[str, V], st: _State, frame: _Frame
    ) -> V:  # noqa: C901
        callee = self.force(callee)
        if isinstance(callee, Partial):
            return self._dispatch_one(callee.func, node, [*callee.args, *args], kwargs, st, frame)
        if isinstance(callee, Ext):
            return self._external(callee.name, node, args, kwargs, st, frame)
        if isinstance(callee, Bound):
            return self._method(callee, node, args, kwargs, st, frame)
        if isinstance(callee, Thing):
            if callee.returns is not None:
                return callee.returns
            if callee.foreign:
                return Unknown(f"{_short(node.func)}()")
            return self._unfollowed(f"{_short(node.func)}()", node, [callee, *args, *kwargs.values()], st, frame)
        if isinstance(callee, Inst):
            method = self.follower.method(callee.cls, "forward") or self.follower.method(callee.cls, "__call__")
            if method is None:
                return self._unfollowed(f"{_short(node.func)}()", node, [*args, *kwargs.values()], st, frame)
            callee = Def(method, bound=callee)
        if isinstance(callee, Closure):
            return self._invoke(callee.node, callee.outer, None, node, args, kwargs, st, frame, closure=True)
        if isinstance(callee, Def):
            defn = callee.defn
            args = [*callee.partial, *args]
            fact = self.case.call(f"{defn.module}.{defn.qualname}") if defn.kind == "function" else None
            if fact is not None:
                return fact
            if defn.kind == "class":
                carried = [a for a in (*args, *kwargs.values()) if isinstance(a, Stream)]
                if carried:
                    self._event(
                        "unknown",
                        f"{_short(node)} at {_where_text(frame, node)} (the weights go into a {defn.qualname})",
                        st.reach,
                        frame,
                        node,
                    )
                if self.follower.is_dataclass(defn):  # its fields are the arguments given
                    fields = tuple((k, v) for k, v in kwargs.items() if k != "**")
                    return Inst(defn, fields, made=node)
                return Inst(defn, made=node)
            if defn.kind != "function":
                return Unknown(_short(node))
            return self._invoke(defn.node, defn, callee.bound, node, args, kwargs, st, frame)  # type: ignore
        return self._unfollowed(f"{_short(node.func)}()", node, [callee, *args, *kwargs.values()], st, frame)

    def _unfollowed(self, what: str, node: ast.Call, carried: list[V], st: _State, frame: _Frame) -> V:
        """A call nobody can follow: unknown, and an event where it touches what is tracked."""
        text = f"{what} at {_where_text(frame, node)}"
        if any(self.force(v).tracked for v in carried if not isinstance(v, Pending)):
            self._event("unknown", text, st.reach, frame, node)
            if any(isinstance(o, Stream) for v in carried for o in options(v)):
                return Stream("unknown")
        return Unknown(text)

    def _external(self, name: str, node: ast.Call, args: list[V], kwargs: dict[str, V], st: _State, frame: _Frame) -> V:  # noqa: C901
        streams = [o for a in (*args, *kwargs.values()) for o in options(a) if isinstance(o, Stream)]
        if streams:
            effect = tables.ITERATORS.get(name)
            via = (*streams[0].via, name.removeprefix("builtins."))
            if effect == tables.LAZY:
                worst = (
                    "holds"
                    if any(s.state == "holds" for s in streams)
                    else ("unknown" if any(s.state == "unknown" for s in streams) else "lazy")
                )
                return Stream(worst, via)
            if effect == tables.HOLDS:
                self._event(
                    "holds", f"{name.removeprefix('builtins.')}() at {_where_text(frame, node)}", st.reach, frame, node
                )
                return Stream("holds", via)
            why = tables.REJECTS.get(name, "")
            self._event(
                "unknown",
                f"{_short(node.func)}() at {_where_text(frame, node)}" + (f" ({why})" if why else ""),
                st.reach,
                frame,
                node,
            )
            return Stream("unknown", via)
        if name in tables.BUILDERS:
            return Made(tables.BUILDERS[name], _where_text(frame, node))
        if name in tables.SETTINGS_CALLS and args and isinstance(self.force(args[0]), Const):
            args = [self.force(a) for a in args]
            self.settings_read[str(args[0].value)] = False
            default = args[1] if len(args) > 1 else kwargs.get("default", NONE)
            return self.case.setting(Setting(str(args[0].value), default))
        short = name.removeprefix("builtins.")
        if name.startswith("builtins."):  # builtins read their arguments: evaluate what they were handed
            args = [self.force(a) for a in args]
            found = self._builtin(short, node, args, kwargs, st, frame)
            if found is not None:
                return found
        if name == "functools.partial" and args:
            return Partial(args[0], tuple(args[1:]))
        return Unknown(f"{_short(node.func)}()")  # another package's code: it does not run vLLM's

    def _builtin(
        self, name: str, node: ast.Call, args: list[V], kwargs: dict[str, V], st: _State, frame: _Frame
    ) -> V | None:  # noqa: C901
        if name in ("getattr", "hasattr", "setattr") and len(args) >= 2 and isinstance(args[1], Const):
            attr = str(args[1].value)
            if name == "setattr" and len(args) == 3:
                path = self._path(node.args[0], st)
                if path is not None:
                    self._write(f"{path}.{attr}", args[2], st)
                return NONE
            path = self._path(node.args[0], st)
            written = st.env.get(f"{path}.{attr}") if path is not None else None
            value = written if written is not None else self.force(self._attribute(args[0], attr, st, frame, node))
            if name == "hasattr":
                if isinstance(value, Raises):
                    return Const(False, src=node)
                return Const(True, src=node) if not isinstance(value, Unknown) else Unknown(_short(node))
            if isinstance(value, Raises) and len(args) == 3:
                return args[2]
            if isinstance(value, OneOf) and len(args) == 3:
                return one_of(*(args[2] if isinstance(o, Raises) else o for o in value.options))
            return value
        if name == "isinstance" and len(args) == 2:
            return self._isinstance(args[0], args[1], node)
        if name in ("len", "int", "str", "bool", "float", "abs") and len(args) == 1:
            value = args[0]
            if name == "bool":
                found = truth(value)
                return Const(found, src=node) if found is not None else Unknown(_short(node))
            if name == "len" and isinstance(value, Seq):
                return Const(len(value.items))
            if isinstance(value, Const):
                try:
                    return Const({"len": len, "int": int, "str": str, "float": float, "abs": abs}[name](value.value))
                except (TypeError, ValueError):
                    return Raises(f"{_short(node)} raises at {_where_text(frame, node)}")
            return Unknown(_short(node))
        if name == "callable" and len(args) == 1:
            value = args[0]
            if isinstance(value, (Def, Closure, Partial)) or isinstance(value, Thing) and value.returns is not None:
                return Const(True, src=node)
            if isinstance(value, Const):
                return Const(False, src=node)
            return Unknown(_short(node))
        if name == "range":
            bounds = [a.value for a in args if isinstance(a, Const) and isinstance(a.value, int)]
            if len(bounds) == len(args) and 1 <= len(args) <= 3 and len(range(*bounds)) <= 64:
                return Seq("list", tuple(Const(i) for i in range(*bounds)))
            return Repeated("list", Unknown("a number"))
        if name in ("list", "tuple", "set", "frozenset", "dict") and not args and not kwargs:
            return Seq(name if name != "frozenset" else "set", ())
        if name in ("list", "tuple", "set", "frozenset", "sorted") and len(args) == 1:
            value = args[0]
            if isinstance(value, Seq):
                return Seq("list" if name == "sorted" else name, value.items)
            if isinstance(value, Made):
                return value
            return Repeated("list", value.item if isinstance(value, Repeated) else Unknown("an item"))
        if name in (
            "print",
            "id",
            "type",
            "repr",
            "hash",
            "min",
            "max",
            "sum",
            "any",
            "all",
            "next",
            "zip",
            "enumerate",
            "map",
            "filter",
            "iter",
            "dict",
            "reversed",
            "divmod",
            "round",
        ):
            tracked = [a for a in (*args, *kwargs.values()) if a.tracked]
            if tracked and name not in ("print", "id", "repr", "type"):
                self._event("unknown", f"{name}() at {_where_text(frame, node)}", st.reach, frame, node)
            return Unknown(f"{name}()")
        return None

    def _isinstance(self, value: V, classes: V, node: ast.AST) -> V:
        """``isinstance`` through the MRO. A class of another package counts where a class of the MRO names it as
        a base; a case's closed object (its class is all it is) is no instance of another one."""
        wanted = classes.items if isinstance(classes, Seq) else (classes,)
        value = self.force(value)
        cls = _class_of(value)
        if cls is None:
            return Unknown(_short(node))
        mro = self.follower.mro(cls)
        ids = {id(c.node) for c in mro}
        external = set()  # the other packages' classes the MRO names as bases, by dotted name
        for owner in mro:
            for base in owner.node.bases:  # type: ignore[union-attr]
                text = ast.unparse(base)
                head, _, rest = text.partition(".")
                origin = (
                    self.follower.external(owner.module, head) if isinstance(base, (ast.Name, ast.Attribute)) else None
                )
                if origin is not None:
                    external.add(f"{origin}.{rest}" if rest else origin)
        found = []
        for item in wanted:
            item = self.force(item)
            if isinstance(item, Def) and item.defn.kind == "class":
                found.append(id(item.defn.node) in ids)
            elif isinstance(item, Ext):
                found.append(True if item.name in external else (False if getattr(value, "closed", False) else None))
            else:
                found.append(None)
        if True in found:
            return Const(True, src=node)
        return Const(False, src=node) if all(f is False for f in found) else Unknown(_short(node))

    def _method(
        self, callee: Bound, node: ast.Call, args: list[V], kwargs: dict[str, V], st: _State, frame: _Frame
    ) -> V:  # noqa: C901
        recv, attr = self.force(callee.recv), callee.attr
        args = [self.force(a) for a in args]
        streams = [o for a in (recv, *args) for o in options(a) if isinstance(o, Stream)]
        if streams and attr in tables.HOLDING_METHODS:
            self._event("holds", f"{_short(node.func)}() at {_where_text(frame, node)}", st.reach, frame, node)
            return NONE if attr in ("sort", "extend", "update") else Stream("holds")
        if streams:
            return self._unfollowed(f"{_short(node.func)}()", node, [recv, *args], st, frame)
        path = self._path(node.func.value, st) if isinstance(node.func, ast.Attribute) else None
        if isinstance(recv, (Seq, Repeated)) and attr in ("append", "extend", "insert") and path is not None:
            added = [args[-1]] if attr != "extend" else []
            if attr == "extend" and args:
                more = args[0]
                added = (
                    list(more.items)
                    if isinstance(more, Seq)
                    else [more.item if isinstance(more, Repeated) else Unknown("items")]
                )
            base = recv.items if isinstance(recv, Seq) else (recv.item,)
            fixed = isinstance(recv, Seq) and (attr != "extend" or isinstance(args[0], Seq))
            self._write(
                path, Seq(recv.kind, (*base, *added)) if fixed else Repeated(recv.kind, one_of(*base, *added)), st
            )
            return NONE
        if isinstance(recv, Seq) and recv.kind == "dict":
            if attr == "get" and args:
                for pair in recv.items:
                    if isinstance(pair, Seq) and equal(pair.items[0], args[0]) is True:
                        return pair.items[1]
                return args[1] if len(args) > 1 else NONE
            if attr in ("items", "keys", "values"):
                pick = {"items": lambda p: p, "keys": lambda p: p.items[0], "values": lambda p: p.items[1]}[attr]
                return Seq("list", tuple(pick(p) for p in recv.items if isinstance(p, Seq)))
        if isinstance(recv, Const) and isinstance(recv.value, str) and attr in _STR_METHODS:
            consts = [a.value if isinstance(a, Const) else a for a in args]
            consts = [
                tuple(i.value for i in c.items)
                if isinstance(c, Seq) and all(isinstance(i, Const) for i in c.items)
                else c
                for c in consts
            ]
            if all(not isinstance(c, V) for c in consts) and not kwargs:
                try:
                    result = getattr(recv.value, attr)(*consts)
                except (TypeError, ValueError):
                    return Unknown(_short(node))
                if isinstance(result, (list, tuple)):
                    return Seq("list", tuple(Const(r) for r in result))
                return Const(result, src=node)
        return self._unfollowed(f"{_short(node.func)}()", node, [recv, *args, *kwargs.values()], st, frame)

    # -- following vLLM's code -----------------------------------------------------------------------------
    def _invoke(
        self,
        func,
        defn: Definition,
        bound: V | None,
        node: ast.Call,
        args: list[V],
        kwargs: dict[str, V],
        st: _State,
        frame: _Frame,
        closure: bool = False,
    ) -> V:
        carried = [v for v in (bound, *args, *kwargs.values()) if v is not None and v.tracked]
        if closure:
            defn = Definition(
                "function",
                defn.module,
                defn.file,
                f"{defn.qualname}.<locals>.{getattr(func, 'name', 'lambda')}",
                func,
                None,
            )
        if not carried and not self._quiet and not closure:
            return Pending(defn, bound, tuple(args), tuple(sorted(kwargs.items())))
        if frame.depth >= self.max_depth or self.budget <= 0:
            return self._unfollowed(f"{_short(node.func)}() (not followed further)", node, carried, st, frame)
        if (
            frame.wanted is not None
            and frame.depth >= 1
            and frame.statement is not None
            and (id(frame.statement) in frame.touch_only and not self._on_self(node, frame))
        ):  # a value question follows helpers handed the object one call deep, methods of self all the way
            return Unknown(f"{_short(node.func)}()")
        self.budget -= 1
        hop = Hop(frame.defn, node, defn)
        if not self._quiet:
            self.followed.append(Where(defn, func, (*frame.path, hop)))
        callee = _Frame(
            defn,
            func,
            (*frame.path, hop),
            frame.depth + 1,
            self_class=_class_of(bound) if bound is not None else frame.self_class,
        )
        if closure:
            callee.outer = {k: v for k, v in st.env.items()}
        callee.generator = is_generator(func)
        callee.item = frame.item
        env = self._bind(func, defn, bound, node, args, kwargs, st, callee, frame)
        if frame.wanted is not None:  # what the caller reads through what it handed over (and what it returns)
            callee.wanted = frozenset(
                param + path[len(outer) :]
                for param, outer in callee.caller_paths.items()
                for path in frame.wanted
                if path == outer or path.startswith(outer + ".")
            )
        returns = frame.statement is None or id(frame.statement) not in frame.touch_only
        body, callee.touch_only, callee.wanted = self._body(defn, func, callee.wanted, callee.self_class, returns)
        end = self._block(body, _State(env, st.reach), callee) if not isinstance(func, ast.Lambda) else None
        if isinstance(func, ast.Lambda):
            value = self._expr(func.body, _State(env, st.reach), callee)
            return value
        result, exit_env = self._finish(callee, end)  # type: ignore[arg-type]
        frame.item = callee.item
        self._write_back(callee, exit_env, st)
        return result

    @staticmethod
    def _on_self(node: ast.Call, frame: _Frame) -> bool:
        """``self.m(...)`` or ``super().m(...)`` in a method."""
        func = node.func
        if not isinstance(func, ast.Attribute):
            return False
        if isinstance(func.value, ast.Call) and isinstance(func.value.func, ast.Name):
            return func.value.func.id == "super"
        return isinstance(func.value, ast.Name) and func.value.id == _first_param(frame.node)

    def _bind(
        self,
        func,
        defn: Definition,
        bound: V | None,
        node: ast.Call,
        args: list[V],
        kwargs: dict[str, V],
        st: _State,
        callee: _Frame,
        caller: _Frame | None = None,
    ) -> dict[str, V]:
        a = func.args
        positional = [p.arg for p in (*a.posonlyargs, *a.args)]
        defaults = dict(zip(positional[len(positional) - len(a.defaults) :], a.defaults, strict=True))
        defaults.update({p.arg: d for p, d in zip(a.kwonlyargs, a.kw_defaults, strict=True) if d is not None})
        env: dict[str, V] = {}
        exprs: list[ast.expr | None] = list(node.args)
        static = any(ast.unparse(d) == "staticmethod" for d in getattr(func, "decorator_list", []))
        if bound is not None and positional and not static:
            env[positional[0]] = bound
            receiver = node.func.value if isinstance(node.func, ast.Attribute) else None
            if receiver is not None and not isinstance(receiver, ast.Call):
                path = self._path(receiver, st)
                if path is not None:
                    callee.caller_paths[positional[0]] = path
            elif isinstance(receiver, ast.Call) and caller is not None:  # super().m(...): the caller's own self
                first = _first_param(caller.node)
                if first is not None:
                    callee.caller_paths[positional[0]] = first
            positional = positional[1:]
        if any(isinstance(v, _Star) for v in args):
            args = args[: next(i for i, v in enumerate(args) if isinstance(v, _Star))]
            exprs = []
        for name, value, expr in zip(positional, args, exprs + [None] * len(args), strict=False):
            env[name] = value
            path = self._path(expr, st) if isinstance(expr, (ast.Name, ast.Attribute)) else None
            if path is not None:
                callee.caller_paths[name] = path
        extra = args[len(positional) :]
        if a.vararg is not None:
            env[a.vararg.arg] = Seq("tuple", tuple(extra))
        names = set(positional) | {p.arg for p in a.kwonlyargs}
        for name, value in kwargs.items():
            if name in names:
                env[name] = value
                expr = next((k.value for k in node.keywords if k.arg == name), None)
                path = self._path(expr, st) if isinstance(expr, (ast.Name, ast.Attribute)) else None
                if path is not None:
                    callee.caller_paths[name] = path
        if a.kwarg is not None:
            env[a.kwarg.arg] = Repeated("dict", Unknown("keyword arguments"))
        for name in [*positional, *(p.arg for p in a.kwonlyargs)]:
            if name not in env:  # not bound by the call (passed on through *args): the case's role of its name
                default = defaults.get(name)
                role = self.case.role(name)
                if role is not None:
                    env[name] = role
                elif default is not None:
                    env[name] = self._expr(default, _State({}, Reach.YES), _Frame(defn, func, (), self.max_depth))
                else:
                    env[name] = Unknown(f"parameter {name}")
        return env

    def _finish(self, frame: _Frame, end: _State) -> tuple[V, dict[str, V]]:
        """What a finished function gives (its returns, None where it falls off the end; for a generator, the
        weights it yields) and its state at the exits."""
        exits = [s for s in frame.exits if s.reach is not Reach.NO]
        if end.reach is not Reach.NO:
            exits.append(end)
            frame.returns.append((end.reach, NONE))
        env: dict[str, V] = {}
        for state in exits:
            for key, value in state.env.items():
                env[key] = value if key not in env else one_of(env[key], value)
        if frame.generator:
            if not frame.out and frame.consumed:
                return Stream("holds", (frame.defn.qualname,)), env
            if frame.out:
                states = {s.state for s in frame.out}
                worst = "holds" if "holds" in states else "unknown" if "unknown" in states else "lazy"
                return Stream(worst, (*frame.out[0].via, frame.defn.qualname)), env
            return Made("generator", frame.defn.where()), env
        returned = [value for reach, value in frame.returns if reach is not Reach.NO]
        if not returned:  # raises on every path: the caller's statement raises too (already told, once)
            return Raises(frame.raised[0].why if frame.raised else f"{frame.defn.qualname} raises", told=True), env
        result = one_of(*returned)
        if isinstance(result, Stream):
            result = Stream(result.state, (*result.via, frame.defn.qualname))
        return result, env

    def _write_back(self, callee: _Frame, exit_env: dict[str, V], st: _State) -> None:
        """Attributes a followed call wrote on objects the caller reaches (``self``, ``self.gate``)."""
        for key, value in sorted(exit_env.items(), key=lambda item: item[0].count(".")):  # an object before its
            head, dot, rest = key.partition(".")  # attributes: writing self.gate after self.gate.bias_vl drops it
            if not dot or head not in callee.caller_paths:
                continue
            self._write(f"{callee.caller_paths[head]}.{rest}", value, st)

    def _resolve_deferred(self, deferred: Deferred) -> V:
        key = ("deferred", id(deferred.node), deferred.args, deferred.kwargs, self.case, self.lazy)
        return self._shared(key, lambda: self._compute_deferred(deferred), Unknown(f"{_short(deferred.node)}"))

    def _compute_deferred(self, deferred: Deferred) -> V:
        self._quiet += 1
        try:
            frame = _Frame(deferred.defn, deferred.defn.node or ast.Lambda(), (), self.max_depth - 2)  # type: ignore
            frame.wanted = frozenset()  # only its result is read
            state = _State({}, Reach.YES)
            callee = self.force(self._expr(deferred.node.func, state, frame))
            args, kwargs = list(deferred.args), dict(deferred.kwargs)
            if isinstance(callee, OneOf):
                result = one_of(
                    *(self._dispatch_one(o, deferred.node, args, kwargs, state, frame) for o in callee.options)
                )
            else:
                result = self._dispatch_one(callee, deferred.node, args, kwargs, state, frame)
            return self.force(result)
        finally:
            self._quiet -= 1

    def _resolve(self, pending: Pending) -> V:
        key = ("pending", id(pending.defn.node), pending.bound, pending.args, pending.kwargs, self.case, self.lazy)
        return self._shared(key, lambda: self._compute_pending(pending), Unknown(f"{pending.defn.qualname}()"))

    def _compute_pending(self, pending: Pending) -> V:
        if self.budget <= 0:
            return Unknown(f"{pending.defn.qualname}() (not followed further)")
        self.budget -= 1
        self._quiet += 1
        try:
            node = ast.Call(ast.Name(pending.defn.qualname.rsplit(".", 1)[-1]), [], [])
            frame = _Frame(pending.defn, pending.defn.node, (), 2, self_class=_class_of(pending.bound))  # type: ignore
            callee = _Frame(pending.defn, pending.defn.node, (), 3, self_class=frame.self_class)  # type: ignore
            callee.generator = is_generator(pending.defn.node)
            env = self._bind(
                pending.defn.node,
                pending.defn,
                pending.bound,
                node,
                list(pending.args),
                dict(pending.kwargs),
                _State({}, Reach.YES),
                callee,
            )
            # only its result is read: the statements that lead to its returns
            body, _, _ = self._body(pending.defn, pending.defn.node, frozenset(), callee.self_class)
            end = self._block(body, _State(env, Reach.YES), callee)
            result, _ = self._finish(callee, end)
            return result
        finally:
            self._quiet -= 1


@dataclass(frozen=True)
class _Super(V):
    owner: Definition
    receiver: V | None
    self_class: Definition | None


@dataclass(frozen=True)
class _Star(V):
    """``*value`` of unknown length in a call."""

    value: V


def _watched(value: V) -> V:
    if isinstance(value, Inst) and not value.watched:
        return Inst(value.cls, value.attrs, value.made, True)
    if isinstance(value, OneOf):
        return one_of(*(_watched(o) for o in value.options))
    return value


def _module_bindings(tree: ast.Module) -> dict[str, list[ast.stmt]]:
    """The module-level statements (under if/try too) that assign or import each name, once per tree."""
    from patch_dsv4.patching.follow import _blocks

    found = tree.__dict__.get("_patch_dsv4_bindings")
    if found is None:
        found = {}
        for stmt in _blocks(tree.body):
            names: list[str] = []
            if isinstance(stmt, (ast.Assign, ast.AnnAssign)):
                targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                names = [t.id for t in targets if isinstance(t, ast.Name)]
            elif isinstance(stmt, (ast.Import, ast.ImportFrom)):
                names = [a.asname or a.name.split(".")[0] for a in stmt.names]
            elif isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names = [stmt.name]
            for name in names:
                found.setdefault(name, []).append(stmt)
        tree._patch_dsv4_bindings = found  # type: ignore[attr-defined]
    return found


def _first_param(func: ast.AST) -> str | None:
    params = _parameters(func)
    return params[0] if params else None


def _class_of(value: V | None) -> Definition | None:
    if isinstance(value, Inst):
        return value.cls
    return None


#: ``x.register_parameter("a", value)`` and its kin make ``x.a``.
_REGISTERS = frozenset({"register_parameter", "register_buffer", "register_module", "add_module"})

_OPERATORS = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.FloorDiv: lambda a, b: a // b,
    ast.Mod: lambda a, b: a % b,
    ast.Div: lambda a, b: a / b,
    ast.Lt: lambda a, b: a < b,
    ast.LtE: lambda a, b: a <= b,
    ast.Gt: lambda a, b: a > b,
    ast.GtE: lambda a, b: a >= b,
    ast.BitOr: lambda a, b: a | b,
    ast.BitAnd: lambda a, b: a & b,
}

__all__ = ["Event", "Hop", "Run", "Sink", "Where", "_function_statements", "is_generator"]
