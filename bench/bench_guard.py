"""The serve guard's cost per vLLM process, and which vLLM processes call it, in a real vLLM venv.

Runs in the real, fully installed venv of tests/integration/venvs.py (built on first
use: about 8 GB and 10 minutes), with this checkout installed into it.

1. Cost. In fresh processes of the venv, one after another: ``import vllm``, then
   ``import patch_dsv4.guard``, then ``patch_dsv4.guard.check()`` (each timed in the
   process), on a pristine known build (no state: the guard decides from anchors/)
   and on an applied tree (the guard reads and hashes every file the state names).
   One warm-up process, then ``--repeat`` measured ones per tree; medians. It also
   says whether ``check()`` took a fast path or fell back to a full judgement. The
   target is at most 5 ms per process on an applied tree (import and check()).
2. Callers. A throwaway ``vllm.general_plugins`` entry point (a dist-info and a module
   written into the venv for this run only, removed after) appends its pid, parent pid
   and argv to a file; ``vllm serve --help``, ``EngineArgs(model=...)`` and, as a
   control, ``import vllm`` run with ``PATCH_DSV4_GUARD=warn`` on the pristine tree
   (pending patches), and the bench prints the processes that called the plugins and
   how many ERROR lines of our guard each command logged.

The venv is left as it was found: the state is reverted, the throwaway plugin removed.

    python bench/bench_guard.py [--version 0.30.0] [--repeat 5] [--skip-callers] [--checkout OTHER]

It times ``check()`` in wall time and in CPU time (``import patch_dsv4.guard`` and ``check()``, the process's own:
what a busy machine's waiting does not inflate); ``--checkout`` installs another checkout (a worktree of main) to
measure it the same way.

``--tree`` measures the guard's first call without the real venv (no torch, nothing installed anywhere but in a
temporary directory): the checkout is installed from its wheel into a directory of its own (as pip installs it in an
image: bytecode compiled, RECORD beside it), a writable copy of the release's installed tree (tests/releases.py) is
applied with it, and each fresh interpreter (``python -I`` of a venv with nothing installed: a cold interpreter)
registers that tree's ``vllm/`` as the imported vLLM and times ``import patch_dsv4.guard`` plus ``check()``, wall
and CPU, with PATCH_DSV4_GUARD=strict (any problem would stop the run): without and with PATCH_DSV4_EXPECT (the
tree's own fingerprint: the guard computes and compares it), after the standard library modules a vLLM process has
imported before it calls its plugins (logging, json, hashlib, re, fcntl: where the guard runs, and where its 5 ms
target holds), and in a bare interpreter (every module the guard needs counted, json and hashlib included).
``--against CHECKOUT`` measures another checkout (e.g. a worktree of main) the same way, interleaved with this one run
by run, so that the machine's load falls on both alike. Every run reads and hashes every file the guard vouches for:
there is no cache of them to hold or not.

    python bench/bench_guard.py --tree [--version 0.30.0] [--repeat 30] [--against /tmp/guard-base]

``--hostile`` measures what a hostile or unlucky file costs the guard's first call (the interpreter as a vLLM process
has it): the state's manifest padded to 60 MB, cut in half, nested 300,000 deep, 512 KiB of empty objects (the most
values a manifest may hold), vLLM's METADATA with a 100 MB line, its RECORD padded to 64 MB, a held lock whose holder
line is 10 MB of escapes: the wall time of check() and the peak memory it adds (ru_maxrss after, less before), the
largest of ``--repeat`` fresh interpreters each, against the targets (20 ms, 20 MB), and what the guard said. The
peak is VmHWM after check() less VmRSS before it, the peak reset before it (/proc/self/clear_refs: Linux).

    python bench/bench_guard.py --hostile [--version 0.30.0] [--repeat 5] [--checkout OTHER]
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TYPE_CHECKING = False
if TYPE_CHECKING:
    from tests.integration.conftest import RealVenv

MARK = "PATCH_DSV4_BENCH="
TIMING = (
    f"MARK = {MARK!r}\n"
    + r"""
