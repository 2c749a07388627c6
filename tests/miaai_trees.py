"""Trees as MiaAI-Lab's kit leaves them, built from the facts in shared/notes/v41.md.

The kit (MiaAI-Lab/DeepSeek-v4.1-Flash-EXL3-2x-DGX-Sparks) runs five ``overlay/patch_*.py`` scripts at image build
and at every container start. Each function here takes a writable copy of a real release
(``tests.releases.copy_tree(pristine_tree(v), dest)``) and leaves it as that script would:

- plain exact-text anchors (``str.count`` / ``str.replace``, indentation included), idempotent by the script's
  marker, files written one by one, **no backup** and no revert;
- the nightly ``vllm/models/deepseek_v4_1/`` paths hard-coded: on a PyPI release (``deepseek_v41/``) those files
  are absent and only the edits of shared files land (V4's ``nvidia/ops/o_proj.py`` and ``nvidia/mtp.py``, the
  shared ``v1/attention/backends/mla/sparse_swa.py``, and generic files);
- the exit status the notes give per script on a release (``patch_exl3_lm_head.py`` turns any exception into 0).

The bodies inserted are short stand-ins written here, not the kit's code: they parse, and they keep the
shapes, names and markers the notes describe (the statements a structural recogniser keys on). Edits of the
generic files no patch reads (weight loading, the worker, the indexer) are marker blocks appended as the kit
appends its helpers: they show that such edits change no verdict. ``KNOWN`` holds the files each script
changes on a release's own bytes, checked on every run whose input files are still the release's.

Files are replaced as ``tests.releases.hand_edit`` does (unlink, then write); a directory the test tree shares
with the pristine cache (a symlink) is made a real directory first, so the cache is never written.
"""

from __future__ import annotations

import ast
import os
from dataclasses import dataclass, field
from pathlib import Path

KIT_REPO = "MiaAI-Lab/DeepSeek-v4.1-Flash-EXL3-2x-DGX-Sparks"
NIGHTLY_V41 = "vllm/models/deepseek_v4_1"
V41_MODEL = f"{NIGHTLY_V41}/nvidia/model.py"  # the one V4.1 file of the kit's a patch edits (aux-streams)

O_PROJ = "vllm/models/deepseek_v4/nvidia/ops/o_proj.py"
MTP = "vllm/models/deepseek_v4/nvidia/mtp.py"
SPARSE_SWA = "vllm/v1/attention/backends/mla/sparse_swa.py"
MLA_INDEXER = "vllm/v1/attention/backends/mla/indexer.py"
WEIGHT_UTILS = "vllm/model_executor/model_loader/weight_utils.py"
LINEAR = "vllm/model_executor/layers/linear.py"
VOCAB_EMBEDDING = "vllm/model_executor/layers/vocab_parallel_embedding.py"
GPU_WORKER = "vllm/v1/worker/gpu_worker.py"

EXL3_LM_HEAD = "patch_exl3_lm_head.py"
SM120_BLOCK64 = "patch_sm120_block64.py"
H2D_STAGE = "patch_h2d_stage.py"
MEMORY_LOG = "patch_memory_log.py"
SM12X_VISION = "patch_sm12x_vision.py"

# What each script changes on a release's own files (the notes' "on a release tree" column, for the files built
# here), and its exit status there.
KNOWN: dict[str, dict[str, tuple[tuple[str, ...], int]]] = {
    EXL3_LM_HEAD: {"0.30.0": ((O_PROJ,), 0), "0.33.0": ((O_PROJ,), 0)},
    SM120_BLOCK64: {"0.30.0": ((SPARSE_SWA, MTP, MLA_INDEXER), 1), "0.33.0": ((MTP, MLA_INDEXER), 1)},
    H2D_STAGE: {v: ((WEIGHT_UTILS, LINEAR, VOCAB_EMBEDDING), 1) for v in ("0.30.0", "0.33.0")},
    MEMORY_LOG: {v: ((GPU_WORKER,), 0) for v in ("0.30.0", "0.33.0")},
    SM12X_VISION: {v: ((), 1) for v in ("0.30.0", "0.33.0")},
}


