"""The rows doctor prints, the context every check reads, and the check registry.

A check is a function ``fn(ctx: DoctorContext) -> Row | Iterable[Row]``
registered with ``@check("id", needs=(...), family=...)``, which is where a check
says all it is: its docstring gives the rule and the evidence (DOCTOR-FACTS.md
aliases are fine). ``needs`` names what it reads: ``"pack"`` (``--pack DIR``),
``"runtime"`` (a located vLLM environment); a check whose needs are missing is
reported as ``skip`` without being called. ``family`` (a :class:`family.Family`)
limits a check to packs of that DeepSeek; a check of the other family is left
out of the report, not skipped.

A row's status is a :class:`Status`: ``pass``, ``warn``, ``fail``, ``skip``,
``info`` (its value is the word the report and the JSON print). Every ``warn``
and ``fail`` row carries ``fix``: the exact command, or the config edit as JSON.
"""

from __future__ import annotations

import errno
import json
import os
import shlex
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from patch_dsv4.doctor.readers.family import Family
from patch_dsv4.doctor.readers.files import clip, json_cost_over, json_depth_over


class Status(str, Enum):
    """A row's verdict; its value is what the report and the JSON print (and equals that string)."""

    PASS = "pass"
    WARN = "warn"
    FAIL = "fail"
    SKIP = "skip"
    INFO = "info"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:  # f"{status:<5}" pads the word, on every Python the tool runs on
        return format(self.value, spec)


PASS, WARN, FAIL, SKIP, INFO = Status
ROW_LIMIT = 2000  # characters of a row's detail or fix, whatever made them long
CONFIG_LIMIT = 2 << 20  # bytes of config.json doctor reads (a real one: a few KB)
CONFIG_MEMORY = 96 << 20  # what json.loads may allocate for config.json (see json_cost)
MAX_CONFIG_DEPTH = 64  # containers nested in config.json (a real one: 3)


@dataclass(frozen=True)
class Row:
    """One line of doctor's report.

    ``detail`` says what was read and what it means (one sentence, no newline);
    ``fix`` is the exact remedy for ``warn``/``fail`` (a command, or the config
    edit as JSON) and None otherwise.
    """

    id: str
    status: Status
    detail: str
    fix: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.status, Status):
            raise TypeError(f"row {self.id}: status {self.status!r} is not a Status")
        if self.status in (WARN, FAIL) and not self.fix:
            raise ValueError(f"row {self.id}: a {self.status} row needs a fix")
        # Echoed values are clipped where they are quoted; this keeps any row short whatever it quoted.
        object.__setattr__(self, "detail", clip(self.detail, ROW_LIMIT))
        if self.fix is not None:
            object.__setattr__(self, "fix", clip(self.fix, ROW_LIMIT))

    def to_json(self) -> dict:
        return {"id": self.id, "status": self.status.value, "detail": self.detail, "fix": self.fix}


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


class PackUnreadable(Exception):
    """config.json (or the pack directory) cannot be used: the message names the file and why."""


@dataclass(frozen=True)
class _Failed:
    """A cached computation that raised."""

    error: Exception