import json, os, sys, time
t0 = time.perf_counter()
import vllm
t1, c1 = time.perf_counter(), time.process_time()
import patch_dsv4.guard as guard
t2 = time.perf_counter()
full = []
judge = guard._full_judgement
guard._full_judgement = lambda *a: full.append(1) or judge(*a)
os.environ["PATCH_DSV4_GUARD"] = "warn"
guard.check()
t3, c3 = time.perf_counter(), time.process_time()
problems = guard.judge_this_vllm()
print(MARK + json.dumps({"import_vllm": t1 - t0, "import_guard": t2 - t1, "check": t3 - t2, "cpu": c3 - c1,
                          "full_judgement": bool(full), "problems": [p[0] + " " + p[1] for p in problems]}))
"""
)

# The first call in a fresh interpreter: the tree's vllm/ stands for the imported vLLM (the guard reads its path).
# argv: the directory patch_dsv4 is installed in, the tree, then the standard library modules to import first.
COLD = (
    f"MARK = {MARK!r}\n"
    + r"""
import sys, time
installed, tree = sys.argv[1:3]
for name in sys.argv[3:]:
    __import__(name)
sys.path[:0] = [installed, tree]
before = set(sys.modules)
vllm = type(sys)("vllm")
vllm.__file__ = tree + "/vllm/__init__.py"
sys.modules["vllm"] = vllm
t1, c1 = time.perf_counter(), time.process_time()
import patch_dsv4.guard as guard
t2 = time.perf_counter()
guard.check()
t3, c3 = time.perf_counter(), time.process_time()
imported = sorted(set(sys.modules) - before - {"vllm"})
full = []
judge = guard._full_judgement
guard._full_judgement = lambda *a: full.append(1) or judge(*a)
problems = guard.judge_this_vllm()
print(MARK + repr({"import_guard": t2 - t1, "check": t3 - t2, "cpu": c3 - c1, "full_judgement": bool(full),
                   "modules": imported, "problems": [p[0] + " " + p[1] for p in problems]}))
