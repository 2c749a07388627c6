"""Injections of each patch's defect: rewrites that do NOT keep the behaviour, whose expected verdict is therefore
``pending`` or ``drifted``, never ``upstream``.

Each :class:`Injection` puts one patch's defect into a site of a release, in one construct (a row of the issue's
table: what holds a whole iterator, how a condition lets the wrong case through), by construction:

    stream-load       the weight stream held whole on its way to the loader: list, tuple, [*x], (*x,), sorted, a set,
                      a dict, a list comprehension, collections.deque, heapq.nsmallest, .sort() on a list extended
                      with it, a generator that loops over everything before its first yield, itertools.tee read
                      ahead beyond its buffer, starred unpacking, functools.partial of sorted, map over a list, a
                      helper in another module that returns list(...)
    dtype-policy      the FP8 GEMM reached on a BF16 arm: the dtype comparison inverted, the test negated, the arms
                      swapped, the flag computed and not branched on, ``or`` a BF16 test
    loader-skips      a vision checkpoint's MoE layer without its gate.bias_vl (created only on non-hash layers, only
                      for text checkpoints, not at all) or a hash layer without its e_score_correction_bias; the
                      vision class that never builds its tower
    aux-streams       a setting read that does not turn the streams off: both arms make streams, it sets how many,
                      a platform test instead, a flag computed and unused, the switched statement overwritten after,
                      a test that is never true
    exl3-wo-a-slices  wo_a.slice named but never mapped: an entry in an unused list, a skip, a raise, an entry added
                      after the loop has read the mapping
    dense-exl3        the compressor still without a quant config (a local holding None, a conditional that always
                      gives None), _exl3_linears read and ignored before the O projection

wide-swa has no injection: its defect is in FlashInfer, not in vLLM's code.
"""

from __future__ import annotations

from collections.abc import Callable

import libcst as cst

from tests.refactor.source import (
    Site,
    append_code,
    code_of,
    expression,
    fresh_name,
    identifiers,
    module_of,
    rewrite_function,
    statement,
)
from tests.refactor.transforms import (
    State,
    Step,
    Transform,
    add_import,
    blocks,
    body_statements,
    choose,
    docstring_count,
    import_line,
    names_in,
    replace_block,
    site_function,
    with_prelude,
)


class Injection(Transform):
    keeps = False

    def __init__(self, patch: str, construct: str) -> None:
        self.patch = patch
        self.construct = construct
        self.name = f"inject-{patch}:{construct}"

    def finish(self, state: State, site: Site, text: str, fn: cst.FunctionDef, extra: str = "") -> Step | None:
        out = rewrite_function(text, site, lambda _fn: fn)
        if out is None:
            return None
        files = {site.file: append_code(out, extra) if extra else out}
        return Step(files, site, self.construct, (site,))


def _statements(fn: cst.FunctionDef) -> list[tuple[cst.CSTNode, int, cst.BaseStatement]]:
    """Every statement of ``fn`` outside nested functions and classes: (owner of its block, index, statement)."""
    return [(owner, i, stmt) for _path, owner in blocks(fn) for i, stmt in enumerate(owner.body.body)]


def _replace_statement(fn, owner, index, new: list[cst.BaseStatement]) -> cst.FunctionDef:
    body = list(owner.body.body)
    return replace_block(fn, owner, [*body[:index], *new, *body[index + 1 :]])


def _assign(stmt: cst.CSTNode) -> cst.Assign | None:
    if isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1 and isinstance(stmt.body[0], cst.Assign):
        return stmt.body[0]
    return None


def _target_text(assign: cst.Assign) -> str:
    return code_of(assign.targets[0].target) if len(assign.targets) == 1 else ""


