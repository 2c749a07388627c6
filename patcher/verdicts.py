"""Typed outcomes: what the engine decides, and what the CLI renders."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class Verdict(str, enum.Enum):
    APPLIED = "applied"
    PENDING = "pending"
    UPSTREAM = "upstream"
    NOT_APPLICABLE = "not-applicable"
    DRIFTED = "drifted"
    MODIFIED = "modified"
    OPT_IN = "opt-in"  # an opt-in patch this environment has not asked for (apply --with ID)
    FOREIGN = "foreign"  # another tool's edit of the same fix stands in the patch's scope

    @property
    def needs_action(self) -> bool:
        """A verdict that fails `verify`: the environment is not in the state it needs."""
        return self in (Verdict.PENDING, Verdict.DRIFTED, Verdict.MODIFIED, Verdict.FOREIGN)


@dataclass(frozen=True)
class Outcome:
    """The judgement of one edit on one file's text.

    ``variant`` is set for PENDING and APPLIED: the index of the edit's
    (anchor, replacement) variant that matched; ``foreign`` for FOREIGN: the
    script whose edit stands there.
    """

    verdict: Verdict
    detail: str
    variant: int | None = None
    expected: str | None = None
    found: str | None = None
    foreign: str | None = None

    @classmethod
    def upstream(cls, evidence: str) -> "Outcome":
        return cls(Verdict.UPSTREAM, evidence)

    @classmethod
    def not_applicable(cls, reason: str) -> "Outcome":
        return cls(Verdict.NOT_APPLICABLE, reason)

    @classmethod
    def drifted(cls, detail: str, expected: str | None = None, found: str | None = None) -> "Outcome":
        return cls(Verdict.DRIFTED, detail, expected=expected, found=found)


@dataclass(frozen=True)
class EditReport:
    label: str
    file: str
    scope: str
    verdict: Verdict
    detail: str
    expected: str | None = None
    found: str | None = None
    foreign: str | None = None  # FOREIGN: the script whose edit stands in this scope

    def to_json(self) -> dict:
        return {
            "label": self.label,
            "file": self.file,
            "scope": self.scope,
            "verdict": self.verdict.value,
            "detail": self.detail,
            "expected": self.expected,
            "found": self.found,
            "foreign": self.foreign,
        }


def summary_line(command: str, reports: "tuple[PatchReport, ...]", extra: str = "") -> str:
    """The closing line of a report: the verdicts counted, and what was done."""
    counts: dict[str, int] = {}
    for r in reports:
        counts[r.verdict.value] = counts.get(r.verdict.value, 0) + 1
    text = ", ".join(f"{n} {v}" for v, n in counts.items()) or "no patches"
    return f"{command}: {text}" + (f"; {extra}" if extra else "")


def next_step(target_args: str, bad: "list[PatchReport]", foreign_next: str | None = None) -> str | None:
    """The one command that resolves the patches ``bad`` lists, naming the target as the user did.

    ``foreign_next`` is the way out of other tools' edits (takeover, or a reinstall where no backup serves).
    """
    verdicts = {r.verdict for r in bad}
    if not verdicts:
        return None
    if Verdict.MODIFIED in verdicts:
        return f"patch-dsv4 revert --discard-local-edits{target_args} (your edit is saved first), then apply"
    if Verdict.FOREIGN in verdicts:
        return foreign_next or f"patch-dsv4 takeover{target_args}"
    if Verdict.DRIFTED in verdicts:
        return f"patch-dsv4 status -v{target_args} (a patch no longer matches this vLLM: do not serve it)"
    return f"patch-dsv4 apply{target_args}"


def combine(verdicts: list[Verdict]) -> Verdict:
    """One verdict for a patch made of several edits (DESIGN.md, "Verdicts")."""
    for v in (Verdict.MODIFIED, Verdict.FOREIGN, Verdict.DRIFTED, Verdict.PENDING, Verdict.APPLIED, Verdict.UPSTREAM):
        if v in verdicts:
            return v
    return Verdict.NOT_APPLICABLE


@dataclass(frozen=True)
class PatchReport:
    id: str
    title: str
    verdict: Verdict
    files: tuple[str, ...]
    detail: str
    edits: tuple[EditReport, ...] = ()

    @property
    def foreign(self) -> str | None:
        """FOREIGN: the scripts whose edits stand in this patch's scopes, comma-separated."""
        if self.verdict is not Verdict.FOREIGN:
            return None
        return ", ".join(dict.fromkeys(e.foreign for e in self.edits if e.foreign)) or None

    @property
    def shown_verdict(self) -> str:
        """The verdict as people read it: a foreign edit names its script (``foreign: <script>``)."""
        return f"foreign: {self.foreign}" if self.foreign else self.verdict.value

    def to_json(self) -> dict:
        return {
            "id": self.id,
            "title": self.title,
            "verdict": self.verdict.value,
            "foreign": self.foreign,
            "files": list(self.files),
            "detail": self.detail,
            "edits": [e.to_json() for e in self.edits],
        }


#: The version of the JSON documents every command writes (README, "JSON output"; patcher/report.schema.json).
JSON_SCHEMA = 1


@dataclass(frozen=True)
class Report:
    """What one command found and did in one environment (or, for drift, one release)."""

    command: str
    target: str | None
    vllm_version: str | None
    flashinfer_version: str | None
    flashinfer_source: str | None
    patches: tuple[PatchReport, ...]
    state: str | None  # "none" | "current" | "stale" | "interrupted"; None where there is no environment (drift)
    exit_code: int
    summary: str
    changed_files: tuple[str, ...] = ()
    diff: str | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)
    build: dict | None = None  # {"known": bool, "detail": str}: is this a release recorded in anchors/?
    next_step: str | None = None  # the command that resolves what failed, with the same target
    backups: str | None = None  # the directory holding the backups, when there is a state
    saved_edits: tuple[str, ...] = ()  # where revert --discard-local-edits saved hand-edited files

    def to_json(self) -> dict:
        """The document of status, verify, apply and revert: the same keys on every path."""
        return {
            "schema": JSON_SCHEMA,
            "command": self.command,
            "exit_code": self.exit_code,
            "error": None,
            "target": self.target,
            "vllm_version": self.vllm_version,
            "flashinfer_version": self.flashinfer_version,
            "flashinfer_source": self.flashinfer_source,
            "build": self.build,
            "state": self.state,
            "patches": [p.to_json() for p in self.patches],
            "changed_files": list(self.changed_files),
            "backups": self.backups,
            "saved_edits": list(self.saved_edits),
            "diff": self.diff,
            "notes": list(self.notes),
            "next": self.next_step,
            "summary": self.summary,
        }


def error_document(command: str, message: str, exit_code: int) -> dict:
    """An error in the command's own document: every key present and empty, ``error`` and ``summary`` set."""
    if command == "list":
        empty = {"patches": []}
    elif command == "doctor":
        empty = {"target": None, "vllm_version": None, "pack": None, "checks": [], "config_fix": None, "summary": message}
    else:
        empty = Report(command, None, None, None, None, (), None, exit_code, message).to_json()
        if command == "drift":
            empty.update(release=None, choices=[], flashinfer_given=False, files_read=[], strict=False)
    return {**empty, "schema": JSON_SCHEMA, "command": command, "exit_code": exit_code, "error": message}
