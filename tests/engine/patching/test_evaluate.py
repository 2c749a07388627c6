"""The evaluator (patcher/patching/evaluate) on small trees written here: every row of its iterator table, its
conditions under the cases, the objects it builds, and the unknowns it names."""

from __future__ import annotations

import ast
import textwrap

import pytest

from patch_dsv4.patching.evaluate import (
    Evaluator,
    cases,
    creates,
    flows_into,
    guarded_by,
    passes_over,
    value_at_exit,
    yields_as_they_arrive,
)
from patch_dsv4.patching.evaluate.values import Const, Inst, Reach, is_none
from patch_dsv4.patching.patch import Context

PKG = "vllm/models/toy"
MODEL = f"{PKG}/model.py"
HELPERS = f"{PKG}/helpers.py"


def _evaluator(model: str, helpers: str = "") -> Evaluator:
    return Evaluator.of(Context.from_texts({MODEL: textwrap.dedent(model), HELPERS: textwrap.dedent(helpers)}))


# -- iterators ---------------------------------------------------------------------------------------------------
def _loader(body: str, imports: str = "") -> str:
    return f"""\
import collections
import functools
import heapq
import itertools
{imports}

class Vision:
    def load_weights(self, weights):
{textwrap.indent(textwrap.dedent(body), " " * 8)}"""


def _flow(body: str, imports: str = "", helpers: str = ""):
    ev = _evaluator(_loader(body, imports), helpers)
    start = ev.follower.function(MODEL, "Vision", "load_weights")

    def loader(call: ast.Call) -> bool:
        return isinstance(call.func, ast.Attribute) and call.func.attr == "load_weights"

    return flows_into(ev, start, "weights", loader)


LOAD = "return self.loader.load_weights({})"
#: expression over ``weights`` -> what it does to the iterator
ITERATORS = {
    "weights": "lazy",
    "(w for w in weights)": "lazy",
    "map(str, weights)": "lazy",
    "filter(None, weights)": "lazy",
    "zip(weights, weights)": "lazy",
    "enumerate(weights)": "lazy",
    "iter(weights)": "lazy",
    "itertools.chain(weights)": "lazy",
    "itertools.chain.from_iterable([weights])": "unknown",  # a list holding the iterator: its items are unknown
    "itertools.islice(weights, 10)": "lazy",
    "itertools.takewhile(bool, weights)": "lazy",
    "itertools.dropwhile(bool, weights)": "lazy",
    "itertools.filterfalse(bool, weights)": "lazy",
    "itertools.starmap(max, weights)": "lazy",
    "itertools.pairwise(weights)": "lazy",
    "heapq.merge(weights)": "lazy",
    "functools.partial(map, str)(weights)": "lazy",
    "list(weights)": "holds",
    "tuple(weights)": "holds",
    "set(weights)": "holds",
    "frozenset(weights)": "holds",
    "dict(weights)": "holds",
    "sorted(weights)": "holds",
    "[*weights]": "holds",
    "(*weights,)": "holds",
    "{*weights}": "holds",
    "[w for w in weights]": "holds",
    "{w for w in weights}": "holds",
    "{k: v for k, v in weights}": "holds",
    "collections.deque(weights)": "holds",
    "collections.Counter(weights)": "holds",
    "collections.OrderedDict(weights)": "holds",
    "heapq.nsmallest(3, weights)": "holds",
    "itertools.tee(weights)[0]": "holds",
    "itertools.cycle(weights)": "holds",
    "itertools.product(weights)": "holds",
    "reversed(weights)": "unknown",  # an iterator has no __reversed__: TypeError
    "sum(weights)": "unknown",
    "weights[0]": "unknown",
    "some_package.transform(weights)": "unknown",
}


@pytest.mark.parametrize("expr", list(ITERATORS))
def test_iterator_table(expr):
    imports = "import some_package\n" if "some_package" in expr else ""
    flow = _flow(LOAD.format(expr), imports)
    want = ITERATORS[expr]
    if want == "lazy":
        assert flow.streams, flow.defect()
    elif want == "holds":
        assert flow.holds and not flow.streams, flow.defect()
    else:
        assert not flow.holds and not flow.streams, flow.defect()
        assert flow.defect().startswith("unknown: ") or flow.defect() == "the weights reach no loader"


