"""Run doctor on an environment and a pack: the checks, their context, the report.

The target environment is located as for every other command; the verdicts of
this project's own patches come from the fast path when the hashes vouch for
them (or from anchors/ for a pristine known build), else from a full judgement.
"""

from __future__ import annotations

import importlib
import os
import platform
import re
import shlex
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from patch_dsv4.doctor.readers.base import (
    CHECKS,
    FAIL,
    INFO,
    STATUSES,
    CheckSpec,
    DoctorContext,
    Row,
    Runtime,
    check,
    clip,
    run_checks,
)
from patch_dsv4.doctor.readers.family import V4
from patch_dsv4.output.errors import EXIT_NEEDS_ACTION, EXIT_OK, EnvironmentProblem

if TYPE_CHECKING:  # an annotation only: the pack's checks need not import pip's metadata readers (~0.06 s)
    from patch_dsv4.tree.environment import Environment

# The check modules, in report order; importing one registers its checks (base.check).
PACK_CHECK_MODULES = (
    "v41_config",  # v41.config, v41.delegate (DeepSeek-V4.1 packs only)
    "config",  # pack.config, pack.text-config, quant.method, quant.bits, quant.codebook
    "shards",  # pack.shards, pack.index, pack.symlinks
    "experts",  # experts.complete, experts.shapes, experts.one-k, quant.layer-bits, experts.markers
    "v41_tensors",  # v41.pack-kind, v41.engram-tables, v41.backbone, v41.experts, v41.vision (V4.1 only)
    "dense",  # dense.policy, mtp.format, quant.delegate, dense.exl3-map, dense.wo-a-slices
    "model",  # config.topk-method, config.hash-layers, config.vision, config.spec-k
)
CHECK_MODULES = (
    *PACK_CHECK_MODULES,
    "runtime",  # rt.*: the serving interpreter's packages (vLLM, FlashInfer, exllamav3, the plugin, torch)
    "v41_serving",  # v41.*: DSpark, EP filter, topology, indexer top-k, streams, FlashInfer (V4.1 only)
    "v41_engram",  # v41.engram-capacity: the Engram tables against the host (V4.1 only)
    "overlay",  # rt.overlay-imports: files of vLLM overlaid from another vLLM, and the names they lack
    "hooks",  # rt.hooks: sitecustomize, usercustomize and .pth lines that name vllm
    "environ",  # env.*: environment variables and serve flags against this vLLM and pack
    "host",  # host.*: the GPUs, memory, page cache, the pack's size
)
# The DeepSeek-V4 rows that do not apply to a V4.1 pack (a v41.* row judges the same thing from V4.1's
# facts, v41-packs.md §1.1, §2, §4): left out of a V4.1 pack's report. The v41_* modules register theirs
# with family="v41".
V4_ONLY = frozenset(
    {
        "pack.config",  # v41.config
        "pack.text-config",  # V4.1's text_config is its layout, not a fault
        "quant.bits",  # per-tensor K in V4.1 packs (SAGE mixes K1-K6 in a layer): v41.experts
        "quant.layer-bits",
        "experts.complete",  # the draft has dspark_n_routed_experts, not n_routed_experts: v41.experts
        "experts.shapes",
        "experts.one-k",
        "dense.policy",  # V4.1's delegate is deepseek_v4_fp8 [32, 32]: v41.delegate
        "mtp.format",
        "quant.delegate",
        "dense.exl3-map",  # non_routed_exl3 is V4's; V4.1 packs say it in their headers: v41.pack-kind
        "dense.wo-a-slices",
        "config.topk-method",  # read through the flattened config by v41.config
        "config.hash-layers",  # V4.1 has no hash layers
        "config.vision",  # v41.vision
        "config.spec-k",  # v41.topology (DSpark only)
        "env.shared-stream",  # v41.shared-stream, from the headers
        "env.aux-streams",  # v41.aux-streams (the compressor only)
        "env.dense-exl3",  # v41.pack-kind
        "rt.flashinfer",  # v41.flashinfer (V4.1 decodes with sliding_window, not index_topk)
        "host.kv-budget",  # V4's 43 x (512 + 64) bytes a token; V4.1's memory: v41.engram-capacity
        "host.sorted-load",  # V4's vision class
    }
)


