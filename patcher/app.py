"""The Typer command line: options in, a report rendered out. The work is in patch_dsv4.pipeline.commands.

Imported only when a command needs it (``patch_dsv4.cli`` answers ``verify``
on an applied tree without Typer).
"""

from __future__ import annotations

import enum
import functools
import sys
from pathlib import Path

import typer
import typer.core

from patch_dsv4 import __version__
from patch_dsv4.output.errors import EXIT_INTERRUPTED, PatcherError

app = typer.Typer(
    name="patch-dsv4",
    help="Apply, verify and revert the vLLM DeepSeek-V4 edits that DeepSeek-V4-Flash-Vision packs need.",
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    no_args_is_help=True,
    context_settings={"help_option_names": ["-h", "--help"]},  # inherited by every command
)


class Format(str, enum.Enum):
    table = "table"
    json = "json"
    markdown = "markdown"


SitePackages = typer.Option(
    None,
    "--site-packages",
    metavar="DIR",
    help="A directory holding vllm/ and its dist-info (e.g. a pip --target dir).",
)
Python = typer.Option(None, "--python", metavar="EXE", help="Act on the environment of this Python interpreter.")
FormatOption = typer.Option(
    Format.table, "--format", metavar="FORMAT", help="How to write the report: table, json or markdown."
)
JsonFlag = typer.Option(False, "--json", help="Short for --format json: one JSON document on stdout.")
Verbose = typer.Option(False, "-v", "--verbose", help="Show the evidence of every verdict.")
Quiet = typer.Option(False, "-q", "--quiet", help="Print only the closing line (and errors).")
WithOptIn = typer.Option(
    None,
    "--with",
    metavar="ID",
    help="Also apply this opt-in patch, and keep it from now on (repeatable; adds to $PATCH_DSV4_WITH).",
)
LockTimeout = typer.Option(
    300.0, "--lock-timeout", metavar="SECONDS", help="Seconds to wait for the environment's lock."
)


def _format(fmt: Format, as_json: bool) -> str:
    return "json" if as_json else fmt.value


def _verbosity(verbose: bool, quiet: bool) -> int:
    return -1 if quiet else (1 if verbose else 0)


def _environment(site_packages: Path | None, python: str | None):
    from patch_dsv4.tree.environment import locate_vllm

    return locate_vllm(site_packages, python)


def _say(message: str) -> None:
    """A progress line for a person, on stderr (stdout holds the report), within 80 columns."""
    from patch_dsv4.output.render import say

    say(message)


def _opt_ins(with_: list[str] | None) -> list[str]:
    """The opt-ins asked for: $PATCH_DSV4_WITH (comma-separated ids), then ``--with``; each must be an opt-in patch.

    A patch applied by default (``--with stream-load``) is refused as an unknown one is, from either source: the
    user asked for something ``--with`` does not do, and the next command is theirs without it.
    """
    from patch_dsv4.fastpath import serving
    from patch_dsv4.patching.registry import discover_patches

    patches = discover_patches()
    opt_ins = sorted(p.id for p in patches if p.opt_in)
    defaults = {p.id for p in patches if not p.opt_in}
    from_env, given = serving.opt_ins_from_env(), list(with_ or [])
    for source, ids in ((serving.ENV_WITH, from_env), ("--with", given)):
        bad = [pid for pid in ids if pid not in opt_ins]
        if not bad:
            continue
        default = [pid for pid in bad if pid in defaults]
        named = f"{source} {','.join(bad)}" if source == "--with" else f"{source}={','.join(ids)}"
        if default:
            what = f"{named}: {', '.join(default)} {'is' if len(default) == 1 else 'are'} no opt-in patch"
            why = (
                f"apply applies {', '.join(default)} by default wherever this vLLM needs it; {source} names "
                f"opt-in patches only ({', '.join(opt_ins)})"
            )
        else:
            what = f"{named}: no opt-in patch {', '.join(bad)}"
            why = f"the opt-in patches are {', '.join(opt_ins)} (patch-dsv4 list says what each does)"
        raise PatcherError(what, why, _without(source, bad, ids))
    return list(dict.fromkeys([*from_env, *given]))


