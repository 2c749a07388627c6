"""What the evaluator knows about a value, and Python's three-valued answers over it.

Every value is a frozen dataclass (hashable: results are memoized by their arguments). ``Unknown`` is a value like
any other: it says which construct, where, could not be evaluated, and that text reaches the verdict.
"""

from __future__ import annotations

import ast
import enum
from dataclasses import dataclass, field

from patch_dsv4.patching.follow import Definition


class Reach(enum.Enum):
    """Whether a statement or call runs: in every execution under the case, in none, or in some."""

    YES = "yes"
    NO = "no"
    MAYBE = "maybe"

    def when(self, truth: bool | None) -> Reach:
        """This reach, narrowed by a test that is ``truth`` (None: unknown)."""
        if self is Reach.NO or truth is False:
            return Reach.NO
        if self is Reach.YES and truth is True:
            return Reach.YES
        return Reach.MAYBE

    def also(self, other: Reach) -> Reach:
        """Reached on one path or the other (the join after an ``if``)."""
        if Reach.YES in (self, other):
            return Reach.YES
        if self is other is Reach.NO:
            return Reach.NO
        return Reach.MAYBE

    def then(self, other: Reach) -> Reach:
        """Reached here and, from here, there (a call path)."""
        if Reach.NO in (self, other):
            return Reach.NO
        if self is other is Reach.YES:
            return Reach.YES
        return Reach.MAYBE


class V:
    """Base of every value."""

    tracked = False  # carries what the question is about (a stream, a case's object): calls with it are followed


@dataclass(frozen=True)
class Const(V):
    """A scalar Python constant (None, bool, int, float, str, bytes). ``src`` is the test that computed it."""

    value: object
    src: ast.AST | None = field(default=None, compare=False, hash=False)


@dataclass(frozen=True)
class Ext(V):
    """An object of another package, by its dotted name: ``torch.float8_e4m3fn``, ``builtins.sorted``, ``os``."""

    name: str


@dataclass(frozen=True)
class Seq(V):
    """A list, tuple, set or dict display of known items (a dict's items are ``Seq("pair", (key, value))``)."""

    kind: str
    items: tuple[V, ...]
    where: object = field(default=None, compare=False, hash=False)  # the display that built it (a Where)

    @property
    def tracked(self) -> bool:  # type: ignore[override]
        return any(item.tracked for item in self.items)


@dataclass(frozen=True)
class Repeated(V):
    """A list of unknown length whose every item is ``item`` (a comprehension over an unknown count)."""

    kind: str
    item: V


@dataclass(frozen=True)
class Thing(V):
    """An object a case describes (``wo_a`` of an FP8 checkpoint, the model's config): its known attributes; a
    ``closed`` one has no other. ``truth`` is its truth value where known, ``returns`` what calling it gives. A
    ``foreign`` one is another package's object (a tensor): its methods never run vLLM's code."""

    what: str
    attrs: tuple[tuple[str, V], ...] = ()
    closed: bool = False
    truth: bool | None = None
    returns: V | None = None
    foreign: bool = False
    tracked = True

    def attr(self, name: str) -> V:
        for key, value in self.attrs:
            if key == name:
                return value
        return MISSING if self.closed else Thing(f"{self.what}.{name}", foreign=self.foreign)


@dataclass(frozen=True)
class Inst(V):
    """An instance of one of vLLM's classes. ``attrs``: attributes known to hold a value (assigned, or set by the
    question: ``self.wo_a`` is the case's ``wo_a``); ``made``: the call that built it; ``watched``: its attributes
    are what the question is about (a constructor's ``self``)."""

    cls: Definition
    attrs: tuple[tuple[str, V], ...] = ()
    made: ast.Call | None = field(default=None, compare=False, hash=False)
    watched: bool = False
    closed: bool = False  # it has no attribute its class (vLLM's code) never sets: reading one raises

    @property
    def tracked(self) -> bool:  # type: ignore[override]
        return self.watched or any(value.tracked for _, value in self.attrs)

    def known(self, name: str) -> V | None:
        for key, value in self.attrs:
            if key == name:
                return value
        return None


@dataclass(frozen=True)
class Def(V):
    """A function, class or module of vLLM; ``bound``: the receiver of a bound method; ``partial``: arguments
    ``functools.partial`` put in front."""

    defn: Definition
    bound: V | None = None
    partial: tuple[V, ...] = ()

    @property
    def tracked(self) -> bool:  # type: ignore[override]
        return bool(self.bound is not None and self.bound.tracked) or any(p.tracked for p in self.partial)


@dataclass(frozen=True)
class Closure(V):
    """A function defined inside the function being evaluated."""

    node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda
    outer: Definition


@dataclass(frozen=True)
class Made(V):
    """An object built by another package's code: ``torch.nn.Parameter``, ``torch.cuda.Stream``, or a list of
    them (``kind`` "list of torch.cuda.Stream"), with where it was made."""

    kind: str
    where: str = field(default="", compare=False, hash=False)


@dataclass(frozen=True)
class Stream(V):
    """An iterator over the weights a question follows. ``state``: "lazy" (items pass one at a time), "holds"
    (every item is held, or reordered, at once) or "unknown"; ``via``: what it went through."""

    state: str
    via: tuple[str, ...] = ()
    tracked = True


@dataclass(frozen=True)
class Setting(V):
    """A value a user sets (an environment variable, ``vllm.envs``): ``name``; ``default`` where the code gives one."""

    name: str
    default: V | None = None


@dataclass(frozen=True)
class Unknown(V):
    """What could not be evaluated: the construct and where it is."""

    why: str


