"""Peak memory and wall time of ``patch-dsv4 doctor`` on hostile packs: the largest headers and configs.

    python bench/bench_doctor_hostile.py [--only NAME ...] [--timeout 120] [--code CHECKOUT]

Each case is a small pack (the synthetic MixedK pack of tests/doctor, its
shards replaced by the case's for a header case) with one hostile file, built
in a temporary directory (sparse payloads: a few hundred MB of disk at most,
freed at the end). ``doctor`` runs on it as a user would, the
whole command on a real vLLM release tree, in a fresh process per case; the
figures are that child's peak RSS (its ``VmHWM`` as it exits: ``ru_maxrss``
would count the parent's memory too, since the child is forked from it) and
its wall time. Targets: every case well under 200 MB and a few seconds; exit 1 or 2,
never an internal error.

``--hub`` runs every case from a stand-in Hub on loopback instead (tests/doctor/hub_server.py, in a process of
its own, its large files behind a loopback CDN: ``--pack hf://OWNER/NAME``), with the cases only the Hub has: a
server that ignores Range, a 404 shard, an answer cut short, a header length past the file, a header past the
Hub client's 25 MB limit, and a server that misbehaves: a listing that never answers, a byte a second on every
request, 429 with Retry-After 100000, endless Link rel="next" pages, a gzip bomb as the listing (256 MB from
261 KB), a file name with terminal escapes. Each ends within doctor's Hub deadline (50 s; the command's
``--hub-timeout``) with one line or a fail row; ``--only Hub:`` runs those alone.

Issue 39 item 5, ``--hub --only Hub: --version 0.34.0`` (default deadline 50 s; "before": ``--code`` a checkout
of 484095a, ``--timeout 90``), peak RSS and wall time, and what doctor said:

    a listing that never answers    before: killed past 90 s    after:  41 MB  31.0 s  exit 2, "listing its
                                                                        files: the server sent nothing for 30 s"
    a byte a second, every request  before: killed past 90 s    after:  41 MB  50.5 s  exit 2, "no answer within
                                                                        the 50 s doctor gives the Hub, reading
                                                                        config.json"
    429, Retry-After: 100000        before: killed past 90 s    after:  41 MB   1.5 s  exit 2, "listing its files:
                                    (it sleeps 100001 s)                the server refused it as too many
                                                                        requests (HTTP 429, Retry-After '100000')"
    endless Link rel="next" pages   before: killed past 90 s    after:  41 MB   5.9 s  exit 2, "the listing runs
                                                                        past 100 pages"
    a gzip bomb as the listing      before: 553 MB, 4.8 s, "holds no after:  73 MB   3.0 s  exit 2, "listing its
    (256 MB from 261 KB)            *.safetensors file"                 files: more than the 16,777,216 bytes
                                                                        doctor reads (once decoded)"
    a file name with terminal       before: 8 raw ESC bytes in the      after:  49 MB   3.2 s  exit 1, pack.shards
    escapes                         table                               fail naming \\x1b]0;owned\\x07...

``--code CHECKOUT`` runs the doctor of another checkout (e.g. a ``git worktree``
of an older commit) on the same files, for before/after figures; a case that
runs past ``--timeout`` is reported as such.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MB = 1_000_000


def _shard(path: Path, header: bytes, payload: int) -> None:
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(header)) + header)
        fh.truncate(8 + len(header) + payload)


def _filled(prefix: bytes, unit: bytes, suffix: bytes, size: int) -> bytes:
    """``prefix + unit * n + suffix`` of about ``size`` bytes, the last unit's trailing comma dropped."""
    body = unit * ((size - len(prefix) - len(suffix)) // len(unit))
    return prefix + body.rstrip(b",") + suffix


def empty_arrays_in_a_field(pack: Path) -> None:
    """A 99 MB header the library accepts: one tensor whose ignored field is a list of 33 million []."""
    head = b'{"t":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":['
    _shard(pack / "model.safetensors", _filled(head, b"[],", b"]}}", 99 * MB), 4)


def empty_arrays_as_a_shape(pack: Path) -> None:
    """A 99 MB header of empty lists where the dimensions should be."""
    head = b'{"t":{"dtype":"F32","data_offsets":[0,4],"shape":['
    _shard(pack / "model.safetensors", _filled(head, b"[],", b"]}}", 99 * MB), 4)


def empty_arrays_as_a_tensor(pack: Path) -> None:
    """A 99 MB header whose one tensor is described by a list of 33 million []."""
    _shard(pack / "model.safetensors", _filled(b'{"t":[', b"[],", b"]}", 99 * MB), 0)


def tiny_tensors(pack: Path) -> None:
    """A 99 MB header the library accepts: 1.6 million one-byte tensors."""
    parts, offset, size = [b"{"], 0, 1
    while size < 99 * MB:
        part = b'"t%d":{"dtype":"U8","shape":[1],"data_offsets":[%d,%d]},' % (offset, offset, offset + 1)
        parts.append(part)
        size += len(part)
        offset += 1
    header = b"".join(parts).rstrip(b",") + b"}"
    _shard(pack / "model.safetensors", header, offset)


def long_metadata(pack: Path) -> None:
    """A 99 MB header the library accepts: one __metadata__ value of 99 MB."""
    header = b'{"__metadata__":{"k":"' + b"m" * (99 * MB) + b'"},"t":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}'
    _shard(pack / "model.safetensors", header, 4)


def long_shape(pack: Path) -> None:
    """A 600 KB header: one tensor of 300,000 dimensions of 2 (its size, 2**300000, overflows 64 bits)."""
    header = _filled(b'{"t":{"dtype":"F32","data_offsets":[0,4],"shape":[', b"2,", b"]}}", 600_000)
    _shard(pack / "model.safetensors", header, 4)


def long_shape_of_ones(pack: Path) -> None:
    """A 600 KB header the library accepts: one tensor of 300,000 dimensions of 1."""
    header = _filled(b'{"t":{"dtype":"F32","data_offsets":[0,4],"shape":[', b"1,", b"]}}", 600_000)
    _shard(pack / "model.safetensors", header, 4)


def alternating_fillers(pack: Path) -> None:
    """A 99 MB header the library accepts: an ignored field of empty lists and objects, alternating."""
    head = b'{"t":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":['
    _shard(pack / "model.safetensors", _filled(head, b"[],{},0,", b"]}}", 99 * MB), 4)


def nested_fillers(pack: Path) -> None:
    """A 99 MB header the library accepts: an ignored field of [[[n]]], each n different."""
    head = b'{"t":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":['
    units, size, n = [], len(head) + 3, 0
    while size < 99 * MB:
        unit = b"[[[%d]]]," % n
        units.append(unit)
        size += len(unit)
        n += 1
    _shard(pack / "model.safetensors", head + b"".join(units).rstrip(b",") + b"]}}", 4)


def long_name(pack: Path) -> None:
    """A 99 MB header the library accepts: one tensor whose name is 99 MB long."""
    header = b'{"' + b"n" * (99 * MB) + b'":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}'
    _shard(pack / "model.safetensors", header, 4)


def experts_in_one_shard(pack: Path) -> None:
    """A shard the library accepts naming 150,000 different experts, one tensor each: just within doctor's
    budget for one shard, and each of its entries one more in the pack's summary."""
    parts, offset = [b"{"], 0
    for i in range(150_000):
        name = b"layers.%d.ffn.experts.%d.w1.suh" % (i // 1000, i % 1000)
        parts.append(b'"%s":{"dtype":"F16","shape":[1],"data_offsets":[%d,%d]},' % (name, offset, offset + 2))
        offset += 2
    _shard(pack / "model.safetensors", b"".join(parts).rstrip(b",") + b"}", offset)


def many_experts(pack: Path) -> None:
    """12 shards the library accepts, each naming 60,000 different experts (the real pack names 11,800)."""
    for shard in range(12):
        parts, offset = [b"{"], 0
        for i in range(60_000):
            name = b"layers.%d.ffn.experts.%d.w1.suh" % (shard * 1000 + i // 1000, i % 1000)
            parts.append(b'"%s":{"dtype":"F16","shape":[1],"data_offsets":[%d,%d]},' % (name, offset, offset + 2))
            offset += 2
        _shard(pack / f"model-{shard + 1:05d}-of-00012.safetensors", b"".join(parts).rstrip(b",") + b"}", offset)


def single_file(pack: Path) -> None:
    """Not hostile, the largest real header: all 137,730 tensors of the full-size pack in one 101 GB shard."""
    from tests.doctor.synthetic import FULL, mixedk_config, mixedk_shards, write_shard

    merged = {}
    for tensors in mixedk_shards(FULL).values():
        merged.update(tensors)
    (pack / "config.json").write_text(json.dumps(mixedk_config(FULL), indent=2))
    write_shard(pack / "model.safetensors", merged)


def objects_config(pack: Path) -> None:
    """A 2 MB config.json (just within the size doctor reads): the real keys, then 600,000 {}."""
    config = json.loads((pack / "config.json").read_text())
    text = json.dumps(config)[:-1].encode() + b', "x": ['
    (pack / "config.json").write_bytes(_filled(text, b"{},", b"]}", 2_000_000))


def big_config(pack: Path) -> None:
    """A 60 MB config.json: the real keys, then a list of 20 million []."""
    config = json.loads((pack / "config.json").read_text())
    text = json.dumps(config)[:-1].encode() + b', "x": ['
    (pack / "config.json").write_bytes(_filled(text, b"[],", b"]}", 60 * MB))


def deep_config(pack: Path) -> None:
    """A config.json nested 700 deep under one key (run with --fix-config)."""
    config = json.loads((pack / "config.json").read_text())
    text = json.dumps(config)[:-1] + ', "x": ' + "[" * 700 + "]" * 700 + "}"
    (pack / "config.json").write_text(text)


def header_past_the_file(pack: Path) -> None:
    first = min(pack.glob("*.safetensors"))
    with open(first, "r+b") as fh:
        fh.write(struct.pack("<Q", first.stat().st_size))


def header_past_the_hub_limit(pack: Path) -> None:
    _shard(pack / "model-00001-of-00001.safetensors", b"{" + b" " * (30 * MB - 2) + b"}", 0)


CASES = {
    "15 MB header: the full pack in one shard": (single_file, ()),
    "99 MB header: empty lists in an ignored field": (empty_arrays_in_a_field, ()),
    "99 MB header: empty lists as a shape": (empty_arrays_as_a_shape, ()),
    "99 MB header: empty lists as a tensor": (empty_arrays_as_a_tensor, ()),
    "99 MB header: 1.6 million tiny tensors": (tiny_tensors, ()),
    "99 MB header: one metadata string": (long_metadata, ()),
    "600 KB header: a shape of 300,000 twos": (long_shape, ()),
    "600 KB header: a shape of 300,000 ones": (long_shape_of_ones, ()),
    "99 MB header: alternating fillers": (alternating_fillers, ()),
    "99 MB header: 8 million different [[[n]]]": (nested_fillers, ()),
    "99 MB header: a tensor name of 99 MB": (long_name, ()),
    "12 shards of 60,000 different experts": (many_experts, ()),
    "one shard of 150,000 different experts": (experts_in_one_shard, ()),
    "60 MB config.json": (big_config, ()),
    "2 MB config.json of 600,000 {}": (objects_config, ()),
    "config.json nested 700 deep, --fix-config": (deep_config, ("--fix-config",)),
}
# Cases only a server can make: (what builds the pack, the stand-in's switches).
HUB_CASES = {
    "Hub: a server that ignores Range": (None, ("ignore_range",)),
    "Hub: a 404 shard": (None, ("missing=#2",)),  # the pack's second shard
    "Hub: an answer cut short": (None, ("truncate=#3",)),
    "Hub: a header length past the file": (header_past_the_file, ()),
    "Hub: a 30 MB header, past the Hub limit": (header_past_the_hub_limit, ()),
    # issue 39 item 5: a server that misbehaves (tests/doctor/hub_server.py's switches)
    "Hub: a listing that never answers": (None, ("stall=tree",)),
    "Hub: a byte a second on every request": (None, ("trickle=tree", "trickle=head", "trickle=get", "trickle=cdn")),
    "Hub: 429 with Retry-After 100000": (None, ("rate_limit=tree",)),
    "Hub: endless Link rel=next pages": (None, ("endless_pages",)),
    "Hub: a gzip bomb as the listing": (None, ("gzip_bomb",)),
    "Hub: a file name with terminal escapes": (None, ("extra_files=\x1b]0;owned\x07\x1b[2Jmodel-9-of-8.safetensors",)),
}
HUB_REPO = "bench/hostile-pack"
HUB_SERVER = """
import sys
from pathlib import Path
from tests.doctor.hub_server import serving
with serving({sys.argv[1]: Path(sys.argv[2])}, cdn=True) as hub:
    for switch in sys.argv[3:]:
        name, _, value = switch.partition("=")
        if isinstance(getattr(hub, name), dict):
            getattr(hub, name)[value] = 4096
        elif value:
            getattr(hub, name).add(value)
        else:
            setattr(hub, name, True)
    print(hub.endpoint, flush=True)
    sys.stdin.read()
"""
BUILD = """
import sys
from pathlib import Path
from tests.doctor.synthetic import build_mixedk_pack
build_mixedk_pack(Path(sys.argv[1]))
"""


def _code_path(checkout: Path, work: Path) -> str:
    """A directory that makes ``import patch_dsv4`` find ``checkout``'s sources (laid out as the wheel is)."""
    package = work / "code" / "patch_dsv4"
    package.mkdir(parents=True)
    for entry in (checkout / "patcher").iterdir():
        (package / entry.name).symlink_to(entry)
    (package / "patches").symlink_to(checkout / "patches")
    (package / "anchors").symlink_to(checkout / "anchors")
    return str(package.parent)


# ``python -m patch_dsv4`` that writes its peak RSS (kB) to $BENCH_HWM as it exits.
MAIN = """
import atexit, os, runpy, sys
def peak():
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmHWM:"))
    with open(os.environ["BENCH_HWM"], "w") as out:
        out.write(line.split()[1])
atexit.register(peak)
sys.argv[0] = "patch-dsv4"
runpy.run_module("patch_dsv4", run_name="__main__", alter_sys=True)
"""


def _run(command: list[str], env: dict, timeout: float) -> tuple[float, float, int | None, str, str]:
    """(wall seconds, peak RSS in MB, exit status or None past the timeout, stdout, stderr) of one run."""
    out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
    hwm = Path(tempfile.mkstemp()[1])
    env = {**env, "BENCH_HWM": str(hwm)}
    started = time.perf_counter()
    proc = subprocess.Popen(command, stdout=out, stderr=err, cwd=ROOT, env=env)
    code = None
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            code = os.waitstatus_to_exitcode(status)
            break
        if time.perf_counter() - started > timeout:
            proc.send_signal(signal.SIGKILL)
            _, status, usage = os.wait4(proc.pid, 0)
            break
        time.sleep(0.01)
    wall = time.perf_counter() - started
    out.seek(0)
    err.seek(0)
    text = hwm.read_text()
    hwm.unlink()
    return (
        wall,
        int(text) / 1024 if text else usage.ru_maxrss / 1024,  # killed: its ru_maxrss, an upper bound
        code,
        out.read().decode("utf-8", "replace"),
        err.read().decode("utf-8", "replace"),
    )


def _printable(text: str) -> str:
    """``text`` with its control characters escaped: a doctor that printed them raw must not act on this terminal."""
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


def _said(name: str, stdout: str, stderr: str) -> str:
    """The row that judged the hostile file (or the one-line error), and any internal error."""
    return _printable(_what_it_said(name, stdout, stderr))


def _what_it_said(name: str, stdout: str, stderr: str) -> str:
    try:
        report = json.loads(stdout)
    except ValueError:
        lines = stderr.strip().splitlines()
        return lines[-1][:200] if lines else "(no output)"
    if report.get("error"):
        return f"error: {str(report['error'])[:200]}"
    rows = {row["id"]: row for row in report["checks"]}
    row = rows.get("pack.config" if "config" in name else "pack.shards")
    crashed = [r["id"] for r in report["checks"] if r["detail"].startswith("internal error")]
    detail = row["detail"] if row else ""
    if "escapes" in name:  # the part that names the file
        detail = detail[max(detail.find("model-9-of-8") - 40, 0) :]
    said = f"{row['status']}: {detail[:160]}" if row else ""
    return said + (f" INTERNAL ERROR in {len(crashed)} rows: {crashed[:3]}" if crashed else "")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", nargs="*", help="run the cases whose name contains one of these words")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds before a case is given up")
    parser.add_argument("--code", type=Path, help="run the doctor of this checkout instead")
    parser.add_argument("--version", default="0.30.0", help="the vLLM release tree doctor runs on")
    parser.add_argument("--hub", action="store_true", help="read each pack from a stand-in Hub (hf://)")
    parser.add_argument("--build", nargs=2, metavar=("CASE", "PACK"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.build:
        sys.path.insert(0, str(ROOT))
        name, pack = args.build[0], Path(args.build[1])
        if name in HUB_CASES:
            if HUB_CASES[name][0] is not None:
                if "past the Hub" in name:
                    for shard in pack.glob("*.safetensors"):
                        shard.unlink()
                HUB_CASES[name][0](pack)
            return
        if "config" not in name:
            for shard in pack.glob("*.safetensors"):
                shard.unlink()  # a header case brings the shards it needs
        CASES[name][0](pack)
        return
    work = Path(tempfile.mkdtemp(prefix="bench-doctor-hostile-"))
    try:
        sys.path.insert(0, str(ROOT))
        from tests.releases import copy_tree, pristine_tree

        tree = copy_tree(pristine_tree(args.version), work / "site-packages")
        env = dict(os.environ)
        if args.code:
            env["PYTHONPATH"] = _code_path(args.code.resolve(), work)
        print(f"doctor of {args.code or ROOT} on vLLM {args.version}; peak RSS and wall time of each run")
        print(f"{'case':46} {'peak RSS':>10} {'wall':>9}  exit  what it said")
        cases = {**CASES, **HUB_CASES} if args.hub else CASES
        for name, (_, extra) in cases.items():
            if args.only and not any(word in name for word in args.only):
                continue
            switches = extra if name in HUB_CASES else ()
            extra = () if name in HUB_CASES else extra
            pack = work / "pack"
            shutil.rmtree(pack, ignore_errors=True)
            # Built in other processes: a child inherits its parent's peak RSS across fork, so this one stays small.
            subprocess.run([sys.executable, "-c", BUILD, str(pack)], cwd=ROOT, check=True)
            subprocess.run([sys.executable, __file__, "--build", name, str(pack)], cwd=ROOT, check=True)
            server = None
            shards = sorted(p.name for p in pack.glob("*.safetensors"))
            switches = [w.split("=")[0] + "=" + shards[int(w.split("#")[1]) - 1] if "#" in w else w for w in switches]
            if args.hub:
                server = subprocess.Popen(
                    [sys.executable, "-c", HUB_SERVER, HUB_REPO, str(pack), *switches],
                    cwd=ROOT,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                )
                endpoint = server.stdout.readline().decode().strip()
                env = {**env, "HF_ENDPOINT": endpoint, "HF_HOME": str(work / "hf-home"), "NO_PROXY": "127.0.0.1"}
            command = [
                sys.executable,
                "-c",
                MAIN,
                "doctor",
                "--site-packages",
                str(tree),
                "--pack",
                f"hf://{HUB_REPO}" if args.hub else str(pack),
                "--serve-args",
                "--max-model-len 65536",
                "--json",
                *extra,
            ]
            try:
                wall, rss, code, stdout, stderr = _run(command, env, args.timeout)
            finally:
                if server is not None:
                    server.stdin.close()
                    server.wait(timeout=30)
            if code is None:
                print(f"{name:46} {rss:7.1f} MB {f'> {args.timeout:.0f}':>7} s  killed past the timeout")
            else:
                print(f"{name:46} {rss:7.1f} MB {wall:7.2f} s  {code:4}  {_said(name, stdout, stderr)}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