@dataclass
class KitRun:
    """What one script did: the files it wrote (in order), its exit status, and the warnings it printed."""

    script: str
    changed: list[str] = field(default_factory=list)
    exit_code: int = 0
    warnings: list[str] = field(default_factory=list)


# -- files ----------------------------------------------------------------------------------------------
def _unshare(tree: Path, rel: str) -> None:
    """Make every directory on the way to ``rel`` a real one (a shared one becomes links to its entries)."""
    here = tree
    for part in Path(rel).parts[:-1]:
        here = here / part
        if here.is_symlink():
            target = here.resolve()
            here.unlink()
            here.mkdir()
            for entry in target.iterdir():
                os.symlink(entry, here / entry.name)
    path = tree / rel
    if path.is_symlink():
        data = path.read_bytes()
        path.unlink()
        path.write_bytes(data)


def _read(tree: Path, rel: str) -> str | None:
    path = tree / rel
    return path.read_text(encoding="utf-8") if path.is_file() else None


def _write(tree: Path, rel: str, text: str) -> None:
    try:
        ast.parse(text)
    except SyntaxError as exc:  # a stand-in of ours that does not parse is a bug here
        raise AssertionError(f"miaai_trees wrote a {rel} that does not parse: {exc}") from exc
    _unshare(tree, rel)
    path = tree / rel
    path.unlink()
    path.write_text(text, encoding="utf-8")


def _replace(run: KitRun, tree: Path, rel: str, marker: str, edits: list[tuple[str, str]], append: str = "") -> None:
    """One file, the kit's way: skipped when its marker is there, each anchor replaced where found exactly once
    (a warning where not), the appended block added, written once."""
    text = _read(tree, rel)
    if text is None:
        run.warnings.append(f"{rel}: not found")
        return
    if marker in text:
        return  # already patched
    new = text
    for anchor, replacement in edits:
        n = new.count(anchor)
        if n != 1:
            run.warnings.append(f"{rel}: anchor found {n} times, skipped: {anchor.strip().splitlines()[0]!r}")
            continue
        new = new.replace(anchor, replacement)
    if new == text and edits:
        return
    if append:
        new = new.rstrip("\n") + "\n\n\n" + append
    _write(tree, rel, new)
    run.changed.append(rel)


def _v41_files_present(tree: Path) -> bool:
    return (tree / NIGHTLY_V41).is_dir()


def _check(run: KitRun, version: str) -> KitRun:
    known = KNOWN[run.script].get(version)
    if known is not None:
        files, code = known
        assert (tuple(run.changed), run.exit_code) == (files, code), (
            f"miaai_trees: {run.script} on {version} was expected to change {files} and exit {code}, "
            f"changed {run.changed} and exited {run.exit_code} ({run.warnings})"
        )
    return run


def _pristine(tree: Path, version: str, rels) -> bool:
    from tests.releases import RELEASES, pristine_tree

    if version not in RELEASES:
        return False
    base = pristine_tree(version)
    return all((tree / r).read_bytes() == (base / r).read_bytes() for r in rels if (base / r).exists())


def _script(name: str, reads: tuple[str, ...]):
    """Check a builder against KNOWN when the files its script reads are still the release's."""

    def wrap(fn):
        def run(tree: Path, version: str) -> KitRun:
            tree = Path(tree)
            assert (tree / f"vllm-{version}.dist-info").is_dir(), f"{tree} is not vLLM {version}"
            checked = not _v41_files_present(tree) and _pristine(tree, version, reads)
            result = fn(tree, version)
            assert result.script == name
            return _check(result, version) if checked else result

        run.__name__, run.__doc__ = fn.__name__, fn.__doc__
        return run

    return wrap


# -- patch_exl3_lm_head.py --------------------------------------------------------------------------------
EXL3_MARKER = "[dsv41-exl3-lm-head]"
USE_FP8 = "    use_fp8 = wo_a.weight.dtype == torch.float8_e4m3fn\n"
USE_FP8_EXL3 = (
    f"    # {EXL3_MARKER} an EXL3 wo_a has no .weight (miaai_trees stand-in)\n"
    '    wo_a_weight = getattr(wo_a, "weight", None)\n'
    "    use_fp8 = wo_a_weight is not None and wo_a_weight.dtype == torch.float8_e4m3fn\n"
)
BF16_BRANCH = "    else:\n        grouped_weight = wo_a.weight.view(n_groups, o_lora_rank, -1)\n"
EXL3_BRANCH = (
    "    elif wo_a_weight is None:\n"
    f"        # {EXL3_MARKER} EXL3 wo_a: its quant method runs the grouped projection\n"
    "        z.copy_(wo_a.quant_method.apply(wo_a, o_proj_input.flatten(1)).view_as(z))\n" + BF16_BRANCH
)


