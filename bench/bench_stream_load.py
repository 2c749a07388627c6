"""Peak host memory of the vision classes' real load path: vLLM's sort against stream-load.

    .venv/bin/python bench/bench_stream_load.py [--shards 16] [--shard-mb 256] [--models v4 v41]

What runs, in the real vLLM 0.30.0 venv the integration tests build
(``tests/integration/venvs.py``; never written to): a synthetic checkpoint of
``--shards`` safetensors files on disk goes through vLLM's own
``safetensors_weights_iterator`` (``model_executor/model_loader/weight_utils.py``)
into the vision class's own ``load_weights``:
``DeepseekV4ForConditionalGeneration`` (V4, ``deepseek_v4/common/vl_model.py``)
and ``DeepseekV41ForCausalLM`` (V4.1, ``deepseek_v41/nvidia/vl_model.py``),
with their real weight mappers, vLLM's ``AutoWeightsLoader`` and the real vision
tower and aligner (``DeepseekV4ViT``, ``DeepseekV4Aligner``, built small on CPU,
loaded by their own weight loaders). "sorted" imports vLLM from the pristine
0.30.0 tree, "streamed" from a copy that ``patch-dsv4 apply --only stream-load``
patched; the rest of the venv is the same.

Faked: the class's ``__init__`` is not run (it builds the language model, which
needs CUDA); the instance is made with ``object.__new__`` and given what
``load_weights`` reads. Its language model is a stand-in that finalizes during
load, as the real one does, and whose ``load_weights`` copies each tensor into
a preallocated parameter with vLLM's ``default_weight_loader``. On a GPU the
parameters live in device memory, so here the language model's parameters are
views of one host buffer (the largest tensor's size): they cost the baseline
one tensor, not the checkpoint.

The checkpoint: each shard holds ``--tensors-per-shard`` language-model tensors
(BF16) and a share of the tower's tensors (dealt round-robin over the shards,
the case where a deferred tensor that kept its file mapping would pin every
shard). Each variant runs in a fresh process; the figure is the peak resident
set (VmHWM, reset once the model is built) above the baseline (VmRSS after the
imports and the parameters' allocation), and its ratio to the largest shard
file. The goal for stream-load: at most 1.5 x the largest shard.

What the figures say (vLLM 0.30.0, safetensors 0.8.0): the iterator maps one
shard at a time, and a tensor it yields is a view of that mapping; every page
the loader reads stays resident while any tensor of the shard is alive. The
sort keeps every tensor alive until the end, so the whole checkpoint's pages
pile up (peak = the checkpoint). Streamed, a shard's mapping goes when the
iterator moves on; what the peak holds beyond the current shard is the
non-language tensors (tower, aligner, image vectors), cloned by the helper and
held until the language model's group ends: peak = one shard + those tensors.
The 1.5 goal holds where they are under half a shard (16 x 256 MB: 1.24 x;
4 x 32 MB, a 76 MB tower: 2.02 x, over it by design).

Each child checks what it ran: the language model's ``load_weights`` was called
once (one contiguous group), every checkpoint tensor reached its parameter with
the right values, and the class's ``load_weights`` source is the sort (sorted)
or patch-dsv4's helper (streamed).
"""

from __future__ import annotations

import argparse
import json
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RELEASE = "0.30.0"
HELPER = "_patch_dsv4_stream_language_model_first"
MODEL_FILES = {
    "v4": "vllm/models/deepseek_v4/common/vl_model.py",
    "v41": "vllm/models/deepseek_v41/nvidia/vl_model.py",
}
MODEL_NAMES = {"v4": "V4 DeepseekV4ForConditionalGeneration", "v41": "V4.1 DeepseekV41ForCausalLM"}
IMAGE_PARAMS = {
    "v4": ("image_start", "image_end", "image_newline", "image_pad"),
    "v41": ("image_start", "image_end", "image_newline"),
}
#: V4.1's class has no image_pad: the V4 run adds this file to the shards.
V4_ONLY_FILE = "image-pad.safetensors"
RESULT = "BENCH_RESULT="
_DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4}


