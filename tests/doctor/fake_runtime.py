"""A fake serving environment for doctor's runtime, environment and host checks.

Built in a test's tmp_path from real release files where the rules depend on
them: vLLM's ``envs.py``, ``utils/flashinfer.py``, DeepSeek-V4 model package
and METADATA (copied from the cached release tree), FlashInfer's SM120 decode
table and exllamav3's ``LinearEXL3`` (extracted from the cached wheels).
Everything else is faked: dist-infos with ``entry_points.txt`` for vllm-exl3
and the patch-dsv4 guard, a compiled extension that is only an ELF header
plus the bytes ``exl3_moe``, ``torch/version.py``, stub ``nvidia-smi``,
``nvcc``, ``ninja`` and ``cuobjdump`` on a PATH the test owns, and a fake
``/proc/meminfo``.

``vcruz305(tmp_path)`` and ``lna_lab(tmp_path)`` give the two healthy
deployments of DOCTOR-FACTS.md B.2 and B.3; a test changes one thing and
reads the one row it provokes.
"""

from __future__ import annotations

import json
import shutil
import struct
import zipfile
from dataclasses import dataclass, field, replace
from pathlib import Path

from patch_dsv4.doctor.readers.base import CHECKS, DoctorContext, Row, Runtime, run_checks
from tests.releases import pristine_tree, wheel

EM_X86_64, EM_AARCH64 = 62, 183
PLUGIN_KEYS = (
    "bits",
    "codebook",
    "layer_bits",
    "non_routed_quantization",
    "mtp_experts",
    "mtp_experts_start_layer",
    "non_routed_exl3",
    "non_routed_dtype_policy",
)
UPSTREAM_KERNELS = ("native", "exllamav3", "auto")


# --- vLLM and FlashInfer from the real releases ----------------------------------------------


