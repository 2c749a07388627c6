"""Each transform and injection on a snippet: the code before, the code after, written out; where it must not apply,
that it does not. Behaviour-keeping rewrites of plain Python are also run, before and after, on the same inputs."""

from __future__ import annotations

import sys
import types

import pytest

from tests.refactor.injections import Fp8OnBf16, HoldStream, MissingGateParameter, SlicesUnmapped, StreamsStayOn
from tests.refactor.source import Site, check_compiles, check_names, unresolved
from tests.refactor.transforms import (
    ConditionFlag,
    EarlyReturn,
    EqToIn,
    EqToIs,
    ExtractHelper,
    FlagIsTrue,
    GetattrRead,
    IfExpToIf,
    InlineHelper,
    LazyWrapper,
    MoveMethod,
    RenameHelper,
    RenameLocal,
    SetattrWrite,
    State,
)

MODULE = "pkg/m.py"


def rewritten(transform, before: str, site: str = "pkg/m.py:C.f", pick: int = 0, others=None) -> dict[str, str]:
    """The files ``transform`` changes or makes (each compiles, and its changed functions' names resolve)."""
    files = {MODULE: before, **(others or {})}
    step = transform.apply(State(files.get), Site.parse(site), pick)
    assert step is not None, f"{transform.name} did not apply"
    check_compiles(step.files)
    merged = {**files, **step.files}
    check_names(merged, {t: unresolved(before, Site.parse(site)) for t in step.touched if t.file in merged})
    return step.files


def skipped(transform, before: str, site: str = "pkg/m.py:C.f", pick: int = 0) -> bool:
    return transform.apply(State({MODULE: before}.get), Site.parse(site), pick) is None


def run_module(text: str, name: str = "snippet"):
    module = types.ModuleType(name)
    exec(compile(text, name, "exec"), module.__dict__)
    return module


def same_results(before: str, after: str, call) -> None:
    """``call(module)`` gives the same result on the code before and after."""
    assert call(run_module(before)) == call(run_module(after))


# -- rename ---------------------------------------------------------------------------------------------------------
def test_rename_local_renames_bindings_reads_and_closures():
    before = """\
class C:
    def f(self, weights):
        mapped = list(weights)
        later = lambda: [m for m in mapped]
        return later()
"""
    after = """\
class C:
    def f(self, weights):
        mapped_1 = list(weights)
        later = lambda: [m for m in mapped_1]
        return later()
"""
    assert rewritten(RenameLocal(), before, pick=1) == {MODULE: after}
    same_results(before, after, lambda m: m.C().f([1, 2]))


def test_rename_local_leaves_a_function_that_reads_its_frame():
    assert skipped(RenameLocal(), "class C:\n    def f(self, x):\n        y = x\n        return locals()\n")


def test_rename_helper_follows_the_importers():
    before = """\
def stream_first(weights):
    yield from weights


class C:
    def f(self, weights):
        return list(stream_first(weights))
"""
    user = "from pkg.m import stream_first\n\n\ndef g(w):\n    return stream_first(w)\n"
    files = rewritten(RenameHelper(lambda: [MODULE, "pkg/user.py"]), before, others={"pkg/user.py": user})
    assert files == {
        MODULE: """\
def stream_first_1(weights):
    yield from weights


class C:
    def f(self, weights):
        return list(stream_first_1(weights))
""",
        "pkg/user.py": "from pkg.m import stream_first_1 as stream_first\n\n\ndef g(w):\n    return stream_first(w)\n",
    }


def test_rename_helper_leaves_a_name_a_string_spells():
    before = """\
__all__ = ["helper"]


def helper():
    return 1


class C:
    def f(self):
        return helper()
"""
    assert skipped(RenameHelper(), before)


# -- extract, inline ------------------------------------------------------------------------------------------------
def test_extract_helper_passes_inputs_and_returns_outputs():
    before = """\
class C:
    def f(self, wo_a, x):
        scale = wo_a * 2
        use_big = scale > 10
        if use_big:
            return x
        return -x
"""
    after = """\
class C:
    def f(self, wo_a, x):
        use_big = _f_part_1(wo_a)
        if use_big:
            return x
        return -x


def _f_part_1(wo_a):
    scale = wo_a * 2
    use_big = scale > 10
    return use_big
"""
    assert rewritten(ExtractHelper(), before, pick=1) == {MODULE: after}
    same_results(before, after, lambda m: [m.C().f(w, 3) for w in (1, 9)])