"""
)
# What vLLM has imported before it calls its plugins, of what the guard uses.
VLLM_PRELOADED = ("logging", "json", "hashlib", "re", "fcntl")


def _install(checkout: Path, into: Path) -> Path:
    """``checkout`` built and installed as a wheel into ``into`` (as in an image: the package's RECORD beside it),
    from a clean copy of its files (a stale build/ in the checkout would add modules no longer there)."""
    import subprocess

    sys.path.insert(0, str(ROOT / "bench"))
    from bench_verify import _source_copy

    with tempfile.TemporaryDirectory(prefix="bench-guard-source-") as tmp:
        source = _source_copy(checkout, Path(tmp) / "source")
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(into)]
            + ["."],
            cwd=source,
            check=True,
            env={**os.environ, "PIP_NO_INPUT": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
        )
    return into


def _with(installed: Path, *args: str) -> str:
    """``patch-dsv4 ARGS`` run with the patch_dsv4 installed in ``installed`` (this venv's dependencies)."""
    import subprocess

    env = {**os.environ, "PYTHONPATH": str(installed)}
    env = {k: v for k, v in env.items() if not k.startswith("PATCH_DSV4_")}
    code = "import sys, patch_dsv4; assert patch_dsv4.__file__.startswith(sys.argv[1]); sys.argv[1:2] = []; "
    code += "from patch_dsv4.cli import main; main()"
    proc = subprocess.run(
        [sys.executable, "-c", code, str(installed), *args], capture_output=True, text=True, env=env, check=False
    )
    if proc.returncode:
        raise SystemExit(f"patch-dsv4 {' '.join(args)} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    return proc.stdout.strip()


def _trimmed(tree: Path, installed: Path, to: Path) -> Path:
    """Of an applied tree, what the guard reads (vLLM's dist-info, the state and its lock, the model packages, every
    file the state or the anchors record names), copied to ``to``: a few MB to carry to another machine."""
    import shutil

    from patch_dsv4.fastpath.quick import PACKAGE_DIRS  # this checkout's; the same three in both

    manifest = json.loads((tree / ".patch-dsv4" / "manifest.json").read_text())
    version = manifest["vllm_version"]
    record = json.loads((installed / "patch_dsv4" / "anchors" / f"vllm-{version}.json").read_text())
    (to / ".patch-dsv4").mkdir(parents=True)
    shutil.copy2(tree / ".patch-dsv4" / "manifest.json", to / ".patch-dsv4" / "manifest.json")
    for name in (".patch-dsv4.lock",):
        if (tree / name).exists():
            shutil.copy2(tree / name, to / name)
    for folder in [*PACKAGE_DIRS, f"vllm-{version}.dist-info"]:
        if (tree / folder).is_dir():
            shutil.copytree(tree / folder, to / folder)
    for rel in {*manifest["inputs"], *manifest["files"], *record["files"]}:
        if (tree / rel).is_file() and not (to / rel).exists():
            (to / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(tree / rel, to / rel)
    return to


def prepare(version: str, checkouts: dict[str, Path], work: Path, trim: bool) -> dict:
    """Each checkout installed from its wheel and a copy of ``version``'s installed tree applied with it (a state is
    trusted only by the definitions that wrote it): label -> [installed, tree, fingerprint], paths under ``work``."""
    import shutil

    from tests.releases import copy_tree, pristine_tree

    setups = {}
    for n, (label, checkout) in enumerate(checkouts.items()):
        installed = _install(checkout, work / f"installed-{n}")
        tree = copy_tree(pristine_tree(version), work / f"full-{n}" / "site-packages")
        _with(installed, "apply", "--site-packages", str(tree), "-q")
        if trim:
            tree = _trimmed(tree, installed, work / f"tree-{n}" / "site-packages")
            shutil.rmtree(work / f"full-{n}")
        fingerprint = _with(installed, "status", "--fingerprint", "--site-packages", str(tree))
        setups[label] = [str(installed.relative_to(work)), str(tree.relative_to(work)), fingerprint]
    (work / "setups.json").write_text(json.dumps({"version": version, "setups": setups}, indent=1))
    return setups


def measure(work: Path, repeat: int) -> None:
    """The first call in fresh interpreters, every case interleaved, for the setups :func:`prepare` left in ``work``."""
    import subprocess
    import venv

    prepared = json.loads((work / "setups.json").read_text())
    bare = Path(tempfile.mkdtemp(prefix="bench-guard-bare-"))  # a venv with nothing installed: python -I of it
    results: dict[tuple, list] = {}
    try:
        venv.create(bare, with_pip=False)
        cases = {}
        for label, (installed, tree, fingerprint) in prepared["setups"].items():
            for expect in (False, True):
                for preload in ((), VLLM_PRELOADED):
                    env = {"PATCH_DSV4_GUARD": "strict", "PATH": "/usr/bin:/bin"}
                    if expect:
                        env["PATCH_DSV4_EXPECT"] = fingerprint
                    command = [str(bare / "bin" / "python"), "-I", "-c", COLD, str(work / installed), str(work / tree)]
                    cases[(label, expect, bool(preload))] = ([*command, *preload], env)
        for i in range(repeat + 1):
            for key, (command, env) in cases.items():  # interleaved: a load that comes and goes hits all alike
                proc = subprocess.run(command, capture_output=True, text=True, env=env)
                lines = [line for line in proc.stdout.splitlines() if line.startswith(MARK)]
                if proc.returncode or not lines:
                    raise SystemExit(f"the timing process failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
                if i:  # the first round warms the page cache and writes the bytecode
                    results.setdefault(key, []).append(ast.literal_eval(lines[-1][len(MARK) :]))
    finally:
        import shutil

        shutil.rmtree(bare, ignore_errors=True)
    print(
        f"vLLM {prepared['version']}, applied tree (PATCH_DSV4_GUARD=strict: it stops on any problem); each checkout "
        f"installed from its wheel;\n{repeat} fresh interpreters (python -I of a bare venv, Python "
        f"{sys.version.split()[0]}, {os.cpu_count()} CPUs) per case after a warm-up round, the cases interleaved;\n"
        f"the guard's first call, its imports included: median (min) in ms; load average {os.getloadavg()[0]:.1f} "
        "at the end"
    )
    print(
        f"{'checkout':16} {'EXPECT':6} {'interpreter':12} {'import':>6} {'check()':>7} {'wall':>13} {'CPU':>13}  "
        f"imports full"
    )
    for (label, expect, preloaded), runs in results.items():
        wall = [r["import_guard"] + r["check"] for r in runs]
        cpu = [r["cpu"] for r in runs]

        def med(values):
            return f"{statistics.median(values) * 1000:6.1f}"

        print(
            f"{label:16} {'set' if expect else '-':6} {'vLLM stdlib' if preloaded else 'bare':12} "
            f"{med(r['import_guard'] for r in runs)} {med(r['check'] for r in runs):>7} "
            f"{med(wall)} ({min(wall) * 1000:4.1f}) {med(cpu)} ({min(cpu) * 1000:4.1f})  "
            f"{len(runs[-1]['modules']):7} {sum(r['full_judgement'] for r in runs)}/{len(runs)}"
        )
        if runs[-1]["problems"]:
            print(f"{'':16} reported: {', '.join(runs[-1]['problems'])}")
    for label in prepared["setups"]:
        bare_modules = sorted(m for m in results[(label, True, False)][-1]["modules"])
        print(f"{label}: modules the first call imports in a bare interpreter (EXPECT set): {', '.join(bare_modules)}")
        for preloaded, name in ((True, "as a vLLM process has it"), (False, "bare")):
            worst = max(
                statistics.median(r["import_guard"] + r["check"] for r in results[(label, e, preloaded)])
                for e in (0, 1)
            )
            target = "target <= 5 ms: " + ("met" if worst <= 0.005 else "NOT met") if preloaded else "for reference"
            print(
                f"{label}: first call, interpreter {name}, wall median, worst of with and without EXPECT: "
                f"{worst * 1000:.1f} ms ({target})"
            )


def cold_tree(version: str, repeat: int, against: Path | None, keep: Path | None, prepared: Path | None) -> None:
    """The guard's first call in fresh interpreters on an applied copy of ``version``'s installed tree, with this
    checkout (and ``against``, another checkout) installed from a wheel; without and with PATCH_DSV4_EXPECT.

    ``keep``: prepare into that directory (trees trimmed to what the guard reads) and leave it there; ``prepared``:
    measure what such a directory holds (on another machine: only this script and the standard library needed)."""
    import shutil

    if prepared is not None:
        measure(prepared, repeat)
        return
    work = keep or Path(tempfile.mkdtemp(prefix="bench-guard-"))
    try:
        work.mkdir(parents=True, exist_ok=True)
        prepare(version, {"this checkout": ROOT, **({against.name: against} if against else {})}, work, bool(keep))
        measure(work, repeat)
    finally:
        if keep is None:
            shutil.rmtree(work, ignore_errors=True)


# The guard's first call on a hostile tree, in an interpreter as a vLLM process has it; its time, the peak memory it
# adds, and what it said. argv: the directory patch_dsv4 is installed in, the tree.
HOSTILE = (
    f"MARK = {MARK!r}\n"
    + r"""
import sys, time, types
installed, tree = sys.argv[1:3]
for name in ("logging", "json", "hashlib", "re", "fcntl"):
    __import__(name)
sys.path.insert(0, installed)
vllm = types.ModuleType("vllm")
vllm.__file__ = tree + "/vllm/__init__.py"
sys.modules["vllm"] = vllm
import patch_dsv4.guard as guard
full = []
judge = guard._full_judgement
guard._full_judgement = lambda *a: full.append(1) or judge(*a)
def status(key):
    with open("/proc/self/status") as fh:
        return int(fh.read().split(key + ":")[1].split()[0]) * 1024
before = status("VmRSS")
with open("/proc/self/clear_refs", "w") as fh:
    fh.write("5")  # the peak (VmHWM) from now on: start-up's is not check()'s
t0 = time.perf_counter()
try:
    guard.check()
    said = "passed"
except Exception as exc:
    said = f"{type(exc).__name__}: {exc}"
t1 = time.perf_counter()
added = status("VmHWM") - before
print(MARK + repr({"check": t1 - t0, "added": added, "said": said, "full": bool(full)}))
"""
)


def _damage_cases():
    """name -> what it does to an applied tree (the state's manifest and lock, vLLM's dist-info)."""

    def manifest(tree):
        return tree / ".patch-dsv4" / "manifest.json"

    def pad(path, size):
        with open(path, "r+b") as fh:
            fh.seek(0, 2)
            fh.write(b" " * (size - fh.tell()))  # real bytes: JSON's blanks, a valid document still

    def cut(tree):
        data = manifest(tree).read_bytes()
        manifest(tree).write_bytes(data[: len(data) // 2])

    def metadata_line(tree):
        path = next(tree.glob("vllm-*.dist-info")) / "METADATA"
        head, _, rest = path.read_text().partition("\n")
        path.write_text(head + "\nSummary: " + "x" * (100 << 20) + "\n" + rest)

    def metadata_lines(tree):
        path = next(tree.glob("vllm-*.dist-info")) / "METADATA"
        head = path.read_bytes().partition(b"\n\n")[0]
        path.write_bytes(head + b"\nA:" * ((1 << 20) // 3 - len(head) // 3 - 1) + b"\n\n")

    def record(tree):
        pad(next(tree.glob("vllm-*.dist-info")) / "RECORD", 64 << 20)

    return {
        "none (an applied tree)": lambda tree: None,
        "manifest padded to 60 MB": lambda tree: pad(manifest(tree), 60 << 20),
        "manifest cut in half": cut,
        "manifest nested 300,000 deep": lambda tree: manifest(tree).write_bytes(b"[" * 300_000),
        "manifest of 512 KiB of empty objects": lambda tree: manifest(tree).write_bytes(
            b"[" + b",".join([b"{}"] * ((512 << 10) // 3 - 1)) + b"]"
        ),
        "METADATA with a 100 MB line": metadata_line,
        "METADATA of 1 MiB of header lines": metadata_lines,
        "RECORD padded to 64 MB": record,
        "lock held, its holder line 10 MB of escapes": lambda tree: (tree / ".patch-dsv4.lock").write_bytes(
            b"pid 1 " + b"\x1b[31m" * (10 << 20 // 5) + b"\n"
        ),
    }


def hostile(version: str, repeat: int, checkout: Path = ROOT) -> None:
    """The guard's first call on each hostile tree of :func:`_damage_cases`, in fresh interpreters, with
    ``checkout`` installed from its wheel (this one, or another to compare)."""
    import fcntl
    import shutil
    import subprocess

    from tests.releases import copy_tree, pristine_tree

    work = Path(tempfile.mkdtemp(prefix="bench-guard-hostile-"))
    try:
        installed = _install(checkout, work / "installed")
        results = {}
        for n, (name, damage) in enumerate(_damage_cases().items()):
            tree = copy_tree(pristine_tree(version), work / f"tree-{n}" / "site-packages")
            _with(installed, "apply", "--site-packages", str(tree), "-q")
            damage(tree)
            lock = tree / ".patch-dsv4.lock"
            held = open(lock, "rb") if lock.exists() else None
            if held is not None:
                fcntl.flock(held, fcntl.LOCK_EX)  # another process's hold: the guard only looks
            runs = []
            try:
                for i in range(repeat + 1):
                    env = {"PATCH_DSV4_GUARD": "strict", "PATH": "/usr/bin:/bin"}
                    proc = subprocess.run(
                        [sys.executable, "-I", "-c", HOSTILE, str(installed), str(tree)],
                        capture_output=True,
                        text=True,
                        env=env,
                    )
                    lines = [line for line in proc.stdout.splitlines() if line.startswith(MARK)]
                    if proc.returncode or not lines:
                        raise SystemExit(f"{name}: the timing process failed:\n{proc.stderr[-2000:]}")
                    if i:
                        runs.append(ast.literal_eval(lines[-1][len(MARK) :]))
            finally:
                if held is not None:
                    held.close()
            results[name] = runs
            shutil.rmtree(work / f"tree-{n}", ignore_errors=True)
    finally:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    print(
        f"{checkout}: vLLM {version}, applied tree, damaged; the guard's first call (strict) in fresh interpreters "
        "(Python "
        f"{sys.version.split()[0]}, logging, json, hashlib, re, fcntl imported first, as in a vLLM process); "
        f"the largest of {repeat}; load average {os.getloadavg()[0]:.1f} at the end"
    )
    print(f"{'what':46} {'check()':>9} {'memory added':>13}  targets 20 ms, 20 MB; what it said")
    for name, runs in results.items():
        worst_time = max(r["check"] for r in runs)
        worst_memory = max(r["added"] for r in runs)
        met = "ok" if worst_time <= 0.020 and worst_memory <= 20 << 20 else "OVER"
        said = runs[-1]["said"].replace(str(Path(tempfile.gettempdir())), "TMP")
        full = " (judged in full)" if any(r["full"] for r in runs) else ""
        print(f"{name:46} {worst_time * 1000:6.1f} ms {worst_memory / (1 << 20):9.1f} MB  {met}{full}; {said[:150]}")


PROBE_NAME = "patch_dsv4_bench_probe"
PROBE_MODULE = '''
import json, os, sys, time

def record():
    """Written by bench/bench_guard.py: which processes call vLLM's general plugins."""
    path = os.environ.get("PATCH_DSV4_BENCH_CALLS")
    if path:
        with open(path, "a") as fh:
            fh.write(json.dumps({"pid": os.getpid(), "ppid": os.getppid(), "argv": sys.argv, "t": time.time()}) + "\\n")
'''


def timings(venv: RealVenv, label: str, repeat: int) -> dict:
    runs = []
    for i in range(repeat + 1):
        proc = venv.run([venv.python, "-c", TIMING])
        lines = [line for line in proc.output.splitlines() if line.startswith(MARK)]
        if proc.rc != 0 or not lines:
            raise SystemExit(f"{label}: the timing process failed (exit {proc.rc}):\n{proc.tail()}")
        result = json.loads(lines[-1][len(MARK) :])
        if i:  # the first one warms the page cache and bytecode
            runs.append(result)
    med = {key: statistics.median(r[key] for r in runs) for key in ("import_vllm", "import_guard", "check", "cpu")}
    return {
        "label": label,
        "runs": runs,
        "median": med,
        "full": sum(r["full_judgement"] for r in runs),
        "problems": runs[-1]["problems"],
    }


def install_probe(venv: RealVenv) -> list[Path]:
    module = venv.site / f"{PROBE_NAME}.py"
    dist = venv.site / f"{PROBE_NAME}-0.0.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {PROBE_NAME}\nVersion: 0.0.0\n")
    (dist / "entry_points.txt").write_text(f"[vllm.general_plugins]\n{PROBE_NAME} = {PROBE_NAME}:record\n")
    module.write_text(PROBE_MODULE)
    return [module, dist]


def remove(paths: list[Path]) -> None:
    import shutil

    for path in paths:
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    for cached in (paths[0].parent / "__pycache__").glob(f"{PROBE_NAME}.*"):
        cached.unlink()


def callers(venv: RealVenv) -> list[dict]:
    seen = []
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"  # a local model directory: EngineArgs does not go to the hub for it
        model.mkdir()
        (model / "config.json").write_text('{"model_type": "deepseek_v4", "architectures": ["DeepseekV4ForCausalLM"]}')
        commands = {
            "vllm serve --help": [venv.bin("vllm"), "serve", "--help"],
            "EngineArgs(model=...)": [
                venv.python,
                "-c",
                f"from vllm.engine.arg_utils import EngineArgs; EngineArgs(model={str(model)!r})",
            ],
            "import vllm (control)": [venv.python, "-c", "import vllm"],
        }
        for name, command in commands.items():
            calls = Path(tmp) / f"{len(seen)}.jsonl"
            proc = venv.run(command, env={"PATCH_DSV4_GUARD": "warn", "PATCH_DSV4_BENCH_CALLS": str(calls)})
            recorded = [json.loads(line) for line in calls.read_text().splitlines()] if calls.exists() else []
            guard_lines = [line for line in proc.output.splitlines() if "patch-dsv4: this vLLM lacks patches" in line]
            seen.append(
                {
                    "command": name,
                    "rc": proc.rc,
                    "seconds": proc.seconds,
                    "calls": recorded,
                    "guard_error_lines": len(guard_lines),
                    "tail": proc.tail(3),
                }
            )
    return seen


def ms(seconds: float) -> str:
    return f"{seconds * 1000:9.1f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--version", default="0.30.0")
    parser.add_argument("--repeat", type=int, help="runs per case (default: 30 with --tree, else 5)")
    parser.add_argument("--skip-callers", action="store_true")
    parser.add_argument("--tree", action="store_true", help="no real venv: a fresh bare interpreter per run")
    parser.add_argument("--against", type=Path, help="with --tree: another checkout, measured interleaved")
    parser.add_argument("--keep", type=Path, help="with --tree: prepare into this directory and leave it")
    parser.add_argument("--prepared", type=Path, help="with --tree: measure what --keep left (nothing is built)")
    parser.add_argument("--hostile", action="store_true", help="hostile and unlucky files: time and memory added")
    parser.add_argument("--checkout", type=Path, help="real venv, --hostile: install this checkout instead of this one")
    args = parser.parse_args()
    if args.hostile:
        hostile(args.version, args.repeat or 5, (args.checkout or ROOT).resolve())
        return
    if args.tree:
        resolved = [p and p.resolve() for p in (args.against, args.keep, args.prepared)]
        cold_tree(args.version, args.repeat or 30, *resolved)
        return

    from tests.integration import venvs
    from tests.integration.conftest import RealVenv

    args.repeat = args.repeat or 5
    started = time.monotonic()
    root = venvs.build(args.version)
    venvs.install_this_project(root, args.checkout or ROOT)
    venv = RealVenv(args.version, root)
    venv.ensure_pristine()
    results, seen, probe = [], [], []
    try:
        results.append(timings(venv, "pristine known build (no state)", args.repeat))
        if not args.skip_callers:
            probe = install_probe(venv)
            seen = callers(venv)
            remove(probe)
            probe = []
        applied = venv.run([venv.bin("patch-dsv4"), "apply", "-q"])  # the installed checkout's: its patch digest
        assert applied.rc == 0, applied.tail()
        results.append(timings(venv, "applied tree", args.repeat))
    finally:
        if probe:
            remove(probe)
        venv.ensure_pristine()

    print(f"\nvLLM {args.version} venv {root}; {args.repeat} fresh processes per tree (after one warm-up), medians")
    print(f"load average {os.getloadavg()[0]:.1f} at the end; checkout {args.checkout or ROOT}")
    print(
        f"{'tree':36} {'import vllm':>12} {'import guard':>12} {'check()':>12} {'guard CPU':>12}  check/import vllm  "
        "full judgement"
    )
    for r in results:
        m = r["median"]
        print(
            f"{r['label']:36} {ms(m['import_vllm'])} {ms(m['import_guard'])} {ms(m['check'])} {ms(m['cpu'])}  "
            f"{m['check'] / m['import_vllm']:16.2%}  {r['full']}/{len(r['runs'])}"
        )
        per_run = ", ".join(f"{x['check'] * 1000:.1f}" for x in r["runs"])
        print(f"{'':36} check() per run: {per_run} ms; reported: {', '.join(r['problems']) or 'nothing'}")
    applied = results[-1]["median"]["check"] + results[-1]["median"]["import_guard"]
    cpu = results[-1]["median"]["cpu"]
    print(
        f"target: guard (import + check) <= 5 ms per process on an applied tree: "
        f"{'met' if applied <= 0.005 else 'NOT met'} ({applied * 1000:.1f} ms wall, {cpu * 1000:.1f} ms CPU)"
    )
    if seen:
        print("\nprocesses that called vllm.general_plugins (PATCH_DSV4_GUARD=warn, pending tree):")
        for s in seen:
            pids = "; ".join(f"pid {c['pid']} (parent {c['ppid']}) argv {c['argv']}" for c in s["calls"]) or "none"
            print(
                f"  {s['command']:24} exit {s['rc']}, {s['seconds']:.0f} s: {len(s['calls'])} call(s): {pids}; "
                f"our ERROR lines: {s['guard_error_lines']}"
            )
            if s["rc"]:
                print(f"  {'':24} (its last line: {s['tail'].splitlines()[-1][:150]})")
    print(f"\n({time.monotonic() - started:.0f} s in all)")


if __name__ == "__main__":
    main()