# The report's first row, about the run itself: registered here, before the check modules are imported.
@check("pack.source", needs=("pack",))
def check_source(ctx: DoctorContext) -> list[Row]:
    """INFO, for a pack on the Hub only: the commit judged and the bytes read to judge it (its config.json,
    index and shard headers are read first, so the count is the run's)."""
    source = ctx.source
    if not source.remote:
        return []
    from patch_dsv4.doctor.readers.base import PackUnreadable
    from patch_dsv4.doctor.readers.pack import pack_index, pack_scan

    try:
        ctx.config()
    except PackUnreadable:
        pass  # pack.config says why
    pack_index(ctx)
    pack_scan(ctx)
    return [Row("pack.source", INFO, source.summary())]


def _register_checks() -> None:
    """Import the check modules: registration order is report order (pack, runtime, environment, host)."""
    for name in CHECK_MODULES:
        importlib.import_module(f"{__package__}.checks.{name}")
    # Report order is CHECK_MODULES' order, whichever module another import registered first (a check module
    # may import another); within a module, the order its checks are defined in. run's own row comes first.
    rank = {f"{__package__}.checks.{name}": i for i, name in enumerate(CHECK_MODULES)}
    CHECKS.sort(key=lambda spec: rank.get(spec.fn.__module__, -1))
    for i, spec in enumerate(CHECKS):
        if spec.id in V4_ONLY and spec.family is None:
            CHECKS[i] = replace(spec, family=V4)


def pack_checks() -> list[CheckSpec]:
    """The pack's checks (the modules that read only the pack, its config and vLLM's files), in report order."""
    _register_checks()
    modules = {f"{__package__}.checks.{name}" for name in PACK_CHECK_MODULES}
    return [spec for spec in CHECKS if spec.fn.__module__ in modules]


@dataclass(frozen=True)
class DoctorReport:
    target: str | None
    vllm_version: str | None
    pack: str | None
    rows: tuple[Row, ...]
    fixed: object | None = None  # the FixResult of --fix-config

    @property
    def exit_code(self) -> int:
        return EXIT_NEEDS_ACTION if any(r.status == FAIL for r in self.rows) else EXIT_OK

    @property
    def summary(self) -> str:
        counts = {s: sum(r.status == s for r in self.rows) for s in STATUSES}
        text = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
        verdict = "will not serve as it is" if self.exit_code else "no check fails"
        return f"doctor: {text}; {verdict}"

    def to_json(self) -> dict:
        from patch_dsv4.output.verdicts import JSON_SCHEMA

        return {
            "schema": JSON_SCHEMA,
            "command": "doctor",
            "exit_code": self.exit_code,
            "error": None,
            "target": self.target,
            "vllm_version": self.vllm_version,
            "pack": self.pack,
            "checks": [r.to_json() for r in self.rows],
            "config_fix": None
            if self.fixed is None
            else {
                "config": str(self.fixed.config),
                "diff": self.fixed.diff,
                "backup": None if self.fixed.backup is None else str(self.fixed.backup),
                "refused": self.fixed.refused,
                "written": self.fixed.written,
            },
            "summary": self.summary,
        }


def _python_of_site(site: Path) -> str | None:
    found = re.search(r"python(\d+\.\d+)", str(site))
    return found.group(1) if found else None


def patch_verdicts(env: Environment) -> tuple[dict[str, str], dict[str, tuple[str, ...]]]:
    """Each patch's verdict on ``env`` and its files: from the hashes when they vouch, else judged in full."""
    from patch_dsv4.fastpath import quick

    verdicts = quick.known_verdicts(quick.site_of(env))
    if verdicts is not None:
        return {pid: v["verdict"] for pid, v in verdicts.items()}, {
            pid: tuple(v["files"]) for pid, v in verdicts.items()
        }
    from patch_dsv4.pipeline import commands  # the full judgement: only when the hashes cannot vouch

    report = commands.status(env)
    return {p.id: p.verdict.value for p in report.patches}, {p.id: p.files for p in report.patches}


