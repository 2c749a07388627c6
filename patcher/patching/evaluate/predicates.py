"""Questions a patch asks of the code, written once over the evaluator's runs.

Each answer keeps its evidence (where, through which calls) and its unknowns (the construct and line that stopped
a proof); a patch turns them into its verdict's text.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from dataclasses import dataclass, field

from patch_dsv4.patching.evaluate.cases import ANY, Case
from patch_dsv4.patching.evaluate.interpret import Event, Run, Sink, Where, is_generator
from patch_dsv4.patching.evaluate.values import (
    NONE,
    UNSET,
    Const,
    Inst,
    Made,
    Raises,
    Reach,
    Seq,
    Stream,
    Unknown,
    V,
    is_none,
    one_of,
    options,
    truth,
)
from patch_dsv4.patching.follow import Definition, Follower, calls_in
from patch_dsv4.patching.patch import Context


class Evaluator:
    """The evaluator of one Context: its runs share the facility and, through the context's memo, the results of
    helpers they call (each replaying the files it read)."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.follower = Follower(ctx)

    @classmethod
    def of(cls, ctx: Context) -> Evaluator:
        """The context's evaluator (one per context)."""
        found = getattr(ctx, "_patch_dsv4_evaluator", None)
        if found is None:
            found = cls(ctx)
            ctx._patch_dsv4_evaluator = found  # type: ignore[attr-defined]
        return found

    def run(
        self,
        defn: Definition,
        case: Case = ANY,
        *,
        bind: dict[str, str] | None = None,
        self_value: V | None = None,
        given: dict[str, V] | None = None,
        sink: Sink | None = None,
        focus: set[str] | None = None,
        lazy: bool = False,
        anchored: frozenset[int] = frozenset(),
    ) -> Run:
        """``defn`` executed under ``case`` (see :class:`Run`); with ``focus``, only what may change those names
        and attribute paths; ``lazy``, without evaluating helpers whose results only tests read."""
        run = Run(self.follower, case, sink, lazy=lazy)
        return run.start(defn, bind=bind, self_value=self_value, given=given, focus=focus, anchored=anchored)


def unknowns(run: Run) -> list[str]:
    """The unknowns a run met where they touch what it tracks: "unknown: <construct> at <file:function:line>"."""
    return [f"unknown: {e.text}" for e in run.of("unknown")]


# -- iterators ---------------------------------------------------------------------------------------------------
@dataclass
class Flow:
    """Where the weights given to a function go: the sinks they reach (and in what state), what held them whole,
    what could not be read, the generators they went through."""

    arrivals: list[tuple[Event, Stream]] = field(default_factory=list)
    holds: list[Event] = field(default_factory=list)
    unknown: list[Event] = field(default_factory=list)
    generators: list[Where] = field(default_factory=list)

    @property
    def streams(self) -> bool:
        """The weights reach a sink one at a time on every path: nothing holds them, nothing is unknown."""
        return (
            bool(self.arrivals)
            and not self.holds
            and not self.unknown
            and all(s.state == "lazy" for _, s in self.arrivals)
        )

    def through(self) -> list[str]:
        """vLLM functions and constructs the weights passed on the way to the sink, in order."""
        steps: list[str] = []
        for _, stream in self.arrivals:
            steps += [s for s in stream.via if s not in steps]
        return steps

    def defect(self) -> str | None:
        """Why the weights do not stream: what holds them, else the first unknown, else no sink reached."""
        if self.holds:
            return f"the weights are held whole: {self.holds[0].text}"
        if self.unknown:
            return f"unknown: {self.unknown[0].text}"
        if not self.arrivals:
            return "the weights reach no loader"
        return None


def flows_into(
    ev: Evaluator, start: Definition, param: str, sink: Callable[[ast.Call], bool], self_value: V | None = None
) -> Flow:
    """Follow the iterator ``start`` takes as ``param`` through every construct and call to the calls ``sink``
    accepts (never followed), by the iterator table."""

    def is_sink(call: ast.Call, args: list[V]) -> bool:
        return sink(call) and any(isinstance(o, Stream) for a in args for o in options(a))

    key = ("flows_into", id(start.node), param, id(self_value.cls.node) if isinstance(self_value, Inst) else None)
    run = ev.ctx.memo(key, lambda: ev.run(start, given={param: Stream("lazy")}, self_value=self_value, sink=is_sink))
    flow = Flow(holds=run.of("holds"), unknown=run.of("unknown"), generators=list(run.generators))  # type: ignore
    for event in run.of("sink"):  # type: ignore[union-attr]
        arriving = [o for a in event.value.items for o in options(a) if isinstance(o, Stream)]  # type: ignore
        flow.arrivals.append((event, arriving[0]))
    return flow