def install_vllm(site: Path, version: str) -> Path:
    """The parts of a real vLLM release the checks read, copied into ``site``."""
    source = pristine_tree(version)
    for relpath in ("vllm/envs.py", "vllm/utils/flashinfer.py"):
        (site / relpath).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source / relpath, site / relpath)
    shutil.copytree(
        source / "vllm/models/deepseek_v4",
        site / "vllm/models/deepseek_v4",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    dist_info = site / f"vllm-{version}.dist-info"
    dist_info.mkdir()
    shutil.copyfile(source / dist_info.name / "METADATA", dist_info / "METADATA")
    return site


def install_flashinfer(site: Path, version: str) -> Path:
    """flashinfer-python ``version``'s SM120 sparse-MLA modules (the decode table lives there) and its METADATA."""
    with zipfile.ZipFile(wheel("flashinfer-python", version)) as whl:
        for name in whl.namelist():
            if name.startswith("flashinfer/mla/_sparse_mla_sm120") or name.endswith(".dist-info/METADATA"):
                whl.extract(name, site)
    (site / "flashinfer/__init__.py").write_text("")
    return site


def flashinfer_runtime_fields(version: str) -> dict:
    return {"flashinfer_version": version, "flashinfer_source": "installed"}


# --- exllamav3 and its compiled extension ----------------------------------------------------


def elf_bytes(e_machine: int, payload: bytes = b"\0exl3_moe\0") -> bytes:
    """A 64-bit little-endian ELF shared-object header for ``e_machine``, then ``payload``."""
    ident = b"\x7fELF" + bytes([2, 1, 1, 0]) + bytes(8)
    header = ident + struct.pack("<HHIQQQIHHHHHH", 3, e_machine, 1, 0, 64, 0, 0, 64, 56, 0, 64, 0, 0)
    return header + payload


def extension_name(module: str, python_tag: str, machine: str) -> str:
    return f"{module}.cpython-{python_tag}-{machine}-linux-gnu.so"


def install_exllamav3(site: Path, version: str, machine: str | None, python_tag: str = "312") -> Path:
    """exllamav3 ``version`` from its wheel (LinearEXL3, ext.py, the JIT sources), plus a compiled
    ``exllamav3_ext`` for ``machine``; ``machine=None`` leaves the JIT-only install the wheel gives."""
    members = ("exllamav3/modules/quant/exl3.py", "exllamav3/ext.py", "exllamav3/exllamav3_ext/quant/exl3_gemm.cu")
    with zipfile.ZipFile(wheel("exllamav3", version)) as whl:
        for name in whl.namelist():
            if name in members or name.endswith(".dist-info/METADATA"):
                whl.extract(name, site)
    (site / "exllamav3/__init__.py").write_text("")
    if machine is not None:
        e_machine = {"aarch64": EM_AARCH64, "x86_64": EM_X86_64}[machine]
        (site / extension_name("exllamav3_ext", python_tag, machine)).write_bytes(elf_bytes(e_machine))
    return site


def remove_extension(site: Path, module: str = "exllamav3_ext") -> None:
    for path in site.glob(f"{module}*.so"):
        path.unlink()


# --- vllm-exl3 and the patch-dsv4 guard ------------------------------------------------------


def plugin_source(reads: tuple[str, ...] = PLUGIN_KEYS, kernels: tuple[str, ...] | None = UPSTREAM_KERNELS) -> str:
    """A vllm_exl3/exl3.py shaped like the plugin's: ``from_config`` reads ``reads`` with ``config.get``."""
    gets = "\n".join(f"        inst.{key} = config.get({key!r})" for key in reads)
    backend = (
        ""
        if kernels is None
        else f"""

def get_moe_kernel_backend() -> str:
    requested = os.environ.get("VLLM_EXL3_MOE_KERNEL", "auto").strip().lower()
    if requested not in {set(kernels)!r}:
        requested = "auto"
    return requested
"""
    )
    return f"""import os


class Exl3Config:
    @classmethod
    def from_config(cls, config):
        inst = cls()
{gets}
        return inst
{backend}"""


def install_plugin(site: Path, version: str = "0.4.1", entry_point: bool = True, source: str | None = None) -> Path:
    (site / "vllm_exl3").mkdir(parents=True, exist_ok=True)
    (site / "vllm_exl3/__init__.py").write_text("def register():\n    from . import exl3  # noqa: F401\n")
    (site / "vllm_exl3/exl3.py").write_text(plugin_source() if source is None else source)
    dist_info = site / f"vllm_exl3-{version}.dist-info"
    dist_info.mkdir(exist_ok=True)
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm-exl3\nVersion: {version}\n")
    if entry_point:
        (dist_info / "entry_points.txt").write_text("[vllm.general_plugins]\nvllm_exl3 = vllm_exl3:register\n")
    return dist_info


def install_guard(site: Path) -> Path:
    """patch-dsv4's own dist-info with its serve-guard entry point."""
    dist_info = site / "patch_dsv4-0.1.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: patch-dsv4\nVersion: 0.1.0\n")
    (dist_info / "entry_points.txt").write_text(
        "[console_scripts]\npatch-dsv4 = patcher.cli:main\n\n"
        "[vllm.general_plugins]\npatch_dsv4 = patcher.guard:register\n"
    )
    return dist_info


def torch_pin(vllm: str) -> str:
    """The torch version the vLLM release's METADATA pins."""
    metadata = (pristine_tree(vllm) / f"vllm-{vllm}.dist-info/METADATA").read_text()
    (pin,) = [
        line.split("==")[1].strip() for line in metadata.splitlines() if line.startswith("Requires-Dist: torch==")
    ]
    return pin


def install_torch(site: Path, version: str, cuda: str | None = "13.0") -> Path:
    (site / "torch").mkdir(exist_ok=True)
    (site / "torch/version.py").write_text(
        "from typing import Optional\n\n"
        f"__all__ = ['__version__', 'cuda']\n__version__ = {version!r}\ncuda: Optional[str] = {cuda!r}\n"
    )
    dist_info = site / f"torch-{version.split('+')[0]}.dist-info"
    dist_info.mkdir(exist_ok=True)
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n")
    return site / "torch"


# --- tools on PATH, /proc, the pack ----------------------------------------------------------


def write_tool(directory: Path, name: str, body: str) -> Path:
    """An executable shell script ``name`` in ``directory``.

    The deployments' PATH holds only the test's own directories (a host's real
    ninja or nvcc must not answer), so bodies use shell builtins.
    """
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)
    return path


