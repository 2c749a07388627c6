"""The `patch-dsv4` entry point: errors printed in one place, and verify's fast path.

``verify`` on an applied tree (the default target or ``--site-packages``) is
answered from the state's hashes without importing Typer, rich or libcst
(:mod:`patch_dsv4.fastpath.quick`), and ``doctor`` with plain options runs without Typer;
everything else goes to the Typer app (:mod:`patch_dsv4.app`). Expected errors are short: what, why and the next
command, each on lines of its own led by ``patch-dsv4: error:``, ``why:`` and ``next:``, within 80 columns.
"""

import os
import sys

from patch_dsv4 import __version__

EXIT_ENVIRONMENT = 2  # patch_dsv4.output.errors.EXIT_ENVIRONMENT: imported where an error is caught, not before
EXIT_INTERRUPTED = 130  # patch_dsv4.output.errors.EXIT_INTERRUPTED

COMMANDS = ("list", "status", "apply", "takeover", "verify", "revert", "drift", "anchors", "doctor")


def _command_of(args: list[str]) -> str | None:
    return next((a for a in args if a in COMMANDS), None)


def _wants_json(args: list[str]) -> bool:
    return (
        "--json" in args
        or "--format=json" in args
        or any(a == "--format" and i + 1 < len(args) and args[i + 1] == "json" for i, a in enumerate(args))
    )


def print_error(what: str, why: str = "", next_step: str = "") -> None:
    """An expected error on stderr: what, why and next, each on lines of its own that fit 80 columns."""
    from patch_dsv4.output.render import error_text, stderr_width

    sys.stderr.write(error_text(what, why, next_step, stderr_width()))


def _fail(command: str | None, what: str, why: str, next_step: str, code: int, as_json: bool, report=None) -> int:
    print_error(what, why, next_step)
    if as_json:
        from patch_dsv4.output.render import write_json
        from patch_dsv4.output.verdicts import error_document

        message = what + (f": {why}" if why else "")
        write_json(error_document(command or "patch-dsv4", message, code, report))
    return code


# -- the fast paths: verify and doctor without Typer ---------------------------------------
# Typer builds a pydantic adapter per option (a third of a second to import); the two commands
# that run on every container start answer without it when their command line is this plain.
# Each fast command's grammar: the options it reads a value of, the flags it reads, and the options it leaves to Typer
# (their presence sends the command there). Together, every option of Typer's command:
# tests/engine/fastpath/test_fast_verify.py holds the two grammars to each other, so that an option added to one
# and not the other fails it.
_VALUES = {
    "verify": ("--site-packages", "--format", "--expect"),
    "doctor": ("--site-packages", "--python", "--pack", "--serve-args", "--format", "--hub-timeout"),
}
_COMMAND_FLAGS = {
    "verify": ("--json", "-q", "--quiet", "-v", "--verbose"),
    "doctor": ("--json", "-q", "--quiet", "-v", "--verbose", "--fix-config"),
}
LEFT_TO_TYPER = {
    "verify": ("--python", "--with", "--lock-timeout", "-h", "--help"),
    "doctor": ("-h", "--help"),
}
FORMATS = ("table", "json", "markdown")
_FLAGS = {
    "--json": ("format", "json"),
    "-q": ("verbosity", -1),
    "--quiet": ("verbosity", -1),
    "-v": ("verbosity", 1),
    "--verbose": ("verbosity", 1),
    "--fix-config": ("fix_config", True),
}


def _plain_options(args: list[str], command: str) -> dict | None:
    """``args`` as {option: value} when they are ``command`` and options it takes plainly; None otherwise."""
    if not args or args[0] != command:
        return None
    options: dict = {"format": "table", "verbosity": 0}
    rest = args[1:]
    while rest:
        arg = rest.pop(0)
        name, eq, value = arg.partition("=")
        if name in _VALUES[command] and (eq or rest):
            options[name.lstrip("-").replace("-", "_")] = value if eq else rest.pop(0)
        elif arg in _COMMAND_FLAGS[command]:
            key, flag_value = _FLAGS[arg]
            options[key] = flag_value
        else:
            return None  # --help, an unknown option, a bad value: Typer says it properly
    return options if options["format"] in FORMATS else None


def _fast_verify(args: list[str]) -> int | None:
    """Answer ``verify`` from the recorded verdicts when the hashes vouch for them; None otherwise."""
    options = _plain_options(args, "verify")
    if options is None:
        return None
    from patch_dsv4.fastpath import quick

    site = options.get("site_packages")
    search = [site] if site is not None else [p for p in sys.path if p]
    try:
        located = quick.locate(search)
        if located is None:
            return None
        if site is not None and os.path.realpath(located.site_packages) != os.path.realpath(site):
            return None
        # the fingerprint where it is compared or shown (--expect, JSON, markdown, -v): a plain table has none,
        # and imports the fingerprint's module only where PATCH_DSV4_WITH names opt-ins (serving.ENV_WITH)
        shown = "expect" in options or options["format"] != "table" or options["verbosity"] > 0
        serving = _serving() if shown or os.environ.get("PATCH_DSV4_WITH") else None
        recorded = quick.vouched(located, serving.opt_ins_from_env() if serving else ())
        if recorded is None:
            return None  # not vouched for, or an opt-in asked for that the state does not keep: judged in full
        served = serving.of_recorded(located, recorded) if shown else None
    except quick.Unreadable:
        return None  # a malformed state or dist-info: the full path says so, in the same words, with what to do
    from patch_dsv4.output.render import render, write_failure
    from patch_dsv4.tree.hooks import find_hooks

    target_args = "" if site is None else f" --site-packages {quick.quote(site)}"
    hooks = find_hooks([site], [site]) if site is not None else find_hooks(search)
    document = quick.recorded_document(located, recorded, target_args, served, hooks, fingerprint=shown)
    if "expect" in options:
        try:
            found = serving.expect(document, served, options["expect"])
            serving.write_differences(found)
        except serving.BadFingerprint:
            return None  # the full path says it properly
    render(document, options["format"], options["verbosity"])
    if document["exit_code"]:  # stderr, so also beside --json
        write_failure(document)
    return document["exit_code"]


