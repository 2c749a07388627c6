"""Cost and accuracy of the wide-swa sliced SM120 prefill, on a torch reference kernel.

The sliced path (128-wide window slices, the compressed segment and the sink in
slice 0, a base-2 LSE merge) is the code the `wide-swa` patch injects, compiled
from the functions of ``patches/wide_swa.py``; FlashInfer is replaced by the torch
reference kernel of ``tests/sparse_mla_reference.py`` (same entry point, same
LSE and empty-row conventions), so this runs anywhere torch does. Reported per
token count:

- the time of one full-width call of the reference kernel, and of the sliced
  path with its merge (same kernel, 128-wide slices), and their ratio;
- the largest error of each against a float64 reference over the whole row,
  absolute and relative to the largest output magnitude.

Sizes default to what DeepSeek-V4-Flash-Vision prefill sees on one GPU (2048
and 8192 tokens, 64 heads, 512-wide window rows, 512 compressed entries, head
dim 512). Without CUDA it falls back to CPU with small sizes.

    python bench/wide_swa_bench.py                      # CUDA if present, else CPU (small)
    python bench/wide_swa_bench.py --tokens 2048 8192 --json
"""

from __future__ import annotations

import argparse
import ast
import functools
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import sparse_mla_reference as reference  # noqa: E402 - tests/ must be on sys.path first

PATCH_MODULE = ROOT / "patches" / "wide_swa.py"


def sliced_path():
    """The injected helpers, compiled from the patch module's source (not imported: no patch-dsv4 install needed)."""
    source = PATCH_MODULE.read_text()
    namespace: dict = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("_patch_dsv4_wide_swa_"):
            exec(compile(ast.Module(body=[node], type_ignores=[]), str(PATCH_MODULE), "exec"), namespace)
    # FlashInfer's private SM120 entry point is played by the reference kernel.
    namespace["_patch_dsv4_wide_swa_flashinfer_api"] = lambda: (
        reference.sparse_mla_sm120,
        reference.SparseMLASegment,
    )
    return namespace["_patch_dsv4_wide_swa_sliced_prefill"]