@dataclass
class DoctorContext:
    """Everything the checks may read. Caches live here so that each file is read once."""

    pack: Path | None = None  # as the user named it: a directory, or a hub.HubSource for hf://OWNER/NAME
    runtime: Runtime | None = None
    environ: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))
    serve_args: tuple[str, ...] = ()
    proc_root: Path = Path("/proc")  # tests point this at a fake /proc
    source: object | None = None  # the source.PackSource every pack read goes through (set from ``pack``)
    _cache: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.source is None and self.pack is not None:
            from patch_dsv4.doctor.readers.source import LocalSource, PackSource

            self.source = self.pack if isinstance(self.pack, PackSource) else LocalSource(self.pack)

    @classmethod
    def from_serve_args(cls, text: str | None, **kwargs) -> DoctorContext:
        return cls(serve_args=tuple(shlex.split(text or "")), **kwargs)

    def cached(self, key: str, compute: Callable[[], object]):
        """``compute()``, once per run: a failure is kept too, and raised again, never computed twice."""
        if key not in self._cache:
            try:
                self._cache[key] = compute()
            except Exception as exc:
                self._cache[key] = _Failed(exc)
        value = self._cache[key]
        if isinstance(value, _Failed):
            raise value.error
        return value

    def seed(self, key: str, value: object) -> None:
        """Give ``key`` the value a caller computed already (``cached`` then returns it)."""
        self._cache[key] = value

    def config(self) -> dict:
        """The pack's config as vLLM reads it: config.json, with a V4.1 pack's nested ``text_config``
        and ``vision_config`` flattened (family.flatten_v41); raises PackUnreadable (cached either way)."""
        from patch_dsv4.doctor.readers.family import V41, family_of, flatten_v41

        def view():
            raw = self.raw_config()
            return flatten_v41(raw) if family_of(raw) == V41 else raw

        return self.cached("config:view", view)

    def pack_family(self) -> Family | None:
        """V4 or V4.1 from config.json (family.family_of); None without a readable config.json."""
        from patch_dsv4.doctor.readers.family import family_of

        if self.pack is None:
            return None
        try:
            return family_of(self.raw_config())
        except PackUnreadable:
            return None

    def raw_config(self) -> dict:
        """The pack's config.json as a dict, as written; raises PackUnreadable (cached either way)."""

        def load():
            assert self.source is not None
            path = self.source.where("config.json")
            try:
                raw = self.source.read_file("config.json", CONFIG_LIMIT)
            except FileNotFoundError:
                return PackUnreadable(f"{path} not found")
            except OSError as exc:
                if exc.errno == errno.EFBIG:
                    return PackUnreadable(f"{path} is {exc.strerror}: a model config is a few KB")
                return PackUnreadable(f"{path} cannot be read ({exc.strerror or exc})")
            if json_cost_over(raw, CONFIG_MEMORY):
                return PackUnreadable(
                    f"{path} holds more JSON values than doctor reads ({len(raw):,} bytes, mostly separators and "
                    "brackets): a model config is a few KB"
                )
            try:
                data = json.loads(raw)
            except (ValueError, RecursionError) as exc:
                return PackUnreadable(f"{path} is not valid JSON ({type(exc).__name__}: {clip(str(exc))})")
            if not isinstance(data, dict):
                return PackUnreadable(f"{path} holds a JSON {type(data).__name__}, not an object")
            if json_depth_over(data, MAX_CONFIG_DEPTH):
                return PackUnreadable(
                    f"{path} nests objects and lists more than {MAX_CONFIG_DEPTH} deep: a model config nests 3"
                )
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
    family: Family | None = None  # the packs the check applies to; None: every pack


def applies(spec: CheckSpec, ctx: DoctorContext) -> bool:
    """Whether ``spec`` belongs in the report: a family-bound check runs only on a pack of its family
    (without a readable config.json, or without --pack, the V4 checks run, as they always did)."""
    if spec.family is None:
        return True
    return spec.family == (ctx.pack_family() or Family.V4)


CHECKS: list[CheckSpec] = []


def check(check_id: str, *, needs: tuple[str, ...] = (), family: Family | None = None) -> Callable[[CheckFn], CheckFn]:
    """Register ``fn`` as the check ``check_id`` (ids are unique; order of registration is report order),
    for the packs of ``family`` only when one is given."""

    def register(fn: CheckFn) -> CheckFn:
        if any(spec.id == check_id for spec in CHECKS):
            raise ValueError(f"doctor check {check_id} registered twice")
        if family is not None and not isinstance(family, Family):
            raise TypeError(f"doctor check {check_id}: family {family!r} is not a Family")
        CHECKS.append(CheckSpec(check_id, tuple(needs), fn, family))
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
        if not applies(spec, ctx):
            continue
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
                Row(
                    spec.id,
                    FAIL,
                    f"internal error in this check: {type(exc).__name__}: {exc}",
                    "report this bug to patch-dsv4 with the command you ran",
                )
            )
            continue
        rows.extend([result] if isinstance(result, Row) else list(result))
    return rows