#: The command line being run (``run`` sets it): a "next" that repeats it, mended, is a command that works.
_ARGS: list[str] = []


def _without(source: str, bad: list[str], ids: list[str]) -> str:
    """The command line being run without the ids in ``bad`` (from ``--with`` or from $PATCH_DSV4_WITH)."""
    import shlex

    from patch_dsv4.fastpath import serving

    args, kept = list(_ARGS), []
    if source == "--with":
        i = 0
        while i < len(args):
            name, eq, value = args[i].partition("=")
            if name == "--with" and (value if eq else (args[i + 1] if i + 1 < len(args) else None)) in bad:
                del args[i : i + (1 if eq else 2)]
                continue
            i += 1
        return "patch-dsv4 " + shlex.join(args)
    kept = [pid for pid in ids if pid not in bad]
    prefix = f"{serving.ENV_WITH}={','.join(kept)} " if kept else f"env -u {serving.ENV_WITH} "
    return prefix + "patch-dsv4 " + shlex.join(args)


def _lock_wait(holder: str) -> None:
    _say(f"waiting for the environment's lock, held by {holder}")


def _finish(document, fmt: str, verbosity: int = 0) -> None:
    """Render a report (or a drift report); on failure, say on stderr what failed and the command to run."""
    from patch_dsv4.output.render import render, write_failure

    report = getattr(document, "report", document)
    code = report["exit_code"] if isinstance(report, dict) else report.exit_code
    render(document, fmt, verbosity)
    if code:  # stderr, so also beside --json
        write_failure(report)
    raise typer.Exit(code)


@app.command("list")
def list_patches(
    patch_ids: list[str] | None = typer.Argument(None, metavar="[ID]...", help="Show what these patches fix and why."),
    fmt: Format = FormatOption,
    as_json: bool = JsonFlag,
    verbose: bool = typer.Option(False, "-v", "--verbose", help="Show what every patch fixes and why."),
) -> None:
    """The patches, a line each; what each fixes and why: -v or an ID."""
    from patch_dsv4.output.render import Style, list_lines, why_lines, write_json
    from patch_dsv4.output.verdicts import JSON_SCHEMA
    from patch_dsv4.patching.registry import discover_patches

    patches = discover_patches()
    known = [p.id for p in patches]
    unknown = [pid for pid in patch_ids or () if pid not in known]
    if unknown:
        raise PatcherError(f"no patch {', '.join(unknown)}", f"the patches are {', '.join(known)}", "patch-dsv4 list")
    shown = [p for p in patches if p.id in patch_ids] if patch_ids else patches
    fmt_name = _format(fmt, as_json)
    if fmt_name == "json":
        data = [
            {"id": p.id, "title": p.title, "why": p.why(), "opt_in": p.opt_in, "files": list(p.files())} for p in shown
        ]
        write_json({"schema": JSON_SCHEMA, "command": "list", "exit_code": 0, "error": None, "patches": data})
        return
    if fmt_name == "markdown":
        for p in shown:
            opt = " (opt-in: apply --with " + p.id + ")" if p.opt_in else ""
            sys.stdout.write(f"### `{p.id}`: {p.title}{opt}\n\n{p.why()}\n\n")
        return
    style = Style.for_stream(sys.stdout)
    rows = [(p.id, p.opt_in, p.title, p.why(), p.files()) for p in shown]
    lines = why_lines(rows, style) if verbose or patch_ids else list_lines(rows, style)
    sys.stdout.write("\n".join(lines) + "\n")


@app.command()
def status(
    site_packages: Path | None = SitePackages,
    python: str | None = Python,
    fmt: Format = FormatOption,
    as_json: bool = JsonFlag,
    verbose: bool = Verbose,
    quiet: bool = Quiet,
    lock_timeout: float = LockTimeout,
    fingerprint: bool = typer.Option(
        False,
        "--fingerprint",
        help="Print only the fingerprint of what this tree serves (for PATCH_DSV4_EXPECT and verify --expect).",
    ),
) -> None:
    """A verdict per patch for this environment; writes nothing.

    An apply or revert under way (another process holds the lock) is waited for, up to --lock-timeout.
    """
    from patch_dsv4.pipeline import commands

    env = _environment(site_packages, python)
    if fingerprint:
        sys.stdout.write(f"{commands.fingerprint(env, lock_timeout, _lock_wait)}\n")
        return
    report = commands.status(env, lock_timeout=lock_timeout, on_wait=_lock_wait)
    _finish(report, _format(fmt, as_json), _verbosity(verbose, quiet))


