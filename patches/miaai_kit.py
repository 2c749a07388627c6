"""MiaAI-Lab's kit (DeepSeek-V4.1-Flash EXL3 on two DGX Sparks), recognised by facts written here.

Its Dockerfile overlays EXL3 onto a vLLM image and runs five `overlay/patch_*.py` scripts at build time and at
every container start: plain string replacements, idempotent by a marker, with no backup and no revert. They
hard-code the nightly `vllm/models/deepseek_v4_1/` layout, so on a PyPI release (0.30.0-0.33.0) only their edits
of shared files land. Those that stand where a patch edits or its probes read:

- `patch_exl3_lm_head.py` (marker `[dsv41-exl3-lm-head]`), in V4's shared `deep_gemm_fp8_o_proj`
  (`nvidia/ops/o_proj.py`): `use_fp8` read through `getattr(wo_a, "weight", None)` and an `elif` that runs
  `wo_a.quant_method.apply` for an EXL3 `wo_a`. The BF16 path stays: dtype-policy keeps its verdict (upstream
  from 0.30.0), and the EXL3 branch, which patch-dsv4 has no equivalent for, stays where it is.
- `patch_sm120_block64.py` (marker `[dsv41-sm120-block64]`, helpers `_dsv41_*` appended to the files):
  `max_image_tokens` 0 on SM12x in the shared `sparse_swa.py` builder, through `_dsv41_text_only_swa()` (on
  0.30.0, whose text its anchor matches), which turns V4's wide image window off there too: wide-swa reads that
  builder; and no aux streams when `DSV41_EXL3_SERIAL_STREAMS=1`, in V4's
  `DeepSeekV4MultiTokenPredictor.__init__` (`nvidia/mtp.py`): the fix aux-streams carries, taken over by it.

On the nightly layout the same switch stands in V4.1's `DeepseekV4Model.__init__` (`deepseek_v4_1/nvidia/model.py`,
foreign in aux-streams), in the file where `patch_exl3_lm_head.py` renames V4.1's EXL3 `wo_a.slice.G` tensors in
`load_weights` (foreign in exl3-wo-a-slices, never taken for upstream's), part of its V4.1 EXL3 loading, which
patch-dsv4 does not take over: no take-over restores that file (apply leaves both edits).

Nothing of the kit's code is kept here: the shapes below are what its edits leave, as the notes on it describe.
"""

from __future__ import annotations

import ast

from patch_dsv4.patches._v41 import in_layouts
from patch_dsv4.patching.edits import ForeignEdit, KeptEdit
from patch_dsv4.patching.patch import Scope

KIT = "MiaAI-Lab kit"
EXL3_LM_HEAD = "patch_exl3_lm_head.py"
SM120_BLOCK64 = "patch_sm120_block64.py"
SERIAL_STREAMS = "DSV41_EXL3_SERIAL_STREAMS"  # "1": no aux streams (its cooperative-MoE extension requires it)
TEXT_ONLY_HELPER = "_dsv41_text_only_swa"

O_PROJ = "vllm/models/deepseek_v4/nvidia/ops/o_proj.py"
SPARSE_SWA = "vllm/v1/attention/backends/mla/sparse_swa.py"


def _calls(node: ast.AST, dotted: str) -> bool:
    return any(isinstance(sub, ast.Call) and ast.unparse(sub.func) == dotted for sub in ast.walk(node))


def _exl3_o_proj(tree: ast.Module, scope: ast.AST | None) -> str | None:
    """An `elif` of deep_gemm_fp8_o_proj that runs wo_a's quant method (the EXL3 branch)."""
    if scope is None:
        return None
    for node in ast.walk(scope):
        if isinstance(node, ast.If) and len(node.orelse) == 1 and isinstance(node.orelse[0], ast.If):
            branch = node.orelse[0]
            if any(_calls(stmt, "wo_a.quant_method.apply") for stmt in branch.body):
                return "an EXL3 wo_a (no .weight) runs wo_a.quant_method.apply in an elif before the BF16 path"
    return None


def _text_only_window(tree: ast.Module, scope: ast.AST | None) -> str | None:
    """max_image_tokens made 0 through the kit's appended _dsv41_text_only_swa()."""
    if scope is not None:
        for node in ast.walk(scope):
            if (
                isinstance(node, ast.Assign)
                and any(ast.unparse(t) == "self.max_image_tokens" for t in node.targets)
                and _calls(node.value, TEXT_ONLY_HELPER)
            ):
                return f"max_image_tokens is 0 on SM12x ({TEXT_ONLY_HELPER}())"
    return None


