"""Trees as the recipes' patch scripts leave them ("foreign edits"), built from the scripts' published behaviour.

Before patch-dsv4, users patched vLLM with six public scripts (shared/notes/recipes.md lists them):
three from the DGX-Spark recipe (vcruz305/DeepSeek-V4-Flash-Vision-EXL3-MixedK-DGX-Spark-recipe,
``scripts/``) and three from lna-lab (lna-lab/dsv4-carve, ``recipe-lna/``). Each function here takes a
writable copy of a real release (``tests.releases.copy_tree(pristine_tree(v), dest)``, the directory
holding ``vllm/`` and ``vllm-<v>.dist-info``) and leaves it as that script would:

- the same files changed, in the same classes and functions, with statements of the same structure and
  the same injected names (the bodies we insert are short stand-ins written here, not the scripts' code:
  they parse, and they keep the shapes and names a structural recogniser keys on);
- the same backups, named as the script names them and made as it makes them (``shutil.copy2`` of the
  file as it is just before the script's write, only when that backup is absent), so the first script to
  touch a file backs up pip's bytes and a later one's backup holds the earlier edits;
- the same refusals: ``RecipeRefuses`` is raised where the script exits non-zero, after writing what the
  script wrote before failing (stock028 on 0.30.0 writes flashinfer_sparse.py, then refuses model.py).

The scripts check no versions: every decision is an exact-text anchor count, and these functions make the
same decisions on the same texts. Where the facts say what a script does to a release's own files
(``KNOWN``) and the files it reads are still that release's, the outcome is checked against them: a
difference raises AssertionError, so a test notices a release or a builder that changed.

Files are written the way ``tests.releases.hand_edit`` does (unlink, then write), so hard-linked siblings
in the shared cache are never touched. Nothing here imports vLLM or torch.
"""

from __future__ import annotations

import ast
import functools
import shutil
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from patch_dsv4.tree.environment import record_digest

DSV4 = "vllm/models/deepseek_v4"
NVIDIA = f"{DSV4}/nvidia"
FLASHINFER = f"{NVIDIA}/flashinfer_sparse.py"
MODEL = f"{NVIDIA}/model.py"
DSPARK = f"{NVIDIA}/dspark.py"
MTP = f"{NVIDIA}/mtp.py"
NVIDIA_VL = f"{NVIDIA}/vl_model.py"
COMMON_VL = f"{DSV4}/common/vl_model.py"
COMPRESSOR = f"{DSV4}/compressor.py"
ATTENTION = f"{DSV4}/attention.py"
PACKAGE_INIT = f"{DSV4}/__init__.py"

VISION_CLASS = "DeepseekV4ForConditionalGeneration"

# The published script behind each builder, and the suffix of the backup it leaves beside each file it writes.
DGX_SPARK_REPO = "vcruz305/DeepSeek-V4-Flash-Vision-EXL3-MixedK-DGX-Spark-recipe"
LNA_REPO = "lna-lab/dsv4-carve"
SCRIPT_PATHS = {  # (repository, path)
    "stock028": (DGX_SPARK_REPO, "scripts/patch_dsv4_stock028.py"),
    "stream_load": (DGX_SPARK_REPO, "scripts/patch_dsv4_vl_stream_load.py"),
    "wide_swa": (DGX_SPARK_REPO, "scripts/patch_dsv4_vl_sm120_wide_swa.py"),
    "dense_exl3": (LNA_REPO, "recipe-lna/patch_dsv4_dense_exl3.py"),
    "attention_compressor": (LNA_REPO, "recipe-lna/patch_dsv4_attention_compressor_exl3.py"),
    "aux_streams": (LNA_REPO, "recipe-lna/patch_dsv4_aux_streams_env.py"),
}
BACKUP_SUFFIX = {
    "stock028": ".orig",
    "stream_load": ".orig-vlstream",
    "wide_swa": ".orig-wideswa",
    "dense_exl3": ".orig-lna",
    "attention_compressor": ".orig-lna2",
    "aux_streams": ".orig-lna3",
}
# The files each script reads (and may write), in the order it handles them.
SCRIPT_FILES = {
    "stock028": (FLASHINFER, MODEL, DSPARK),
    "stream_load": (NVIDIA_VL,),
    "wide_swa": (FLASHINFER,),
    "dense_exl3": (COMPRESSOR, FLASHINFER, MODEL),
    "attention_compressor": (ATTENTION,),
    "aux_streams": (MODEL,),
}

# What each script does to a release's own files: None where it applies, else the file it refuses at
# (anything written before that file stays written). Read from the scripts' anchors, checked on the trees.
KNOWN: dict[str, dict[str, str | None]] = {
    # 0.29/0.30 lost the e_score_correction_bias anchor in load_weights; 0.31+ have one 128-col _o_proj left.
    "stock028": {
        "0.28.0": None,
        "0.29.0": MODEL,
        "0.30.0": MODEL,
        "0.31.0": FLASHINFER,
        "0.32.0": FLASHINFER,
        "0.33.0": FLASHINFER,
    },
    # No nvidia/vl_model.py before 0.30 (exit 2); from 0.30 it only re-exports common/vl_model.py (exit 1).
    "stream_load": {v: NVIDIA_VL for v in ("0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0")},
    # The SM120 dual-cache prefill call is byte-identical in every release, and so is `import torch`.
    "wide_swa": {v: None for v in ("0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0")},
    # 0.31+: compressor.py is written, then flashinfer_sparse.py has one baseline _o_proj, not two.
    "dense_exl3": {
        "0.28.0": None,
        "0.29.0": None,
        "0.30.0": None,
        "0.31.0": FLASHINFER,
        "0.32.0": FLASHINFER,
        "0.33.0": FLASHINFER,
    },
    "attention_compressor": {v: None for v in ("0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0")},
    "aux_streams": {v: None for v in ("0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0")},
}


