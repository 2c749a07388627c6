"""The `patch-dsv4` command: a thin Typer layer over patch_dsv4.commands."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import List, Optional

import typer

try:  # typer >= 0.26 vendors click; older releases use the click package
    from typer._click import exceptions as click_exceptions
except ImportError:  # pragma: no cover - depends on the installed typer
    from click import exceptions as click_exceptions

# The vendored click of newer typer has no Abort of its own: typer.Abort is it.
_ABORTS = tuple({typer.Abort, getattr(click_exceptions, "Abort", typer.Abort)})

from patch_dsv4 import __version__
from patch_dsv4.errors import EXIT_ENVIRONMENT, PatcherError

app = typer.Typer(
    name="patch-dsv4",
    help="Apply, verify and revert the vLLM DeepSeek-V4 edits that DeepSeek-V4-Flash-Vision packs need.",
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    no_args_is_help=True,
)

SitePackages = typer.Option(
    None, "--site-packages", help="A directory holding vllm/ and its dist-info (e.g. a pip --target dir)."
)
Python = typer.Option(None, "--python", help="Act on the environment of this Python interpreter.")
Format = typer.Option("table", "--format", help="table, json or markdown.")
JsonFlag = typer.Option(False, "--json", help="Short for --format json.")
LockTimeout = typer.Option(300.0, "--lock-timeout", help="Seconds to wait for the environment's lock.")


def _format(fmt: str, as_json: bool) -> str:
    fmt = "json" if as_json else fmt
    if fmt not in ("table", "json", "markdown"):
        raise PatcherError(f"unknown --format {fmt!r}", "use table, json or markdown")
    return fmt


def _environment(site_packages: Optional[Path], python: Optional[str]):
    from patch_dsv4.environment import locate_vllm

    return locate_vllm(site_packages, python)


def _finish(report, fmt: str) -> None:
    from patch_dsv4.render import render

    render(report, fmt)
    if report.exit_code and report.next_step:
        for patch in report.patches:
            if patch.verdict.needs_action:
                sys.stderr.write(f"patch-dsv4: {patch.id} is {patch.verdict.value}: {', '.join(patch.files)}\n")
        sys.stderr.write(f"patch-dsv4: run: {report.next_step}\n")
    raise typer.Exit(report.exit_code)


@app.command("list")
def list_patches(fmt: str = Format, as_json: bool = JsonFlag) -> None:
    """The patches: what each fixes, why, and where."""
    from patch_dsv4.registry import discover_patches

    fmt = _format(fmt, as_json)
    patches = discover_patches()
    if fmt == "json":
        data = [{"id": p.id, "title": p.title, "why": p.why()} for p in patches]
        sys.stdout.write(json.dumps({"patches": data}, indent=2) + "\n")
        return
    for p in patches:
        if fmt == "markdown":
            sys.stdout.write(f"### `{p.id}`: {p.title}\n\n{p.why()}\n\n")
        else:
            sys.stdout.write(f"{p.id}: {p.title}\n\n")
            sys.stdout.write("".join(f"    {line}\n" if line else "\n" for line in p.why().splitlines()) + "\n")
    if fmt != "markdown":
        sys.stdout.write(f"{len(patches)} patches\n")


@app.command()
def status(
    site_packages: Optional[Path] = SitePackages,
    python: Optional[str] = Python,
    fmt: str = Format,
    as_json: bool = JsonFlag,
) -> None:
    """A verdict per patch for this environment."""
    from patch_dsv4 import commands

    fmt = _format(fmt, as_json)
    _finish(commands.status(_environment(site_packages, python)), fmt)


@app.command()
def apply(
    site_packages: Optional[Path] = SitePackages,
    python: Optional[str] = Python,
    only: Optional[List[str]] = typer.Option(None, "--only", help="Apply only this patch id (repeatable)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the unified diff; write nothing."),
    force: bool = typer.Option(False, "--force", help="Patch files that differ from their RECORD hash."),
    lock_timeout: float = LockTimeout,
    fmt: str = Format,
    as_json: bool = JsonFlag,
) -> None:
    """Apply every patch this environment needs (all files or none)."""
    from patch_dsv4 import commands

    fmt = _format(fmt, as_json)
    env = _environment(site_packages, python)
    _finish(commands.apply(env, only=only, force=force, dry_run=dry_run, lock_timeout=lock_timeout), fmt)


@app.command()
def verify(
    site_packages: Optional[Path] = SitePackages,
    python: Optional[str] = Python,
    fmt: str = Format,
    as_json: bool = JsonFlag,
) -> None:
    """CI gate: exit 0 only if every patch this environment needs is applied and intact."""
    from patch_dsv4 import commands

    fmt = _format(fmt, as_json)
    _finish(commands.verify(_environment(site_packages, python)), fmt)


@app.command()
def revert(
    site_packages: Optional[Path] = SitePackages,
    python: Optional[str] = Python,
    lock_timeout: float = LockTimeout,
    fmt: str = Format,
    as_json: bool = JsonFlag,
) -> None:
    """Restore every file we patched, byte for byte, and remove the state."""
    from patch_dsv4 import commands

    fmt = _format(fmt, as_json)
    _finish(commands.revert(_environment(site_packages, python), lock_timeout=lock_timeout), fmt)


# -- drift and anchors: judge a release without installing it (drift.py) ----
CacheDir = typer.Option(None, "--cache-dir", help="Where fetched wheels are kept (default ~/.cache/patch-dsv4/wheels).")
PipOption = typer.Option(None, "--pip-option", help="Pass this option to pip download (repeatable), e.g. --pip-option=--pre.")


def _release_target(vllm_version, wheel, source, flashinfer_version, cache_dir, pip_options):
    from patch_dsv4 import release_target as rt

    if wheel is not None and (source is not None or vllm_version is not None):
        raise PatcherError("--wheel takes no --source or --vllm-version", "the wheel names its release", "pass one of them")
    if wheel is not None:
        return rt.open_wheel(wheel, flashinfer_version)
    if source is not None:
        return rt.open_source(source, vllm_version, flashinfer_version)
    if vllm_version is None:
        raise PatcherError("no release to judge", "", "pass --vllm-version X, --wheel FILE or --source DIR")
    path, how = rt.fetch_wheel(vllm_version, cache_dir, pip_options or ())
    target = rt.open_wheel(path, flashinfer_version)
    target.notes.insert(0, f"wheel {path.name} {how}")
    return target


@app.command()
def drift(
    vllm_version: Optional[str] = typer.Option(
        None, "--vllm-version", help="Fetch this release's wheel with pip (with --source: that tree's version)."
    ),
    wheel: Optional[Path] = typer.Option(None, "--wheel", help="Judge this vLLM wheel file."),
    source: Optional[Path] = typer.Option(None, "--source", help="Judge this source tree (the directory holding vllm/)."),
    flashinfer_version: Optional[str] = typer.Option(
        None, "--flashinfer-version", help="Judge with this FlashInfer release instead of the one vLLM pins."
    ),
    strict: bool = typer.Option(False, "--strict", help="Also exit 1 on a new (unrecorded) fingerprint."),
    cache_dir: Optional[Path] = CacheDir,
    pip_options: Optional[List[str]] = PipOption,
    fmt: str = Format,
    as_json: bool = JsonFlag,
) -> None:
    """Judge a vLLM release without installing it: per patch, its verdict and its anchors' fingerprints."""
    from patch_dsv4.drift import drift as judge_drift
    from patch_dsv4.drift_render import render

    fmt = _format(fmt, as_json)
    with _release_target(vllm_version, wheel, source, flashinfer_version, cache_dir, pip_options) as target:
        report = judge_drift(target, strict=strict)
    render(report, fmt)
    raise typer.Exit(report.exit_code)


