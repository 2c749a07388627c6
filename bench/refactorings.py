"""The refactoring generator of tests/refactor, run in full from the command line: the confusion matrix of the
verdicts on refactorings generated from vLLM's real code.

For each release (the cached pristine trees of tests/releases.py, or a tree you give), every function the
recorded judgements rest on is rewritten: first by every transform once at a few places (``--singles``, on by
default), then by chains of 1-3 transforms Hypothesis draws (``--examples`` per release, ``--seed``). Each variant
is judged in memory by the engine's own judge (tests/refactor/generator.py says how, what is expected and what
each false verdict means). Printed: the matrix per patch and per release, the number of variants per transform,
every false verdict with its chain, the file:line it changed and the spec that reproduces it, and the run's wall
time.

    python bench/refactorings.py --all [--examples 300] [--seed 1] [--jobs 2] [--dump DIR]
    python bench/refactorings.py --vllm-version 0.34.0
    python bench/refactorings.py --site-packages DIR            # a tree pip installed (its release recorded)
    python bench/refactorings.py --vllm-version 0.34.0 --replay "SPEC" [--dump DIR]

``--replay`` judges one variant again (SPEC as a false verdict's ``replay:`` line gives it) and prints the diff
of every file it changes; ``--dump DIR`` writes the changed and new files of that variant (of each false verdict,
in a run) under DIR, each variant in a folder of its own.
"""

from __future__ import annotations

import argparse
import difflib
import os
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.refactor.generator import (  # noqa: E402 - the checkout first on the path
    ReleaseCode,
    Results,
    all_transforms,
    build,
    cpu_count,
    false_lines,
    judge_variant,
    matrix_lines,
    parse_spec,
    plan_release,
    pristine,
    run,
    summary_lines,
    transform_lines,
)
from tests.releases import RELEASES  # noqa: E402


def singles(plan, results: Results, picks: int) -> None:
    """Every transform once at every site, at its first ``picks`` places (an injection only where its patch's
    judgement rests on the site)."""
    keep, inject = all_transforms(plan)
    for site in plan.sites:
        here = plan.patches_at(site)
        for transform in (*keep, *inject):
            if not transform.keeps and transform.patch not in here:
                continue
            for pick in range(picks):
                before = results.variants
                results.add(plan, site, [(transform, pick)])
                if results.variants == before and pick:
                    break  # fewer places than picks: the same variant again, or none


def one_release(root: str, examples: int, seed: int, picks: int) -> tuple[str, Results, list[str]]:
    started = time.perf_counter()
    plan = plan_release(ReleaseCode(Path(root)))
    results = Results()
    if picks:
        singles(plan, results, picks)
    if examples:
        run(plan, examples, seed=seed, results=results)
    results.seconds = time.perf_counter() - started
    results.seen = set()  # not needed by the parent; keeps the pickle small
    return plan.release.version, results, plan.notes


def checkout() -> str:
    """The commit of this checkout (``+`` when files differ from it), or ``unknown``."""
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain"], capture_output=True, text=True)
    except OSError:
        return "unknown"
    return head.stdout.strip() + ("+" if dirty.stdout.strip() else "") if head.returncode == 0 else "unknown"


def dump(directory: Path, name: str, files: dict[str, str]) -> Path:
    where = directory / name
    for path, text in files.items():
        target = where / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    return where