@app.command()
def apply(
    site_packages: Path | None = SitePackages,
    python: str | None = Python,
    only: list[str] | None = typer.Option(None, "--only", metavar="ID", help="Apply only this patch id (repeatable)."),
    with_: list[str] | None = WithOptIn,
    dry_run: bool = typer.Option(
        False,
        "--dry-run",
        help="Run every check; print the unified diff on stdout (all else on stderr); write nothing.",
    ),
    force: bool = typer.Option(
        False, "--force", help="Also patch files that differ from their RECORD hash, as they are."
    ),
    lock_timeout: float = LockTimeout,
    fmt: Format = FormatOption,
    as_json: bool = JsonFlag,
    verbose: bool = Verbose,
    quiet: bool = Quiet,
) -> None:
    """Apply every patch this environment needs (all files or none)."""
    from patch_dsv4.pipeline import commands

    env = _environment(site_packages, python)
    asked = _opt_ins(with_)
    report = commands.apply(
        env, only=only, with_=asked, force=force, dry_run=dry_run, lock_timeout=lock_timeout, on_wait=_lock_wait
    )
    _finish(report, _format(fmt, as_json), _verbosity(verbose, quiet))


@app.command()
def takeover(
    site_packages: Path | None = SitePackages,
    python: str | None = Python,
    with_: list[str] | None = WithOptIn,
    dry_run: bool = typer.Option(
        False, "--dry-run", help="Show the whole plan: the unified diff on stdout, the rest on stderr; write nothing."
    ),
    lock_timeout: float = LockTimeout,
    fmt: Format = FormatOption,
    as_json: bool = JsonFlag,
    verbose: bool = Verbose,
    quiet: bool = Quiet,
) -> None:
    """Replace other tools' edits (the recipes' scripts) by ours.

    No reinstall: each file holding a recognised edit of another tool is saved under .patch-dsv4/saved-edits/
    and restored from the backup beside it whose sha256 is pip's RECORD entry; then every patch is applied as
    apply would, all files or none. revert afterwards gives pip's bytes.
    """
    from patch_dsv4.pipeline import commands

    env = _environment(site_packages, python)
    report = commands.apply(
        env, with_=_opt_ins(with_), dry_run=dry_run, lock_timeout=lock_timeout, on_wait=_lock_wait, takeover=True
    )
    _finish(report, _format(fmt, as_json), _verbosity(verbose, quiet))


@app.command()
def verify(
    site_packages: Path | None = SitePackages,
    python: str | None = Python,
    fmt: Format = FormatOption,
    as_json: bool = JsonFlag,
    verbose: bool = Verbose,
    quiet: bool = Quiet,
    lock_timeout: float = LockTimeout,
    with_: list[str] | None = typer.Option(
        None, "--with", metavar="ID", help="This opt-in must be applied too (repeatable; adds to PATCH_DSV4_WITH)."
    ),
    expect: str | None = typer.Option(
        None,
        "--expect",
        metavar="FP",
        help="Also exit 1 unless this tree's fingerprint is FP (another node's `status --fingerprint`).",
    ),
) -> None:
    """CI gate: exit 0 only if every needed patch is applied, intact.

    Needed: every patch this environment needs (pending, drifted, modified or foreign ones fail it).
    """
    from patch_dsv4.pipeline import commands

    env = _environment(site_packages, python)
    report = commands.verify(env, lock_timeout=lock_timeout, on_wait=_lock_wait, with_=_opt_ins(with_))
    if expect is not None:
        from patch_dsv4.fastpath import serving

        document = report.to_json()
        try:
            found = serving.expect(document, report.fingerprint, expect)
        except serving.BadFingerprint as exc:
            raise PatcherError(
                f"--expect {expect[:40]!r} is no fingerprint",
                str(exc),
                "copy it whole from `patch-dsv4 status --fingerprint`",
            ) from None
        serving.write_differences(found)
        _finish(document, _format(fmt, as_json), _verbosity(verbose, quiet))
    _finish(report, _format(fmt, as_json), _verbosity(verbose, quiet))