def _serving():
    from patch_dsv4.fastpath import serving

    return serving


def _fast_doctor(args: list[str]) -> int | None:
    options = _plain_options(args, "doctor")
    if options is None:
        return None
    try:
        hub_timeout = float(options["hub_timeout"]) if "hub_timeout" in options else None
    except ValueError:
        return None  # Typer says it properly
    from patch_dsv4.doctor.run import doctor_command

    return doctor_command(
        options.get("site_packages"),
        options.get("python"),
        options.get("pack"),
        options.get("serve_args"),
        options.get("fix_config", False),
        options["format"],
        options["verbosity"],
        hub_timeout,
    )


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns (and exits with) the exit status. Expected errors never show a traceback."""
    args = list(sys.argv[1:] if argv is None else argv) or ["--help"]
    as_json = _wants_json(args)
    command = _command_of(args)
    if command in WRITING:
        from patch_dsv4.output.errors import forget_progress

        forget_progress()
    try:
        code = _fast_verify(args)
        if code is None:
            code = _fast_doctor(args)
        if code is None:
            from patch_dsv4.app import run

            code = run(args)
    except KeyboardInterrupt:
        code = _fail(command, *_interrupted(command, args), EXIT_INTERRUPTED, as_json)
    except BrokenPipeError:  # `patch-dsv4 status | head`: the reader left; say nothing more
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        code = 0
    except Exception as exc:
        from patch_dsv4.output.errors import AGAIN, PatcherError

        if isinstance(exc, PatcherError):
            report = getattr(exc, "report", None)
            next_step = exc.next_step or (_again(args) if exc.exit_code == EXIT_INTERRUPTED else "")
            next_step = next_step.replace(AGAIN, _again(args))
            code = _fail(command, exc.what, exc.why, next_step, exc.exit_code, as_json, report)
        else:
            code = _unexpected(command, exc, as_json)
    return _exit(code, argv)


#: The commands that write vLLM's files (their transaction says how far an interrupt let them go).
WRITING = ("apply", "takeover", "revert")


def _again(args: list[str]) -> str:
    """The command line being run, as the user can run it again."""
    import shlex

    return "patch-dsv4 " + shlex.join(args)


def _target_args(args: list[str]) -> str:
    """The target options of ``args`` (``--site-packages DIR``, ``--python EXE``), as a next command repeats them."""
    import shlex

    found = []
    for i, arg in enumerate(args):
        name, eq, value = arg.partition("=")
        if name in ("--site-packages", "--python") and (eq or i + 1 < len(args)):
            found.append(f" {name} {shlex.quote(value if eq else args[i + 1])}")
    return "".join(found)


def _interrupted(command: str | None, args: list[str]) -> tuple[str, str, str]:
    """(what, why, next) of a Ctrl-C that no step said more of: what the command had done, and the tree's state.

    Every write of apply, takeover and revert says itself where an interrupt strikes it (the transaction); one
    struck anywhere else finds their work not begun, or complete.
    """
    from patch_dsv4.output.errors import progress

    how_far = progress() if command in WRITING else None
    status = f"patch-dsv4 status{_target_args(args)}"
    if how_far is not None and how_far[0] == "completed":
        return f"interrupted after {how_far[1]}", "only its report was cut short", status
    if how_far is not None:
        return (
            f"interrupted while {how_far[1]} wrote the files",
            "its journal is kept in .patch-dsv4/: the next apply or revert finishes it (status says what is there)",
            _again(args),
        )
    if command in WRITING and "--dry-run" not in args:
        return f"interrupted: {command} changed nothing", "it had not begun to write", _again(args)
    if command == "anchors":
        return "interrupted", "the releases said recorded above are written; the rest are not", _again(args)
    if command == "doctor":
        return "interrupted", "", _again(args)
    return f"interrupted: {command or 'patch-dsv4'} changed nothing", "", ""


def _unexpected(command: str | None, exc: Exception, as_json: bool) -> int:
    """Typer's aborts and usage errors, said as ours are; anything else is a bug of ours."""
    import typer

    if isinstance(exc, typer.Abort):
        return _fail(command, "aborted", "", "", EXIT_ENVIRONMENT, as_json)
    if isinstance(exc, typer.TyperException) and hasattr(exc, "format_message"):  # usage errors
        ctx = getattr(exc, "ctx", None)
        name = "" if ctx is None or ctx.info_name == "patch-dsv4" else f" {ctx.info_name}"
        return _fail(command, exc.format_message(), "", f"patch-dsv4{name} --help", EXIT_ENVIRONMENT, as_json)
    return _fail(  # a bug of ours: say so, briefly, and never as exit 1 ("needs action")
        command,
        f"internal error: {type(exc).__name__}: {exc}",
        f"this is a bug in patch-dsv4 {__version__}",
        "report it with the command you ran",
        EXIT_ENVIRONMENT,
        as_json,
    )


def _exit(code: int, argv: list[str] | None) -> int:
    if argv is None:
        sys.exit(code)
    return code