def make_inputs(tokens, heads, keys, compressed, dim, device, generator):
    page = 64
    window_slots = ((tokens + keys + page - 1) // page) * page
    compressed_slots = ((max(tokens // 4, compressed) + page - 1) // page) * page

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(device)

    swa_cache = randn(window_slots // page, page, 1, dim)
    compressed_cache = randn(compressed_slots // page, page, 1, dim)
    query = randn(tokens, heads, dim)
    # Window rows as vLLM builds them: contiguous slots ending past the token
    # (image spans see ahead), lengths up to the row width, -1 beyond.
    lens = torch.randint(keys // 4, keys + 1, (tokens,), generator=generator, dtype=torch.int32)
    starts = torch.arange(tokens) + keys - lens
    columns = torch.arange(keys)
    window = (starts[:, None] + columns[None, :]).to(torch.int32)
    window = torch.where(columns[None, :] < lens[:, None], window, torch.full_like(window, -1))
    extra = torch.randint(0, compressed_slots, (tokens, compressed), generator=generator, dtype=torch.int32)
    extra_lens = torch.randint(0, compressed + 1, (tokens,), generator=generator, dtype=torch.int32)
    sinks = randn(heads)
    return {
        "query": query,
        "swa_kv_cache": swa_cache,
        "compressed_kv_cache": compressed_cache,
        "sparse_indices": window.view(tokens, 1, keys).to(device),
        "swa_topk_lens": lens.to(device),
        "extra_sparse_indices": extra.to(device),
        "extra_sparse_topk_lens": extra_lens.to(device),
        "sinks": sinks,
        "bmm1_scale": 1.0 / math.sqrt(dim),
    }


def full_width(inputs, out, compute_dtype=torch.float32):
    return reference.one_softmax_over_the_row(inputs, out, compute_dtype, return_lse=False)


def timed(fn, device, repeats):
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()  # warm-up
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--tokens", type=int, nargs="+", default=None, help="prefill token counts")
    parser.add_argument("--heads", type=int, default=None)
    parser.add_argument("--keys", type=int, default=512, help="window row width (sliding_window + vision_max_n_token)")
    parser.add_argument("--compressed", type=int, default=512, help="compressed entries per row")
    parser.add_argument("--dim", type=int, default=None, help="head dim (latent, key = value)")
    parser.add_argument(
        "--out-dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="dtype of the partial and final outputs (the real kernel writes bfloat16)",
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="one JSON document on stdout")
    args = parser.parse_args(argv)

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    small = device.type == "cpu"
    tokens_list = args.tokens or ([256, 1024] if small else [2048, 8192])
    heads = args.heads or (8 if small else 64)
    dim = args.dim or (64 if small else 512)
    out_dtype = getattr(torch, args.out_dtype)
    sliced = sliced_path()
    generator = torch.Generator().manual_seed(args.seed)

    rows = []
    for tokens in tokens_list:
        inputs = make_inputs(tokens, heads, args.keys, args.compressed, dim, device, generator)
        out_full = torch.empty(tokens, heads, dim, dtype=out_dtype, device=device)
        out_sliced = torch.empty_like(out_full)
        # functools.partial binds this iteration's tensors now (a lambda would look them up when called).
        t_full = timed(functools.partial(full_width, inputs, out_full), device, args.repeats)
        t_sliced = timed(
            functools.partial(
                sliced,
                query=inputs["query"],
                swa_kv_cache=inputs["swa_kv_cache"],
                workspace_buffer=None,
                sparse_indices=inputs["sparse_indices"],
                compressed_kv_cache=inputs["compressed_kv_cache"],
                out=out_sliced,
                bmm1_scale=inputs["bmm1_scale"],
                sinks=inputs["sinks"],
                swa_topk_lens=inputs["swa_topk_lens"],
                extra_sparse_indices=inputs["extra_sparse_indices"],
                extra_sparse_topk_lens=inputs["extra_sparse_topk_lens"],
            ),
            device,
            args.repeats,
        )
        exact = torch.empty(tokens, heads, dim, dtype=torch.float64, device=device)
        full_width(inputs, exact, compute_dtype=torch.float64)
        scale = max(1.0, exact.abs().max().item())
        err_sliced = (out_sliced.double() - exact).abs().max().item()
        err_full = (out_full.double() - exact).abs().max().item()
        rows.append(
            {
                "tokens": tokens,
                "heads": heads,
                "keys": args.keys,
                "compressed": args.compressed,
                "dim": dim,
                "device": str(device),
                "out_dtype": args.out_dtype,
                "full_ms": t_full * 1e3,
                "sliced_ms": t_sliced * 1e3,
                "overhead_ratio": t_sliced / t_full,
                "max_abs_err_sliced": err_sliced,
                "max_abs_err_full": err_full,
                "max_rel_err_sliced": err_sliced / scale,
                "max_rel_err_full": err_full / scale,
            }
        )
        del inputs, out_full, out_sliced, exact
        if device.type == "cuda":
            torch.cuda.empty_cache()

    if args.json:
        print(json.dumps({"rows": rows}, indent=2))
        return 0
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"wide-swa sliced prefill vs one full-width call, torch reference kernel on {name}")
    print(
        f"{'tokens':>7} {'heads':>5} {'keys':>5} {'comp':>5} {'dim':>4} {'full ms':>9} {'sliced ms':>10} "
        f"{'ratio':>6} {'err sliced':>11} {'err full':>10} {'rel sliced':>11}"
    )
    for r in rows:
        print(
            f"{r['tokens']:>7} {r['heads']:>5} {r['keys']:>5} {r['compressed']:>5} {r['dim']:>4} "
            f"{r['full_ms']:>9.2f} {r['sliced_ms']:>10.2f} {r['overhead_ratio']:>6.2f} "
            f"{r['max_abs_err_sliced']:>11.2e} {r['max_abs_err_full']:>10.2e} {r['max_rel_err_sliced']:>11.2e}"
        )
    print("errors: max |out - float64 one-softmax reference|; rel: divided by max(1, max |reference|)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