def test_extract_helper_into_another_module_imports_what_it_reads():
    before = """\
import math

SCALE = 2


class C:
    def f(self, x):
        y = math.sqrt(x) * SCALE
        return y
"""
    files = rewritten(ExtractHelper(other_module=True), before)
    assert files == {
        MODULE: """\
import math

SCALE = 2


from pkg._refactor_helpers_1 import _f_part_1

class C:
    def f(self, x):
        y = _f_part_1(x)
        return y
""",
        "pkg/_refactor_helpers_1.py": """\
import math


def _f_part_1(x):
    from pkg.m import SCALE
    y = math.sqrt(x) * SCALE
    return y
""",
    }


@pytest.mark.parametrize(
    "body",
    [
        "        if x:\n            return 1\n        return 2\n",  # a return leaves the run
        "        y = super().f(x)\n        return y\n",  # zero-argument super() needs its class
        "        try:\n            y = 1 / x\n        except ZeroDivisionError:\n"
        "            return 0\n        return y\n",
    ],
    ids=["return", "super", "try-body"],
)
def test_extract_helper_leaves_runs_that_cannot_leave_their_function(body):
    assert skipped(ExtractHelper(), f"class C(B):\n    def f(self, x):\n{body}")


def test_inline_helper_binds_the_arguments_and_renames_what_it_binds():
    before = '''\
def is_big(value, limit=10):
    """Whether value is big."""
    doubled = value * 2
    return doubled > limit


class C:
    def f(self, x):
        big = is_big(x + 1)
        return big
'''
    after = '''\
def is_big(value, limit=10):
    """Whether value is big."""
    doubled = value * 2
    return doubled > limit


class C:
    def f(self, x):
        value_1 = x + 1
        limit_1 = 10
        doubled_1 = value_1 * 2
        big = doubled_1 > limit_1
        return big
'''
    assert rewritten(InlineHelper(), before) == {MODULE: after}
    same_results(before, after, lambda m: [m.C().f(x) for x in (1, 9)])


def test_inline_helper_from_another_module_imports_what_it_reads():
    before = "from pkg.ops import scaled\n\n\nclass C:\n    def f(self, x):\n        return scaled(x, factor=4)\n"
    ops = "import math\n\n\ndef scaled(v, *, factor):\n    k = math.sqrt(factor)\n    return v * k\n"
    after = """\
from pkg.ops import scaled


class C:
    def f(self, x):
        import math
        v_1 = x
        factor_1 = 4
        k_1 = math.sqrt(factor_1)
        return v_1 * k_1
"""
    assert rewritten(InlineHelper(), before, others={"pkg/ops.py": ops}) == {MODULE: after}


def test_inline_helper_leaves_a_helper_whose_globals_the_site_shadows():
    before = """\
def helper(a):
    return a + offset


class C:
    def f(self, x):
        offset = 3
        return helper(x)
"""
    assert skipped(InlineHelper(), before)


# -- methods into other classes -------------------------------------------------------------------------------------
CLASS = """\
import torch
from torch import nn


class C(nn.Module):
    def f(self, x: torch.Tensor, *rest, scale=1, **extra) -> torch.Tensor:
        \"\"\"Doc.\"\"\"
        return super().forward(helper(x)) * scale


def helper(x):
    return x
"""


def test_move_to_mixin_puts_the_method_first_in_the_bases():
    files = rewritten(MoveMethod("mixin"), CLASS)
    assert files == {
        MODULE: """\
import torch
from torch import nn


from pkg._refactor_c_1 import CMixin_1

class C(CMixin_1, nn.Module):
    pass


def helper(x):
    return x
""",
        "pkg/_refactor_c_1.py": '''\
from __future__ import annotations


class CMixin_1:
    def f(self, x, *rest, scale=1, **extra):
        """Doc."""
        from pkg.m import helper
        return super().forward(helper(x)) * scale
''',
    }


def test_move_to_base_puts_a_class_between_the_class_and_its_bases():
    files = rewritten(MoveMethod("base"), CLASS)
    assert files[MODULE].count("class C(CBase_1):\n    pass\n") == 1
    assert files["pkg/_refactor_c_1.py"].startswith(
        "from __future__ import annotations\n\nfrom torch import nn\n\n\nclass CBase_1(nn.Module):\n"
    )


def test_super_delegation_keeps_the_signature_and_forwards_every_argument():
    files = rewritten(MoveMethod("delegate"), CLASS)
    assert """\
class C(CMixin_1, nn.Module):
    def f(self, x: torch.Tensor, *rest, scale=1, **extra) -> torch.Tensor:
        return super().f(x, *rest, scale=scale, **extra)
""" in files[MODULE]