# -- the child: runs in the vLLM venv, imports nothing of this project ---------------------------------------


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _header(path: Path) -> tuple[dict, dict]:
    """A safetensors file's tensor index (name -> dtype, shape) and its metadata, read from its header."""
    with open(path, "rb") as fh:
        (size,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(size))
    return header, header.pop("__metadata__", None) or {}


def _tower_config(args):
    import types

    return types.SimpleNamespace(
        vision_patch_size=2,
        vision_dim=args.vision_dim,
        vision_n_heads=8,
        vision_inter_dim=4 * args.vision_dim,
        vision_n_layers=args.vision_layers,
        vision_rope_theta=10000.0,
        vision_downsample_ratio=2,
        hidden_size=args.hidden_size,
    )


def _tower(args, model: str):
    """The real vision tower, aligner and image vectors of the class, built small on CPU (one-process gloo group)."""
    import socket

    import torch
    from torch import nn
    from vllm.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from vllm.models.deepseek_v4.common.vision import DeepseekV4Aligner, DeepseekV4ViT

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    init_distributed_environment(
        world_size=1, rank=0, local_rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}", backend="gloo"
    )
    initialize_model_parallel(1, 1)
    cfg = _tower_config(args)
    parts = {"vision": DeepseekV4ViT(cfg), "aligner": DeepseekV4Aligner(cfg)}
    for name in IMAGE_PARAMS[model]:
        parts[name] = nn.Parameter(torch.zeros(cfg.hidden_size), requires_grad=False)
    return parts


def _tower_tensors(parts) -> dict[str, tuple]:
    """Checkpoint name -> (shape, dtype) of the tower's parameters (the checkpoint names are the parameter names)."""
    from torch import nn

    out = {}
    for prefix, part in parts.items():
        if isinstance(part, nn.Parameter):
            out[prefix] = (tuple(part.shape), part.dtype)
        else:
            for name, param in part.named_parameters():
                out[f"{prefix}.{name}"] = (tuple(param.shape), param.dtype)
    return out


def _fill(index: int) -> float:
    """The value every element of checkpoint tensor ``index`` holds (exact in BF16)."""
    return float(index % 251 + 1)