class RecipeRefuses(Exception):
    """A script stopped where the real one exits non-zero; what it wrote before that is in ``written``."""

    def __init__(self, script: str, relpath: str, reason: str, *, exit_code: int = 1, written: Sequence[str] = ()):
        super().__init__(f"{script}: {relpath}: {reason} (exit {exit_code})")
        self.script = script
        self.relpath = relpath
        self.reason = reason
        self.exit_code = exit_code
        self.written = list(written)
        # Set by run_chain when it propagates the refusal.
        self.chain_changed: list[str] = []
        self.chain_ran: list[str] = []


# -- files ----------------------------------------------------------------------------------------------
def _check_version(tree: Path, version: str) -> None:
    found = sorted(p.name for p in tree.glob("vllm-*.dist-info"))
    assert f"vllm-{version}.dist-info" in found, f"{tree} is not vLLM {version}: dist-info {found}"


def _read(tree: Path, rel: str) -> str:
    return (tree / rel).read_text(encoding="utf-8")


def _write(tree: Path, rel: str, text: str) -> None:
    """Replace a file without writing through its inode (hard-linked siblings stay as they are)."""
    path = tree / rel
    probe = tree
    for part in Path(rel).parts[:-1]:
        probe = probe / part
        assert not probe.is_symlink(), f"{path} lies under {probe}, a link into the shared cache"
    try:
        ast.parse(text, filename=str(path))
    except SyntaxError as exc:  # a stand-in of ours that does not parse is a bug here, not a refusal
        raise AssertionError(f"recipe_trees wrote a {rel} that does not parse: {exc}") from exc
    path.unlink()
    path.write_text(text, encoding="utf-8")


def _backup(tree: Path, rel: str, suffix: str) -> None:
    """The scripts' backup: a copy of the file as it is now, made only if that backup does not exist yet."""
    path = tree / rel
    backup = path.with_name(path.name + suffix)
    if not backup.exists():
        shutil.copy2(path, backup)


def _once(text: str, old: str, new: str, what: str) -> str:
    """Our own fixture edits (not a script's): the release text must be there exactly once."""
    n = text.count(old)
    assert n == 1, f"recipe_trees: expected the {what} once, found {n}: {old[:70]!r}"
    return text.replace(old, new)


def _record_line(tree: Path, rel: str) -> str:
    data = (tree / rel).read_bytes()
    return f"{rel},sha256={record_digest(data)},{len(data)}"


def rewrite_record(tree: Path, relpaths: Iterable[str]) -> None:
    """Make the dist-info RECORD describe ``relpaths`` as they now are: changed, added or removed files."""
    (dist_info,) = tree.glob("vllm-*.dist-info")
    record = dist_info / "RECORD"
    pending = dict.fromkeys(relpaths)
    out = []
    for line in record.read_text().splitlines():
        path = line.split(",", 1)[0]
        if path in pending:
            del pending[path]
            if not (tree / path).exists():
                continue  # removed
            line = _record_line(tree, path)
        out.append(line)
    out.extend(_record_line(tree, path) for path in pending if (tree / path).exists())  # added
    record.unlink()
    record.write_text("\n".join(out) + "\n")


def _release_files(version: str, tree: Path, rels: Iterable[str]) -> bool:
    """Whether ``rels`` in ``tree`` are byte for byte the release's own (absent where it has none)."""
    from tests.releases import RELEASES, pristine_tree

    if version not in RELEASES:
        return False
    pristine = pristine_tree(version)
    for rel in rels:
        ours, theirs = tree / rel, pristine / rel
        if ours.exists() != theirs.exists():
            return False
        if ours.exists() and ours.read_bytes() != theirs.read_bytes():
            return False
    return True


def _script(name: str) -> Callable:
    """Check a builder against KNOWN when the files its script reads are still the release's."""

    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def run(tree: Path, version: str, **kwargs) -> list[str]:
            tree = Path(tree)
            _check_version(tree, version)
            expected = KNOWN[name].get(version, "unknown")
            checked = expected != "unknown" and _release_files(version, tree, SCRIPT_FILES[name])
            try:
                changed = fn(tree, version, **kwargs)
            except RecipeRefuses as refusal:
                if checked and refusal.relpath != expected:
                    where = "apply" if expected is None else f"refuse at {expected}"
                    raise AssertionError(
                        f"recipe_trees: {name} on pristine {version} was expected to {where}, "
                        f"but refused at {refusal.relpath}: {refusal.reason}"
                    ) from refusal
                raise
            if checked and expected is not None:
                raise AssertionError(
                    f"recipe_trees: {name} on pristine {version} was expected to refuse at {expected}, "
                    f"but applied (changed {changed})"
                )
            return changed

        return run

    return wrap


def _exact_edit(
    script: str,
    tree: Path,
    rel: str,
    anchor: str,
    patched: str,
    expect: int,
    suffix: str,
    changed: list[str],
    partial: str,
) -> None:
    """The DGX-Spark stock028 and lna dense_exl3 edit step: already / partial / anchor count / backup / write."""
    text = _read(tree, rel)
    have = text.count(patched)
    if have == expect:
        return  # "already patched"
    if have:
        raise RecipeRefuses(script, rel, f"partially patched ({have}/{expect}); {partial}", written=changed)
    n = text.count(anchor)
    if n != expect:
        raise RecipeRefuses(script, rel, f"expected {expect} anchor(s), found {n}", written=changed)
    _backup(tree, rel, suffix)
    _write(tree, rel, text.replace(anchor, patched))
    changed.append(rel)