def test_a_mixin_keeps_what_the_method_does(tmp_path, monkeypatch):
    """Imported for real: the class with its method moved to a mixin in a new module computes the same."""
    before = """\
class Base:
    def g(self):
        return 10


class C(Base):
    def f(self, x):
        return helper(x) + super().g()


def helper(x):
    return 2 * x
"""
    for how in ("mixin", "delegate"):
        files = rewritten(MoveMethod(how), before)
        root = tmp_path / how
        for path, text in {MODULE: before, **files}.items():
            (root / path).parent.mkdir(parents=True, exist_ok=True)
            (root / path).write_text(text)
        (root / "pkg" / "__init__.py").write_text("")
        monkeypatch.syspath_prepend(str(root))
        for name in [m for m in sys.modules if m == "pkg" or m.startswith("pkg.")]:
            monkeypatch.delitem(sys.modules, name)
        import pkg.m  # noqa: PLC0415 - the rewritten package, freshly imported

        assert pkg.m.C().f(3) == 16
        assert "f" not in vars(pkg.m.C) or how == "delegate"


def test_delegation_leaves_a_property():
    assert skipped(MoveMethod("delegate"), "class C:\n    @property\n    def f(self):\n        return 1\n")


# -- spellings ------------------------------------------------------------------------------------------------------
def test_getattr_read_spells_one_read():
    before = """\
class C:
    def f(self, x):
        import a.b
        self.count += 1
        self.last = x
        return self.gate.bias_vl
"""
    after = """\
class C:
    def f(self, x):
        import a.b
        self.count += 1
        self.last = x
        return getattr(self.gate, "bias_vl")
"""
    assert rewritten(GetattrRead(), before, pick=1) == {MODULE: after}


def test_attribute_spellings_everywhere_at_once():
    before = "class C:\n    def f(self, n):\n        self.gate.bias_vl = self.make(n)\n        self.last = n\n"
    after = """\
class C:
    def f(self, n):
        setattr(getattr(self, "gate"), "bias_vl", getattr(self, "make")(n))
        setattr(self, "last", n)
"""
    step = rewritten(GetattrRead(every=True), before)[MODULE]
    assert rewritten(SetattrWrite(every=True), step) == {MODULE: after}


def test_getattr_read_leaves_f_strings_alone():
    before = 'class C:\n    def f(self):\n        return f"{self.prefix}.gate"\n'
    assert skipped(GetattrRead(), before)


def test_setattr_write_spells_one_assignment():
    before = "class C:\n    def f(self, n):\n        self.gate.bias_vl = nn.Parameter(torch.empty(n))\n"
    after = 'class C:\n    def f(self, n):\n        setattr(self.gate, "bias_vl", nn.Parameter(torch.empty(n)))\n'
    assert rewritten(SetattrWrite(), before) == {MODULE: after}


def test_eq_to_in_in_a_test_or_a_bool():
    before = """\
class C:
    def f(self, wo_a, x):
        y = x == 3
        if wo_a.weight.dtype != torch.float8_e4m3fn:
            return y
"""
    after = """\
class C:
    def f(self, wo_a, x):
        y = x == 3
        if wo_a.weight.dtype not in (torch.float8_e4m3fn,):
            return y
"""
    assert rewritten(EqToIn(), before) == {MODULE: after}
    assert skipped(EqToIn(), "class C:\n    def f(self, x):\n        return x == 3\n")  # may not be a bool


def test_eq_to_is_for_torch_dtypes():
    before = "class C:\n    def f(self, wo_a):\n        return wo_a.weight.dtype == torch.float8_e4m3fn\n"
    after = "class C:\n    def f(self, wo_a):\n        return wo_a.weight.dtype is torch.float8_e4m3fn\n"
    assert rewritten(EqToIs(), before) == {MODULE: after}


def test_flag_is_true_only_for_a_flag_that_holds_a_bool():
    before = """\
class C:
    def f(self, wo_a, other):
        use_fp8 = wo_a.weight.dtype == torch.float8_e4m3fn
        maybe = other
        if maybe:
            pass
        if use_fp8:
            return 1
"""
    after = before.replace("if use_fp8:", "if use_fp8 is True:")
    assert rewritten(FlagIsTrue(), before) == {MODULE: after}


# -- lazy wrappers --------------------------------------------------------------------------------------------------
STREAM = """\
class C:
    def f(self, weights):
        mapped = self.hf_to_vllm_mapper.apply(weights)
        return self.loader.load_weights(mapped)
"""
WRAPPED = {
    "map": "map(lambda item_1: item_1, weights)",
    "genexp": "(item_1 for item_1 in weights)",
    "iter": "iter(weights)",
    "filter": "filter(None, weights)",
    "zip": "(item_1 for (item_1,) in zip(weights))",
    "enumerate": "(item_1 for _, item_1 in enumerate(weights))",
    "islice": "itertools.islice(weights, None)",
}


