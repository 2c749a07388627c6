"""The evaluator: what vLLM's code does, under the cases a patch names, read without importing it.

A probe states its defect and its fix as a few predicates over three kinds of answer. Unknown is an answer too:
it names the construct and its ``file:function:line``, and a predicate that meets one proves nothing (never
``upstream``).

Iterators: what a construct does to an iterator it is given (``tables.ITERATORS``)
    lazy        generator expressions; generator functions that yield inside their loop over it; ``yield from``;
                ``map``, ``filter``, ``zip``, ``enumerate``, ``iter``; itertools' ``chain`` (and
                ``from_iterable``), ``islice``, ``takewhile``, ``dropwhile``, ``filterfalse``, ``compress``,
                ``starmap``, ``accumulate``, ``pairwise``, ``batched``, ``groupby``, ``zip_longest``;
                ``heapq.merge``; ``functools.partial`` of any of these, or of a vLLM function (followed)
    holds all   ``list``, ``tuple``, ``set``, ``frozenset``, ``dict``, ``sorted``, ``bytes``, ``bytearray``;
                starred displays and unpacking (``[*x]``, ``(*x,)``, ``{**x}``, ``a, *b = x``, ``f(*x)``);
                list, set and dict comprehensions; ``collections``' ``deque``, ``Counter``, ``OrderedDict``,
                ``defaultdict``, ``ChainMap``, ``UserList``, ``UserDict``; ``heapq.heapify``, ``nlargest``,
                ``nsmallest``; ``.sort()``, ``.extend(x)``, ``"".join(x)``; ``itertools.tee`` (beyond its
                buffer), ``cycle``, ``product``, ``permutations``, ``combinations``; a loop that takes every
                item before its function yields one (or returns)
    unknown     anything else: another package's function, a call nobody can follow, ``x[i]`` of an iterator,
                ``reversed(x)`` (an iterator has no ``__reversed__``: TypeError), ``sum``/``any``/``next``...
    A call of vLLM's code is followed (``follow.Follower``) and judged by what its body does.

Conditions: a test is true, false or unknown under a case (``cases``)
    ``==``, ``!=``, ``is``, ``is not``, ``<``..., ``in``/``not in`` over literal containers, ``not``, ``and``/
    ``or``; local flags (``use_fp8 = ...; if use_fp8``); early returns, ``raise``, ``continue``, ``break``;
    ``getattr(x, "a", default)``, ``hasattr``, ``isinstance`` (through the MRO); a helper's return value (the
    helper run under the same case); string methods on constants; settings (``vllm.envs``, ``os.environ``,
    ``os.getenv``). An attribute the case's object lacks raises (``wo_a.weight`` of EXL3).
    Cases:
    wo_a BF16, wo_a FP8                 ``wo_a.weight.dtype`` is ``torch.bfloat16`` / ``torch.float8_e4m3fn``
    wo_a EXL3 (no .weight)              ``wo_a.weight`` raises; ``wo_a._exl3_linears`` holds LinearEXL3s
    a (non-)hash MoE layer of a         ``vllm_config.model_config.hf_config``: ``vision_n_layers`` 27 (vision) or
      vision / text checkpoint            0, ``topk_method`` "noaux_tc", ``num_hash_layers`` 3; ``prefix``
                                          ``model.layers.0.ffn`` (hash) or ``model.layers.10.ffn``, and
                                          ``extract_layer_index`` gives 0 or 10
    a vision checkpoint, images on      the same config; ``multimodal_config.get_limit_per_prompt`` gives 1
    an EXL3 linear / pack               no ``.weight``, its shards, its ``quant_method``; the pack's quant config
                                          names itself "exl3"
    a weight named N                    a loop over the weights takes ``(N, tensor)`` first
    settings on and off                 every setting read: unset, "0" or "1" (``vllm.envs``: False, True)

Objects: what an instance has once built
    attributes and parameters made by ``x.a = ...``, ``setattr(x, "a", ...)``, ``x.register_parameter("a", ...)``
    (in ``__init__``, a method it calls, a base's ``__init__`` through ``super()``), read back through ``x.a`` or
    ``getattr(x, "a")``; methods found through the MRO (mixins in other modules) and ``super()``; a dataclass
    field's default where the call that built the instance passed none.

Predicates (``predicates``)
    ``flows_into(ev, start, param, sink)``          where the weights go, and in what state
    ``yields_as_they_arrive(ev, generator, case)``  a generator yields the case's item before taking the next
    ``guarded_by(ev, start, sink, allowed, forbidden, bind)``  a sink reached in the allowed cases only
    ``creates(ev, cls, "gate.bias_vl", case)``       what ``__init__`` leaves in an attribute (a parameter?)
    ``attribute_value(ev, cls, name, case)``        ``self.<name>`` once built (``__init__``, else the class's)
    ``built_with(ev, cls, name, case)``             the arguments of the calls that built ``self.<name>``
    ``passes_over(ev, start, param, case)``         a loader's loop skips the case's item
    ``mappings_iterated(ev, start, width)``         what its ``for a, b, c in mapping`` loops iterate, as built
    ``value_at_exit(ev, start, name, case)``, ``settings_read(ev, start)``, ``reaches_call(...)``

Only probes import this package: verify's fast path and the guard never do.
"""

from patch_dsv4.patching.evaluate import cases
from patch_dsv4.patching.evaluate.focus import callee
from patch_dsv4.patching.evaluate.predicates import (
    Created,
    Evaluator,
    Flow,
    Guard,
    attribute_value,
    built_with,
    creates,
    flows_into,
    guarded_by,
    is_module,
    mappings_iterated,
    passes_over,
    reaches_call,
    settings_read,
    unknowns,
    value_at_exit,
    yields_as_they_arrive,
)

__all__ = [
    "Created",
    "Evaluator",
    "Flow",
    "Guard",
    "attribute_value",
    "built_with",
    "callee",
    "cases",
    "creates",
    "flows_into",
    "guarded_by",
    "is_module",
    "mappings_iterated",
    "passes_over",
    "reaches_call",
    "settings_read",
    "unknowns",
    "value_at_exit",
    "yields_as_they_arrive",
]