# -- release text the scripts anchor on ------------------------------------------------------------------
O_PROJ_SIGNATURE = "    def _o_proj(self, o: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:\n"
O_PROJ_FP8_RETURN = "        return deep_gemm_fp8_o_proj(\n"
O_PROJ_BASELINE = O_PROJ_SIGNATURE + O_PROJ_FP8_RETURN

LOAD_WEIGHTS_PLAIN_PARAM = (
    "                    if is_pp_missing_parameter(name, self):\n"
    "                        continue\n"
    "                    param = params_dict[name]\n"
)
DSPARK_CONFIDENCE = '            name = mapped\n            if "confidence_head." in name:\n'

VL_EAGER_SORT_MAPPER = "        mapped = sorted(self.hf_to_vllm_mapper.apply(weights), key=lambda x: x[0])\n"
VL_EAGER_SORT_ITER = "mapped = iter(sorted(mapped, key=lambda x: x[0]))"

SM120_DUAL_CACHE_PREFILL = """\
            flashinfer_trtllm_batch_decode_sparse_mla_dsv4(
                query=q_chunk,
                swa_kv_cache=swa_kv_paged,
                workspace_buffer=self._get_workspace(q.device),
                sparse_indices=swa_indices_chunk,
                compressed_kv_cache=extra_kv_paged,
                out=output[query_start:query_end],
                bmm1_scale=self.scale,
                sinks=self.attn_sink,
                kv_layout="NHD",
                swa_topk_lens=swa_lens_chunk,
                extra_sparse_indices=extra_sparse_indices_chunk,
                extra_sparse_topk_lens=extra_sparse_lengths_chunk,
            )
"""

COMPRESSOR_QUANT_NONE = (
    "            bias=False,\n"
    "            return_bias=False,\n"
    "            quant_config=None,\n"
    "            disable_tp=True,\n"
)
STACKED_FUSED_WKV_WGATE_END = (
    '            ("compressor.fused_wkv_wgate", "compressor.wkv", 0),\n'
    '            ("compressor.fused_wkv_wgate", "compressor.wgate", 1),\n'
    "        ]\n"
)
KV_SCORE_MM = {
    "compressor": (
        "                return torch.mm(\n"
        "                    hidden_states,\n"
        "                    compressor.fused_wkv_wgate.weight.T,\n"
        "                    out_dtype=torch.float32,\n"
        "                )\n"
    ),
    "indexer.compressor": (
        "                return torch.mm(\n"
        "                    hidden_states,\n"
        "                    indexer.compressor.fused_wkv_wgate.weight.T,\n"
        "                    out_dtype=torch.float32,\n"
        "                )\n"
    ),
}
AUX_STREAMS = "        aux_stream_list = [torch.cuda.Stream() for _ in range(3)]\n"


# -- stock028 (DGX-Spark) -----------------------------------------------------------------------------
STOCK028_O_PROJ = (
    O_PROJ_SIGNATURE
    + "        if self.wo_a.weight.dtype != torch.float8_e4m3fn:\n"
    + "            # recipe_trees stand-in for patch_dsv4_stock028.py: BF16 wo_a has no FP8 block scales.\n"
    + "            from vllm.v1.attention.ops.rocm_aiter_mla_sparse import rocm_inv_rope_einsum\n"
    + "\n"
    + "            z = rocm_inv_rope_einsum(self.rotary_emb, o, positions, self.rope_head_dim,"
    + " self.n_local_groups, self.o_lora_rank, self.wo_a)\n"
    + "            return self.wo_b(z.flatten(1))\n"
    + O_PROJ_FP8_RETURN
)
STOCK028_LOAD_WEIGHTS = (
    "                    if is_pp_missing_parameter(name, self):\n"
    "                        continue\n"
    '                    if name.endswith(".ffn.gate.e_score_correction_bias") and name not in params_dict:\n'
    "                        continue  # recipe_trees stand-in: hash-routed layers have no correction bias\n"
    "                    param = params_dict[name]\n"
)
STOCK028_DSPARK = (
    "            name = mapped\n"
    '            if name.endswith(".ffn.gate.bias_vl"):\n'
    "                continue  # recipe_trees stand-in: the vision routing bias is not loaded by the draft\n"
    '            if "confidence_head." in name:\n'
)


@_script("stock028")
def apply_stock028(tree: Path, version: str) -> list[str]:
    """scripts/patch_dsv4_stock028.py (DGX-Spark recipe), three exact-text edits under nvidia/.

    In this order, each one "already patched" (no write) when its patched text is there ``expect`` times,
    refused when it is there fewer times or the anchor count is not ``expect``, else backed up to
    ``<file>.orig`` (if absent) and written:
    flashinfer_sparse.py, both ``_o_proj`` (SM100 ``DeepseekV4FlashInferMLAAttention`` and SM120
    ``DeepseekV4FlashInferSM120Attention``): ``if self.wo_a.weight.dtype != torch.float8_e4m3fn:`` (import
    ``rocm_inv_rope_einsum``, ``z = rocm_inv_rope_einsum(...)``, ``return self.wo_b(z.flatten(1))``)
    before the FP8 ``return deep_gemm_fp8_o_proj(``; model.py ``DeepseekV4Model.load_weights``: ``if
    name.endswith(".ffn.gate.e_score_correction_bias") and name not in params_dict: continue`` between the
    plain branch's ``is_pp_missing_parameter`` check and ``param = params_dict[name]``; dspark.py
    ``DSparkDeepseekV4ForCausalLM.load_weights``: ``if name.endswith(".ffn.gate.bias_vl"): continue`` after
    ``name = mapped``. Applies on 0.28.0; 0.29.0 and 0.30.0 write flashinfer_sparse.py then refuse
    model.py; 0.31.0-0.33.0 refuse flashinfer_sparse.py (one matching ``_o_proj``), writing nothing.
    """
    if not (tree / NVIDIA).is_dir():
        raise RecipeRefuses("stock028", NVIDIA, "missing")
    changed: list[str] = []
    for rel, anchor, patched, expect in (
        (FLASHINFER, O_PROJ_BASELINE, STOCK028_O_PROJ, 2),
        (MODEL, LOAD_WEIGHTS_PLAIN_PARAM, STOCK028_LOAD_WEIGHTS, 1),
        (DSPARK, DSPARK_CONFIDENCE, STOCK028_DSPARK, 1),
    ):
        if not (tree / rel).is_file():
            raise RecipeRefuses("stock028", rel, "missing (the script dies reading it)", written=changed)
        _exact_edit("stock028", tree, rel, anchor, patched, expect, ".orig", changed, "restore .orig first")
    return changed