def yields_as_they_arrive(ev: Evaluator, generator: Where, case: Case) -> bool:
    """Whether ``generator`` (a generator the weights go through) yields the first item of ``case`` inside its
    loop over the weights, before taking the next one."""
    defn = generator.defn
    params = [a.arg for a in defn.node.args.args]  # type: ignore[union-attr]
    if defn.owner is not None:
        params = params[1:]
    for param in params:
        run = ev.run(defn, case, given={param: Stream("lazy")})
        loop = run.item_loop
        if loop is None:
            continue
        inside = {id(n) for n in ast.walk(loop)}
        if any(e.reach is Reach.YES and id(e.where.node) in inside for e in run.of("yield")):
            return True
    return False


# -- calls and conditions ----------------------------------------------------------------------------------------
@dataclass
class Guard:
    """Whether a sink call runs only in the cases it should: each case's run, with the sink calls it reached and
    the unknowns it met."""

    runs: dict[Case, Run]
    allowed: tuple[Case, ...]
    forbidden: tuple[Case, ...]

    def sites(self, case: Case) -> list[Event]:
        return [e for e in self.runs[case].of("sink") if e.reach is not Reach.NO]

    @property
    def proven(self) -> bool:
        """Reached in an allowed case, in no forbidden one, and nothing unknown met in a forbidden one."""
        return (
            any(self.sites(c) for c in self.allowed)
            and not any(self.sites(c) for c in self.forbidden)
            and not any(unknowns(self.runs[c]) for c in self.forbidden)
        )

    def deciding(self, frames: list[Definition]) -> list[ast.Compare]:
        """The comparisons whose value tells the first allowed case from the first forbidden one (``wo_a.weight.dtype
        == torch.float8_e4m3fn``: true for FP8, false for BF16): those made in ``frames`` first, in source order,
        then those of the helpers they called."""
        allowed, forbidden = self.runs[self.allowed[0]], self.runs[self.forbidden[0]]
        nodes = {id(n) for defn in frames for n in ast.walk(defn.node)}  # type: ignore[arg-type]
        found = []
        for key, (node, value) in allowed.compared.items():
            other = forbidden.compared.get(key)
            if other is not None and truth(value) is not None and truth(other[1]) is not None:
                if truth(value) != truth(other[1]):
                    found.append(node)
        return sorted(found, key=lambda n: (id(n) not in nodes, n.lineno, n.col_offset))

    def failure(self) -> str:
        """Why the guard is not proven: a forbidden case reaching the sink, an unknown met there, or no allowed
        case reaching it."""
        for case in self.forbidden:
            reached = self.sites(case)
            if reached:
                site = reached[0]
                how = "may reach" if site.reach is Reach.MAYBE else "reaches"
                return f"{site.where.names()} {how} {site.text.split('(')[0]} (line {site.where.line}) for {case}"
            found = unknowns(self.runs[case])
            if found:
                return found[0]
        return f"no case of {', '.join(map(str, self.allowed))} reaches it"

    def unknown_tests(self, case: Case, frames: list[Definition]) -> list[str]:
        """The comparisons in ``frames`` whose value is unknown under ``case``."""
        nodes = {id(n) for defn in frames for n in ast.walk(defn.node)}  # type: ignore[arg-type]
        return [v.why for k, (_n, v) in self.runs[case].compared.items() if k in nodes and isinstance(v, Unknown)]


def path_frames(site: Event) -> list[Definition]:
    """The functions on the way to a site, the site's own first."""
    return [site.where.defn, *(h.caller for h in reversed(site.where.path))]


