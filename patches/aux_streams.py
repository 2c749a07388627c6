"""Keep DeepSeek-V4's attention GEMMs off vLLM's auxiliary CUDA streams when asked to (opt-in).

`DeepseekV4Model.__init__` (`nvidia/model.py`) and the MTP draft's
`DeepSeekV4MultiTokenPredictor.__init__` (`nvidia/mtp.py`) create three
auxiliary CUDA streams, on which `DeepseekV4Attention` runs some input
projections (and the indexer its own) concurrently with the default stream.
Packs whose attention linears are EXL3 (lna-lab's dense-EXL3 bakes) run
exllamav3 kernels there, and exllamav3 keeps one cooperative-launch lock buffer
per device, not per stream (`exl3_devctx.cuh`, every release through 1.6.5):
two streams in those kernels at once deadlock decode with the GPU at 100 %. No
vLLM setting turns the streams off (`VLLM_MULTI_STREAM_GEMM_TOKEN_THRESHOLD=0`
leaves the forward fan-out and the indexer on them).

DeepSeek-V4.1's `DeepseekV4Model.__init__` (`deepseek_v41/nvidia/model.py`,
`deepseek_v4_1/` in the nightlies) makes the same three streams on vLLM
0.30.0-0.34.0, and V4.1 EXL3 packs hit the same deadlock: the patch switches it
too, with the same switch.

With this patch, `aux_stream_list` is None (the path vLLM takes on ROCm, which
every release's attention code handles) when `PATCH_DSV4_AUX_STREAMS=0`, lna-lab's
`LNA_DSV4_AUX_STREAMS=0` or MiaAI-Lab's V4.1 kit's `DSV41_EXL3_SERIAL_STREAMS=1`
is set when the model is built; otherwise the streams are created as before. Applied only when asked for
(`patch-dsv4 apply --with aux-streams`), then kept by later applies.

Not fixed upstream in vLLM 0.28.0-0.34.0 nor in exllamav3 1.4.0-1.6.5.

What the probes check, through the evaluator (patcher/patching/evaluate), whatever
the code is called: `__init__` runs under every combination of the settings it
reads (vllm.envs, the environment; through the helpers it calls): unset, "0" or
"1". The defect: it builds the streams whatever they say. The fix: a name that
holds a list of CUDA streams under one combination holds None under another. A
setting that only sets how many streams there are, or a test of the platform, is
no fix.
"""

from __future__ import annotations

import ast

from patch_dsv4.output.verdicts import Outcome, Verdict
from patch_dsv4.patches import miaai_kit
from patch_dsv4.patches._v41 import in_layouts
from patch_dsv4.patching.edits import ForeignEdit, NotProven, ReplaceStatements, Variant, mentions_injected
from patch_dsv4.patching.evaluate import Evaluator, cases
from patch_dsv4.patching.evaluate.values import NONE, Inst, Made, Repeated, Seq, V, is_none, options
from patch_dsv4.patching.fingerprint import find_scope
from patch_dsv4.patching.patch import Context, Example, Patch, Scope

MODEL = "vllm/models/deepseek_v4/nvidia/model.py"
MTP = "vllm/models/deepseek_v4/nvidia/mtp.py"
#: Each switch and the value that turns the streams off.
SWITCHES = (("PATCH_DSV4_AUX_STREAMS", "0"), ("LNA_DSV4_AUX_STREAMS", "0"), ("DSV41_EXL3_SERIAL_STREAMS", "1"))

ANCHOR = "aux_stream_list = [torch.cuda.Stream() for _ in range(3)]"
REPLACEMENT = """
# patch-dsv4 (aux-streams): no auxiliary streams when PATCH_DSV4_AUX_STREAMS=0 (EXL3 attention).
aux_stream_list = (
    None if _patch_dsv4_aux_streams_off() else [torch.cuda.Stream() for _ in range(3)]
)
"""


# The helpers below are written into vLLM as they stand here (edits.helper_source): not formatted.
# fmt: off
def _patch_dsv4_aux_streams_off():
    """Whether this process builds DeepSeek-V4 without vLLM's auxiliary CUDA streams.

    Written by patch-dsv4 (aux-streams). True when PATCH_DSV4_AUX_STREAMS=0,
    LNA_DSV4_AUX_STREAMS=0 or DSV41_EXL3_SERIAL_STREAMS=1: exllamav3 kernels
    (EXL3 attention linears) keep one lock buffer per device, and two streams
    in them at once deadlock decode.
    """
    import os

    switches = (("PATCH_DSV4_AUX_STREAMS", "0"), ("LNA_DSV4_AUX_STREAMS", "0"), ("DSV41_EXL3_SERIAL_STREAMS", "1"))
    return any(os.environ.get(name, "").strip() == off for name, off in switches)