@pytest.mark.parametrize("how", sorted(WRAPPED))
def test_lazy_wrapper_around_the_stream(how):
    after = STREAM.replace("apply(weights)", f"apply({WRAPPED[how]})")
    if how == "islice":
        after = after.replace("    def f(self, weights):\n", "    def f(self, weights):\n        import itertools\n")
    assert rewritten(LazyWrapper(how), STREAM) == {MODULE: after}


@pytest.mark.parametrize("how", sorted(WRAPPED))
def test_lazy_wrappers_yield_the_same_items(how):
    before = "def f(xs):\n    return [a * b for a, b in xs]\n"
    after = rewritten(LazyWrapper(how), before, site="pkg/m.py:f")[MODULE]
    same_results(before, after, lambda m: m.f([(1, 2), (3, 4)]))


def test_filter_none_only_where_no_item_can_be_false():
    assert skipped(LazyWrapper("filter"), "class C:\n    def f(self, xs):\n        return sum(xs)\n")


def test_no_wrapper_around_a_quant_method_argument_or_a_dict():
    before = "class C:\n    def f(self, x, d):\n        self.quant_method.apply(self, x)\n        return dict(d)\n"
    assert skipped(LazyWrapper("map"), before)


# -- conditions and returns -----------------------------------------------------------------------------------------
GENERATOR = """\
class C:
    def f(self, weights):
        rest = []
        for name, tensor in weights:
            if name.startswith("language_model."):
                yield name, tensor
            else:
                rest.append((name, tensor))
        yield from rest
"""


def test_condition_flag():
    after = GENERATOR.replace(
        '            if name.startswith("language_model."):\n',
        '            condition_1 = name.startswith("language_model.")\n            if condition_1:\n',
    )
    assert rewritten(ConditionFlag(), GENERATOR) == {MODULE: after}
    same_results(GENERATOR, after, lambda m: list(m.C().f([("vision.a", 1), ("language_model.b", 2)])))


def test_condition_helper():
    after = GENERATOR.replace('if name.startswith("language_model."):', "if _f_condition_1(name):")
    after += '\n\ndef _f_condition_1(name):\n    return name.startswith("language_model.")\n'
    assert rewritten(ConditionFlag(helper=True), GENERATOR) == {MODULE: after}
    same_results(GENERATOR, after, lambda m: list(m.C().f([("vision.a", 1), ("language_model.b", 2)])))


def test_early_return_and_its_inverse():
    with_else = """\
class C:
    def f(self, x):
        if x < 0:
            return -x
        else:
            y = x * 2
        return y
"""
    flat = """\
class C:
    def f(self, x):
        if x < 0:
            return -x
        y = x * 2
        return y
"""
    nested = """\
class C:
    def f(self, x):
        if x < 0:
            return -x
        else:
            y = x * 2
            return y
"""
    assert rewritten(EarlyReturn(), with_else) == {MODULE: flat}
    assert rewritten(EarlyReturn(reverse=True), flat) == {MODULE: nested}
    for after in (flat, nested):
        same_results(with_else, after, lambda m: [m.C().f(x) for x in (-3, 4)])


def test_ifexp_to_if():
    before = """\
class C:
    def f(self, off):
        aux = None if off else [1, 2]
        return aux if aux else []
"""
    assigned = """\
class C:
    def f(self, off):
        if off:
            aux = None
        else:
            aux = [1, 2]
        return aux if aux else []
"""
    returned = """\
class C:
    def f(self, off):
        aux = None if off else [1, 2]
        if aux:
            return aux
        return []
"""
    assert rewritten(IfExpToIf(), before, pick=0) == {MODULE: assigned}
    assert rewritten(IfExpToIf(), before, pick=1) == {MODULE: returned}
    for after in (assigned, returned):
        same_results(before, after, lambda m: [m.C().f(off) for off in (True, False)])


# -- injections -----------------------------------------------------------------------------------------------------
VISION = """\
class V:
    def load_weights(self, weights):
        loader = AutoWeightsLoader(self)
        return loader.load_weights(self.hf_to_vllm_mapper.apply(weights))
"""