@dataclass(frozen=True)
class Raises(V):
    """Evaluating it raises: reading an attribute the object lacks (``why`` says which, where); ``told``: an event
    already says so (a callee's, raised on through its caller)."""

    why: str
    told: bool = field(default=False, compare=False, hash=False)


@dataclass(frozen=True)
class OneOf(V):
    """One of several values, by the path taken (branches whose test is unknown under the case)."""

    options: tuple[V, ...]

    @property
    def tracked(self) -> bool:  # type: ignore[override]
        return any(o.tracked for o in self.options)


class _Missing(V):
    """An attribute the object does not have (reading it raises AttributeError)."""

    def __repr__(self) -> str:
        return "MISSING"


MISSING = _Missing()
NONE = Const(None)
UNKNOWN = Unknown("unknown")
UNSET = Unknown("not set on every path")


def one_of(*values: V) -> V:
    """The join of ``values`` (equal ones once; a single one as itself)."""
    flat: list[V] = []
    for value in values:
        for option in value.options if isinstance(value, OneOf) else (value,):
            if option not in flat:
                flat.append(option)
    return flat[0] if len(flat) == 1 else OneOf(tuple(flat))


def options(value: V) -> tuple[V, ...]:
    return value.options if isinstance(value, OneOf) else (value,)


def is_none(value: V) -> bool:
    return isinstance(value, Const) and value.value is None


#: torch's dtypes: distinct objects, so two different names are never equal.
DTYPE_PREFIX = "torch."
DTYPES = frozenset(
    f"torch.{name}"
    for name in (
        "float8_e4m3fn",
        "float8_e4m3fnuz",
        "float8_e5m2",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
        "bfloat16",
        "float16",
        "half",
        "float32",
        "float",
        "float64",
        "int8",
        "uint8",
        "int32",
        "int64",
        "bool",
    )
)


def truth(value: V) -> bool | None:
    """``bool(value)`` where it is known (a Raises is handled by the caller)."""
    if isinstance(value, Const):
        try:
            return bool(value.value)
        except Exception:  # noqa: BLE001 - any constant whose truth fails is unknown
            return None
    if isinstance(value, Seq):
        return bool(value.items)
    if isinstance(value, (Ext, Def, Closure)):
        return True
    if isinstance(value, Thing):
        return value.truth
    if isinstance(value, OneOf):
        found = {truth(o) for o in value.options}
        return found.pop() if len(found) == 1 else None
    return None


def _non_none(value: V) -> bool:
    """Whether the value is an object that is certainly not None."""
    return isinstance(value, (Ext, Def, Closure, Seq, Repeated, Made, Stream, Inst)) or (
        isinstance(value, Thing) and value.truth is not False
    )


def equal(left: V, right: V) -> bool | None:
    """``left == right`` where it is known."""
    if isinstance(left, OneOf) or isinstance(right, OneOf):
        found = {equal(a, b) for a in options(left) for b in options(right)}
        return found.pop() if len(found) == 1 else None
    if isinstance(left, Const) and isinstance(right, Const):
        return left.value == right.value
    if isinstance(left, Ext) and isinstance(right, Ext):
        if left.name == right.name:
            return True
        return False if left.name in DTYPES and right.name in DTYPES else None
    if is_none(left) and _non_none(right) or is_none(right) and _non_none(left):
        return False
    if isinstance(left, Seq) and isinstance(right, Seq) and left.kind == right.kind:
        if len(left.items) != len(right.items):
            return False
        found = {equal(a, b) for a, b in zip(left.items, right.items, strict=True)}
        return False if False in found else (True if found <= {True} else None)
    return None


def identical(left: V, right: V) -> bool | None:
    """``left is right`` where it is known (None, True, False and dtypes are singletons)."""
    if isinstance(left, OneOf) or isinstance(right, OneOf):
        found = {identical(a, b) for a in options(left) for b in options(right)}
        return found.pop() if len(found) == 1 else None
    if isinstance(left, Const) and isinstance(right, Const):
        if left.value is None or right.value is None or isinstance(left.value, bool):
            return left.value is right.value
        return None
    if isinstance(left, Ext) and isinstance(right, Ext):
        return equal(left, right)
    if is_none(left) and _non_none(right) or is_none(right) and _non_none(left):
        return False
    return None


def contains(container: V, item: V) -> bool | None:
    """``item in container`` over a display or a constant string, where it is known."""
    if isinstance(container, OneOf):
        found = {contains(c, item) for c in container.options}
        return found.pop() if len(found) == 1 else None
    if isinstance(container, Const) and isinstance(container.value, str) and isinstance(item, Const):
        return item.value in container.value if isinstance(item.value, str) else None
    if isinstance(container, Seq):
        keys = (
            [i.items[0] for i in container.items if isinstance(i, Seq)] if container.kind == "dict" else container.items
        )
        found = [equal(key, item) for key in keys]
        if True in found:
            return True
        return False if all(f is False for f in found) else None
    return None


def describe(value: V) -> str:
    """A short human text for a value, for evidence."""
    if isinstance(value, Const):
        return repr(value.value)
    if isinstance(value, Ext):
        return value.name
    if isinstance(value, (Made, Thing)):
        return value.kind if isinstance(value, Made) else value.what
    if isinstance(value, Inst):
        return f"a {value.cls.qualname}"
    if isinstance(value, Stream):
        return f"the weights ({value.state})"
    if isinstance(value, Setting):
        return value.name
    if isinstance(value, (Unknown, Raises)):
        return value.why
    if isinstance(value, OneOf):
        return " or ".join(describe(o) for o in value.options)
    if isinstance(value, Seq):
        return f"a {value.kind} of {len(value.items)}"
    return type(value).__name__