def runtime_for(env: Environment) -> Runtime:
    """The serving environment as the checks read it, named as the user named it."""
    if env.interpreter is not None:
        site_dirs = tuple(p for p in env.interpreter.search_path if p.is_dir())
        python, machine = env.interpreter.version, env.interpreter.machine
    elif env.target.option == "--site-packages":
        site_dirs = (env.site_packages,)
        python, machine = _python_of_site(env.site_packages), platform.machine()
    else:
        site_dirs = tuple(Path(p) for p in sys.path if p and Path(p).is_dir())
        python, machine = platform.python_version(), platform.machine()
    verdicts, files = patch_verdicts(env)
    return Runtime(
        site_dirs=site_dirs,
        vllm_root=env.site_packages,
        vllm_version=env.vllm_version,
        flashinfer_version=env.flashinfer_version,
        flashinfer_source=env.flashinfer_source,
        python_version=python,
        machine=machine,
        patch_verdicts=verdicts,
        patch_files=files,
        target_args=env.target.args(),
    )


def doctor(env: Environment, pack: str | Path | None, serve_args: str | None, fix_config: bool = False) -> DoctorReport:
    """Every check on ``env``, ``pack``, ``os.environ`` and the intended ``vllm serve`` arguments.

    ``pack`` is a directory, or ``hf://OWNER/NAME[@REVISION]`` for a pack on the Hub
    (read there, never downloaded: source.py, hub.py).
    With ``fix_config``, the config edits the pack rows ask for are written first
    (a backup of the original kept in the pack), and the checks see the result;
    for a pack on the Hub they are printed, not written.
    """
    from patch_dsv4.doctor.readers.hub import is_hub_pack, open_source

    source = None
    if isinstance(pack, str) and is_hub_pack(pack):
        source = open_source(pack)  # the revision resolved, the files listed; EnvironmentProblem when it cannot be
    elif pack is not None:
        pack = Path(pack)
        try:
            is_dir = pack.is_dir()
        except OSError as exc:
            raise EnvironmentProblem(f"cannot use --pack {pack}", exc.strerror or str(exc)) from None
        if not is_dir:
            raise EnvironmentProblem(
                f"no pack directory at {pack}",
                "",
                "pass --pack the directory holding config.json, or hf://OWNER/NAME for a pack on the Hub",
            )
    try:
        args = tuple(shlex.split(serve_args or ""))
    except ValueError as exc:
        raise EnvironmentProblem(
            f"cannot read --serve-args {clip(repr(serve_args))}", str(exc), "quote it as a shell would"
        ) from None
    fixed = None
    if fix_config and pack is None:
        raise EnvironmentProblem("--fix-config needs --pack DIR", "", "patch-dsv4 doctor --pack DIR --fix-config")
    ctx = DoctorContext(
        pack=source if source is not None else pack, runtime=runtime_for(env), environ=dict(os.environ), serve_args=args
    )
    if source is not None:
        _read_hub_pack(ctx)
    if fix_config:
        from patch_dsv4.doctor.fix_config import fix_config as write_fixes
        from patch_dsv4.doctor.fix_config import planned_fix

        # scans the headers in ctx, where the rows then find the scan; a pack on the Hub: the edits, printed
        fixed = planned_fix(ctx) if source is not None else write_fixes(pack, ctx)
    _register_checks()
    rows = tuple(run_checks(ctx))
    return DoctorReport(str(env.site_packages), env.vllm_version, str(ctx.pack) if pack else None, rows, fixed)


def _read_hub_pack(ctx: DoctorContext) -> None:
    """Read a Hub pack's config.json, index and headers before any row, so that a server doctor cannot read as
    it must (one that ignores Range, a read past doctor's budget) stops the run with one line (hub.HubStop)."""
    from patch_dsv4.doctor.readers.base import PackUnreadable
    from patch_dsv4.doctor.readers.pack import pack_index, pack_scan

    try:
        ctx.config()
    except PackUnreadable:
        pass  # pack.config reports it
    pack_index(ctx)
    pack_scan(ctx)


def doctor_command(site_packages, python, pack, serve_args, fix_config: bool, fmt: str, verbosity: int) -> int:
    """``patch-dsv4 doctor`` from its options (strings or paths), rendered; its exit status."""
    from patch_dsv4.output.render import render_doctor
    from patch_dsv4.tree.environment import locate_vllm

    env = locate_vllm(None if site_packages is None else Path(site_packages), python)
    report = doctor(env, None if pack is None else str(pack), serve_args, fix_config)
    render_doctor(report, fmt, verbosity)
    return report.exit_code