# -- stream_load (DGX-Spark) ----------------------------------------------------------------------------
STREAM_LOAD_MARK = "vcruz305 recipe patch: stream instead of sorted()"
STREAM_LOAD_NEW = f"""\
        # {STREAM_LOAD_MARK} -- recipe_trees stand-in: language_model.* first, the rest deferred.
        def _stream_language_model_first(mapped_iter):
            held = []
            for item in mapped_iter:
                if not item[0].startswith("language_model."):
                    held.append(item)
                    continue
                yield item
            yield from held

        mapped = _stream_language_model_first(self.hf_to_vllm_mapper.apply(weights))
"""


@_script("stream_load")
def apply_stream_load(tree: Path, version: str) -> list[str]:
    """scripts/patch_dsv4_vl_stream_load.py (DGX-Spark recipe): nvidia/vl_model.py only.

    Refuses (exit 2) when nvidia/vl_model.py is absent (0.28.0, 0.29.0); "already patched" when its marker
    comment is there; refuses (exit 1) unless the line ``mapped = sorted(self.hf_to_vllm_mapper.apply(
    weights), key=lambda x: x[0])`` (8-space indent) is there exactly once; else backs up
    ``vl_model.py.orig-vlstream`` (if absent) and replaces that line, in
    ``DeepseekV4ForConditionalGeneration.load_weights``, by a nested generator
    ``def _stream_language_model_first(mapped_iter)`` then ``mapped =
    _stream_language_model_first(self.hf_to_vllm_mapper.apply(weights))``. Written for the 0.28.1rc1.dev337
    nightly; every release refuses (0.30.0+: the file only re-exports common/vl_model.py). It applies to
    ``make_nvidia_vl_model_nightly(..., eager_sort="sorted-mapper")``, not to its default "iter" form.
    """
    if not (tree / NVIDIA_VL).is_file():
        raise RecipeRefuses("stream_load", NVIDIA_VL, "missing: this vLLM has no DeepSeek-V4 vision model", exit_code=2)
    src = _read(tree, NVIDIA_VL)
    if STREAM_LOAD_MARK in src:
        return []
    n = src.count(VL_EAGER_SORT_MAPPER)
    if n != 1:
        raise RecipeRefuses("stream_load", NVIDIA_VL, f"expected 1 anchor, found {n}")
    _backup(tree, NVIDIA_VL, ".orig-vlstream")
    _write(tree, NVIDIA_VL, src.replace(VL_EAGER_SORT_MAPPER, STREAM_LOAD_NEW))
    return [NVIDIA_VL]


# -- wide_swa (DGX-Spark) -------------------------------------------------------------------------------
WIDE_SWA_MARK = "vcruz305 recipe patch: sliced SM120 prefill for wide window rows"
WIDE_SWA_BRANCH = f"""\
            if swa_indices_chunk.shape[-1] > _SM120_SWA_SLICE_WIDTH:
                # {WIDE_SWA_MARK} (recipe_trees stand-in)
                _sm120_sparse_mla_sliced_prefill(
                    q_chunk, swa_kv_paged, swa_indices_chunk, swa_lens_chunk, extra_kv_paged,
                    extra_sparse_indices_chunk, extra_sparse_lengths_chunk, output[query_start:query_end],
                    self.scale, self.attn_sink, self._get_workspace(q.device),
                )
                continue
"""
WIDE_SWA_HELPER = f'''

# {WIDE_SWA_MARK} (helper; recipe_trees stand-in)
_SM120_SWA_SLICE_WIDTH = 128


def _sm120_sparse_mla_sliced_prefill(
    q: torch.Tensor,
    swa_kv_cache: torch.Tensor,
    swa_indices: torch.Tensor,
    swa_lens: torch.Tensor,
    compressed_kv_cache: torch.Tensor | None,
    extra_indices: torch.Tensor | None,
    extra_lens: torch.Tensor | None,
    out: torch.Tensor,
    sm_scale: float,
    sinks: torch.Tensor | None,
    workspace_buffer: torch.Tensor,
) -> None:
    """Stand-in for the recipe's helper: 128-wide slices through FlashInfer-0.6-private SM120 calls
    (fi_core._trtllm_batch_decode_sparse_mla_sm120), merged with exp() of the kernel's base-2 LSE."""
    from flashinfer.mla import _core as fi_core

    raise NotImplementedError(f"recipe_trees stand-in ({{fi_core.__name__}})")
'''