def nvidia_smi(directory: Path, gpus: list[tuple[str, str, str]], apps: list[tuple[int, str, str]] = ()) -> Path:
    """A stub nvidia-smi answering doctor's two queries (csv, noheader, nounits)."""
    gpu_lines = "".join(", ".join(gpu) + "\\n" for gpu in gpus)
    app_lines = "".join(f"{pid}, {name}, {memory}\\n" for pid, name, memory in apps)
    return write_tool(
        directory,
        "nvidia-smi",
        f"""case "$*" in
  *--query-gpu=*) printf '{gpu_lines}' ;;
  *--query-compute-apps=*) printf '{app_lines}' ;;
  *) exit 2 ;;
esac""",
    )


def cuobjdump(directory: Path, cubins: list[str]) -> Path:
    lines = "".join(f"ELF file    {i}: exllamav3_ext.{i}.{arch}.cubin\\n" for i, arch in enumerate(cubins, 1))
    return write_tool(directory, "cuobjdump", f"printf '{lines}'")


def write_meminfo(proc: Path, total_kb: int, free_kb: int, cached_kb: int) -> Path:
    proc.mkdir(parents=True, exist_ok=True)
    path = proc / "meminfo"
    path.write_text(
        f"MemTotal:       {total_kb} kB\nMemFree:        {free_kb} kB\nMemAvailable:   {free_kb + cached_kb} kB\n"
        f"Buffers:          123456 kB\nCached:         {cached_kb} kB\nSwapCached:            0 kB\n"
    )
    return path


def write_pack(directory: Path, config: dict, total_bytes: int, shards: int = 4) -> Path:
    """config.json and ``shards`` sparse safetensors files of ``total_bytes`` together (they cost no disk)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    for old in directory.glob("*.safetensors"):
        old.unlink()
    for index in range(1, shards + 1):
        with open(directory / f"model-{index:05d}-of-{shards:05d}.safetensors", "wb") as fh:
            fh.truncate(total_bytes // shards)
    return directory


def vcruz305_config() -> dict:
    """The vcruz305 MixedK Flash-Vision pack after scripts/fix_pack_config.py (route a)."""
    return {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "num_hidden_layers": 43,
        "num_attention_heads": 64,
        "index_topk": 192,
        "num_nextn_predict_layers": 3,
        "vision_n_layers": 24,
        "max_position_embeddings": 1048576,
        "swiglu_limit": 10.0,
        "quantization_config": {
            "quant_method": "exl3",
            "bits": 2,
            "codebook": "mcg",
            "head_bits": 16,
            "non_routed_dtype_policy": "bf16_as_stored",
            "scope": "dsv4_routed_experts_only",
            "layer_bits": {"3": 3, "13": 3, "21": 3, "22": 3, "28": 3, "41": 3},
            "mtp_experts": "source",
            "mtp_experts_start_layer": 43,
            "non_routed_quantization": {
                "activation_scheme": "dynamic",
                "fmt": "e4m3",
                "quant_method": "fp8",
                "scale_fmt": "ue8m0",
                "weight_block_size": [128, 128],
            },
        },
    }


def lna_lab_config() -> dict:
    """lna-lab's Dense6 pack: dense attention linears and shared experts are EXL3 too; MTP experts are EXL3."""
    config = vcruz305_config()
    block = config["quantization_config"]
    del block["mtp_experts"], block["mtp_experts_start_layer"]
    block["layer_bits"].update({"43": 2, "44": 2, "45": 2})
    block["non_routed_exl3"] = {
        "codebook": "mcg",
        "layers": {
            f"model.layers.{n}.{module}": {"bits": 6}
            for n in range(43)
            for module in (
                "attn.fused_wqa_wkv",
                "attn.wq_b",
                "attn.compressor.fused_wkv_wgate",
                "mlp.shared_experts.gate_up_proj",
                "mlp.shared_experts.down_proj",
            )
        },
    }
    return config


# --- the two deployments ---------------------------------------------------------------------