def replay(root: Path, spec: str, directory: Path | None) -> int:
    plan = plan_release(ReleaseCode(root))
    site, chain = parse_spec(plan, spec)
    variant = build(plan, site, chain)
    if variant is None:
        print(f"no transform of the spec applies at {site}", file=sys.stderr)
        return 2
    for path in sorted(variant.files):
        before = plan.release.text(path) or ""
        print("".join(difflib.unified_diff(before.splitlines(True), variant.files[path].splitlines(True), path, path)))
    for row in judge_variant(plan, variant):
        print(f"{row.patch}: {row.edit}: expected {row.expected} ({row.kind}), found {row.found} [{row.verdict}]")
        print(f"  {row.detail[:500]}")
    if directory is not None:
        print(f"variant written to {dump(directory, 'replay', variant.files)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--vllm-version", help="one recorded release, from the tests' cache (fetched with pip)")
    which.add_argument("--all", action="store_true", help="every recorded release, 0.28.0-0.34.0")
    which.add_argument("--site-packages", type=Path, help="a tree holding vllm/ and its dist-info")
    parser.add_argument("--examples", type=int, default=300, help="variants Hypothesis draws per release")
    parser.add_argument("--seed", type=int, default=0, help="Hypothesis's seed (mixed with each release's version)")
    parser.add_argument("--singles", type=int, default=2, help="places each transform is tried at alone (0: none)")
    parser.add_argument("--jobs", type=int, default=cpu_count(), help="releases judged at once")
    parser.add_argument("--replay", metavar="SPEC", help="judge one variant again and show its diff")
    parser.add_argument("--dump", type=Path, metavar="DIR", help="write the variants' changed files under DIR")
    parser.add_argument("--false-limit", type=int, default=None, help="list at most this many false verdicts")
    args = parser.parse_args(argv)

    if args.site_packages is not None:
        roots = [args.site_packages]
    elif args.all:
        roots = [pristine(v) for v in RELEASES]
    else:
        roots = [pristine(args.vllm_version)]
    if args.replay:
        if len(roots) != 1:
            parser.error("--replay judges one release: name it with --vllm-version or --site-packages")
        return replay(roots[0], args.replay, args.dump)

    started = time.perf_counter()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"refactorings: {len(roots)} release(s), {args.examples} drawn per release, singles x{args.singles}, "
        f"seed {args.seed}"
    )
    print(f"machine: {cpu_count()} cores, {args.jobs} job(s), load {load:.2f} at start; checkout {checkout()}")
    jobs = max(1, min(args.jobs, len(roots)))
    work = [(str(root), args.examples, args.seed, args.singles) for root in roots]
    if jobs == 1:
        done = [one_release(*w) for w in work]
    else:
        with ProcessPoolExecutor(jobs) as pool:
            done = list(pool.map(one_release, *zip(*work, strict=True)))
    total = Results()
    for version, results, notes in done:
        total.rows += results.rows
        total.variants += results.variants
        total.per_transform.update(results.per_transform)
        total.invalid += results.invalid
        total.errors += results.errors
        print(f"\n== vLLM {version}: {results.variants} variants in {results.seconds:.0f} s")
        for note in notes:
            print(f"note: {note}")
        print("\n".join(summary_lines(results)))
        print("\n".join(matrix_lines(results.rows, lambda r: r.patch, "patch")))
    if len(done) > 1:
        print("\n== every release")
        print("\n".join(summary_lines(total)))
        print("\n".join(matrix_lines(total.rows, lambda r: r.patch, "patch")))
        print()
        print("\n".join(matrix_lines(total.rows, lambda r: r.release, "release")))
    print("\n== variants per transform (steps that applied)")
    print("\n".join(transform_lines(total)))
    print(f"\n== false verdicts ({len(total.false())})")
    print("\n".join(false_lines(total, args.false_limit)))
    for line in (*total.invalid, *total.errors):
        print(f"generator bug: {line}")
    if args.dump is not None:
        by_spec = {}
        for row in total.false():
            by_spec.setdefault((row.release, row.spec), row)
        plans = {}
        for n, (release, spec) in enumerate(sorted(by_spec), 1):
            if release not in plans:
                root = next(r for r, (v, _res, _n) in zip(roots, done, strict=True) if v == release)
                plans[release] = plan_release(ReleaseCode(Path(root)))
            plan = plans[release]
            variant = build(plan, *parse_spec(plan, spec))
            dump(args.dump, f"{n:03d}-{release}", {**variant.files, "SPEC": spec + "\n"})
        print(f"\n{len(by_spec)} variant(s) with a false verdict written under {args.dump}")
    wall = time.perf_counter() - started
    print(f"\nwall time: {wall:.0f} s ({total.variants} variants, {len(total.rows)} judgements)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