anchors_app = typer.Typer(help="The recorded anchors of known vLLM releases (anchors/*.json).", no_args_is_help=True)
app.add_typer(anchors_app, name="anchors")


@anchors_app.command("record")
def anchors_record(
    vllm_versions: Optional[List[str]] = typer.Option(None, "--vllm-version", help="Record this release (repeatable)."),
    record_all: bool = typer.Option(False, "--all", help="Re-record every release anchors/ already holds."),
    cache_dir: Optional[Path] = CacheDir,
    pip_options: Optional[List[str]] = PipOption,
    out: Optional[Path] = typer.Option(None, "--out", help="Write here instead of the anchors/ package directory."),
    check: bool = typer.Option(False, "--check", help="Write nothing; exit 1 if a record differs from a fresh one."),
) -> None:
    """Maintainers: record each release's verdicts, fingerprints and file hashes from its real wheel."""
    from patch_dsv4 import anchors_store
    from patch_dsv4.drift import record
    from patch_dsv4.release_target import fetch_wheel, open_wheel

    versions = list(vllm_versions or [])
    if record_all:
        versions += [v for v in anchors_store.recorded_versions(out) if v not in versions]
    if not versions:
        raise PatcherError("no release to record", "", "pass --vllm-version X (repeatable) or --all")
    stale = []
    for version in versions:
        path, _how = fetch_wheel(version, cache_dir, pip_options or ())
        with open_wheel(path) as target:
            if target.vllm_version != version:
                raise PatcherError(f"{path.name} is vLLM {target.vllm_version}, not {version}", "", "clear the cache")
            fresh = record(target, wheel_name=path.name)
        current = anchors_store.load(version, out)
        same = current is not None and anchors_store.dumps(current) == anchors_store.dumps(fresh)
        if check:
            if not same:
                stale.append(version)
            sys.stdout.write(f"vLLM {version}: {'up to date' if same else 'differs from a fresh record'}\n")
            continue
        written = anchors_store.write(fresh, out)
        sys.stdout.write(f"vLLM {version}: {'unchanged' if same else 'recorded'} {written}\n")
    if stale:
        sys.stdout.write(f"anchors record --check: {len(stale)} stale; re-record: {anchors_store.RECORD_COMMAND}\n")
        raise typer.Exit(1)


