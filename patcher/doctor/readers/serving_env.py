"""What doctor reads about the serving environment, without importing any of it.

Distributions (dist-info METADATA and entry_points.txt), packages and compiled
extensions on the target's import path, ELF headers, the GPUs ``nvidia-smi``
reports, ``/proc/meminfo``, the intended vLLM command line and the pack facts
the runtime checks take from config.json. Every reader turns a missing or
malformed input into a value the checks can report (None, or a problem
string), never an exception.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from email.parser import HeaderParser
from pathlib import Path

from patch_dsv4.doctor.readers.base import DoctorContext, Runtime

# nvidia-smi answers in well under a second; a hung driver must not hang doctor.
TOOL_TIMEOUT_S = 5.0

_NAME_RE = re.compile(r"[-_.]+")


def canonical_name(name: str) -> str:
    return _NAME_RE.sub("-", name).lower()


def release(version: str | None) -> tuple[int, ...] | None:
    """The numeric release of a version string ("0.6.16.post3" -> (0, 6, 16)); None when there is none."""
    match = re.match(r"\s*v?(\d+(?:\.\d+)*)", version or "")
    return tuple(int(part) for part in match.group(1).split(".")) if match else None


def older_than(version: str | None, floor: tuple[int, ...]) -> bool | None:
    """Whether ``version``'s release is below ``floor``; None when the version cannot be read."""
    found = release(version)
    return None if found is None else found < floor


def read_utf8(path: Path) -> tuple[str | None, str | None]:
    """(text, None), or (None, why it cannot be read)."""
    try:
        return path.read_bytes().decode("utf-8"), None
    except FileNotFoundError:
        return None, f"{path.name} is missing"
    except UnicodeDecodeError:
        return None, f"{path} is not UTF-8"
    except OSError as exc:
        return None, f"{path} cannot be read ({exc.strerror or exc})"


# --- distributions ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Dist:
    """One ``*.dist-info`` directory; ``version`` is None when METADATA does not give one."""

    name: str
    version: str | None
    path: Path

    def requirements(self) -> list[str]:
        text, _ = read_utf8(self.path / "METADATA")
        if text is None:
            return []
        return [str(value) for value in HeaderParser().parsestr(text).get_all("Requires-Dist") or []]

    def pinned(self, project: str) -> str | None:
        """The version this distribution pins ``project`` to with ``==``, if it does."""
        wanted = canonical_name(project)
        for requirement in self.requirements():
            match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*==\s*([^\s;,]+)", requirement)
            if match and canonical_name(match.group(1)) == wanted:
                return match.group(2)
        return None

    def entry_points(self) -> tuple[dict[str, dict[str, str]], str | None]:
        """{group: {name: value}} from entry_points.txt, and why it could not be read (or None)."""
        text, problem = read_utf8(self.path / "entry_points.txt")
        if text is None:
            return {}, None if problem and problem.endswith("is missing") else problem
        groups: dict[str, dict[str, str]] = {}
        current: dict[str, str] | None = None
        for line in text.splitlines():
            line = line.strip()
            if not line or line.startswith(("#", ";")):
                continue
            if line.startswith("[") and line.endswith("]"):
                current = groups.setdefault(line[1:-1].strip(), {})
                continue
            name, sep, value = line.partition("=")
            if current is not None and sep:
                current[name.strip()] = value.strip()
        return groups, None


def _dist_at(dist_info: Path) -> Dist:
    text, _ = read_utf8(dist_info / "METADATA")
    headers = HeaderParser().parsestr(text, headersonly=True) if text is not None else None
    name = headers.get("Name") if headers is not None else None
    version = headers.get("Version") if headers is not None else None
    # "<name>-<version>.dist-info": the directory name stands in for unreadable METADATA.
    fallback = dist_info.name[: -len(".dist-info")].rpartition("-")[0]
    return Dist(canonical_name(str(name or fallback)), str(version).strip() if version else None, dist_info)


def distributions(site_dirs: Iterable[Path]) -> list[Dist]:
    """Every distribution on the import path, in import order."""
    found = []
    for directory in site_dirs:
        try:
            entries = sorted(directory.glob("*.dist-info"))
        except OSError:
            continue
        found.extend(_dist_at(entry) for entry in entries if entry.is_dir())
    return found