# -- stream-load: the stream held whole -----------------------------------------------------------------------------
# Each construct: (statements before, the expression the stream continues as); {e} the stream, {t} a fresh name,
# {h} a fresh name for what holds it, {f} a helper's name.
HOLDERS: dict[str, tuple[tuple[str, ...], str]] = {
    "list": ((), "list({e})"),
    "tuple": ((), "tuple({e})"),
    "star-list": ((), "[*{e}]"),
    "star-tuple": ((), "(*{e},)"),
    "sorted": ((), "sorted({e}, key=lambda {t}: {t}[0])"),
    "set": ((), "set({e})"),
    "dict": ((), "dict({e}).items()"),
    "list-comprehension": ((), "[{t} for {t} in {e}]"),
    "deque": (("import collections",), "collections.deque({e})"),
    "heapq": (("import heapq",), "heapq.nsmallest(1 << 62, {e}, key=lambda {t}: {t}[0])"),
    "sort-method": (("{h} = []", "{h}.extend({e})", "{h}.sort(key=lambda {t}: {t}[0])"), "{h}"),
    "buffering-generator": ((), "{f}({e})"),
    "tee-read-ahead": (
        ("import itertools", "{h}, {t} = itertools.tee({e})", "{h}_count = sum(1 for _ in {h})"),
        "{t}",
    ),
    "starred-unpacking": (("{h}, *{t} = {e}",), "({h}, *{t})"),
    "partial-of-sorted": (("import functools", "{h} = functools.partial(sorted, key=lambda {t}: {t}[0])"), "{h}({e})"),
    "map-over-list": ((), "map(lambda {t}: {t}, list({e}))"),
    "helper-in-other-module": ((), "{f}({e})"),
}
BUFFERING_GENERATOR = """\
def {f}(items):
    held = []
    for item in items:
        held.append(item)
    yield from held
"""
HOLDING_HELPER = """\
def {f}(items):
    return list(items)
"""


def stream_parameter(fn: cst.FunctionDef) -> str | None:
    """The parameter holding the weight stream: ``weights``, or the first annotated ``Iterable[...]``."""
    params = [*fn.params.posonly_params, *fn.params.params]
    for param in params:
        if param.name.value == "weights":
            return "weights"
    for param in params:
        if param.annotation is not None and "Iterable" in code_of(param.annotation.annotation):
            return param.name.value
    return None


def _carries(assign: cst.Assign, carriers: set[str]) -> bool:
    """Whether ``assign``'s value carries the stream on: it names a carrier, and is not what a loader returns
    (``x = loader.load_weights(weights)`` binds the names loaded, the stream is consumed by the call: holding
    that value keeps the stream whole, so it is no injection of the defect)."""
    value = assign.value
    func = value.func if isinstance(value, cst.Call) else None
    if isinstance(func, cst.Attribute) and func.attr.value == "load_weights":
        return False
    return any(n.value in carriers for n in names_in(value))


class HoldStream(Injection):
    """stream-load's defect: the stream held whole, in ``construct``, where it flows: rebound at the function's
    start, around the value of an assignment that carries it, or around the argument of a ``load_weights`` call."""

    def __init__(self, construct: str) -> None:
        assert construct in HOLDERS
        super().__init__("stream-load", construct)

    def apply(self, state, site, pick):
        found = site_function(state, site)
        if found is None:
            return None
        text, fn = found
        param = stream_parameter(fn)
        if param is None:
            return None
        carriers = {param}
        statements = _statements(fn)
        for _ in range(3):
            for _owner, _i, stmt in statements:
                assign = _assign(stmt)
                if assign and _carries(assign, carriers):
                    carriers |= {n.value for t in assign.targets for n in names_in(t.target)}
        places: list[tuple[str, object]] = [("start", None)]
        for owner, i, stmt in statements:
            assign = _assign(stmt)
            if assign and _carries(assign, carriers) and _target_text(assign):
                places.append(("assignment", (owner, i)))
            for call in _calls(stmt):
                func = call.func
                if isinstance(func, cst.Attribute) and func.attr.value == "load_weights" and call.args:
                    if any(n.value in carriers for n in names_in(call.args[0].value)):
                        places.append(("loader", (owner, i, call)))
        where, at = choose(places, pick)
        taken = identifiers(text)
        names = {
            "t": fresh_name("item", taken),
            "h": fresh_name("held", taken),
            "f": fresh_name("_held_weights", taken),
        }
        before, template = HOLDERS[self.construct]
        imports = [line for line in before if line.startswith("import ")]
        before = [line for line in before if not line.startswith("import ")]

        def held(expr_code: str) -> tuple[list[cst.BaseStatement], cst.BaseExpression]:
            fill = {**names, "e": expr_code}
            return [statement(line.format(**fill) + "\n") for line in before], expression(template.format(**fill))

        if where == "start":
            pre, value = held(param)
            new_fn = _at_start(fn, [*pre, statement(f"{param} = {code_of(value)}\n")])
        elif where == "assignment":
            owner, index = at
            stmt = owner.body.body[index]
            assign = _assign(stmt)
            pre, value = held(code_of(assign.value))
            new_stmt = stmt.with_changes(body=[assign.with_changes(value=value)])
            new_fn = _replace_statement(fn, owner, index, [*pre, new_stmt])
        else:
            owner, index, call = at
            stmt = owner.body.body[index]
            pre, value = held(code_of(call.args[0].value))

            class Wrap(cst.CSTTransformer):
                def on_leave(self, original, updated):
                    if original is call.args[0]:
                        return updated.with_changes(value=value)
                    return updated

            new_fn = _replace_statement(fn, owner, index, [*pre, stmt.visit(Wrap())])
        new_fn = with_prelude(new_fn, imports)
        if self.construct == "buffering-generator":
            return self.finish(state, site, text, new_fn, BUFFERING_GENERATOR.format(**names))
        if self.construct == "helper-in-other-module":
            path = state.new_module(site.file, "refactor_holders")
            out = rewrite_function(text, site, lambda _fn: new_fn)
            out = add_import(out, site, import_line(module_of(path), [names["f"]]))
            return Step({site.file: out, path: HOLDING_HELPER.format(**names)}, site, f"{self.construct} at {where}")
        step = self.finish(state, site, text, new_fn)
        return Step(step.files, site, f"{self.construct} at {where}", step.touched) if step else None