# V4.1's DeepseekV4Model.load_weights: the wo_a.slice.G.* mapping (its other V4.1 edits, in files no patch reads,
# are not built here)
V41_SKIP_VISION = (
    '            if name.startswith(("vision.", "aligner.", "image_")):\n'
    "                # Vision weights are loaded by the outer multimodal wrapper.\n"
)
V41_WO_A_SLICES = (
    f'            if ".wo_a.slice." in name:  # {EXL3_MARKER} EXL3 wo_a shards load into wo_a\n'
    '                name = re.sub(r"\\.wo_a\\.slice\\.\\d+\\.", ".wo_a.", name)\n' + V41_SKIP_VISION
)


@_script(EXL3_LM_HEAD, (O_PROJ,))
def apply_exl3_lm_head(tree: Path, version: str) -> KitRun:
    """patch_exl3_lm_head.py: V4's shared deep_gemm_fp8_o_proj gets the EXL3 branch; on the nightly layout V4.1's
    loader maps the wo_a slices too. Any exception ends the script with exit 0."""
    run = KitRun(EXL3_LM_HEAD)
    _replace(run, tree, O_PROJ, EXL3_MARKER, [(USE_FP8, USE_FP8_EXL3), (BF16_BRANCH, EXL3_BRANCH)])
    if not _v41_files_present(tree):
        run.warnings.append(f"{V41_MODEL}: No such file (exit 0 all the same)")
        return run
    _replace(run, tree, V41_MODEL, EXL3_MARKER, [(V41_SKIP_VISION, V41_WO_A_SLICES)])
    return run


# -- patch_sm120_block64.py ----------------------------------------------------------------------------------
BLOCK64_MARKER = "[dsv41-sm120-block64]"
# the 0.30.0 text of the builder's max_image_tokens (0.31 on check the V4 config class as well)
MAX_IMAGE_TOKENS = (
    "        self.max_image_tokens = (\n"
    '            getattr(hf_config, "vision_max_n_token", 0)\n'
    '            if getattr(hf_config, "vision_n_layers", 0) > 0\n'
    "            else 0\n"
    "        )\n"
)
MAX_IMAGE_TOKENS_TEXT_ONLY = (
    f"        # {BLOCK64_MARKER} text-only sliding window on SM12x\n"
    "        self.max_image_tokens = (\n"
    '            getattr(hf_config, "vision_max_n_token", 0)\n'
    '            if getattr(hf_config, "vision_n_layers", 0) > 0 and not _dsv41_text_only_swa()\n'
    "            else 0\n"
    "        )\n"
)
TEXT_ONLY_HELPER = f"""\
# {BLOCK64_MARKER} (miaai_trees stand-in)
def _dsv41_text_only_swa():
    from vllm.platforms import current_platform

    capability = current_platform.get_device_capability()
    return capability is not None and capability.major == 12
"""
AUX_STREAMS = "        aux_stream_list = [torch.cuda.Stream() for _ in range(3)]\n"
AUX_STREAMS_SERIAL = (
    f"        # {BLOCK64_MARKER} exllamav3 kernels share one lock buffer per device\n"
    "        aux_stream_list = (\n"
    "            None\n"
    '            if os.environ.get("DSV41_EXL3_SERIAL_STREAMS") == "1"\n'
    "            else [torch.cuda.Stream() for _ in range(3)]\n"
    "        )\n"
)
IMPORT_TYPING = "\nimport typing\n"
IMPORT_OS_TYPING = "\nimport os\nimport typing\n"
BLOCK_SIZE_HELPER = f"""\
# {BLOCK64_MARKER} (miaai_trees stand-in)
def _dsv41_cr_block_size(block_size, compress_ratio):
    return block_size * max(compress_ratio, 1)
"""