def _serial_streams(tree: ast.Module, scope: ast.AST | None) -> str | None:
    """aux_stream_list made None by the kit's DSV41_EXL3_SERIAL_STREAMS switch."""
    if scope is None:
        return None
    for node in ast.walk(scope):
        if (
            isinstance(node, ast.Assign)
            and any(ast.unparse(t) == "aux_stream_list" for t in node.targets)
            and SERIAL_STREAMS in ast.unparse(node.value)
        ):
            return f"aux_stream_list is None when {SERIAL_STREAMS}=1"
    return None


#: In V4's shared O projection, read by dtype-policy's probe (every V4 and V4.1 CUDA class calls it).
EXL3_O_PROJ = KeptEdit(
    script=EXL3_LM_HEAD,
    recipe=KIT,
    file=O_PROJ,
    scope=Scope(None, "deep_gemm_fp8_o_proj"),
    meaning=(
        "EXL3 wo_a serves through its quant method, BF16 and FP8 wo_a as vLLM has them (patch-dsv4 has no "
        "equivalent: remove the script and an EXL3 wo_a fails here)"
    ),
    found=_exl3_o_proj,
)
#: In the shared sparse-SWA builder, read by wide-swa's probe.
TEXT_ONLY_WINDOW = KeptEdit(
    script=SM120_BLOCK64,
    recipe=KIT,
    file=SPARSE_SWA,
    scope=Scope("DeepseekSparseSWAMetadataBuilder", "__init__"),
    meaning=(
        "on SM12x (DGX Spark, RTX PRO) image tokens of V4 and V4.1 get the plain causal window, not the wide image "
        "window (prefill rows stay 128 wide there; vision answers degrade), elsewhere nothing changes"
    ),
    found=_text_only_window,
)


def _v41_wo_a_slices(tree: ast.Module, scope: ast.AST | None) -> str | None:
    """V4.1's loader renames the EXL3 ``wo_a.slice.G`` tensors: ``name`` rebound by an expression naming them
    (vLLM's own loaders, ours and lna-lab's add stacked_params_mapping entries instead)."""
    for node in ast.walk(scope) if scope is not None else ():
        if (
            isinstance(node, ast.Assign)
            and [ast.unparse(t) for t in node.targets] == ["name"]
            and any(
                isinstance(sub, ast.Constant) and isinstance(sub.value, str) and "wo_a" in sub.value
                for sub in ast.walk(node.value)
            )
        ):
            return "load_weights renames the EXL3 wo_a.slice.G tensors to wo_a"
    return None


#: In V4.1's model file (nightly layout: the kit names deepseek_v4_1/), beside the streams aux-streams switches: a
#: take-over that restored the whole file would remove it, so it is refused there.
V41_EXL3_LOADING = tuple(
    KeptEdit(
        script=EXL3_LM_HEAD,
        recipe=KIT,
        file=file,
        scope=Scope("DeepseekV4Model", "load_weights"),
        meaning="V4.1's EXL3 pack loads its wo_a shards (patch-dsv4 has no equivalent for V4.1)",
        found=_v41_wo_a_slices,
    )
    for file, _tag in in_layouts("nvidia/model.py")
)
#: The same edit, where exl3-wo-a-slices would write its own: never planned behind it, never taken for upstream's.
V41_WO_A_SLICES = ForeignEdit(
    script=EXL3_LM_HEAD,
    recipe=KIT,
    meaning=(
        "it loads V4.1's EXL3 wo_a slices as this patch does, as part of the kit's V4.1 EXL3 loading, which "
        "patch-dsv4 does not take over (takeover refuses this file): leave it to the kit"
    ),
    found=_v41_wo_a_slices,
)
#: The aux-streams switch, in V4's MTP draft (and V4.1's model on the nightly layout): the fix aux-streams carries.
SERIAL_STREAMS_SWITCH = ForeignEdit(
    script=SM120_BLOCK64,
    recipe=KIT,
    meaning=(
        f"its switch works where its scripts found their text: on a release only in V4's MTP draft, and V4's target "
        f"model keeps vLLM's three streams (the EXL3 deadlock); take it over so that {SERIAL_STREAMS}=1 (or "
        "PATCH_DSV4_AUX_STREAMS=0) switches both"
    ),
    found=_serial_streams,
)