def find_dist(site_dirs: Iterable[Path], project: str) -> Dist | None:
    """The first distribution called ``project`` on the import path (what importlib.metadata would pick)."""
    wanted = canonical_name(project)
    for directory in site_dirs:
        try:
            entries = sorted(directory.glob("*.dist-info"))
        except OSError:
            continue
        for entry in entries:
            if canonical_name(entry.name[: -len(".dist-info")].rpartition("-")[0]) == wanted and entry.is_dir():
                return _dist_at(entry)
    return None


def find_package(site_dirs: Iterable[Path], name: str) -> Path | None:
    """Where ``import name`` would find a pure-Python package or module (a directory or ``name.py``)."""
    for directory in site_dirs:
        if (directory / name).is_dir():
            return directory / name
        if (directory / f"{name}.py").is_file():
            return directory / f"{name}.py"
    return None


# --- compiled extensions ---------------------------------------------------------------------

# platform.machine() spellings -> the name an ELF header's e_machine gives.
_MACHINE = {"x86_64": "x86_64", "amd64": "x86_64", "aarch64": "aarch64", "arm64": "aarch64"}
_ELF_MACHINE = {
    3: "i386",
    8: "mips",
    20: "ppc",
    21: "ppc64",
    22: "s390x",
    40: "arm",
    62: "x86_64",
    183: "aarch64",
    243: "riscv64",
}
_TAGGED_SUFFIX = re.compile(r"\.cpython-(\d+)-([A-Za-z0-9_]+)-linux-gnu\.so$")


def normal_machine(machine: str | None) -> str | None:
    return _MACHINE.get((machine or "").lower(), (machine or "").lower() or None)


def python_tag(python_version: str | None) -> str | None:
    """The tag in an extension's file name: "3.12.3" gives "312"."""
    found = release(python_version)
    return f"{found[0]}{found[1]}" if found and len(found) >= 2 else None


@dataclass(frozen=True)
class Extension:
    """What ``importlib.util.find_spec(module)`` would find for the serving interpreter.

    ``path`` is the file it would load (None when it would find none);
    ``unloadable`` lists the files it would pass over, each with why.
    """

    path: Path | None
    unloadable: tuple[str, ...]


def locate_extension(runtime: Runtime, module: str) -> Extension:
    tag, machine = python_tag(runtime.python_version), normal_machine(runtime.machine)
    unloadable = []
    for directory in runtime.site_dirs:
        try:
            names = sorted(
                p.name for p in directory.iterdir() if p.name.startswith(module + ".") and p.name.endswith(".so")
            )
        except OSError:
            continue
        ranked = []
        for name in names:
            suffix = name[len(module) :]
            tagged = _TAGGED_SUFFIX.fullmatch(suffix)
            if tagged:
                built_tag, built_machine = tagged.groups()
                if tag and built_tag != tag:
                    unloadable.append(f"{name} (built for Python {built_tag[0]}.{built_tag[1:]})")
                elif machine and normal_machine(built_machine) != machine:
                    unloadable.append(f"{name} (built for {built_machine})")
                else:
                    ranked.append((0, name))
            elif suffix == ".abi3.so":
                ranked.append((1, name))
            elif suffix == ".so":
                ranked.append((2, name))
            else:
                unloadable.append(f"{name} (an extension suffix no CPython loads)")
        if ranked:
            return Extension(directory / min(ranked)[1], tuple(unloadable))
    return Extension(None, tuple(unloadable))


def elf_machine(path: Path) -> tuple[str | None, str | None]:
    """(the architecture in the ELF header, None), or (None, why the file is not a readable ELF)."""
    try:
        with open(path, "rb") as fh:
            header = fh.read(20)
    except OSError as exc:
        return None, f"{path.name} cannot be read ({exc.strerror or exc})"
    if header[:4] != b"\x7fELF":
        return None, f"{path.name} is not an ELF file"
    if len(header) < 20 or header[5] not in (1, 2):
        return None, f"{path.name} is truncated or malformed ({len(header)} header bytes)"
    code = int.from_bytes(header[18:20], "little" if header[5] == 1 else "big")
    return _ELF_MACHINE.get(code, f"e_machine {code}"), None


