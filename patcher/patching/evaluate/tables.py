"""Python's semantics the evaluator reads code by: what each construct does to an iterator, and where a user's
settings come from. The tables are the module docstring of :mod:`patch_dsv4.patching.evaluate`, written out."""

from __future__ import annotations

LAZY = "lazy"  # takes one item at a time, as it is asked for
HOLDS = "holds"  # takes every item (or reorders them) before it gives the first
UNKNOWN = "unknown"

#: What a call of another package's function does to an iterator passed to it (by the function's dotted origin).
#: Anything else is unknown; a function of vLLM's is followed instead.
ITERATORS: dict[str, str] = {
    # lazy: items pass one at a time
    **dict.fromkeys(
        (
            "builtins.map",
            "builtins.filter",
            "builtins.zip",
            "builtins.enumerate",
            "builtins.iter",
            "itertools.chain",
            "itertools.chain.from_iterable",
            "itertools.islice",
            "itertools.takewhile",
            "itertools.dropwhile",
            "itertools.filterfalse",
            "itertools.compress",
            "itertools.starmap",
            "itertools.accumulate",
            "itertools.pairwise",
            "itertools.batched",
            "itertools.groupby",
            "itertools.zip_longest",
            "heapq.merge",
        ),
        LAZY,
    ),
    # holds every item: containers, sorting, and the itertools that keep what they have seen
    **dict.fromkeys(
        (
            "builtins.list",
            "builtins.tuple",
            "builtins.set",
            "builtins.frozenset",
            "builtins.dict",
            "builtins.sorted",
            "builtins.bytes",
            "builtins.bytearray",
            "collections.deque",
            "collections.Counter",
            "collections.OrderedDict",
            "collections.defaultdict",
            "collections.ChainMap",
            "collections.UserList",
            "collections.UserDict",
            "heapq.heapify",
            "heapq.nlargest",
            "heapq.nsmallest",
            "itertools.tee",  # beyond its buffer: one branch read to the end holds every item for the other
            "itertools.cycle",
            "itertools.product",
            "itertools.permutations",
            "itertools.combinations",
            "itertools.combinations_with_replacement",
        ),
        HOLDS,
    ),
}

#: Methods that hold every item of the iterator they are given (``"".join(x)``, ``held.extend(x)``) or of the
#: list they are called on (``held.sort()``).
HOLDING_METHODS = frozenset({"join", "extend", "sort", "update", "__init__"})

#: ``reversed`` takes a sequence (``__reversed__``, or ``__len__`` and ``__getitem__``); given an iterator it
#: raises TypeError: never a stream, never the fix.
REJECTS = {"builtins.reversed": "reversed() of an iterator raises TypeError"}

#: Where a user's settings are read: an attribute of these modules, or these calls and mappings.
SETTINGS_MODULES = frozenset({"vllm.envs"})
SETTINGS_UNBOUND = frozenset({"envs"})  # a snippet that leaves ``from vllm import envs`` out
SETTINGS_CALLS = frozenset({"os.getenv", "os.environ.get"})
SETTINGS_MAPPINGS = frozenset({"os.environ"})

#: Objects another package builds, kept as what they are (``Made``): parameters and CUDA streams (``nn`` and
#: ``torch`` unbound: a snippet that leaves its imports out).
BUILDERS = {
    "torch.nn.Parameter": "torch.nn.Parameter",
    "torch.nn.parameter.Parameter": "torch.nn.Parameter",
    "nn.Parameter": "torch.nn.Parameter",
    "torch.cuda.Stream": "torch.cuda.Stream",
}
