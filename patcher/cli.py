"""The `patch-dsv4` command: a thin Typer layer over patcher.engine."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import List, Optional

import typer

try:  # typer >= 0.26 vendors click; older releases use the click package
    from typer import _click as click
except ImportError:  # pragma: no cover - depends on the installed typer
    import click

from patcher import __version__
from patcher.errors import EXIT_ENVIRONMENT, PatcherError

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
    from patcher.environment import locate_vllm

    return locate_vllm(site_packages, python)


def _finish(report, fmt: str) -> None:
    from patcher.render import render

    render(report, fmt)
    raise typer.Exit(report.exit_code)


@app.command("list")
def list_patches(fmt: str = Format, as_json: bool = JsonFlag) -> None:
    """The patches: what each fixes, why, and where."""
    from patcher.registry import discover_patches

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
    from patcher import engine

    fmt = _format(fmt, as_json)
    _finish(engine.status(_environment(site_packages, python)), fmt)


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
    from patcher import engine

    fmt = _format(fmt, as_json)
    env = _environment(site_packages, python)
    _finish(engine.apply(env, only=only, force=force, dry_run=dry_run, lock_timeout=lock_timeout), fmt)


@app.command()
def verify(
    site_packages: Optional[Path] = SitePackages,
    python: Optional[str] = Python,
    fmt: str = Format,
    as_json: bool = JsonFlag,
) -> None:
    """CI gate: exit 0 only if every patch this environment needs is applied and intact."""
    from patcher import engine

    fmt = _format(fmt, as_json)
    _finish(engine.verify(_environment(site_packages, python)), fmt)


@app.command()
def revert(
    site_packages: Optional[Path] = SitePackages,
    python: Optional[str] = Python,
    lock_timeout: float = LockTimeout,
    fmt: str = Format,
    as_json: bool = JsonFlag,
) -> None:
    """Restore every file we patched, byte for byte, and remove the state."""
    from patcher import engine

    fmt = _format(fmt, as_json)
    _finish(engine.revert(_environment(site_packages, python), lock_timeout=lock_timeout), fmt)


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
    except click.ClickException as exc:
        ctx = getattr(exc, "ctx", None)
        name = "" if ctx is None or ctx.info_name == "patch-dsv4" else f" {ctx.info_name}"
        code = _error(f"{exc.format_message()} (next: patch-dsv4{name} --help)", EXIT_ENVIRONMENT, as_json)
    except (typer.Abort, click.Abort):
        code = _error("aborted", EXIT_ENVIRONMENT, as_json)
    except KeyboardInterrupt:
        code = _error("interrupted", 130, as_json)
    if argv is None:
        sys.exit(code)
    return code