def test_hold_stream_at_the_start_at_an_assignment_and_at_the_loader():
    site = "pkg/m.py:V.load_weights"
    start = rewritten(HoldStream("star-list"), VISION, site=site, pick=0)[MODULE]
    assert "    def load_weights(self, weights):\n        weights = [*weights]\n" in start
    loader = rewritten(HoldStream("sorted"), VISION, site=site, pick=1)[MODULE]
    assert "loader.load_weights(sorted(self.hf_to_vllm_mapper.apply(weights), key=lambda item_1: item_1[0]))" in loader
    tee = rewritten(HoldStream("tee-read-ahead"), VISION, site=site, pick=0)[MODULE]
    assert (
        "        import itertools\n        held_1, item_1 = itertools.tee(weights)\n"
        "        held_1_count = sum(1 for _ in held_1)\n        weights = item_1\n"
    ) in tee


def test_hold_stream_in_a_generator_that_buffers_everything():
    files = rewritten(HoldStream("buffering-generator"), VISION, site="pkg/m.py:V.load_weights", pick=0)
    assert files[MODULE].endswith(
        "\n\n\ndef _held_weights_1(items):\n    held = []\n    for item in items:\n        held.append(item)\n"
        "    yield from held\n"
    )


O_PROJ = """\
def o_proj(o, wo_a):
    use_fp8 = wo_a.weight.dtype == torch.float8_e4m3fn
    if use_fp8:
        fp8_einsum(o, wo_a.weight)
    else:
        torch.bmm(o, wo_a.weight)
"""


@pytest.mark.parametrize(
    "construct,expected",
    [
        ("inverted-comparison", "    use_fp8 = wo_a.weight.dtype != torch.float8_e4m3fn\n"),
        ("negated-test", "    if not (use_fp8):\n        fp8_einsum"),
        ("swapped-arms", "    if use_fp8:\n        torch.bmm(o, wo_a.weight)\n    else:\n        fp8_einsum"),
        ("flag-not-branched-on", "    use_fp8 = wo_a.weight.dtype == torch.float8_e4m3fn\n    fp8_einsum("),
        ("or-bf16", "    if use_fp8 or wo_a.weight.dtype == torch.bfloat16:\n"),
    ],
)
def test_fp8_on_a_bf16_arm(construct, expected):
    assert expected in rewritten(Fp8OnBf16(construct), O_PROJ, site="pkg/m.py:o_proj")[MODULE]


MOE = """\
class MoE:
    def __init__(self, config, prefix, num_hash_layers):
        is_hash_moe = layer_index(prefix) < num_hash_layers
        if getattr(config, "topk_method", None) == "noaux_tc" and (
            not is_hash_moe or getattr(config, "vision_n_layers", 0) > 0
        ):
            self.gate.e_score_correction_bias = nn.Parameter(torch.empty(8))
        if getattr(config, "vision_n_layers", 0) > 0:
            self.gate.bias_vl = nn.Parameter(torch.empty(8))
"""


def test_missing_gate_parameters():
    site = "pkg/m.py:MoE.__init__"
    non_hash = rewritten(MissingGateParameter("bias-vl-non-hash-only"), MOE, site=site)[MODULE]
    assert "            if not is_hash_moe:\n                self.gate.bias_vl = nn.Parameter" in non_hash
    text_only = rewritten(MissingGateParameter("bias-vl-text-only"), MOE, site=site)[MODULE]
    assert 'if not (getattr(config, "vision_n_layers", 0) > 0):\n            self.gate.bias_vl' in text_only
    hash_bias = rewritten(MissingGateParameter("hash-bias-text-only"), MOE, site=site)[MODULE]
    assert "not is_hash_moe or False\n" in hash_bias


def test_streams_stay_on_whatever_the_setting():
    before = "class M:\n    def __init__(self):\n        aux_stream_list = [torch.cuda.Stream() for _ in range(3)]\n"
    site = "pkg/m.py:M.__init__"
    after = rewritten(StreamsStayOn("overwritten-after"), before, site=site)[MODULE]
    assert after == (
        "class M:\n    def __init__(self):\n        import os\n"
        '        aux_stream_list = None if os.environ.get("VLLM_DSV4_AUX_STREAMS", "1") == "0" else '
        "[torch.cuda.Stream() for _ in range(3)]\n"
        "        aux_stream_list = [torch.cuda.Stream() for _ in range(3)]\n"
    )


def test_slices_named_never_mapped():
    before = (
        "class M:\n    def load_weights(self, weights):\n        stacked_params_mapping = [('a', 'b', 0)]\n"
        "        for name, w in weights:\n            load(name, w)\n"
    )
    after = rewritten(SlicesUnmapped("skipped"), before, site="pkg/m.py:M.load_weights")[MODULE]
    assert '        for name, w in weights:\n            if "wo_a.slice" in name:\n                continue\n' in after