@pytest.mark.parametrize(
    ("statements", "held"),
    [
        ("held = list(weights)\n" + LOAD.format("iter(held)"), "list()"),
        ("first, *rest = weights\n" + LOAD.format("rest"), "first, *rest = weights unpacks every item"),
        ("held = []\nheld.extend(weights)\n" + LOAD.format("held"), "held.extend()"),
        ("held = []\nheld += weights\n" + LOAD.format("held"), "held += weights"),
        ("return self.loader.load_weights(*weights)", "self.loader.load_weights(*weights) unpacks every item (*)"),
    ],
    ids=["a name bound to a list", "starred unpacking", "extend", "augmented assignment", "f(*x)"],
)
def test_statements_that_hold_the_stream(statements, held):
    flow = _flow(statements)
    assert not flow.streams and flow.holds[0].text.startswith(held), [h.text for h in flow.holds]


def test_helpers_are_followed_and_named():
    helpers = """\
    def lazily(stream):
        for item in stream:
            yield item


    def eagerly(stream):
        kept = []
        for item in stream:
            kept.append(item)
        yield from kept
    """
    imports = "from vllm.models.toy.helpers import eagerly, lazily\n"
    lazy = _flow(LOAD.format("lazily(weights)"), imports, helpers)
    assert lazy.streams and lazy.through() == ["lazily"]
    eager = _flow(LOAD.format("eagerly(weights)"), imports, helpers)
    assert eager.holds[0].text == f"eagerly takes every item of the weights before it yields one ({HELPERS}:eagerly:8)"


def test_a_generator_yielding_as_it_arrives():
    helpers = """\
    def language_model_first(stream):
        rest = []
        for name, tensor in stream:
            if name.startswith("language_model."):
                yield name, tensor
            else:
                rest.append((name, tensor))
        yield from rest


    def vision_first(stream):
        rest = []
        for name, tensor in stream:
            if name.startswith("vision."):
                yield name, tensor
            else:
                rest.append((name, tensor))
        yield from rest
    """
    imports = "from vllm.models.toy.helpers import language_model_first, vision_first\n"
    for helper, yields in (("language_model_first", True), ("vision_first", False)):
        flow = _flow(LOAD.format(f"{helper}(weights)"), imports, helpers)
        ev = _evaluator(_loader(LOAD.format(f"{helper}(weights)"), imports), helpers)
        (generator,) = flow.generators
        assert yields_as_they_arrive(ev, generator, cases.LANGUAGE_MODEL_WEIGHT) is yields, helper


def test_unknown_names_its_construct_and_line():
    flow = _flow(LOAD.format("self.reorder(weights)"))
    assert flow.defect() == f"unknown: self.reorder() at {MODEL}:Vision.load_weights:9"


# -- conditions --------------------------------------------------------------------------------------------------
ATTENTION = """\
import torch

from vllm.models.toy.helpers import is_fp8


class Attention:
    def __init__(self):
        self.wo_a = Linear()

    def _o_proj(self, x):
{body}


class Linear:
    pass
"""
HELPER = "def is_fp8(layer):\n    return layer.weight.dtype == torch.float8_e4m3fn\n"
#: body of _o_proj -> whether fp8_einsum runs for an FP8 wo_a only
CONDITIONS = {
    "==": ("if self.wo_a.weight.dtype == torch.float8_e4m3fn:\n    return fp8_einsum(x)\nreturn x", True),
    "!=": ("if self.wo_a.weight.dtype != torch.float8_e4m3fn:\n    return fp8_einsum(x)\nreturn x", False),
    "is": ("if self.wo_a.weight.dtype is torch.float8_e4m3fn:\n    return fp8_einsum(x)\nreturn x", True),
    "is not": ("if self.wo_a.weight.dtype is not torch.float8_e4m3fn:\n    return x\nreturn fp8_einsum(x)", True),
    "in": ("if self.wo_a.weight.dtype in (torch.float8_e4m3fn,):\n    return fp8_einsum(x)\nreturn x", True),
    "in, BF16 too": (
        "if self.wo_a.weight.dtype in {torch.float8_e4m3fn, torch.bfloat16}:\n    return fp8_einsum(x)\nreturn x",
        False,
    ),
    "not in": ("if self.wo_a.weight.dtype not in [torch.float8_e4m3fn]:\n    return x\nreturn fp8_einsum(x)", True),
    "not": ("if not self.wo_a.weight.dtype == torch.float8_e4m3fn:\n    return x\nreturn fp8_einsum(x)", True),
    "and, a flag": (
        "fp8 = self.wo_a.weight.dtype == torch.float8_e4m3fn\nif fp8 and x is not None:\n"
        "    return fp8_einsum(x)\nreturn x",
        True,
    ),
    "or": ("if self.wo_a.weight.dtype == torch.bfloat16 or x is None:\n    return x\nreturn fp8_einsum(x)", True),
    "or, BF16 may pass": (
        "if self.wo_a.weight.dtype == torch.float8_e4m3fn or x is not None:\n    return fp8_einsum(x)\nreturn x",
        False,  # x is unknown: for BF16 the test may still be true, and the GEMM runs
    ),
    "getattr with a default": (
        'weight = getattr(self.wo_a, "weight", None)\n'
        "if weight is not None and weight.dtype == torch.float8_e4m3fn:\n    return fp8_einsum(x)\nreturn x",
        True,
    ),
    "hasattr": (
        'if hasattr(self.wo_a, "weight") and self.wo_a.weight.dtype == torch.float8_e4m3fn:\n'
        "    return fp8_einsum(x)\nreturn x",
        True,
    ),
    "a helper's result": ("if is_fp8(self.wo_a):\n    return fp8_einsum(x)\nreturn x", True),
    "a helper, negated, early return": ("if not is_fp8(self.wo_a):\n    raise ValueError\nreturn fp8_einsum(x)", True),
    "no test": ("return fp8_einsum(x)", False),
}