@app.command()
def revert(
    site_packages: Path | None = SitePackages,
    python: str | None = Python,
    discard_local_edits: bool = typer.Option(
        False,
        "--discard-local-edits",
        help="Also restore files changed since we patched them; each edited file is saved in the state first.",
    ),
    lock_timeout: float = LockTimeout,
    fmt: Format = FormatOption,
    as_json: bool = JsonFlag,
    verbose: bool = Verbose,
    quiet: bool = Quiet,
) -> None:
    """Restore every file we patched, byte for byte; remove the state."""
    from patch_dsv4.pipeline import commands

    env = _environment(site_packages, python)
    report = commands.revert(
        env, lock_timeout=lock_timeout, discard_local_edits=discard_local_edits, on_wait=_lock_wait
    )
    _finish(report, _format(fmt, as_json), _verbosity(verbose, quiet))


def _write_dl(formatter, rows, col_max: int = 30, col_spacing: int = 2) -> None:
    """Click's option list, each description wrapped at spaces only: a flag or path in an option's help
    (``"--tensor-parallel-size 8"``) is never split at a hyphen, so it can be copied from the help."""
    import textwrap

    rows = list(rows)
    first_col = min(max((len(term) for term, _ in rows), default=0), col_max) + col_spacing
    indent = " " * formatter.current_indent
    for term, text in rows:
        formatter.write(f"{indent}{term}")
        if not text:
            formatter.write("\n")
            continue
        if len(term) <= first_col - col_spacing:
            formatter.write(" " * (first_col - len(term)))
        else:
            formatter.write("\n" + " " * (first_col + formatter.current_indent))
        width = max(formatter.width - first_col - formatter.current_indent, 10)
        lines = textwrap.wrap(text, width, break_long_words=False, break_on_hyphens=False) or [""]
        formatter.write(lines[0] + "\n")
        for line in lines[1:]:
            formatter.write(" " * (first_col + formatter.current_indent) + line + "\n")


class _FlagSafeContext(typer.Context):
    def make_formatter(self):
        formatter = super().make_formatter()
        formatter.write_dl = functools.partial(_write_dl, formatter)
        return formatter


class _FlagSafeCommand(typer.core.TyperCommand):
    context_class = _FlagSafeContext


@app.command(cls=_FlagSafeCommand)
def doctor(
    site_packages: Path | None = SitePackages,
    python: str | None = Python,
    pack: str | None = typer.Option(
        None,
        "--pack",
        metavar="DIR|hf://OWNER/NAME[@REV]",
        help="The pack directory (config.json and the shards), or a pack on the Hub, read there: config.json, "
        "the index and each shard's header, with HTTP range requests (needs patch-dsv4[hub]).",
    ),
    serve_args: str | None = typer.Option(
        None,
        "--serve-args",
        metavar="ARGS",
        help='The intended vllm serve arguments, e.g. "--tensor-parallel-size 8 --max-model-len 65536".',
    ),
    fix_config: bool = typer.Option(
        False, "--fix-config", help="Write the config.json edits the failing rows ask for (the original is kept)."
    ),
    hub_timeout: float | None = typer.Option(
        None,
        "--hub-timeout",
        metavar="S",
        help="Seconds for all of the reads of a pack on the Hub (default 50, or PATCH_DSV4_HUB_TIMEOUT).",
    ),
    fmt: Format = FormatOption,
    as_json: bool = JsonFlag,
    verbose: bool = Verbose,
    quiet: bool = Quiet,
) -> None:
    """Will this vLLM serve this pack? Read-only checks, in seconds.

    Checked from files (config.json, the shards' headers, the installed packages), before a 95 GB load.
    """
    from patch_dsv4.doctor.run import doctor_command

    code = doctor_command(
        site_packages,
        python,
        pack,
        serve_args,
        fix_config,
        _format(fmt, as_json),
        _verbosity(verbose, quiet),
        hub_timeout,
    )
    raise typer.Exit(code)