def _at_start(fn: cst.FunctionDef, stmts: list[cst.BaseStatement]) -> cst.FunctionDef:
    body = body_statements(fn)
    at = docstring_count(fn)
    return fn.with_changes(body=fn.body.with_changes(body=[*body[:at], *stmts, *body[at:]]))


def _calls(node: cst.CSTNode) -> list[cst.Call]:
    found: list[cst.Call] = []

    class Collect(cst.CSTVisitor):
        def visit_Call(self, call):  # noqa: N802
            found.append(call)

        def visit_FunctionDef(self, _node):  # noqa: N802
            return False

        def visit_Lambda(self, _node):  # noqa: N802
            return False

    node.visit(Collect())
    return found


# -- dtype-policy: the FP8 GEMM on a BF16 arm -----------------------------------------------------------------------
FP8 = "float8_e4m3fn"
FP8_GEMM = "fp8_einsum"


def _is_fp8_test(node: cst.CSTNode) -> bool:
    return (
        isinstance(node, cst.Comparison)
        and len(node.comparisons) == 1
        and isinstance(node.comparisons[0].operator, (cst.Equal, cst.NotEqual, cst.Is, cst.IsNot))
        and FP8 in code_of(node)
    )


def _fp8_gate(fn: cst.FunctionDef):
    """(the comparison of a dtype with FP8, the flags bound to it, the ``if`` that branches on either and holds the
    FP8 GEMM on one arm) in ``fn``; None where ``fn`` has no such ``if``."""
    tests = []

    class Collect(cst.CSTVisitor):
        def visit_Comparison(self, node):  # noqa: N802
            if _is_fp8_test(node):
                tests.append(node)

    fn.visit(Collect())
    if not tests:
        return None
    flags = set()
    for _owner, _i, stmt in _statements(fn):
        assign = _assign(stmt)
        if assign and any(t is assign.value for t in tests) and _target_text(assign).isidentifier():
            flags.add(_target_text(assign))
    for owner, i, stmt in _statements(fn):
        if not isinstance(stmt, cst.If):
            continue
        reads = {n.value for n in names_in(stmt.test)}
        if not (reads & flags or any(_is_fp8_test(t) for t in _comparisons(stmt.test))):
            continue
        if FP8_GEMM in code_of(stmt):
            return tests[0], flags, (owner, i, stmt)
    return None


def _comparisons(node: cst.CSTNode) -> list[cst.Comparison]:
    found: list[cst.Comparison] = []

    class Collect(cst.CSTVisitor):
        def visit_Comparison(self, c):  # noqa: N802
            found.append(c)

    node.visit(Collect())
    return found