def _version_callback(value: bool) -> None:
    if value:
        sys.stdout.write(f"patch-dsv4 {__version__}\n")
        raise typer.Exit(0)


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version_callback, is_eager=True, help="Show the version."),
) -> None:
    pass


def _error(message: str, code: int, as_json: bool) -> int:
    sys.stderr.write(f"patch-dsv4: error: {message}\n")
    if as_json:
        sys.stdout.write(json.dumps({"error": message, "exit_code": code}) + "\n")
    return code


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns (and exits with) the exit status. Errors are one line on stderr."""
    args = list(sys.argv[1:] if argv is None else argv) or ["--help"]
    as_json = "--json" in args or "--format=json" in args or (
        "--format" in args and args.index("--format") + 1 < len(args) and args[args.index("--format") + 1] == "json"
    )
    command = typer.main.get_command(app)
    try:
        code = command.main(args=args, prog_name="patch-dsv4", standalone_mode=False)
        code = code if isinstance(code, int) else 0
    except PatcherError as exc:
        code = _error(exc.line(), exc.exit_code, as_json)
    except typer.Exit as exc:
        code = getattr(exc, "exit_code", 0)
    except click_exceptions.ClickException as exc:
        ctx = getattr(exc, "ctx", None)
        name = "" if ctx is None or ctx.info_name == "patch-dsv4" else f" {ctx.info_name}"
        code = _error(f"{exc.format_message()} (next: patch-dsv4{name} --help)", EXIT_ENVIRONMENT, as_json)
    except _ABORTS:
        code = _error("aborted", EXIT_ENVIRONMENT, as_json)
    except KeyboardInterrupt:
        code = _error("interrupted", 130, as_json)
    except (BrokenPipeError, SystemExit):
        raise
    except Exception as exc:  # a bug of ours: say so, briefly, and never as exit 1 ("needs action")
        code = _error(
            f"internal error: {type(exc).__name__}: {exc} (this is a bug in patch-dsv4 {__version__}; "
            "report it with the command you ran)",
            EXIT_ENVIRONMENT,
            as_json,
        )
    if argv is None:
        sys.exit(code)
    return code
