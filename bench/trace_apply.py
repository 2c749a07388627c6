"""The call trace of one apply: which pipeline step calls which, and how often a later step calls back into an
earlier one (planning or reporting into reading, say), on a writable copy of a real release tree.

Every call from a function of one module of the package into a function of another is recorded (sys.setprofile,
C functions left out); the report gives the steps' calls in order with their counts, and the calls that go back
up the pipeline (read -> judge -> plan -> write -> report).

    python bench/trace_apply.py [--version 0.30.0] [--checkout DIR]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STEPS = ("reading", "judge", "takeover", "planning", "transaction", "reporting")  # the pipeline, in order


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--version", default="0.30.0")
    parser.add_argument("--checkout", type=Path, help="a checkout's package laid out by bench/compare_commands.py")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    if args.checkout:
        from bench.compare_commands import package_of

        sys.path.insert(0, str(package_of(args.checkout.resolve(), Path(tempfile.mkdtemp()))))
    from patch_dsv4.pipeline import commands
    from patch_dsv4.tree.environment import locate_vllm
    from tests.releases import copy_tree, pristine_tree

    tree = copy_tree(pristine_tree(args.version), Path(tempfile.mkdtemp()) / "site-packages")
    env = locate_vllm(site_packages=tree)
    package = str(Path(commands.__file__).parent)
    calls: Counter = Counter()
    order: list[tuple[str, str]] = []

    def module_of(frame) -> str | None:
        path = frame.f_code.co_filename
        return Path(path).stem if path.startswith(package) and "/doctor/" not in path else None

    def profile(frame, event, _arg):
        if event != "call" or frame.f_back is None:
            return
        callee, caller = module_of(frame), module_of(frame.f_back)
        if callee and caller and callee != caller:
            edge = (caller, callee)
            if edge not in calls:
                order.append(edge)
            calls[edge] += 1

    sys.setprofile(profile)
    try:
        report = commands.apply(env)
    finally:
        sys.setprofile(None)
    print(f"apply on vLLM {args.version}: {report.summary}")
    print("module calls (caller -> callee: calls), in order of first call:")
    for edge in order:
        print(f"  {edge[0]:>12} -> {edge[1]:<16} {calls[edge]}")
    back = {e: n for e, n in calls.items() if e[0] in STEPS and e[1] in STEPS and STEPS.index(e[1]) < STEPS.index(e[0])}
    print(f"calls back up the pipeline ({' -> '.join(STEPS)}): {sum(back.values())}")
    for (caller, callee), n in sorted(back.items()):
        print(f"  {caller} -> {callee}: {n}")


if __name__ == "__main__":
    main()