def _gate(body: str):
    ev = _evaluator(ATTENTION.format(body=textwrap.indent(body, " " * 8)), HELPER)
    owner = ev.follower.class_def(MODEL, "Attention")
    start = ev.follower.method(owner, "_o_proj")

    def gemm(call: ast.Call, _args) -> bool:
        return ast.unparse(call.func) == "fp8_einsum"

    return guarded_by(ev, start, gemm, (cases.WO_A_FP8,), (cases.WO_A_BF16,), {"self.wo_a": "wo_a"}, Inst(owner))


@pytest.mark.parametrize("name", list(CONDITIONS))
def test_conditions_under_the_wo_a_cases(name):
    body, proven = CONDITIONS[name]
    guard = _gate(body)
    assert guard.proven is proven, guard.failure()


def test_exl3_wo_a_has_no_weight():
    """An EXL3 wo_a has no .weight: hasattr is false (the GEMM is not reached), reading it raises (named)."""

    def run(body: str):
        ev = _evaluator(ATTENTION.format(body=textwrap.indent(body, " " * 8)), HELPER)
        start = ev.follower.function(MODEL, "Attention", "_o_proj")
        return ev.run(
            start, cases.WO_A_EXL3, bind={"self.wo_a": "wo_a"}, sink=lambda call, _args: "fp8" in ast.unparse(call)
        )

    guarded = run(CONDITIONS["hasattr"][0])
    assert not [e for e in guarded.of("sink") if e.reach is not Reach.NO] and not guarded.of("raises")
    raw = run(CONDITIONS["=="][0])
    assert (
        raw.of("raises")[0].text == f"reads self.wo_a.weight (the Linear has no weight) at {MODEL}:Attention._o_proj:11"
    )


# -- objects -----------------------------------------------------------------------------------------------------
MOE = """\
import torch
from torch import nn

from vllm.models.toy.helpers import BiasMixin


class Gate:
    pass


class MoE(BiasMixin, nn.Module):
    def __init__(self, vllm_config, prefix, *, num_hash_layers):
        super().__init__()
        config = vllm_config.model_config.hf_config
        is_hash = extract_layer_index(prefix) < num_hash_layers
        self.gate = Gate()
        self.gate.bias_vl = None
{body}
"""
MIXIN = """\
import torch
from torch import nn


class BiasMixin:
    def make_bias(self):
        setattr(self.gate, "bias_vl", nn.Parameter(torch.empty(8)))
"""
#: __init__'s last lines -> whether gate.bias_vl is a parameter on every MoE layer of a vision checkpoint
OBJECTS = {
    "assigned": ("if config.vision_n_layers > 0:\n    self.gate.bias_vl = nn.Parameter(torch.empty(8))", True),
    "setattr": (
        'if config.vision_n_layers > 0:\n    setattr(self.gate, "bias_vl", nn.Parameter(torch.empty(8)))',
        True,
    ),
    "register_parameter": (
        'if config.vision_n_layers > 0:\n    self.gate.register_parameter("bias_vl", nn.Parameter(torch.empty(8)))',
        True,
    ),
    "through a local alias": (
        "gate = self.gate\nif config.vision_n_layers > 0:\n    gate.bias_vl = nn.Parameter(torch.empty(8))",
        True,
    ),
    "a mixin's method in another module": ("if config.vision_n_layers > 0:\n    self.make_bias()", True),
    "not on hash layers": (
        "if config.vision_n_layers > 0 and not is_hash:\n    self.gate.bias_vl = nn.Parameter(torch.empty(8))",
        False,
    ),
    "for text checkpoints only": (
        "if config.vision_n_layers == 0:\n    self.gate.bias_vl = nn.Parameter(torch.empty(8))",
        False,
    ),
    "after a test that raises": (
        'if config.moe_backend == "mega" and not config.ep:\n    raise NotImplementedError("needs EP")\n'
        "self.gate.bias_vl = nn.Parameter(torch.empty(8))",
        True,
    ),
    "in the else of a test that raises": (
        'if config.moe_backend == "mega":\n    raise NotImplementedError("needs EP")\n'
        "else:\n    self.gate.bias_vl = nn.Parameter(torch.empty(8))",
        True,
    ),
    "raises on hash layers": (
        'if is_hash:\n    raise NotImplementedError("no hash layers")\n'
        "self.gate.bias_vl = nn.Parameter(torch.empty(8))",
        False,
    ),
    "made, then dropped": (
        "self.gate.bias_vl = nn.Parameter(torch.empty(8))\nif is_hash:\n    self.gate.bias_vl = None",
        False,
    ),
}