def child_write(args) -> dict:
    """Write the checkpoint: language-model tensors in order, the tower's dealt round-robin over the shards."""
    import torch
    from safetensors.torch import save_file
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
        parts = _tower(args, "v4")
    tower = _tower_tensors(parts)
    pad = {"image_pad": tower.pop("image_pad")}
    per_tensor = args.shard_mb * 2**20 // args.tensors_per_shard // 2  # BF16 elements
    out = Path(args.ckpt)
    out.mkdir(parents=True, exist_ok=True)
    tower_names = list(tower)
    count = 0
    for s in range(args.shards):
        shard, fills = {}, {}
        for t in range(args.tensors_per_shard):
            if s == 0 and t == 0:
                name = "embed.weight"
            elif s == args.shards - 1 and t == args.tensors_per_shard - 1:
                name = "head.weight"
            else:
                name = f"layers.{s}.ffn.experts.{t}.w1.weight"
            fills[name] = _fill(count)
            shard[name] = torch.full((per_tensor // 1024, 1024), fills[name], dtype=torch.bfloat16)
            count += 1
        for name in tower_names[s :: args.shards]:
            shape, dtype = tower[name]
            fills[name] = _fill(count)
            shard[name] = torch.full(shape, fills[name], dtype=dtype)
            count += 1
        # Each tensor's value goes into the file's metadata, for the loader's check.
        metadata = {name: repr(value) for name, value in fills.items()}
        save_file(shard, str(out / f"model-{s + 1:05d}-of-{args.shards:05d}.safetensors"), metadata=metadata)
        del shard
    pad_shape = pad["image_pad"][0]
    save_file({"image_pad": torch.full(pad_shape, 7.0)}, str(out / V4_ONLY_FILE), metadata={"image_pad": "7.0"})
    return {"tensors": count + 1}


class _Recorder:
    """Where the resident set stands as the language model's tensors are copied, and what was checked."""

    def __init__(self):
        self.calls = self.checked = 0
        self.at_start = self.at_end = 0
        self.max_rss = self.max_file = 0
        self.max_at = ""

    def sample(self, name: str) -> None:
        rss = _status_kb("VmRSS")
        if rss > self.max_rss:
            self.max_rss, self.max_at = rss, name
            self.max_file = _status_kb("RssFile")  # the shards' mapped pages (the rest is anonymous memory)


def _language_model(params: dict, values: dict, recorder: _Recorder):
    """The stand-in: finalizes during load (so the class must hand it one contiguous group), copies with vLLM's
    default_weight_loader into preallocated parameters, and checks each copy against the checkpoint's value."""
    from torch import nn
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    class StandInLanguageModel(nn.Module):
        finalizes_weights_during_load = True

        def load_weights(self, weights):
            recorder.calls += 1
            recorder.at_start = _status_kb("VmRSS")
            loaded = set()
            for name, tensor in weights:
                default_weight_loader(params[name], tensor)
                flat = params[name].data.view(-1)
                if float(flat[0]) != values[name] or float(flat[-1]) != values[name]:
                    raise AssertionError(f"{name}: holds {float(flat[0])}, the checkpoint {values[name]}")
                recorder.checked += 1
                loaded.add(name)
                recorder.sample(name)
            recorder.at_end = _status_kb("VmRSS")
            return loaded

    return StandInLanguageModel()


def child_load(args) -> dict:
    import gc
    import inspect

    import torch
    import vllm
    from torch import nn
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator

    if args.model == "v4":
        from vllm.models.deepseek_v4.common import vl_model
        from vllm.models.deepseek_v4.nvidia.model import DeepseekV4ForCausalLM

        cls = vl_model.DeepseekV4ForConditionalGeneration
        mapper = vl_model._make_deepseek_v4_vl_weights_mapper(DeepseekV4ForCausalLM.hf_to_vllm_mapper, True)
    else:
        from vllm.models.deepseek_v41.nvidia import vl_model

        cls = vl_model.DeepseekV41ForCausalLM
        # What __init__ passes for an FP4-expert checkpoint without MXFP8 linears (the default expert_dtype).
        mapper = vl_model._make_deepseek_v4_vl_weights_mapper(
            "fp4", vl_model._linear_scale_param_name(VllmConfig(device_config=DeviceConfig(device="cpu")), "fp4")
        )
    source = inspect.getsource(cls.load_weights)
    ran = "streamed" if HELPER in source else "sorted" if "sorted(" in source else "unknown"

    ckpt = Path(args.ckpt)
    files = sorted(ckpt.glob("model-*.safetensors"))
    if args.model == "v4":
        files.append(ckpt / V4_ONLY_FILE)
    index, fills = {}, {}
    for f in files:
        tensors, metadata = _header(f)
        index.update(tensors)
        fills.update({name: float(value) for name, value in metadata.items()})

    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
        parts = _tower(args, args.model)
    model = object.__new__(cls)
    nn.Module.__init__(model)
    for name, part in parts.items():
        setattr(model, name, part)
    model.hf_to_vllm_mapper = mapper

    # The language model's parameters, named as the class's mapper names the checkpoint's tensors.
    lm_params, lm_values, expected = {}, {}, set()
    deferred = 0  # bytes of the tensors the class does not hand to the language model
    numel = max(int(torch.Size(spec["shape"]).numel()) for spec in index.values())
    buffer = torch.zeros(numel, dtype=torch.bfloat16)
    for name, spec in index.items():
        mapped = list(mapper.apply([(name, name)]))
        if not mapped:
            continue
        ((target, _),) = mapped
        expected.add(target)
        shape = torch.Size(spec["shape"])
        if target.startswith("language_model."):
            inner = target[len("language_model.") :]
            lm_params[inner] = nn.Parameter(buffer[: shape.numel()].view(shape), requires_grad=False)
            lm_values[inner] = fills[name]
        else:
            deferred += shape.numel() * _DTYPE_BYTES[spec["dtype"]]
    recorder = _Recorder()
    model.language_model = _language_model(lm_params, lm_values, recorder)
    for param in model.parameters():
        param.data.zero_()  # resident before the baseline

    gc.collect()
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # VmHWM := VmRSS
    baseline = _status_kb("VmRSS")
    baseline_file = _status_kb("RssFile")
    loaded = model.load_weights(safetensors_weights_iterator([str(f) for f in files], False))
    peak = _status_kb("VmHWM")
    after = _status_kb("VmRSS")

    tower_wrong = []
    for name in _tower_tensors(parts):
        param = model.get_parameter(name)
        if not bool((param.detach() == fills[name]).all()):
            tower_wrong.append(name)
    return {
        "model": args.model,
        "ran": ran,
        "vllm": str(Path(vllm.__file__).parent),
        "files": len(files),
        "largest_shard_mb": max(f.stat().st_size for f in files) / 2**20,
        "checkpoint_mb": sum(f.stat().st_size for f in files) / 2**20,
        "baseline_mb": baseline / 1024,
        "peak_above_mb": (peak - baseline) / 1024,
        "lm_start_above_mb": (recorder.at_start - baseline) / 1024,
        "lm_max_above_mb": (recorder.max_rss - baseline) / 1024,
        "lm_max_at": recorder.max_at,
        "lm_max_file_above_mb": (recorder.max_file - baseline_file) / 1024,
        "deferred_mb": deferred / 2**20,
        "after_above_mb": (after - baseline) / 1024,
        "lm_calls": recorder.calls,
        "lm_values_checked": recorder.checked,
        "lm_params": len(lm_params),
        "tower_wrong": tower_wrong,
        "loaded_matches": set(loaded) == expected,
        "finalized": getattr(model, "_weights_finalized", None),
    }


# -- the parent: this checkout's venv ----------------------------------------------------------------------


def _run_child(python: str, tree: Path, role: str, args, extra: list[str]) -> dict:
    from tests.integration.conftest import clean_env

    argv = [
        python,
        __file__,
        "--child",
        role,
        "--ckpt",
        str(args.ckpt),
        "--shards",
        str(args.shards),
        "--shard-mb",
        str(args.shard_mb),
        "--tensors-per-shard",
        str(args.tensors_per_shard),
        "--vision-dim",
        str(args.vision_dim),
        "--vision-layers",
        str(args.vision_layers),
        "--hidden-size",
        str(args.hidden_size),
        *extra,
    ]
    # vLLM from `tree`, everything else from the venv; no bytecode written (the pristine tree is shared).
    env = clean_env(PYTHONPATH=str(tree), PYTHONDONTWRITEBYTECODE="1", VLLM_LOGGING_LEVEL="WARNING")
    done = subprocess.run(argv, capture_output=True, text=True, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT)]
    if done.returncode != 0 or not lines:
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-30:])
        raise SystemExit(f"bench child {role} {' '.join(extra)} failed (exit {done.returncode}):\n{tail}")
    return json.loads(lines[-1][len(RESULT) :])