@dataclass
class Deployment:
    """One serving environment on disk; ``context()`` is what doctor would be given for it."""

    site: Path
    tools: Path  # nvidia-smi, cuobjdump
    cuda_home: Path  # bin/nvcc
    venv_bin: Path  # ninja
    proc: Path
    pack: Path
    runtime: Runtime
    environ: dict = field(default_factory=dict)
    serve_args: str = ""

    def context(self) -> DoctorContext:
        return DoctorContext.from_serve_args(
            self.serve_args, pack=self.pack, runtime=self.runtime, environ=dict(self.environ), proc_root=self.proc
        )

    def change_runtime(self, **changes) -> None:
        self.runtime = replace(self.runtime, **changes)

    def set_verdict(self, patch_id: str, verdict: str) -> None:
        self.change_runtime(patch_verdicts={**(self.runtime.patch_verdicts or {}), patch_id: verdict})

    def path_without(self, directory: Path) -> None:
        self.environ["PATH"] = ":".join(p for p in self.environ["PATH"].split(":") if p != str(directory))


def toolchain(root: Path) -> tuple[Path, Path, Path]:
    cuda_home, venv_bin, tools = root / "cuda-13.0", root / "venv/bin", root / "tools"
    write_tool(cuda_home / "bin", "nvcc", 'echo "Cuda compilation tools, release 13.0"')
    write_tool(venv_bin, "ninja", "echo 1.13.0")
    return cuda_home, venv_bin, tools


def vcruz305(tmp_path: Path, vllm: str = "0.28.0", flashinfer: str = "0.6.18") -> Deployment:
    """One DGX Spark (GB10, sm_121, aarch64, unified memory), stock vLLM with FlashInfer overridden to 0.6.18,
    the compiled exllamav3_ext, vllm-exl3 reading every pack key, the patches applied, --enforce-eager."""
    site = tmp_path / "site-packages"
    install_vllm(site, vllm)
    install_flashinfer(site, flashinfer)
    install_exllamav3(site, "1.4.5", "aarch64")
    install_plugin(site)
    install_guard(site)
    install_torch(site, torch_pin(vllm) + "+cu130")
    cuda_home, venv_bin, tools = toolchain(tmp_path)
    nvidia_smi(tools, [("NVIDIA GB10", "12.1", "[N/A]")])
    cuobjdump(cuda_home / "bin", ["sm_121a"])
    proc = tmp_path / "proc"
    write_meminfo(proc, total_kb=127_601_092, free_kb=121_000_000, cached_kb=1_500_000)
    pack = write_pack(tmp_path / "pack", vcruz305_config(), total_bytes=95 * 10**9)
    verdicts = {
        "dtype-policy": "applied",
        "loader-skips": "applied",
        "stream-load": "not-applicable",
        "wide-swa": "not-applicable",
        "aux-streams": "opt-in",
        "dense-exl3": "opt-in",
        "exl3-wo-a-slices": "opt-in",
    }
    runtime = Runtime(
        site_dirs=(site,),
        vllm_root=site,
        vllm_version=vllm,
        python_version="3.12.3",
        machine="aarch64",
        patch_verdicts=verdicts,
        **flashinfer_runtime_fields(flashinfer),
    )
    environ = {
        "PATH": f"{cuda_home / 'bin'}:{venv_bin}:{tools}",
        "CUDA_HOME": str(cuda_home),
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
    }
    serve_args = (
        "--tensor-parallel-size 1 --quantization exl3 --max-model-len 65536 --max-num-seqs 16 "
        "--max-num-batched-tokens 2048 --kv-cache-dtype fp8 --gpu-memory-utilization 0.92 --trust-remote-code "
        "--no-enable-prefix-caching --enforce-eager "
        """--speculative-config '{"method":"dspark","num_speculative_tokens":3}'"""
    )
    return Deployment(site, tools, cuda_home, venv_bin, proc, pack, runtime, environ, serve_args)