@_script(SM120_BLOCK64, (SPARSE_SWA, MTP, MLA_INDEXER))
def apply_sm120_block64(tree: Path, version: str) -> KitRun:
    """patch_sm120_block64.py: the text-only window in the shared sparse_swa.py builder (where its anchor
    matches), the serial-streams switch in V4's MTP draft, page sizes in the MLA indexer; its V4.1 files are
    missing on a release: exit 1."""
    run = KitRun(SM120_BLOCK64)
    _replace(run, tree, SPARSE_SWA, BLOCK64_MARKER, [(MAX_IMAGE_TOKENS, MAX_IMAGE_TOKENS_TEXT_ONLY)], TEXT_ONLY_HELPER)
    _replace(run, tree, MTP, BLOCK64_MARKER, [(AUX_STREAMS, AUX_STREAMS_SERIAL), (IMPORT_TYPING, IMPORT_OS_TYPING)])
    _replace(run, tree, MLA_INDEXER, BLOCK64_MARKER, [], BLOCK_SIZE_HELPER)
    if not _v41_files_present(tree):
        run.warnings.append(f"{NIGHTLY_V41}/attention.py: not found")
        run.exit_code = 1
        return run
    # V4.1's target model: the same switch
    edits = [(AUX_STREAMS, AUX_STREAMS_SERIAL), (IMPORT_TYPING, IMPORT_OS_TYPING)]
    _replace(run, tree, V41_MODEL, BLOCK64_MARKER, edits)
    return run


# -- patch_h2d_stage.py, patch_memory_log.py, patch_sm12x_vision.py ----------------------------------------
H2D_MARKER = "dsv41-h2d-stage"
H2D_HELPER = f"""\
# {H2D_MARKER} (miaai_trees stand-in): host-to-device copies through one pinned buffer
def _dsv41_h2d_stage_copy(param, loaded_weight):
    param.data.copy_(loaded_weight.pin_memory(), non_blocking=True)
"""
MEMORY_MARKER = "dsv41-memory-log"
MEMORY_FOOTER = f"""\
# {MEMORY_MARKER} (miaai_trees stand-in): wraps Worker methods with memory logs
def _dsv41_memory_log(method):
    return method
"""


@_script(H2D_STAGE, (WEIGHT_UTILS, LINEAR, VOCAB_EMBEDDING))
def apply_h2d_stage(tree: Path, version: str) -> KitRun:
    """patch_h2d_stage.py: weight copies through a pinned buffer in three generic files; exit 1 on a release."""
    run = KitRun(H2D_STAGE)
    for rel in (WEIGHT_UTILS, LINEAR, VOCAB_EMBEDDING):
        _replace(run, tree, rel, H2D_MARKER, [], H2D_HELPER)
    run.exit_code = 0 if _v41_files_present(tree) else 1
    return run


@_script(MEMORY_LOG, (GPU_WORKER,))
def apply_memory_log(tree: Path, version: str) -> KitRun:
    """patch_memory_log.py: a footer appended to the GPU worker."""
    run = KitRun(MEMORY_LOG)
    _replace(run, tree, GPU_WORKER, MEMORY_MARKER, [], MEMORY_FOOTER)
    return run


@_script(SM12X_VISION, ())
def apply_sm12x_vision(tree: Path, version: str) -> KitRun:
    """patch_sm12x_vision.py: rewrites the body of block64's helper in the V4.1 files: none on a release (exit 1)."""
    run = KitRun(SM12X_VISION, exit_code=0 if _v41_files_present(tree) else 1)
    if run.exit_code:
        run.warnings.append(f"{NIGHTLY_V41}: not found")
    return run


SCRIPTS = {
    EXL3_LM_HEAD: apply_exl3_lm_head,
    SM120_BLOCK64: apply_sm120_block64,
    H2D_STAGE: apply_h2d_stage,
    MEMORY_LOG: apply_memory_log,
    SM12X_VISION: apply_sm12x_vision,
}


def run_kit(tree: Path, version: str) -> list[KitRun]:
    """Every script in the kit's Dockerfile order; a failing one is a warning, the next runs."""
    return [SCRIPTS[name](tree, version) for name in (EXL3_LM_HEAD, SM120_BLOCK64, H2D_STAGE, MEMORY_LOG, SM12X_VISION)]