def scan_for(path: Path, needles: Sequence[bytes], chunk: int = 1 << 20) -> set[bytes]:
    """Which of ``needles`` occur in the file (read in chunks: extensions run to hundreds of MB)."""
    found: set[bytes] = set()
    overlap = max(len(n) for n in needles) - 1
    tail = b""
    try:
        with open(path, "rb") as fh:
            while len(found) < len(needles):
                block = fh.read(chunk)
                if not block:
                    break
                window = tail + block
                found.update(n for n in needles if n in window)
                tail = window[-overlap:] if overlap else b""
    except OSError:
        pass
    return found


# --- tools on the target's PATH --------------------------------------------------------------


@dataclass(frozen=True)
class ToolRun:
    """A tool's stdout, or why there is none (not on PATH, failed, timed out)."""

    output: str | None
    problem: str | None


def run_tool(ctx: DoctorContext, name: str, args: Sequence[str], timeout: float | None = None) -> ToolRun:
    """Run ``name`` as found on the target's PATH, in its own session so that a hang can be killed whole."""
    executable = shutil.which(name, path=ctx.environ.get("PATH", ""))
    if executable is None:
        return ToolRun(None, f"{name} is not on PATH")
    try:
        proc = subprocess.Popen(
            [executable, *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=dict(ctx.environ),
            start_new_session=True,
        )
    except OSError as exc:
        return ToolRun(None, f"{executable} cannot be run ({exc.strerror or exc})")
    limit = TOOL_TIMEOUT_S if timeout is None else timeout
    try:
        out, _ = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # it ended between the timeout and the kill
            pass
        proc.communicate()
        return ToolRun(None, f"{name} did not answer within {limit:g} s")
    if proc.returncode != 0:
        return ToolRun(None, f"{name} exited with status {proc.returncode}")
    return ToolRun(out.decode("utf-8", "replace"), None)


def which(ctx: DoctorContext, name: str) -> str | None:
    return shutil.which(name, path=ctx.environ.get("PATH", ""))


@dataclass(frozen=True)
class Gpu:
    name: str
    compute_cap: str  # "12.1"
    memory_mib: int | None  # None where nvidia-smi says [N/A]: unified memory (GB10)

    @property
    def sm(self) -> int:
        major, minor = self.compute_cap.split(".")
        return int(major) * 10 + int(minor)

    @property
    def unified_memory(self) -> bool:
        return self.memory_mib is None or "GB10" in self.name


def gpus(ctx: DoctorContext) -> tuple[tuple[Gpu, ...], str | None]:
    """The GPUs nvidia-smi lists, or () and why there are none to read (cached per run)."""

    def query():
        run = run_tool(
            ctx, "nvidia-smi", ["--query-gpu=name,compute_cap,memory.total", "--format=csv,noheader,nounits"]
        )
        if run.output is None:
            return (), run.problem
        found = []
        for line in run.output.splitlines():
            fields = [f.strip() for f in line.split(",")]
            if len(fields) != 3 or not re.fullmatch(r"\d+\.\d+", fields[1]):
                continue
            memory = int(fields[2]) if fields[2].isdigit() else None
            found.append(Gpu(fields[0], fields[1], memory))
        if not found:
            return (), f"nvidia-smi printed no GPU line doctor can read ({_excerpt(run.output)})"
        return tuple(found), None

    return ctx.cached("nvidia-smi:gpus", query)


def _excerpt(text: str) -> str:
    first = text.strip().splitlines()[0] if text.strip() else ""
    return repr(first[:60]) if first else "empty output"


# --- /proc -----------------------------------------------------------------------------------


def meminfo(ctx: DoctorContext) -> tuple[dict[str, int], str | None]:
    """/proc/meminfo in bytes ({"MemTotal": ...}), or {} and why it cannot be read."""
    path = ctx.proc_root / "meminfo"
    text, problem = read_utf8(path)
    if text is None:
        return {}, problem
    values = {}
    for line in text.splitlines():
        match = re.fullmatch(r"(\w+(?:\(\w+\))?):\s*(\d+)\s*(kB)?", line.strip())
        if match:
            values[match.group(1)] = int(match.group(2)) * (1024 if match.group(3) else 1)
    if "MemTotal" not in values:
        return {}, f"{path} has no MemTotal line"
    return values, None


# --- the intended command line ---------------------------------------------------------------


def human_readable_int(text: str | None) -> int | None:
    """vLLM's own parse of --max-model-len and friends ("256k" = 256000, "256K" = 262144); None if invalid."""
    if text is None:
        return None
    text = text.strip()
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT])", text)
    if match:
        number, suffix = match.groups()
        if len(number) > 30 or not number.isascii():  # far past any length a GPU holds
            return None
        if suffix.islower():
            return int(float(number) * 10 ** {"k": 3, "m": 6, "g": 9, "t": 12}[suffix])
        return int(number) * 2 ** {"K": 10, "M": 20, "G": 30, "T": 40}[suffix] if number.isdigit() else None
    if len(text) > 30:
        return None
    try:
        return int(text)
    except ValueError:
        return None