@pytest.mark.parametrize("name", list(OBJECTS))
def test_creates_on_every_moe_layer_of_a_vision_checkpoint(name):
    body, made = OBJECTS[name]
    imports = "from vllm.model_executor.models.utils import extract_layer_index\n"
    ev = Evaluator.of(
        Context.from_texts(
            {
                MODEL: imports + MOE.format(body=textwrap.indent(body, " " * 8)),
                HELPERS: MIXIN,
                "vllm/model_executor/models/utils.py": "def extract_layer_index(prefix):\n    return 0\n",
            }
        )
    )
    moe = ev.follower.class_def(MODEL, "MoE")
    found = [creates(ev, moe, "gate.bias_vl", case).reach for case in (cases.VISION_HASH_LAYER, cases.VISION_LAYER)]
    assert (found == [Reach.YES, Reach.YES]) is made, found


# -- settings and loops ------------------------------------------------------------------------------------------
def test_settings_on_and_off():
    model = """\
    import os


    class Model:
        def __init__(self):
            streams = None if os.environ.get("TOY_SERIAL", "0") == "1" else [1, 2]
    """
    ev = _evaluator(model)
    init = ev.follower.function(MODEL, "Model", "__init__")
    read = {"TOY_SERIAL": False}
    values = {c.name: value_at_exit(ev, init, "streams", c) for c in cases.settings_cases(read)}
    assert is_none(values["TOY_SERIAL='1'"])
    assert values["no setting set"] == values["TOY_SERIAL='0'"] and not is_none(values["no setting set"])


def test_a_loader_passing_over_the_vision_tower():
    model = """\
    class Model:
        def load_weights(self, weights):
            for name, tensor in weights:
                if name.startswith(("vision.", "aligner.", "image_")):
                    continue
                self.params[name].copy_(tensor)
    """
    ev = _evaluator(model)
    load = ev.follower.function(MODEL, "Model", "load_weights")
    assert all(passes_over(ev, load, "weights", case) for case in cases.VISION_WEIGHTS)
    assert not passes_over(ev, load, "weights", cases.LANGUAGE_MODEL_WEIGHT)


def test_constants_fold_through_helpers_and_f_strings():
    helpers = """\
    def entries(n):
        return [("wo_a.", f"wo_a.slice.{g}.", g) for g in range(n)]
    """
    model = """\
    from vllm.models.toy.helpers import entries


    class Model:
        def load_weights(self, weights):
            mapping = [("a", "b", 0)]
            mapping += entries(2)
    """
    ev = _evaluator(model, helpers)
    load = ev.follower.function(MODEL, "Model", "load_weights")
    value = value_at_exit(ev, load, "mapping", cases.ANY)
    rows = [tuple(i.value for i in item.items) for item in value.items]  # type: ignore[attr-defined]
    assert rows == [("a", "b", 0), ("wo_a.", "wo_a.slice.0.", 0), ("wo_a.", "wo_a.slice.1.", 1)]
    assert all(isinstance(i, Const) for item in value.items for i in item.items)  # type: ignore[attr-defined]