# fmt: on


def _aux_stream_assignments(scope: ast.AST) -> list[ast.Assign]:
    return [
        node
        for node in ast.walk(scope)
        if isinstance(node, ast.Assign) and any(ast.unparse(t) == "aux_stream_list" for t in node.targets)
    ]


STREAM = "torch.cuda.Stream"


def _makes_streams(value: V) -> bool:
    """A list of CUDA streams (made by a comprehension or a display), on every path."""

    def streams(option: V) -> bool:
        if isinstance(option, Made):
            return option.kind == f"list of {STREAM}"
        items = option.items if isinstance(option, Seq) else (option.item,) if isinstance(option, Repeated) else ()
        return bool(items) and all(isinstance(i, Made) and i.kind == STREAM for i in items)

    return all(streams(o) for o in options(value))


def _streams_off_by_a_setting(ctx: Context, file: str, cls: str) -> tuple[str | None, str]:
    """Evidence that ``cls.__init__`` makes no streams when a setting says so: (evidence or None, why not).

    ``__init__`` runs under every combination of the settings it reads (through the calls it makes): unset, "0"
    or "1" (``vllm.envs``: False, True). The fix: a name that holds a list of CUDA streams under one combination
    holds None under another. A setting that only changes how many streams there are, or a test of something
    else (``current_platform.is_rocm()``), is no fix: the streams are made whatever the user asks.
    """
    ev = Evaluator.of(ctx)
    owner = ev.follower.class_def(file, cls)
    init = ev.follower.method(owner, "__init__") if owner is not None else None
    if init is None:
        return None, f"{cls}.__init__ not found in {file}"
    # once with every setting unknown: the names that hold streams, and whether any may hold None instead (only
    # what may change the constructor's own names runs)
    local = {t.id for node in ast.walk(init.node) if isinstance(node, ast.Assign) for t in node.targets
             if isinstance(t, ast.Name)}  # fmt: skip
    first = ev.run(init, self_value=Inst(owner), focus=local, lazy=True)
    holders = {}
    for name, value in first.exit.items():
        if "." not in name and not name.startswith("<"):
            found = first.force(value, final=True)
            if any(_makes_streams(o) for o in options(found)):
                holders[name] = found
    if not holders:
        return None, f"{cls}.__init__ keeps no list of streams in a name"
    if not any(is_none(o) for value in holders.values() for o in options(value)):
        return None, f"{', '.join(sorted(holders))} holds streams on every path of {cls}.__init__"
    read = first.settings_read
    if not read:
        return None, f"{cls}.__init__ reads no setting"
    values = {case: ev.run(init, case, self_value=Inst(owner), focus=set(holders)) for case in
              cases.settings_cases(read)}  # fmt: skip
    for name in sorted(holders):
        off = [c for c, run in values.items() if is_none(run.force(run.exit.get(name, NONE)))]
        on = [c for c, run in values.items() if _makes_streams(run.force(run.exit.get(name, NONE)))]
        if off and on:
            evidence = f"{name} is None when {off[0]}, a list of streams when {on[0]}"
            helper = _helper_making(ev, init, name)
            if helper is not None:
                evidence += f"; {helper.file}: {helper.qualname} returns None when {off[0]}"
            return evidence, ""
    return None, f"{cls}.__init__ makes its streams whatever the settings it reads ({', '.join(sorted(read))}) say"


def _helper_making(ev: Evaluator, init, name: str):
    """The vLLM function whose result ``init`` assigns to ``name``, where one does."""
    frame = ev.follower.frame(init)
    for node in ast.walk(init.node):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            if any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
                callees = ev.follower.callees(frame, node.value)
                if callees:
                    return callees[0].defn
    return None


def _upstream_switch(file: str, cls: str):
    """Upstream made the streams optional itself: no streams when a setting (vllm.envs, the environment) says so.

    A condition that is not a setting (``None if current_platform.is_rocm() else [...]``, which some
    nightlies have) is not the fix: the streams are still built on CUDA whatever the user asks.
    """

    def probe(ctx: Context, tree: ast.Module | None) -> Outcome | NotProven | None:
        init = find_scope(tree, cls, "__init__") if tree is not None else None
        if tree is None or (init is not None and mentions_injected(init)):
            return None  # ours: the anchors tell applied from modified
        evidence, why = _streams_off_by_a_setting(ctx, file, cls)
        if evidence:
            return Outcome.upstream(f"{file}: {cls}.__init__ makes no streams when asked: {evidence}")
        return NotProven(why)

    return probe