# -- drift and anchors: judge a release without installing it ----------------------------
CacheDir = typer.Option(
    None, "--cache-dir", metavar="DIR", help="Where fetched wheels are kept (default ~/.cache/patch-dsv4/wheels)."
)
PipOption = typer.Option(
    None,
    "--pip-option",
    metavar="OPTION",
    help="Pass this option to pip download (repeatable), e.g. --pip-option=--pre.",
)


def _release_target(vllm_version, wheel, source, flashinfer_version, cache_dir, pip_options, quiet=False):
    from patch_dsv4.releases import release_target as rt
    from patch_dsv4.releases.release_wheel import fetch_wheel, flashinfer_pin_served

    if wheel is not None and (source is not None or vllm_version is not None):
        raise PatcherError(
            "--wheel takes no --source or --vllm-version", "the wheel names its release", "pass one of them"
        )
    if wheel is not None:
        return rt.open_wheel(wheel, flashinfer_version)
    if source is not None:
        return rt.open_source(source, vllm_version, flashinfer_version)
    if vllm_version is None:
        raise PatcherError("no release to judge", "", "pass --vllm-version X, --wheel FILE or --source DIR")
    from patch_dsv4.output.progress import progress

    with progress(quiet) as bars:
        path, how = fetch_wheel(vllm_version, cache_dir, pip_options or (), None if quiet else _say, bars)
    target = rt.open_wheel(path, flashinfer_version)
    target.notes.insert(0, f"wheel {path.name} {how}")
    if target.flashinfer_source == "pinned" and target.flashinfer_version and not target.flashinfer_given:
        # drift fetches with pip anyway: say whether a user can install the pin the verdicts rest on
        target.flashinfer_pin_served, note = flashinfer_pin_served(target.flashinfer_version, pip_options or ())
        target.notes.append(note)
    return target


@app.command()
def drift(
    vllm_version: str | None = typer.Option(
        None,
        "--vllm-version",
        metavar="VERSION",
        help="Fetch this release's wheel with pip (with --source: that tree's version).",
    ),
    wheel: Path | None = typer.Option(None, "--wheel", metavar="FILE", help="Judge this vLLM wheel file."),
    source: Path | None = typer.Option(
        None, "--source", metavar="DIR", help="Judge this source tree (the directory holding vllm/)."
    ),
    flashinfer_version: str | None = typer.Option(
        None,
        "--flashinfer-version",
        metavar="VERSION",
        help="Judge with this FlashInfer release instead of the one vLLM pins.",
    ),
    strict: bool = typer.Option(False, "--strict", help="Also exit 1 on a new (unrecorded) fingerprint."),
    cache_dir: Path | None = CacheDir,
    pip_options: list[str] | None = PipOption,
    fmt: Format = FormatOption,
    as_json: bool = JsonFlag,
    verbose: bool = Verbose,
    quiet: bool = Quiet,
) -> None:
    """Judge a vLLM release without installing it.

    Per patch, its verdict and its anchors' fingerprints, from a wheel (fetched with pip), a file or a source tree.
    """
    from patch_dsv4.pipeline.drift import drift as judge_drift

    with _release_target(vllm_version, wheel, source, flashinfer_version, cache_dir, pip_options, quiet) as target:
        report = judge_drift(target, strict=strict)
    _finish(report, _format(fmt, as_json), _verbosity(verbose, quiet))


anchors_app = typer.Typer(help="The recorded anchors of known vLLM releases (anchors/*.json).", no_args_is_help=True)
app.add_typer(anchors_app, name="anchors")


