"""The rows doctor prints, the context every check reads, and the check registry.

A check is a function ``fn(ctx: DoctorContext) -> Row | Iterable[Row]``
registered with ``@check("id", needs=(...))``. Its docstring gives the rule and
the evidence (DOCTOR-FACTS.md aliases are fine). ``needs`` names what it reads:
``"pack"`` (``--pack DIR``), ``"runtime"`` (a located vLLM environment); a check
whose needs are missing is reported as ``skip`` without being called.

Statuses: ``pass``, ``warn``, ``fail``, ``skip``, ``info``. Every ``warn`` and
``fail`` row carries ``fix``: the exact command, or the config edit as JSON.
"""

from __future__ import annotations

import errno
import json
import os
import shlex
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Mapping

PASS, WARN, FAIL, SKIP, INFO = "pass", "warn", "fail", "skip", "info"
STATUSES = (PASS, WARN, FAIL, SKIP, INFO)


@dataclass(frozen=True)
class Row:
    """One line of doctor's report.

    ``detail`` says what was read and what it means (one sentence, no newline);
    ``fix`` is the exact remedy for ``warn``/``fail`` (a command, or the config
    edit as JSON) and None otherwise.
    """

    id: str
    status: str
    detail: str
    fix: str | None = None

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"row {self.id}: unknown status {self.status!r}")
        if self.status in (WARN, FAIL) and not self.fix:
            raise ValueError(f"row {self.id}: a {self.status} row needs a fix")

    def to_json(self) -> dict:
        return {"id": self.id, "status": self.status, "detail": self.detail, "fix": self.fix}


@dataclass(frozen=True)
class Runtime:
    """The serving environment, as read from files (nothing of it is imported).

    ``site_dirs`` is the target interpreter's import path (directories only),
    in import order; ``vllm_root`` the one holding ``vllm/``.
    ``patch_verdicts`` maps each patch-dsv4 patch id to its verdict on this
    environment (``applied``, ``pending``, ``upstream``, ``not-applicable``,
    ``drifted``, ``modified``, ``opt-in``) and ``patch_files`` to the files it
    edits; both are filled by the engine (tests pass plain dicts).
    """

    site_dirs: tuple[Path, ...]
    vllm_root: Path | None = None
    vllm_version: str | None = None
    flashinfer_version: str | None = None
    flashinfer_source: str | None = None  # "installed" | "pinned" | None
    python_version: str | None = None  # "3.12.3"; None when it cannot be told
    machine: str | None = None  # platform.machine() of the serving interpreter
    patch_verdicts: Mapping[str, str] | None = None
    patch_files: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    target_args: str | None = None  # how the user named the target (" --python EXE"), for the fixes' commands


def read_regular_file(path: Path, limit: int = 64 << 20) -> bytes:
    """The bytes of ``path`` if it is a regular file of at most ``limit`` bytes; else OSError.

    Opened non-blocking, so a FIFO or device under a pack's file name cannot hang doctor.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        if info.st_size > limit:
            raise OSError(errno.EFBIG, f"{info.st_size} bytes, more than the {limit} doctor reads")
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


class PackUnreadable(Exception):
    """config.json (or the pack directory) cannot be used: the message names the file and why."""


@dataclass
class DoctorContext:
    """Everything the checks may read. Caches live here so that each file is read once."""

    pack: Path | None = None
    runtime: Runtime | None = None
    environ: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))
    serve_args: tuple[str, ...] = ()
    proc_root: Path = Path("/proc")  # tests point this at a fake /proc
    _cache: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_serve_args(cls, text: str | None, **kwargs) -> "DoctorContext":
        return cls(serve_args=tuple(shlex.split(text or "")), **kwargs)

    def cached(self, key: str, compute: Callable[[], object]):
        if key not in self._cache:
            self._cache[key] = compute()
        return self._cache[key]

    def config(self) -> dict:
        """The pack's config.json as a dict; raises PackUnreadable (cached either way)."""

        def load():
            assert self.pack is not None
            path = self.pack / "config.json"
            try:
                data = json.loads(read_regular_file(path))
            except FileNotFoundError:
                return PackUnreadable(f"{path} not found")
            except OSError as exc:
                return PackUnreadable(f"{path} cannot be read ({exc.strerror or exc})")
            except (ValueError, RecursionError) as exc:
                return PackUnreadable(f"{path} is not valid JSON ({type(exc).__name__}: {exc})")
            if not isinstance(data, dict):
                return PackUnreadable(f"{path} holds a JSON {type(data).__name__}, not an object")
            return data

        result = self.cached("config", load)
        if isinstance(result, PackUnreadable):
            raise result
        return result

    def serve_flag(self, name: str) -> str | None:
        """The value of ``--name X`` or ``--name=X`` in the intended command line (last one wins)."""
        value = None
        args = self.serve_args
        for i, arg in enumerate(args):
            if arg == name and i + 1 < len(args):
                value = args[i + 1]
            elif arg.startswith(name + "="):
                value = arg[len(name) + 1 :]
        return value

    def serve_switch(self, name: str) -> bool:
        """Whether ``--name`` (a flag without a value) is on the intended command line."""
        return name in self.serve_args


CheckFn = Callable[[DoctorContext], "Row | Iterable[Row]"]


@dataclass(frozen=True)
class CheckSpec:
    id: str
    needs: tuple[str, ...]
    fn: CheckFn


CHECKS: list[CheckSpec] = []


def check(check_id: str, *, needs: tuple[str, ...] = ()) -> Callable[[CheckFn], CheckFn]:
    """Register ``fn`` as the check ``check_id`` (ids are unique; order of registration is report order)."""

    def register(fn: CheckFn) -> CheckFn:
        if any(spec.id == check_id for spec in CHECKS):
            raise ValueError(f"doctor check {check_id} registered twice")
        CHECKS.append(CheckSpec(check_id, tuple(needs), fn))
        return fn

    return register


_NEEDS = {
    "pack": lambda ctx: ctx.pack is not None,
    "runtime": lambda ctx: ctx.runtime is not None,
}
_MISSING = {"pack": "no --pack given", "runtime": "no vLLM environment located"}


def run_checks(ctx: DoctorContext, checks: Iterable[CheckSpec] | None = None) -> list[Row]:
    """Run every registered check (or ``checks``); a check that raises is reported, never propagated."""
    rows: list[Row] = []
    for spec in CHECKS if checks is None else checks:
        missing = [need for need in spec.needs if not _NEEDS[need](ctx)]
        if missing:
            rows.append(Row(spec.id, SKIP, _MISSING[missing[0]]))
            continue
        try:
            result = spec.fn(ctx)
        except PackUnreadable as exc:
            rows.append(Row(spec.id, SKIP, f"cannot read the pack: {exc}"))
            continue
        except Exception as exc:  # a bug in one check must not hide the others
            rows.append(
                Row(spec.id, FAIL, f"internal error in this check: {type(exc).__name__}: {exc}",
                    "report this bug to patch-dsv4 with the command you ran")
            )
            continue
        rows.extend([result] if isinstance(result, Row) else list(result))
    return rows