def _lna_aux_streams(tree: ast.Module, scope: ast.AST | None) -> str | None:
    """lna-lab's patch_dsv4_aux_streams_env.py: the streams depend on LNA_DSV4_AUX_STREAMS alone."""
    if scope is None:
        return None
    for node in _aux_stream_assignments(scope):
        if "LNA_DSV4_AUX_STREAMS" in ast.unparse(node.value):
            return "aux_stream_list is None when LNA_DSV4_AUX_STREAMS=0"
    return None


LNA_AUX_STREAMS = ForeignEdit(
    script="patch_dsv4_aux_streams_env.py",
    recipe="lna-lab recipe",
    meaning=(
        "its switch honours only LNA_DSV4_AUX_STREAMS and only in the target model: the MTP draft keeps vLLM's three "
        "streams (the deadlock this patch prevents); take it over to switch both"
    ),
    found=_lna_aux_streams,
)


class AuxStreams(Patch):
    id = "aux-streams"
    title = "opt-in: PATCH_DSV4_AUX_STREAMS=0 keeps attention GEMMs off vLLM's auxiliary CUDA streams"
    serve_impact = "EXL3 attention linears run on vLLM's auxiliary CUDA streams (decode deadlock risk)"
    opt_in = True
    edits = tuple(
        ReplaceStatements(
            label=f"{what} builds no auxiliary streams when switched off",
            file=file,
            scope=Scope(cls, "__init__"),
            variants=(Variant(ANCHOR, REPLACEMENT, releases="0.28.0-0.34.0"),),
            helpers=(_patch_dsv4_aux_streams_off,),
            probe=_upstream_switch(file, cls),
            foreign=(LNA_AUX_STREAMS, miaai_kit.SERIAL_STREAMS_SWITCH),
            kept=tuple(other for other in miaai_kit.V41_EXL3_LOADING if other.file == file),
        )
        for what, file, cls in (
            ("target model", MODEL, "DeepseekV4Model"),
            ("MTP draft", MTP, "DeepSeekV4MultiTokenPredictor"),
            *((f"target model ({tag})", file, "DeepseekV4Model") for file, tag in in_layouts("nvidia/model.py")),
        )
    )


EXAMPLES = (
    Example(
        "streams-made-switchable",
        MTP,
        before="""\
import torch


class DeepSeekV4MultiTokenPredictor(nn.Module):
    def __init__(self, *, vllm_config, prefix=""):
        # Three aux streams shared across all MTP layers, mirroring DeepseekV4Model.
        aux_stream_list = [torch.cuda.Stream() for _ in range(3)]
        self.layers = build(aux_stream_list=aux_stream_list)
""",
        after='''\
import torch


def _patch_dsv4_aux_streams_off():
    """Whether this process builds DeepSeek-V4 without vLLM's auxiliary CUDA streams.

    Written by patch-dsv4 (aux-streams). True when PATCH_DSV4_AUX_STREAMS=0,
    LNA_DSV4_AUX_STREAMS=0 or DSV41_EXL3_SERIAL_STREAMS=1: exllamav3 kernels
    (EXL3 attention linears) keep one lock buffer per device, and two streams
    in them at once deadlock decode.
    """
    import os

    switches = (("PATCH_DSV4_AUX_STREAMS", "0"), ("LNA_DSV4_AUX_STREAMS", "0"), ("DSV41_EXL3_SERIAL_STREAMS", "1"))
    return any(os.environ.get(name, "").strip() == off for name, off in switches)


class DeepSeekV4MultiTokenPredictor(nn.Module):
    def __init__(self, *, vllm_config, prefix=""):
        # Three aux streams shared across all MTP layers, mirroring DeepseekV4Model.
        # patch-dsv4 (aux-streams): no auxiliary streams when PATCH_DSV4_AUX_STREAMS=0 (EXL3 attention).
        aux_stream_list = (
            None if _patch_dsv4_aux_streams_off() else [torch.cuda.Stream() for _ in range(3)]
        )
        self.layers = build(aux_stream_list=aux_stream_list)
''',
    ),
    Example(
        "upstream-made-them-optional",
        MTP,
        before="""\
class DeepSeekV4MultiTokenPredictor(nn.Module):
    def __init__(self, *, vllm_config, prefix=""):
        aux_stream_list = None if envs.VLLM_DSV4_NO_AUX_STREAMS else [torch.cuda.Stream() for _ in range(3)]
""",
        after=None,
        verdict=Verdict.UPSTREAM,
    ),
)