@_script("wide_swa")
def apply_wide_swa(tree: Path, version: str) -> list[str]:
    """scripts/patch_dsv4_vl_sm120_wide_swa.py (DGX-Spark recipe): nvidia/flashinfer_sparse.py only.

    Refuses (exit 2) when the file is absent; "already patched" when its marker comment is there; refuses
    (exit 1) unless the dual-cache ``flashinfer_trtllm_batch_decode_sparse_mla_dsv4(...)`` call of
    ``DeepseekV4FlashInferSM120Attention._forward_prefill`` (12-space indent, exact keyword list) is there
    once, or when the text has no ``import torch\\n``. Else backs up ``flashinfer_sparse.py.orig-wideswa``
    (if absent), inserts immediately before that call, inside the same loop, ``if
    swa_indices_chunk.shape[-1] > _SM120_SWA_SLICE_WIDTH: _sm120_sparse_mla_sliced_prefill(11 positional
    args); continue``, and appends at the end of the module ``_SM120_SWA_SLICE_WIDTH = 128`` and ``def
    _sm120_sparse_mla_sliced_prefill(...) -> None``. No version or FlashInfer check: applies on every
    release 0.28.0-0.33.0 (the call is identical in all of them).
    """
    if not (tree / FLASHINFER).is_file():
        raise RecipeRefuses("wide_swa", FLASHINFER, "missing", exit_code=2)
    src = _read(tree, FLASHINFER)
    if WIDE_SWA_MARK in src:
        return []
    n = src.count(SM120_DUAL_CACHE_PREFILL)
    if n != 1:
        raise RecipeRefuses("wide_swa", FLASHINFER, f"expected 1 anchor, found {n}")
    if "import torch\n" not in src:
        raise RecipeRefuses("wide_swa", FLASHINFER, "no torch import")
    _backup(tree, FLASHINFER, ".orig-wideswa")
    new = src.replace(SM120_DUAL_CACHE_PREFILL, WIDE_SWA_BRANCH + SM120_DUAL_CACHE_PREFILL) + WIDE_SWA_HELPER
    _write(tree, FLASHINFER, new)
    return [FLASHINFER]


# -- dense_exl3 (lna) -----------------------------------------------------------------------------------
DENSE_EXL3_MARKER = 'exl3_linears = getattr(self.wo_a, "_exl3_linears", None)'
DENSE_EXL3_COMPRESSOR = (
    "            bias=False,\n"
    "            return_bias=False,\n"
    "            # LNA-LAB (recipe_trees stand-in): the dense EXL3 overlay needs the quant config.\n"
    "            quant_config=vllm_config.quant_config,\n"
    "            disable_tp=True,\n"
)
DENSE_EXL3_O_PROJ = (
    O_PROJ_SIGNATURE
    + f"        {DENSE_EXL3_MARKER}\n"
    + "        if exl3_linears is not None:\n"
    + "            # LNA-LAB (recipe_trees stand-in): one rank-local LinearEXL3 after the inverse RoPE.\n"
    + "            z = exl3_linears[0].forward(o.reshape(o.shape[0], -1).half(), {}, out_dtype=torch.float32)\n"
    + "            return self.wo_b(z.to(torch.bfloat16).flatten(1))\n"
    + '        wo_a_weight = getattr(self.wo_a, "weight", None)\n'
    + "        if wo_a_weight is None:\n"
    + '            raise RuntimeError("wo_a: no dense weight and no EXL3 linears")\n'
    + "        if wo_a_weight.dtype != torch.float8_e4m3fn:\n"
    + "            from vllm.v1.attention.ops.rocm_aiter_mla_sparse import rocm_inv_rope_einsum\n"
    + "\n"
    + "            z = rocm_inv_rope_einsum(self.rotary_emb, o, positions, self.rope_head_dim,"
    + " self.n_local_groups, self.o_lora_rank, self.wo_a)\n"
    + "            return self.wo_b(z.flatten(1))\n"
    + O_PROJ_FP8_RETURN
)
DENSE_EXL3_STACKED = (
    '            ("compressor.fused_wkv_wgate", "compressor.wkv", 0),\n'
    '            ("compressor.fused_wkv_wgate", "compressor.wgate", 1),\n'
    "            # LNA-LAB (recipe_trees stand-in): one pre-fusion wo_a slice per TP rank.\n"
    + "".join(f'            ("attn.wo_a", "attn.wo_a.slice.{i}", {i}),\n' for i in range(8))
    + "        ]\n"
)


@_script("dense_exl3")
def apply_dense_exl3(tree: Path, version: str) -> list[str]:
    """recipe-lna/patch_dsv4_dense_exl3.py (lna): compressor.py, nvidia/flashinfer_sparse.py, nvidia/model.py.

    Refuses (exit 2, nothing written) when any of the three is absent. Then, in order, each with backup
    ``<file>.orig-lna`` (if absent): compressor.py ``DeepseekCompressor.__init__``, the
    ``fused_wkv_wgate = MergedColumnParallelLinear(...)`` call gets ``quant_config=vllm_config.quant_config``
    instead of ``quant_config=None``; flashinfer_sparse.py, "already patched" with two
    ``exl3_linears = getattr(self.wo_a, "_exl3_linears", None)``, refused with one, else both ``_o_proj``
    bodies (pip's baseline, or stock028's) are replaced by: that marker assignment, ``if exl3_linears is not
    None: ... return self.wo_b(...)``, ``wo_a_weight = getattr(self.wo_a, "weight", None)``, ``if
    wo_a_weight is None: raise RuntimeError``, ``if wo_a_weight.dtype != torch.float8_e4m3fn:``
    (``rocm_inv_rope_einsum`` branch), then the FP8 ``return deep_gemm_fp8_o_proj(``; any other text
    (one ``_o_proj`` as on 0.31+, or our dtype-policy's) is refused; model.py
    ``DeepseekV4Model.load_weights``: eight ``("attn.wo_a", "attn.wo_a.slice.N", N)`` entries close
    ``stacked_params_mapping``. Applies on 0.28.0-0.30.0 (also over stock028); on 0.31.0-0.33.0 it writes
    compressor.py, then refuses flashinfer_sparse.py.
    """
    missing = [rel for rel in (COMPRESSOR, FLASHINFER, MODEL) if not (tree / rel).is_file()]
    if missing:
        raise RecipeRefuses("dense_exl3", missing[0], "missing DSV4 vLLM file(s)", exit_code=2)
    changed: list[str] = []
    guess = "refusing to guess"
    _exact_edit(
        "dense_exl3", tree, COMPRESSOR, COMPRESSOR_QUANT_NONE, DENSE_EXL3_COMPRESSOR, 1, ".orig-lna", changed, guess
    )
    text = _read(tree, FLASHINFER)
    have = text.count(DENSE_EXL3_MARKER)
    if have == 1:
        raise RecipeRefuses("dense_exl3", FLASHINFER, "partially patched; refusing to guess", written=changed)
    if have != 2:
        baseline, stock = text.count(O_PROJ_BASELINE), text.count(STOCK028_O_PROJ)
        if baseline == 2 and stock == 0:
            new = text.replace(O_PROJ_BASELINE, DENSE_EXL3_O_PROJ)
        elif stock == 2 and baseline == 0:
            new = text.replace(STOCK028_O_PROJ, DENSE_EXL3_O_PROJ)
        else:
            raise RecipeRefuses(
                "dense_exl3",
                FLASHINFER,
                f"expected two matching _o_proj methods; baseline={baseline}, stock028={stock}",
                written=changed,
            )
        _backup(tree, FLASHINFER, ".orig-lna")
        _write(tree, FLASHINFER, new)
        changed.append(FLASHINFER)
    _exact_edit(
        "dense_exl3", tree, MODEL, STACKED_FUSED_WKV_WGATE_END, DENSE_EXL3_STACKED, 1, ".orig-lna", changed, guess
    )
    return changed