class Fp8OnBf16(Injection):
    """dtype-policy's defect: the FP8-only GEMM runs for a BF16 ``wo_a``, through the gate's own test turned."""

    CONSTRUCTS = ("inverted-comparison", "negated-test", "swapped-arms", "flag-not-branched-on", "or-bf16")

    def __init__(self, construct: str) -> None:
        assert construct in self.CONSTRUCTS
        super().__init__("dtype-policy", construct)

    def apply(self, state, site, pick):
        found = site_function(state, site)
        if found is None:
            return None
        text, fn = found
        gate = _fp8_gate(fn)
        if gate is None:
            return None
        test, _flags, (owner, index, node) = gate
        if self.construct == "inverted-comparison":
            op = test.comparisons[0].operator
            space = cst.SimpleWhitespace(" ")
            flipped = {
                cst.Equal: cst.NotEqual(whitespace_before=space, whitespace_after=space),
                cst.NotEqual: cst.Equal(whitespace_before=space, whitespace_after=space),
                cst.Is: cst.IsNot(whitespace_before=space, whitespace_between=space, whitespace_after=space),
                cst.IsNot: cst.Is(whitespace_before=space, whitespace_after=space),
            }[type(op)]

            class Flip(cst.CSTTransformer):
                def on_leave(self, original, updated):
                    if original is test:
                        return updated.with_changes(comparisons=[updated.comparisons[0].with_changes(operator=flipped)])
                    return updated

            return self.finish(state, site, text, fn.visit(Flip()))
        if self.construct == "negated-test":
            new = [node.with_changes(test=expression(f"not ({code_of(node.test)})"))]
        elif self.construct == "swapped-arms":
            if not isinstance(node.orelse, cst.Else):
                return None
            new = [node.with_changes(body=node.orelse.body, orelse=node.orelse.with_changes(body=node.body))]
        elif self.construct == "flag-not-branched-on":
            arms = [node.body, *([node.orelse.body] if isinstance(node.orelse, cst.Else) else [])]
            fp8_arm = next((arm for arm in arms if FP8_GEMM in code_of(cst.Module(body=list(arm.body)))), None)
            if fp8_arm is None:
                return None
            new = list(fp8_arm.body)
        else:
            lhs = code_of(test.left)
            new = [node.with_changes(test=expression(f"{code_of(node.test)} or {lhs} == torch.bfloat16"))]
        return self.finish(state, site, text, _replace_statement(fn, owner, index, new))


# -- loader-skips: a vision MoE layer without its gate parameter ----------------------------------------------------
def _creates(stmt: cst.CSTNode, attr: str) -> bool:
    """``x.<attr> = ...Parameter(...)`` (a parameter created)."""
    assign = _assign(stmt)
    return bool(
        assign
        and _target_text(assign).endswith("." + attr)
        and isinstance(assign.value, cst.Call)
        and code_of(assign.value.func).endswith("Parameter")
    )