def guarded_by(
    ev: Evaluator,
    start: Definition,
    sink: Sink,
    allowed: tuple[Case, ...],
    forbidden: tuple[Case, ...],
    bind: dict[str, str] | None = None,
    self_value: V | None = None,
) -> Guard:
    """Run ``start`` under each case: the sink must be reached in the ``allowed`` ones only."""
    runs = {}
    binding = tuple(sorted((bind or {}).items()))
    for case in (*allowed, *forbidden):
        key = ("guarded_by", id(start.node), case, binding, sink, self_value)
        runs[case] = ev.ctx.memo(
            key, lambda case=case: ev.run(start, case, bind=bind, self_value=self_value, sink=sink)
        )
    return Guard(runs, allowed, forbidden)  # type: ignore[arg-type]


def reaches_call(ev: Evaluator, start: Definition, self_class: Definition, name: str, depth: int = 2):
    """The first call of a method called ``name`` reachable from ``start`` through calls on ``self`` (the
    facility's walk), as (path, call); None when none is."""

    def on_self(_frame, call: ast.Call) -> bool:
        return ast.unparse(call.func).startswith("self.")

    for path in ev.follower.walk(ev.follower.frame(start, self_class), depth, follow=on_self):
        for call in calls_in(path.frame.node):
            if isinstance(call.func, ast.Attribute) and call.func.attr == name:
                return path, call
    return None


# -- objects -----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Created:
    """What ``__init__`` leaves in an attribute under a case: ``reach`` YES (on every path), MAYBE (on some) or
    NO, with the value."""

    reach: Reach
    value: V
    case: Case

    def where(self) -> str:
        made = [o.where for o in options(self.value) if isinstance(o, Made) and o.where]
        return made[0] if made else ""


def creates(ev: Evaluator, cls: Definition, attr: str, case: Case, what: Callable[[V], bool] | None = None) -> Created:
    """Whether an instance of ``cls`` has ``attr`` (a path: ``gate.bias_vl``) once built under ``case``: made by
    ``x.a = ...``, ``setattr(x, "a", ...)``, ``x.register_parameter("a", ...)``, in ``__init__``, a method it
    calls, a base's ``__init__`` through ``super()`` (mixins in other modules included). ``what`` says which
    values count (default: a ``torch.nn.Parameter``)."""
    init = ev.follower.method(cls, "__init__")
    if init is None:
        return Created(Reach.NO, Unknown(f"{cls.qualname} has no __init__"), case)
    run = ev.ctx.memo(
        ("creates", id(cls.node), case, attr),
        lambda: ev.run(init, case, self_value=Inst(cls, watched=True), focus={f"self.{attr}"}),
    )
    value = run.force(run.exit.get(f"self.{attr}", NONE))  # type: ignore[union-attr]
    accept = what or (lambda v: isinstance(v, Made) and v.kind == "torch.nn.Parameter")
    found = [accept(run.force(o)) for o in options(value)]  # type: ignore[union-attr]
    reach = Reach.YES if all(found) else Reach.NO if not any(found) else Reach.MAYBE
    return Created(reach, value, case)


def attribute_value(ev: Evaluator, cls: Definition, name: str, case: Case = ANY) -> V:
    """What ``self.<name>`` holds once an instance of ``cls`` is built under ``case``: what ``__init__`` (and what
    it calls) leaves there, else the class attribute (evaluated: a factory's result is run)."""
    init = ev.follower.method(cls, "__init__")
    run = ev.ctx.memo(
        ("creates", id(cls.node), case, name),
        lambda: ev.run(init, case, self_value=Inst(cls, watched=True), focus={f"self.{name}"}),
    )
    written = run.force(run.exit.get(f"self.{name}", UNSET)) if init is not None else UNSET  # type: ignore[union-attr]
    default = run.class_value(cls, name) or Unknown(f"{cls.qualname}.{name}")  # type: ignore[union-attr]
    return one_of(*(default if o == UNSET else o for o in options(written)))