# -- attention_compressor (lna) -------------------------------------------------------------------------
def _kv_score_helper(name: str, fallback: str) -> str:
    """Our stand-in for the lna helper; v2 (``_lna_kv_score_v2``) also reads ``LNA_EXL3_DENSE_STRICT``."""
    if name.endswith("_v2"):
        shards = (
            "        import os\n\n"
            '        strict = os.environ.get("LNA_EXL3_DENSE_STRICT") == "1"\n'
            '        raise NotImplementedError(f"recipe_trees stand-in for the EXL3 shard path (strict={strict})")\n'
        )
    else:
        shards = '        raise NotImplementedError("recipe_trees stand-in for the EXL3 shard path")\n'
    return (
        f"\ndef {name}(module, hidden_states):\n"
        '    """LNA-LAB (recipe_trees stand-in): fused_wkv_wgate as a BF16 weight, or as vllm-exl3 shards."""\n'
        '    linears = getattr(module, "_exl3_linears", None)\n'
        "    if linears:\n"
        f"{shards}"
        f"    return torch.mm(hidden_states, {fallback}.T, out_dtype=torch.float32)\n\n"
    )


def _kv_score_calls(name: str) -> dict[str, str]:
    return {
        who: f"                return {name}({who}.fused_wkv_wgate, hidden_states)  # LNA-LAB\n" for who in KV_SCORE_MM
    }


@_script("attention_compressor")
def apply_attention_compressor(tree: Path, version: str, *, helper: str = "v2") -> list[str]:
    """recipe-lna/patch_dsv4_attention_compressor_exl3.py (lna): attention.py only, backup ``attention.py.orig-lna2``.

    In ``DeepseekV4Attention._run_parallel_input_projections``, the nested ``compressor_kv_score`` and
    ``indexer_compressor_kv_score`` each ``return torch.mm(hidden_states, <x>.fused_wkv_wgate.weight.T,
    out_dtype=torch.float32)`` becomes ``return _lna_kv_score_v2(<x>.fused_wkv_wgate, hidden_states)``
    (each anchor must be there once, else refused, nothing written); the module function
    ``def _lna_kv_score_v2(module, hidden_states)`` (reads ``LNA_EXL3_DENSE_STRICT``; falls back to
    ``torch.mm(hidden_states, module.weight.T, ...)``) is inserted before the first top-level ``class``
    (``DeepseekV4Attention``). "Already patched" when ``def _lna_kv_score_v2(`` is there. On a tree the
    older version patched (``helper="v1"``: helper ``_lna_kv_score``, no strict env, its rerun check any
    ``_lna_kv_score`` substring), v2 replaces the old helper in place and renames the calls; that path leaves
    the fallback reading ``module.fused_wkv_wgate.weight.T`` (the script skips its fix-up there). Applies
    on every release 0.28.0-0.33.0.
    """
    assert helper in ("v1", "v2"), helper
    name = "_lna_kv_score_v2" if helper == "v2" else "_lna_kv_score"
    text = _read(tree, ATTENTION)
    if helper == "v2" and "def _lna_kv_score_v2(" in text:
        return []
    if helper == "v1" and "_lna_kv_score" in text:
        return []
    if helper == "v2" and "def _lna_kv_score(" in text:
        start = text.index("\ndef _lna_kv_score(")
        end = text.find("\n\nclass ", start)
        if end < 0:
            raise RecipeRefuses("attention_compressor", ATTENTION, "old _lna_kv_score helper has no class boundary")
        end += 2
        old_fallback = "module.fused_wkv_wgate.weight"
        text = text[:start] + "\n" + _kv_score_helper("_lna_kv_score_v2", old_fallback) + text[end:]
        text = text.replace("_lna_kv_score(", "_lna_kv_score_v2(")
        _backup(tree, ATTENTION, ".orig-lna2")
        _write(tree, ATTENTION, text)
        return [ATTENTION]
    for who, old in KV_SCORE_MM.items():
        n = text.count(old)
        if n != 1:
            raise RecipeRefuses("attention_compressor", ATTENTION, f"expected 1 anchor, found {n}: {who}")
        text = text.replace(old, _kv_score_calls(name)[who])
    idx = text.find("\nclass ")
    if idx < 0:
        raise RecipeRefuses("attention_compressor", ATTENTION, "no top-level class (the script dies)")
    text = text[:idx] + "\n" + _kv_score_helper(name, "module.weight") + text[idx:]
    _backup(tree, ATTENTION, ".orig-lna2")
    _write(tree, ATTENTION, text)
    return [ATTENTION]


