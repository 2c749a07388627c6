"""Expected failures, each with what failed, why, and the command to run next.

The CLI prints them as one line on stderr and exits with ``exit_code``; nothing
else in the code base formats user-facing errors.
"""

EXIT_OK = 0
EXIT_NEEDS_ACTION = 1  # verify/drift found work; apply/revert refused
EXIT_ENVIRONMENT = 2  # usage and environment errors
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT), as shells report it
#: In a next step, the command line being run, again (with all its options): the CLI writes it out.
AGAIN = "the same command again"


class PatcherError(Exception):
    exit_code = EXIT_ENVIRONMENT

    def __init__(self, what: str, why: str = "", next_step: str = "") -> None:
        self.what = what
        self.why = why
        self.next_step = next_step
        super().__init__(self.line())

    def line(self) -> str:
        parts = [self.what]
        if self.why:
            parts.append(self.why)
        text = ": ".join(parts)
        if self.next_step:
            text += f" (next: {self.next_step})"
        return text


class EnvironmentProblem(PatcherError):
    """No vLLM where we looked, unreadable state, lock not obtained: exit 2."""


class Refused(PatcherError):
    """apply/revert would be unsafe (drift, hand edits): exit 1, nothing written."""

    exit_code = EXIT_NEEDS_ACTION
    report = None  # a refused apply: the Report of the verdicts it refused on (--json carries them)


class TransformBug(PatcherError):
    """A patch's transform broke its own contract (not idempotent, unparsable output)."""

    exit_code = EXIT_ENVIRONMENT


class Interrupted(PatcherError):
    """Ctrl-C, said where it struck: what the command had done and the state it leaves the tree in."""

    exit_code = EXIT_INTERRUPTED


#: How far a writing command got in this process: ("begun", command) once its journal is about to be saved,
#: ("completed", what) once its write is whole; an interrupt that no step caught is said from the last of them.
_progress: list[tuple[str, str]] = []


def begun(command: str) -> None:
    """Record that ``command`` starts changing files (from here, its journal lets the next run finish it)."""
    _progress.append(("begun", command))


def completed(what: str) -> None:
    """Record that ``what`` ("apply completed: patched 5 files") is done, whatever interrupts the command later."""
    _progress.append(("completed", what))


def progress() -> tuple[str, str] | None:
    """The last of :func:`begun` and :func:`completed` in this process since :func:`forget_progress`; None if none."""
    return _progress[-1] if _progress else None


def forget_progress() -> None:
    _progress.clear()