class MissingGateParameter(Injection):
    """loader-skips' defect: a MoE layer of a vision checkpoint without a gate parameter the checkpoint ships."""

    CONSTRUCTS = ("bias-vl-non-hash-only", "bias-vl-text-only", "bias-vl-never", "hash-bias-text-only", "no-tower")

    def __init__(self, construct: str) -> None:
        assert construct in self.CONSTRUCTS
        super().__init__("loader-skips", construct)

    def apply(self, state, site, pick):
        found = site_function(state, site)
        if found is None:
            return None
        text, fn = found
        statements = _statements(fn)
        if self.construct == "no-tower":
            spots = [
                (o, i)
                for o, i, s in statements
                if (a := _assign(s)) and _target_text(a) == "self.vision" and isinstance(a.value, cst.Call)
            ]
            spot = choose(spots, pick)
            if spot is None:
                return None
            return self.finish(state, site, text, _replace_statement(fn, *spot, [statement("pass\n")]))
        creations = [(o, i, s) for o, i, s in statements if _creates(s, "bias_vl")]
        if self.construct == "bias-vl-non-hash-only":
            flags = [
                _target_text(a)
                for _o, _i, s in statements
                if (a := _assign(s)) and "hash" in _target_text(a) and "num_hash_layers" in code_of(a.value)
            ]
            spot = choose(creations, pick)
            if spot is None or not flags or not flags[0].isidentifier():
                return None
            owner, index, stmt = spot
            guarded = statement(f"if not {flags[0]}:\n    pass\n")
            guarded = guarded.with_changes(body=guarded.body.with_changes(body=[stmt]))
            return self.finish(state, site, text, _replace_statement(fn, owner, index, [guarded]))
        if self.construct == "bias-vl-never":
            spot = choose(creations, pick)
            if spot is None:
                return None
            return self.finish(state, site, text, _replace_statement(fn, spot[0], spot[1], [statement("pass\n")]))
        if self.construct == "bias-vl-text-only":
            ifs = [
                (o, i, s)
                for o, i, s in statements
                if isinstance(s, cst.If) and any(_creates(c, "bias_vl") for c in s.body.body)
            ]
            spot = choose(ifs, pick)
            if spot is None:
                return None
            owner, index, node = spot
            new = node.with_changes(test=expression(f"not ({code_of(node.test)})"))
            return self.finish(state, site, text, _replace_statement(fn, owner, index, [new]))
        ifs = [
            (o, i, s)
            for o, i, s in statements
            if isinstance(s, cst.If)
            and any(_creates(c, "e_score_correction_bias") for c in s.body.body)
            and "vision_n_layers" in code_of(s.test)
        ]
        spot = choose(ifs, pick)
        if spot is None:
            return None
        owner, index, node = spot

        class NoVision(cst.CSTTransformer):
            def leave_Comparison(self, original, updated):  # noqa: N802
                return cst.Name("False") if "vision_n_layers" in code_of(original) else updated

        new = node.with_changes(test=node.test.visit(NoVision()))
        return self.finish(state, site, text, _replace_statement(fn, owner, index, [new]))


# -- aux-streams: a setting that does not turn the streams off ------------------------------------------------------
SWITCH = 'os.environ.get("VLLM_DSV4_AUX_STREAMS", "1") == "0"'
AUX_VALUES: dict[str, Callable[[str], str]] = {
    "both-arms-make-streams": lambda v: f"{v} if {SWITCH} else {v}",
    "setting-sets-how-many": lambda v: f'{v}[: max(1, int(os.environ.get("VLLM_DSV4_AUX_STREAM_COUNT", "3")))]',
    "platform-test": lambda v: f"None if torch.version.hip is not None else {v}",
    "test-never-true": lambda v: f"None if {SWITCH} and False else {v}",
}


class StreamsStayOn(Injection):
    """aux-streams' defect kept where a fix seems near: the streams are made whatever the setting says."""

    CONSTRUCTS = (*AUX_VALUES, "flag-not-branched-on", "overwritten-after")

    def __init__(self, construct: str) -> None:
        assert construct in self.CONSTRUCTS
        super().__init__("aux-streams", construct)

    def apply(self, state, site, pick):
        found = site_function(state, site)
        if found is None:
            return None
        text, fn = found
        spots = [(o, i, s) for o, i, s in _statements(fn) if (a := _assign(s)) and _target_text(a) == "aux_stream_list"]
        spot = choose(spots, pick)
        if spot is None:
            return None
        owner, index, stmt = spot
        value = code_of(_assign(stmt).value)
        if self.construct in AUX_VALUES:
            new = [statement(f"aux_stream_list = {AUX_VALUES[self.construct](value)}\n")]
        elif self.construct == "flag-not-branched-on":
            new = [statement(f"streams_off = {SWITCH}\n"), stmt]
        else:
            new = [statement(f"aux_stream_list = None if {SWITCH} else {value}\n"), stmt]
        new_fn = _replace_statement(fn, owner, index, new)
        return self.finish(state, site, text, with_prelude(new_fn, ["import os"]))


# -- exl3-wo-a-slices: the slices named, never mapped ---------------------------------------------------------------
ENTRY = '("attn.wo_a.", "attn.wo_a.slice.0.", 0)'