def lna_lab(tmp_path: Path, vllm: str = "0.33.0", flashinfer: str = "0.7.2.post1") -> Deployment:
    """8 x RTX PRO 2000 (sm_120, x86_64, 16 GB each) at TP 8 with the Dense6 pack: EXL3 attention and shared
    experts, the shared-expert stream and aux streams off, a populated exllamav3 tune cache, vllm_exl3_c."""
    site = tmp_path / "site-packages"
    install_vllm(site, vllm)
    install_flashinfer(site, flashinfer)
    install_exllamav3(site, "1.4.5", "x86_64")
    install_plugin(site, source=plugin_source(kernels=UPSTREAM_KERNELS + ("lna2",)))
    install_guard(site)
    install_torch(site, torch_pin(vllm) + "+cu130")
    (site / extension_name("vllm_exl3_c", "312", "x86_64")).write_bytes(elf_bytes(EM_X86_64, b"p2b_fused_moe"))
    cuda_home, venv_bin, tools = toolchain(tmp_path)
    nvidia_smi(tools, [("NVIDIA RTX PRO 2000 Blackwell", "12.0", "16311")] * 8)
    cuobjdump(cuda_home / "bin", ["sm_120"])
    proc = tmp_path / "proc"
    write_meminfo(proc, total_kb=263_000_000, free_kb=240_000_000, cached_kb=12_000_000)
    pack = write_pack(tmp_path / "pack", lna_lab_config(), total_bytes=100 * 10**9)
    tune_cache = tmp_path / "exl3-tune-cache"
    tune_cache.mkdir()
    (tune_cache / "coop_autotune_v1.bin").write_bytes(b"\x01" * 4096)
    verdicts = {
        "dtype-policy": "upstream",
        "loader-skips": "upstream",
        "stream-load": "upstream",
        "wide-swa": "upstream",
        "aux-streams": "applied",
        "dense-exl3": "applied",
        "exl3-wo-a-slices": "opt-in",  # this pack stores wo_a whole (no attn.wo_a.slice.G tensors)
    }
    runtime = Runtime(
        site_dirs=(site,),
        vllm_root=site,
        vllm_version=vllm,
        python_version="3.12.3",
        machine="x86_64",
        patch_verdicts=verdicts,
        **flashinfer_runtime_fields(flashinfer),
    )
    environ = {
        "PATH": f"{cuda_home / 'bin'}:{venv_bin}:{tools}",
        "CUDA_HOME": str(cuda_home),
        "VLLM_DISABLE_SHARED_EXPERTS_STREAM": "1",
        "VLLM_SPARSE_INDEXER_MAX_LOGITS_MB": "128",
        "VLLM_DISABLE_DSV4_MEGAMOE_SHARED_EXPERT_FUSION": "1",
        "VLLM_EXL3_MOE_KERNEL": "lna2",
        "LNA_DSV4_AUX_STREAMS": "0",
        "EXLLAMAV3_TUNE_CACHE": str(tune_cache),
        "NCCL_P2P_DISABLE": "1",
        "NCCL_CUMEM_ENABLE": "0",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    serve_args = (
        "--tensor-parallel-size 8 --quantization exl3 --max-model-len 65536 --max-num-seqs 4 "
        "--max-num-batched-tokens 2048 --kv-cache-dtype fp8 --gpu-memory-utilization 0.90 "
        """--compilation-config '{"cudagraph_capture_sizes":[1,2,4]}' --disable-custom-all-reduce """
        "--no-enable-prefix-caching --trust-remote-code"
    )
    return Deployment(site, tools, cuda_home, venv_bin, proc, pack, runtime, environ, serve_args)


DEPLOYMENTS = {"vcruz305": vcruz305, "lna-lab": lna_lab}


# --- running checks --------------------------------------------------------------------------


def check_rows(ctx: DoctorContext, check_id: str) -> list[Row]:
    """The rows of one registered check, run the way doctor runs it."""
    specs = [spec for spec in CHECKS if spec.id == check_id]
    assert specs, f"no check {check_id} is registered"
    return run_checks(ctx, specs)


def check_row(ctx: DoctorContext, check_id: str) -> Row:
    (row,) = check_rows(ctx, check_id)
    return row


def module_rows(ctx: DoctorContext, prefix: str) -> list[Row]:
    return run_checks(ctx, [spec for spec in CHECKS if spec.id.startswith(prefix)])
