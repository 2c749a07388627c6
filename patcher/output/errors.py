"""Expected failures, each with what failed, why, and the command to run next.

The CLI prints them as one line on stderr and exits with ``exit_code``; nothing
else in the code base formats user-facing errors.
"""

EXIT_OK = 0
EXIT_NEEDS_ACTION = 1  # verify/drift found work; apply/revert refused
EXIT_ENVIRONMENT = 2  # usage and environment errors


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