def max_model_len(ctx: DoctorContext) -> tuple[int | None, str]:
    """(the context length, where it came from): --max-model-len, or where it is absent or auto (-1) the
    pack's max_position_embeddings, the most vLLM would take; None when neither can be read."""
    flag = ctx.serve_flag("--max-model-len")
    if flag is not None and flag.strip().lower() not in ("auto", "-1"):
        return human_readable_int(flag), "--max-model-len"
    length = ctx.config().get("max_position_embeddings") if ctx.pack is not None else None
    usable = isinstance(length, int) and not isinstance(length, bool) and 0 < length < 2**40
    return (length if usable else None), "max_position_embeddings"


def tensor_parallel_size(ctx: DoctorContext) -> int | None:
    """--tensor-parallel-size (or -tp); 1 when absent, None when it is not a positive integer."""
    value = ctx.serve_flag("--tensor-parallel-size") or ctx.serve_flag("-tp")
    if value is None:
        return 1
    return int(value) if value.isascii() and value.isdigit() and len(value) <= 6 and int(value) > 0 else None


def gpu_memory_utilization(ctx: DoctorContext) -> float | None:
    """--gpu-memory-utilization; vLLM's default 0.9 when absent, None when it is not a fraction."""
    value = ctx.serve_flag("--gpu-memory-utilization")
    if value is None:
        return 0.9
    try:
        fraction = float(value)
    except ValueError:
        return None
    return fraction if 0 < fraction <= 1 else None


# --- pack facts from config.json -------------------------------------------------------------


def quantization_config(ctx: DoctorContext) -> dict:
    block = ctx.config().get("quantization_config")
    return block if isinstance(block, dict) else {}


def dense_exl3_modules(ctx: DoctorContext) -> list[str]:
    """The module prefixes ``non_routed_exl3`` declares (either of its two forms)."""
    block = quantization_config(ctx).get("non_routed_exl3")
    if not isinstance(block, dict):
        return []
    layers = block.get("layers")
    modules = block.get("modules")
    found = list(layers) if isinstance(layers, dict) else []
    found += [m for m in modules if isinstance(m, str)] if isinstance(modules, list) else []
    return [str(m) for m in found]


def exl3_attention(ctx: DoctorContext) -> bool:
    return any(".attn." in f".{m}." for m in dense_exl3_modules(ctx))


def exl3_shared_experts(ctx: DoctorContext) -> bool:
    return any("shared_experts" in m for m in dense_exl3_modules(ctx))


def vision_pack(ctx: DoctorContext) -> bool:
    layers = ctx.config().get("vision_n_layers")
    return isinstance(layers, int) and layers > 0


def pack_bytes(ctx: DoctorContext) -> int:
    """The size of the pack's ``*.safetensors`` files (links followed, dangling ones left out)."""
    assert ctx.source is not None
    if ctx.source.local is None:  # on the Hub: the sizes its listing gives
        return sum(ctx.source.file_size(f) or 0 for f in ctx.source.shard_files())
    total = 0
    try:
        shards = list(ctx.source.local.glob("*.safetensors"))
    except OSError:
        return 0
    for shard in shards:
        try:
            total += shard.stat().st_size
        except OSError:
            continue
    return total


def gib(n_bytes: float) -> str:
    return f"{n_bytes / 2**30:.1f} GiB"