def _problems(result: dict, variant: str, tree: Path) -> list[str]:
    bad = []
    if Path(result["vllm"]) != tree / "vllm":
        bad.append(f"vLLM was imported from {result['vllm']}, not {tree}")
    if result["finalized"] is not True:
        bad.append(f"_weights_finalized is {result['finalized']}")
    if result["ran"] != variant:
        bad.append(f"load_weights is the {result['ran']} code, not {variant}")
    if result["lm_calls"] != 1:
        bad.append(f"language model's load_weights called {result['lm_calls']} times")
    if result["lm_values_checked"] != result["lm_params"]:
        bad.append(f"{result['lm_values_checked']} of {result['lm_params']} language-model tensors loaded")
    if result["tower_wrong"]:
        bad.append(f"tower tensors not loaded: {result['tower_wrong'][:3]}")
    if not result["loaded_matches"]:
        bad.append("the loaded names differ from the mapped checkpoint")
    return bad


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shards", type=int, default=16)
    parser.add_argument("--shard-mb", type=int, default=256, help="language-model bytes per shard")
    parser.add_argument("--tensors-per-shard", type=int, default=16)
    parser.add_argument("--vision-dim", type=int, default=512)
    parser.add_argument("--vision-layers", type=int, default=4)
    parser.add_argument("--hidden-size", type=int, default=1024)
    parser.add_argument("--models", nargs="+", choices=sorted(MODEL_FILES), default=["v4", "v41"])
    parser.add_argument("--workdir", type=Path, help="kept afterwards (default: a temporary folder, removed)")
    parser.add_argument("--child", choices=("write", "load"), help=argparse.SUPPRESS)
    parser.add_argument("--ckpt", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--model", choices=sorted(MODEL_FILES), help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child:
        result = child_write(args) if args.child == "write" else child_load(args)
        print(RESULT + json.dumps(result), flush=True)
        return

    sys.path.insert(0, str(ROOT))
    from tests.conftest import run_cli
    from tests.integration.venvs import venv_path
    from tests.releases import copy_tree, pristine_tree

    venv = venv_path(RELEASE)
    if not (venv / ".complete").exists():
        raise SystemExit(
            f"no complete vLLM {RELEASE} venv at {venv}: build it with `python -m tests.integration.venvs {RELEASE}`"
        )
    python = str(venv / "bin" / "python")
    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench-stream-load-"))
    work.mkdir(parents=True, exist_ok=True)
    args.ckpt = work / "checkpoint"
    try:
        pristine = pristine_tree(RELEASE)
        patched = work / "patched"
        if not patched.exists():
            copy_tree(pristine, patched)
            applied = run_cli("apply", "--site-packages", str(patched), "--only", "stream-load")
            if applied.code != 0:
                raise SystemExit(f"patch-dsv4 apply failed on the copy:\n{applied.out}{applied.err}")
        for model in args.models:
            if HELPER not in (patched / MODEL_FILES[model]).read_text():
                raise SystemExit(f"patch-dsv4 apply left {MODEL_FILES[model]} sorting: no edit for it here")

        # A kept --workdir reuses its checkpoint when it was written with the same sizes.
        sizes = ("shards", "shard_mb", "tensors_per_shard", "vision_dim", "vision_layers", "hidden_size")
        shape = {k: getattr(args, k) for k in sizes}
        stamp = args.ckpt / "written-with.json"
        if not stamp.exists() or json.loads(stamp.read_text()) != shape:
            shutil.rmtree(args.ckpt, ignore_errors=True)
            _run_child(python, pristine, "write", args, [])
            stamp.write_text(json.dumps(shape))
        total = sum(f.stat().st_size for f in args.ckpt.glob("model-*.safetensors")) / 2**20
        print(
            f"vLLM {RELEASE} venv {venv}\ncheckpoint {args.ckpt}: {total:.0f} MB in {args.shards} shards, each "
            f"{args.tensors_per_shard} language-model tensors of {args.shard_mb / args.tensors_per_shard:g} MB "
            f"and its share of the tower's tensors"
        )
        print(f"{'model':40s} {'variant':9s} {'shard MB':>8s} {'base MB':>8s} {'peak+ MB':>9s} {'x shard':>8s}")
        failures = []
        for model in args.models:
            for variant, tree in (("sorted", pristine), ("streamed", patched)):
                r = _run_child(python, tree, "load", args, ["--model", model])
                ratio = r["peak_above_mb"] / r["largest_shard_mb"]
                print(
                    f"{MODEL_NAMES[model]:40s} {variant:9s} {r['largest_shard_mb']:8.1f} {r['baseline_mb']:8.1f} "
                    f"{r['peak_above_mb']:9.1f} {ratio:8.2f}"
                )
                print(
                    f"    language model's load: +{r['lm_start_above_mb']:.0f} MB at its start, at most "
                    f"+{r['lm_max_above_mb']:.0f} MB (of it {r['lm_max_file_above_mb']:.0f} MB the shards' mapped "
                    f"pages), at {r['lm_max_at']}; non-language tensors {r['deferred_mb']:.0f} MB"
                )
                if variant == "streamed":
                    print(
                        f"    above one shard: {r['peak_above_mb'] - r['largest_shard_mb']:.0f} MB; the non-language "
                        f"tensors, cloned and held until the language model's group ends: {r['deferred_mb']:.0f} MB"
                    )
                failures += [f"{model} {variant}: {p}" for p in _problems(r, variant, tree)]
                if variant == "streamed" and ratio > 1.5:
                    failures.append(f"{model} streamed: {ratio:.2f} x the largest shard, over the 1.5 goal")
        if failures:
            raise SystemExit("\n".join(failures))
        print("every load checked: one contiguous language-model group, every tensor's values, the tower loaded")
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
