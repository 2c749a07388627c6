"""Peak host memory of the vision class's weight ordering: upstream sort vs stream-load.

    python bench/bench_stream_load.py [--shards 32] [--shard-mb 64]

A synthetic checkpoint (safetensors-like: each tensor is its own allocation,
read shard by shard, language-model tensors interleaved with the vision tower's)
goes through the ordering the vision class applies before AutoWeightsLoader,
and a consumer that copies each tensor into a parameter buffer and drops it,
as the loader does. Each variant runs in a fresh process; the figure is the
peak resident set above the process's baseline (torch imported, buffer
allocated). The streamed variant is the generator patch-dsv4 writes, taken from
a patched copy of vLLM 0.30.0.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CHILD = r"""
import json, resource, sys
import torch
sys.path.insert(0, {root!r})
from tests.injected import load_function

variant, shards, shard_mb, patched = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
per_shard = 8
numel = shard_mb * 2**20 // 4 // per_shard
param = torch.empty(numel)  # the destination a loader copies into

def checkpoint():
    for s in range(shards):
        for t in range(per_shard):
            name = (f"vision.blocks.{{s}}.w{{t}}" if (t == 0 and s % 4 == 0)
                    else f"language_model.model.layers.{{s}}.w{{t}}")
            numel_t = numel // 16 if name.startswith("vision.") else numel
            yield name, torch.full((numel_t,), float(s))

def rss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

base = rss_mb()
if variant == "sorted":
    ordered = iter(sorted(checkpoint(), key=lambda x: x[0]))
else:
    ordered = load_function(patched, "_patch_dsv4_stream_language_model_first")(checkpoint())
count = 0
for name, tensor in ordered:
    param[: tensor.numel()].copy_(tensor)
    count += 1
    del tensor
print(json.dumps({{"variant": variant, "peak_mb": rss_mb() - base, "tensors": count}}))
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shards", type=int, default=32)
    parser.add_argument("--shard-mb", type=int, default=64)
    args = parser.parse_args()

    from tests.conftest import run_cli
    from tests.releases import copy_tree, pristine_tree

    work = Path(tempfile.mkdtemp())
    tree = copy_tree(pristine_tree("0.30.0"), work / "site-packages")
    assert run_cli("apply", "--site-packages", str(tree), "--only", "stream-load").code == 0
    patched = tree / "vllm/models/deepseek_v4/common/vl_model.py"
    checkpoint_mb = args.shards * args.shard_mb
    print(f"checkpoint {checkpoint_mb} MB in {args.shards} shards of {args.shard_mb} MB")
    for variant in ("sorted", "streamed"):
        out = subprocess.run(
            [
                sys.executable,
                "-c",
                CHILD.format(root=str(ROOT)),
                variant,
                str(args.shards),
                str(args.shard_mb),
                str(patched),
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        result = json.loads(out.strip().splitlines()[-1])
        print(
            f"  {variant:9s} peak host memory above baseline: {result['peak_mb']:8.1f} MB"
            f"  ({result['peak_mb'] / args.shard_mb:.2f} shards, {result['tensors']} tensors)"
        )


if __name__ == "__main__":
    main()