class SlicesUnmapped(Injection):
    """exl3-wo-a-slices' defect kept where the slices are named: no mapping entry the loader uses loads them."""

    CONSTRUCTS = ("entry-in-unused-list", "skipped", "rejected", "entry-added-after-the-loop")

    def __init__(self, construct: str) -> None:
        assert construct in self.CONSTRUCTS
        super().__init__("exl3-wo-a-slices", construct)

    def apply(self, state, site, pick):
        found = site_function(state, site)
        if found is None:
            return None
        text, fn = found
        statements = _statements(fn)
        mapping = [
            (o, i, s) for o, i, s in statements if (a := _assign(s)) and _target_text(a) == "stacked_params_mapping"
        ]
        loops = [
            (o, i, s)
            for o, i, s in statements
            if isinstance(s, cst.For) and "name" in {n.value for n in names_in(s.target)}
        ]
        if not mapping or not loops:
            return None
        if self.construct == "entry-in-unused-list":
            owner, index, stmt = mapping[0]
            new = [stmt, statement(f"slice_mapping = [{ENTRY}]\n")]
            return self.finish(state, site, text, _replace_statement(fn, owner, index, new))
        owner, index, loop = choose(loops, pick)
        if self.construct == "entry-added-after-the-loop":
            new = [loop, statement(f"stacked_params_mapping.append({ENTRY})\n")]
            return self.finish(state, site, text, _replace_statement(fn, owner, index, new))
        action = "continue" if self.construct == "skipped" else "raise KeyError(name)"
        guard = statement(f'if "wo_a.slice" in name:\n    {action}\n')
        new_loop = loop.with_changes(body=loop.body.with_changes(body=[guard, *loop.body.body]))
        return self.finish(state, site, text, _replace_statement(fn, owner, index, [new_loop]))


# -- dense-exl3: the compressor without a quant config; _exl3_linears read and ignored ------------------------------
class StillDense(Injection):
    """dense-exl3's defect kept in another spelling: the compressor built with no quant config, or the attention
    reading ``_exl3_linears`` and running the dense O projection whatever it holds."""

    CONSTRUCTS = ("quant-config-local-none", "quant-config-always-none", "exl3-linears-ignored")

    def __init__(self, construct: str) -> None:
        assert construct in self.CONSTRUCTS
        super().__init__("dense-exl3", construct)

    def apply(self, state, site, pick):
        found = site_function(state, site)
        if found is None:
            return None
        text, fn = found
        statements = _statements(fn)
        if self.construct == "exl3-linears-ignored":
            spots = [
                (o, i, s)
                for o, i, s in statements
                if isinstance(s, cst.SimpleStatementLine)
                and isinstance(s.body[0], cst.Return)
                and "self._o_proj(" in code_of(s)
            ]
            spot = choose(spots, pick)
            if spot is None:
                return None
            owner, index, stmt = spot
            new = [statement('exl3_linears = getattr(self.wo_a, "_exl3_linears", None)\n'), stmt]
            return self.finish(state, site, text, _replace_statement(fn, owner, index, new))
        spots = [
            (o, i, s)
            for o, i, s in statements
            if (a := _assign(s))
            and _target_text(a) == "self.fused_wkv_wgate"
            and isinstance(a.value, cst.Call)
            and any(k.keyword is not None and k.keyword.value == "quant_config" for k in a.value.args)
        ]
        spot = choose(spots, pick)
        if spot is None:
            return None
        owner, index, stmt = spot
        assign = _assign(stmt)
        replacement = (
            "no_quant_config"
            if self.construct == "quant-config-local-none"
            else ('getattr(vllm_config, "compressor_quant_config", None) if False else None')
        )
        args = [
            a.with_changes(value=expression(replacement))
            if a.keyword is not None and a.keyword.value == "quant_config"
            else a
            for a in assign.value.args
        ]
        new_stmt = stmt.with_changes(body=[assign.with_changes(value=assign.value.with_changes(args=args))])
        new = [statement("no_quant_config = None\n"), new_stmt] if replacement == "no_quant_config" else [new_stmt]
        return self.finish(state, site, text, _replace_statement(fn, owner, index, new))


def injections() -> tuple[Injection, ...]:
    """Every injection, in a fixed order (Hypothesis draws from it)."""
    return (
        *(HoldStream(c) for c in HOLDERS),
        *(Fp8OnBf16(c) for c in Fp8OnBf16.CONSTRUCTS),
        *(MissingGateParameter(c) for c in MissingGateParameter.CONSTRUCTS),
        *(StreamsStayOn(c) for c in StreamsStayOn.CONSTRUCTS),
        *(SlicesUnmapped(c) for c in SlicesUnmapped.CONSTRUCTS),
        *(StillDense(c) for c in StillDense.CONSTRUCTS),
    )