# -- aux_streams (lna) ----------------------------------------------------------------------------------
AUX_STREAMS_ENV = "LNA_DSV4_AUX_STREAMS"
AUX_STREAMS_NEW = (
    "        import os as _lna_os  # LNA-LAB (recipe_trees stand-in)\n"
    f'        aux_stream_list = (None if _lna_os.environ.get("{AUX_STREAMS_ENV}", "1") == "0"\n'
    "                           else [torch.cuda.Stream() for _ in range(3)])  # LNA-LAB\n"
)


@_script("aux_streams")
def apply_aux_streams(tree: Path, version: str) -> list[str]:
    """recipe-lna/patch_dsv4_aux_streams_env.py (lna): nvidia/model.py only, backup ``model.py.orig-lna3``.

    "Already patched" when ``LNA_DSV4_AUX_STREAMS`` is anywhere in the file; refused unless ``aux_stream_list
    = [torch.cuda.Stream() for _ in range(3)]`` (8-space indent) is there once; else, in
    ``DeepseekV4Model.__init__``, that line becomes two statements: a function-local ``import os as
    _lna_os`` and ``aux_stream_list = (None if _lna_os.environ.get("LNA_DSV4_AUX_STREAMS", "1") == "0" else
    [torch.cuda.Stream() for _ in range(3)])``. nvidia/mtp.py (the MTP draft's own streams) is not touched.
    The real script ignores argv and patches the ``import vllm`` install. Applies on every release
    0.28.0-0.33.0.
    """
    text = _read(tree, MODEL)
    if AUX_STREAMS_ENV in text:
        return []
    n = text.count(AUX_STREAMS)
    if n != 1:
        raise RecipeRefuses("aux_streams", MODEL, f"expected 1 anchor, found {n}")
    _backup(tree, MODEL, ".orig-lna3")
    _write(tree, MODEL, text.replace(AUX_STREAMS, AUX_STREAMS_NEW))
    return [MODEL]


# -- the lna chain --------------------------------------------------------------------------------------
LNA_CHAIN = ("stock028", "stream_load", "wide_swa", "dense_exl3", "attention_compressor", "aux_streams")
SCRIPTS: dict[str, Callable[..., list[str]]] = {
    "stock028": apply_stock028,
    "stream_load": apply_stream_load,
    "wide_swa": apply_wide_swa,
    "dense_exl3": apply_dense_exl3,
    "attention_compressor": apply_attention_compressor,
    "aux_streams": apply_aux_streams,
}


@dataclass
class ChainResult:
    changed: list[str] = field(default_factory=list)  # source files written, first write first, no repeats
    ran: list[str] = field(default_factory=list)  # scripts that exited 0 (applied or "already patched")
    refused: dict[str, RecipeRefuses] = field(default_factory=dict)  # only with keep_going


def run_chain(tree: Path, version: str, names: Iterable[str] = LNA_CHAIN, *, keep_going: bool = False) -> ChainResult:
    """The lna Dockerfile's patch step: ``names`` (default all six) in LNA_CHAIN order.

    The Dockerfile (lna-lab/dsv4-carve) runs all six in one ``RUN a && b && ...``: a script's non-zero exit
    stops the step, later scripts never run, and the build fails with what was written so far. That is the
    default here: the first refusal propagates (``RecipeRefuses``, with ``chain_changed`` and ``chain_ran``
    set), after the refusing script's own writes. The Dockerfile targets the 0.28.1rc1.dev337 nightly; on a
    release it stops early (0.28.0: at stream_load, no nvidia/vl_model.py; 0.29.0-0.33.0: at stock028).
    (The DGX-Spark ``install_local_runtime.sh`` runs its three under ``set -euo pipefail``: it stops too.)
    ``keep_going=True`` instead skips a refusal and runs the rest, as a user running the scripts one by one
    and ignoring failures would (the DGX-Spark README runs its three as separate commands): the way to get,
    on 0.28.0, ``flashinfer_sparse.py.orig`` (pip's bytes) beside ``flashinfer_sparse.py.orig-lna``
    (stock028's and wide_swa's edits).
    """
    wanted = list(names)
    unknown = [n for n in wanted if n not in SCRIPTS]
    assert not unknown, f"unknown recipe script(s) {unknown}; known: {LNA_CHAIN}"
    result = ChainResult()
    for name in LNA_CHAIN:
        if name not in wanted:
            continue
        try:
            changed = SCRIPTS[name](tree, version)
        except RecipeRefuses as refusal:
            result.changed += [rel for rel in refusal.written if rel not in result.changed]
            if not keep_going:
                refusal.chain_changed, refusal.chain_ran = list(result.changed), list(result.ran)
                raise
            result.refused[name] = refusal
            continue
        result.ran.append(name)
        result.changed += [rel for rel in changed if rel not in result.changed]
    return result