@anchors_app.command("record")
def anchors_record(
    vllm_versions: list[str] | None = typer.Option(
        None, "--vllm-version", metavar="VERSION", help="Record this release (repeatable)."
    ),
    record_all: bool = typer.Option(False, "--all", help="Re-record every release anchors/ already holds."),
    cache_dir: Path | None = CacheDir,
    pip_options: list[str] | None = PipOption,
    out: Path | None = typer.Option(
        None, "--out", metavar="DIR", help="Write here instead of the anchors/ package directory."
    ),
    check: bool = typer.Option(False, "--check", help="Write nothing; exit 1 if a record differs from a fresh one."),
) -> None:
    """Maintainers: record each release's anchors from its wheel.

    Each release's verdicts, fingerprints and file hashes, recorded from its real wheel.
    """
    from patch_dsv4.pipeline.drift import record
    from patch_dsv4.releases import anchors_store
    from patch_dsv4.releases.release_target import open_wheel
    from patch_dsv4.releases.release_wheel import fetch_wheel

    versions = list(vllm_versions or [])
    if record_all:
        versions += [v for v in anchors_store.recorded_versions(out) if v not in versions]
    if not versions:
        raise PatcherError("no release to record", "", "pass --vllm-version X (repeatable) or --all")
    from patch_dsv4.output.progress import progress

    stale = []
    with progress() as bars:
        releases = bars.task("releases", len(versions))
        for number, version in enumerate(versions, 1):
            if not bars.shown:
                _say(f"vLLM {version} ({number} of {len(versions)})")
            bars.update(releases, completed=number - 1)
            path, _how = fetch_wheel(version, cache_dir, pip_options or (), _say, bars)
            with open_wheel(path) as target:
                if target.vllm_version != version:
                    raise PatcherError(
                        f"{path.name} is vLLM {target.vllm_version}, not {version}", "", "clear the cache"
                    )
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
            sys.stdout.flush()
    if stale:
        sys.stdout.write(f"anchors record --check: {len(stale)} stale; re-record: {anchors_store.RECORD_COMMAND}\n")
        raise typer.Exit(1)


def _version_callback(value: bool) -> None:
    if value:
        sys.stdout.write(f"patch-dsv4 {__version__}\n")
        raise typer.Exit(0)


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version_callback, is_eager=True, help="Show the version."
    ),
) -> None:
    pass


TARGETED = ("status", "apply", "takeover", "verify", "revert", "doctor")


def _stray_argument(command: str, stray: str) -> PatcherError:
    """``patch-dsv4 status DIR``: the target is an option; the error names the one that fits what was given."""
    import os
    import shlex

    given = stray.split()[0]
    path = Path(given)
    if command == "drift":
        option = "--wheel" if given.endswith(".whl") else "--source" if path.is_dir() else "--vllm-version"
    elif command == "doctor" and (path / "config.json").is_file():
        option = "--pack"
    elif path.is_dir():
        option = "--site-packages"
    elif path.is_file() and os.access(path, os.X_OK):
        option = "--python"
    else:
        option = None
    what = f"{command} takes no positional argument ({stray})"
    if option is None:
        why = "name the environment with --python EXE or --site-packages DIR"
        return PatcherError(what, why, f"patch-dsv4 {command} -h")
    return PatcherError(what, f"name it with {option}", f"patch-dsv4 {command} {option} {shlex.quote(given)}")


def run(args: list[str]) -> int:
    """Run the command line; PatcherError and usage errors propagate to patch_dsv4.cli, which prints them."""
    import re

    _ARGS[:] = args
    command = typer.main.get_command(app)
    try:
        code = command.main(args=args, prog_name="patch-dsv4", standalone_mode=False)
    except typer.Exit as exc:
        return getattr(exc, "exit_code", 0)
    except typer.TyperException as exc:  # a usage error (Typer's own click): a stray positional gets a hint
        ctx = getattr(exc, "ctx", None)
        name = ctx.info_name if ctx is not None else None
        stray = re.match(r"Got unexpected extra argument(?:s|\(s\))? \((.*)\)$", getattr(exc, "message", ""))
        if stray and name in (*TARGETED, "drift"):
            raise _stray_argument(name, stray[1]) from None
        raise
    if code == EXIT_INTERRUPTED:  # Typer turns Ctrl-C into a silent 130; patch_dsv4.cli says where it struck
        raise KeyboardInterrupt
    return code if isinstance(code, int) else 0
