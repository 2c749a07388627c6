"""Try `patch-dsv4 doctor` in a minute, without a 100 GB pack: synthetic packs on disk and on a stand-in Hub.

    python examples/try_doctor.py [--dir DIR]

From a checkout with the test extra installed (`pip install -e '.[test]'`; the Hub reads need huggingface_hub,
which the test extra brings). It builds, in DIR (a temporary directory by default, removed on exit):

- ``dsv4-small``: a small DeepSeek-V4-Flash-Vision EXL3 pack (vcruz305's MixedK layout, 4 layers, 4 experts);
- ``dsv41-flash``: a full-size DeepSeek-V4.1-Flash routed-only EXL3 pack (48 shards, ~188k tensors, 368 GB as
  its headers say, a few tens of MB on disk: the tensors' data is never written);
- ``dsv41-no-engram``: the same without its Engram tables, the silent failure doctor exists for;

each with its real safetensors headers and config (tests/doctor/synthetic.py, synthetic_v41.py), starts the
stand-in Hub (tests/doctor/hub_server.py) on 127.0.0.1 serving the three, prints the doctor commands to try, and
serves until Ctrl-C. The packs are what doctor's tests judge; nothing here loads a weight or needs a GPU.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # tests/doctor is the checkout's, not an installed package

OWNER = "synthetic"
V4_SERVE = "--tensor-parallel-size 1 --max-model-len 65536"
V41_SERVE = "--tensor-parallel-size 2 --max-model-len 65536"


def build(where: Path) -> dict[str, Path]:
    """The three packs, built in ``where``: name -> directory."""
    from tests.doctor.synthetic import build_mixedk_pack
    from tests.doctor.synthetic_v41 import FLASH, build_v41_pack, build_v41_variant

    packs = {}
    for name, make in (
        ("dsv4-small", lambda dest: build_mixedk_pack(dest)),
        ("dsv41-flash", lambda dest: build_v41_pack(dest, FLASH)),
        ("dsv41-no-engram", lambda dest: build_v41_variant(dest, "no-engram", FLASH)),
    ):
        started = time.monotonic()
        packs[name] = make(where / name)
        print(f"built {name} in {time.monotonic() - started:.1f} s: {packs[name]}", flush=True)
    return packs


def vllm_target(args: argparse.Namespace) -> list[str]:
    """The target options doctor's commands take: the one given, the running interpreter's vLLM, or the real
    vLLM 0.34.0 tree the tests use (from their cache; built there once with pip, about 240 MB, where absent)."""
    if args.site_packages is not None:
        return ["--site-packages", str(args.site_packages)]
    if args.python is not None:
        return ["--python", args.python]
    from patch_dsv4.output.errors import PatcherError
    from patch_dsv4.tree.environment import locate_vllm

    try:
        locate_vllm()
        return []  # this interpreter's environment has vLLM: doctor's default target
    except PatcherError:
        pass
    from tests.releases import cache_dir, pristine_tree

    if not (cache_dir() / "trees" / "vllm-0.34.0" / ".complete").exists():
        print("no vLLM here: installing vLLM 0.34.0 (no dependencies) into the tests' cache, once", flush=True)
    return ["--site-packages", str(pristine_tree("0.34.0"))]


def commands(packs: dict[str, Path], target: list[str], endpoint: str | None) -> list[str]:
    """The doctor commands to try (the ``#`` lines say what each shows), each option on a line of its own."""
    q = shlex.quote
    where = [f"    {' '.join(q(part) for part in target)} \\"] if target else []

    def doctor(pack: str, serve: str, env: str = "") -> list[str]:
        return [f"{env}patch-dsv4 doctor \\", *where, f"    --pack {q(pack)} \\", f"    --serve-args {q(serve)}"]

    lines = [
        "# a small V4 pack on disk (-v: what each row read; --json: the document)",
        *doctor(str(packs["dsv4-small"]), V4_SERVE),
        "# the full-size V4.1-Flash pack on disk: 48 headers read in about a second",
        *doctor(str(packs["dsv41-flash"]), V41_SERVE),
        "# the same without its Engram tables: v41.engram-tables fails",
        *doctor(str(packs["dsv41-no-engram"]), V41_SERVE),
    ]
    if endpoint is not None:
        lines += [
            "# from the stand-in Hub, by range requests only (needs huggingface_hub)",
            *doctor(f"hf://{OWNER}/dsv41-flash@main", V41_SERVE, f"HF_ENDPOINT={endpoint} "),
        ]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, help="build the packs here (kept); default: a temporary directory")
    parser.add_argument("--no-hub", action="store_true", help="build the packs only, start no stand-in Hub")
    parser.add_argument("--site-packages", type=Path, metavar="DIR", help="the vLLM doctor judges the packs with")
    parser.add_argument("--python", metavar="EXE", help="the interpreter whose vLLM doctor judges them with")
    args = parser.parse_args(argv)
    target = vllm_target(args)
    where = args.dir or Path(tempfile.mkdtemp(prefix="patch-dsv4-try-doctor-"))
    where.mkdir(parents=True, exist_ok=True)
    try:
        packs = build(where)
        if args.no_hub:
            print("\n" + "\n".join(commands(packs, target, None)))
            return 0
        from tests.doctor.hub_server import serving

        with serving({f"{OWNER}/{name}": path for name, path in packs.items()}) as hub:
            print(f"\nstand-in Hub at {hub.endpoint} serving {', '.join(f'{OWNER}/{n}' for n in packs)}")
            print("try, in another shell:\n\n" + "\n".join(commands(packs, target, hub.endpoint)) + "\n")
            print("Ctrl-C stops the Hub" + ("" if args.dir else " and removes the packs"), flush=True)
            try:
                while True:
                    time.sleep(3600)
            except KeyboardInterrupt:
                print()
        return 0
    finally:
        if args.dir is None:
            shutil.rmtree(where, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