# -- nightly layouts ------------------------------------------------------------------------------------
def make_nvidia_vl_model_nightly(
    tree: Path, version: str = "0.30.0", *, record_matches: bool = False, eager_sort: str = "iter"
) -> list[str]:
    """A nightly between 0.29.0 and 0.30.0: the vision class lives in nvidia/vl_model.py.

    Before 0.30.0's platform-neutral move (whose nvidia/vl_model.py is a re-export shim, "Compatibility
    imports for the platform-neutral DeepSeek-V4 vision model"), ``DeepseekV4ForConditionalGeneration``
    was defined in nvidia/vl_model.py and there was no common/vl_model.py. Built from ``version``'s
    common/vl_model.py (0.30.0-0.32.0: their ``load_weights`` sorts eagerly): its text replaces the shim,
    with ``from .mm_preprocess``/``from .vision`` re-pointed at ``..common`` (those two modules stay where
    the release has them); common/vl_model.py is removed, and deepseek_v4/__init__.py imports the class
    from ``.nvidia.vl_model``. ``eager_sort="iter"`` keeps the release's ``mapped = iter(sorted(mapped,
    key=lambda x: x[0]))`` under ``if child_finalizes:`` (stream_load refuses it: wrong anchor);
    ``"sorted-mapper"`` replaces those lines by the one the stream_load script anchors on, as the dev337
    nightly had it: ``mapped = sorted(self.hf_to_vllm_mapper.apply(weights), key=lambda x: x[0])``.
    ``record_matches`` rewrites RECORD for the three files (a real nightly install); otherwise RECORD stays
    the release's (a hand-edited tree). Returns the relpaths changed, the removed one included.
    """
    tree = Path(tree)
    _check_version(tree, version)
    assert eager_sort in ("iter", "sorted-mapper"), eager_sort
    assert (tree / COMMON_VL).is_file(), f"{version} has no {COMMON_VL} (the vision class came in 0.30.0)"
    text = _read(tree, COMMON_VL)
    assert f"\nclass {VISION_CLASS}(" in text, f"{version}: {COMMON_VL} defines no {VISION_CLASS}"
    shim = _read(tree, NVIDIA_VL)
    assert "from ..common.vl_model import (" in shim, f"{version}: {NVIDIA_VL} is not the re-export shim"
    text = _once(text, "\nfrom .mm_preprocess import (", "\nfrom ..common.mm_preprocess import (", "mm import")
    text = _once(text, "\nfrom .vision import ", "\nfrom ..common.vision import ", "vision import")
    if eager_sort == "sorted-mapper":
        start = text.index("        mapped = self.hf_to_vllm_mapper.apply(weights)\n")
        end = text.index(VL_EAGER_SORT_ITER, start) + len(VL_EAGER_SORT_ITER) + 1
        block = text[start:end]
        assert block.count("\n") == 5 and "if child_finalizes:" in block, f"{version}: load_weights: {block!r}"
        text = text[:start] + VL_EAGER_SORT_MAPPER + text[end:]
    else:
        assert text.count(VL_EAGER_SORT_ITER) == 1, f"{version}: {COMMON_VL} has no eager iter(sorted(...))"
    _write(tree, NVIDIA_VL, text)
    (tree / COMMON_VL).unlink()
    init = _read(tree, PACKAGE_INIT)
    n = init.count("from .common.vl_model import (")
    assert n >= 1, f"{version}: {PACKAGE_INIT} does not import the vision class from common/vl_model.py"
    _write(tree, PACKAGE_INIT, init.replace("from .common.vl_model import (", "from .nvidia.vl_model import ("))
    changed = [NVIDIA_VL, COMMON_VL, PACKAGE_INIT]
    if record_matches:
        rewrite_record(tree, changed)
    return changed


MTP_ROCM_CONDITIONAL = (
    "        aux_stream_list = None if current_platform.is_rocm() else [torch.cuda.Stream() for _ in range(3)]\n"
)
CURRENT_PLATFORM_IMPORT = "from vllm.platforms import current_platform\n"


def make_rocm_conditional_mtp_nightly(tree: Path, version: str, *, record_matches: bool = False) -> list[str]:
    """A nightly whose MTP draft makes no aux CUDA streams on ROCm.

    In nvidia/mtp.py ``DeepSeekV4MultiTokenPredictor.__init__``, ``aux_stream_list = [torch.cuda.Stream()
    for _ in range(3)]`` becomes ``aux_stream_list = None if current_platform.is_rocm() else [...]``, and
    ``from vllm.platforms import current_platform`` is added in sorted place among the module's top-level
    ``from vllm.`` imports when the file has none (no release imports it there). nvidia/model.py is left
    as it is (aux_streams' anchor there is unchanged). ``record_matches`` rewrites RECORD for mtp.py.
    """
    tree = Path(tree)
    _check_version(tree, version)
    text = _read(tree, MTP)
    module = ast.parse(text)
    (cls,) = [n for n in module.body if isinstance(n, ast.ClassDef) and n.name == "DeepSeekV4MultiTokenPredictor"]
    (init,) = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"]
    line_at = {text.count("\n", 0, i) + 1 for i in _find_all(text, AUX_STREAMS)}
    assert len(line_at) == 1 and init.lineno <= min(line_at) <= init.end_lineno, (
        f"{version}: {MTP} has no single aux_stream_list line in DeepSeekV4MultiTokenPredictor.__init__"
    )
    text = _once(text, AUX_STREAMS, MTP_ROCM_CONDITIONAL, "MTP aux_stream_list line")
    imported = any(
        isinstance(n, ast.ImportFrom) and any(a.name == "current_platform" for a in n.names) for n in module.body
    )
    if not imported:
        vllm_imports = [
            n for n in module.body if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("vllm.")
        ]
        assert vllm_imports, f"{version}: {MTP} has no top-level vllm import"
        after = [n for n in vllm_imports if n.module > "vllm.platforms"]
        lines = text.splitlines(keepends=True)
        at = after[0].lineno - 1 if after else vllm_imports[-1].end_lineno
        text = "".join(lines[:at]) + CURRENT_PLATFORM_IMPORT + "".join(lines[at:])
    _write(tree, MTP, text)
    if record_matches:
        rewrite_record(tree, [MTP])
    return [MTP]


def _find_all(text: str, needle: str) -> list[int]:
    found, i = [], text.find(needle)
    while i >= 0:
        found.append(i)
        i = text.find(needle, i + 1)
    return found