def built_with(ev: Evaluator, cls: Definition, attr: str, case: Case) -> list[dict[str, V]]:
    """The keyword arguments of the calls that built what ``self.<attr>`` holds once an instance of ``cls`` is
    built under ``case`` (one per class it may be)."""
    init = ev.follower.method(cls, "__init__")
    if init is None:
        return []
    run = ev.ctx.memo(
        ("creates", id(cls.node), case, attr),
        lambda: ev.run(init, case, self_value=Inst(cls, watched=True), focus={f"self.{attr}"}),
    )
    value = run.force(run.exit.get(f"self.{attr}", NONE))  # type: ignore[union-attr]
    calls = [o.made for o in options(value) if isinstance(o, Inst) and o.made is not None]
    calls += [e for e in run.sources.get(f"self.{attr}", []) if isinstance(e, ast.Call)]  # type: ignore[union-attr]
    found = {id(c): run.built[id(c)] for c in calls if id(c) in run.built}  # type: ignore[union-attr]
    return list(found.values())


def is_module(value: V) -> bool:
    """An instance of a vLLM class (a module), not None."""
    return isinstance(value, Inst)


# -- values ------------------------------------------------------------------------------------------------------
def value_at_exit(ev: Evaluator, start: Definition, name: str, case: Case, **run_args) -> V:
    """What the local ``name`` holds when ``start`` returns, under ``case``."""
    run = ev.run(start, case, **run_args)
    return run.force(run.exit.get(name, NONE))


def mappings_iterated(ev: Evaluator, start: Definition, width: int, case: Case = ANY) -> list[V]:
    """What the loops of ``start`` that unpack ``width`` names at a time (``for a, b, c in mapping``) iterate, as
    they see it: the mapping as the code builds it before them (displays, ``+=``, ``.extend``, helpers whose
    results it adds, evaluated; an entry added after a loop is not one it loads with)."""
    loops = [
        node
        for node in ast.walk(start.node)  # type: ignore[arg-type]
        if isinstance(node, (ast.For, ast.AsyncFor))
        and isinstance(node.target, ast.Tuple)
        and len(node.target.elts) == width
        and isinstance(node.iter, ast.Name)
    ]
    if not loops:
        return []
    names = {loop.iter.id for loop in loops}  # type: ignore[attr-defined]
    anchored = frozenset(id(s) for s in ast.walk(start.node) if isinstance(s, ast.stmt) and any(  # type: ignore
        loop is n for loop in loops for n in ast.walk(s)))  # fmt: skip
    run = ev.run(start, case, focus=names, anchored=anchored)
    return [run.force(run.iterated[id(loop)], final=True) for loop in loops if id(loop) in run.iterated]


def settings_read(ev: Evaluator, start: Definition) -> dict[str, bool]:
    """The settings ``start`` reads (through the calls it makes, their results evaluated): name -> whether it is a
    ``vllm.envs`` one."""
    run = ev.run(start)
    for value in run.exit.values():
        run.force(value)
    return dict(run.settings_read)


def passes_over(ev: Evaluator, start: Definition, param: str, case: Case) -> bool:
    """Whether the loop of ``start`` over ``param`` (the weights) goes on to the next item, definitely, when the
    item is the case's: a ``continue`` reached in its body before anything else is done with it."""
    run = ev.run(start, case, given={param: Stream("lazy")})
    loop = run.item_loop
    if loop is None:
        return False
    return any(
        isinstance(node, ast.Continue) and run.reach_of(node) is Reach.YES
        for stmt in loop.body  # type: ignore[attr-defined]
        for node in ast.walk(stmt)
        if not isinstance(node, (ast.For, ast.While))
    )


def constant_strings(value: V) -> list[tuple[object, ...]]:
    """The tuples of constants a value holds (a mapping's entries), each as Python values."""
    found = []
    for option in options(value):
        items = option.items if isinstance(option, Seq) else (option.item,) if hasattr(option, "item") else ()
        for item in items:
            for entry in options(item):
                if isinstance(entry, Seq) and all(isinstance(e, Const) for e in entry.items):
                    found.append(tuple(e.value for e in entry.items))  # type: ignore[attr-defined]
    return found


__all__ = [
    "Created",
    "Evaluator",
    "Flow",
    "Guard",
    "Raises",
    "attribute_value",
    "built_with",
    "creates",
    "flows_into",
    "guarded_by",
    "is_generator",
    "is_module",
    "is_none",
    "mappings_iterated",
    "passes_over",
    "reaches_call",
    "settings_read",
    "path_frames",
    "unknowns",
    "value_at_exit",
    "yields_as_they_arrive",
]
