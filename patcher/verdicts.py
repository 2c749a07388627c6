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

    @property
    def needs_action(self) -> bool:
        """A verdict that fails `verify`: the environment is not in the state it needs."""
        return self in (Verdict.PENDING, Verdict.DRIFTED, Verdict.MODIFIED)


@dataclass(frozen=True)
class Outcome:
    """The judgement of one edit on one file's text.

    ``variant`` is set for PENDING and APPLIED: the index of the edit's
    (anchor, replacement) variant that matched.
    """

    verdict: Verdict
    detail: str
    variant: int | None = None
    expected: str | None = None
    found: str | None = None

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
    verdict: Verdict
    detail: str
    expected: str | None = None
    found: str | None = None

    def to_json(self) -> dict:
        data = {"label": self.label, "file": self.file, "verdict": self.verdict.value, "detail": self.detail}
        if self.expected is not None:
            data["expected"] = self.expected
        if self.found is not None:
            data["found"] = self.found
        return data


def combine(verdicts: list[Verdict]) -> Verdict:
    """One verdict for a patch made of several edits (DESIGN.md, "Verdicts")."""
    for v in (Verdict.MODIFIED, Verdict.DRIFTED, Verdict.PENDING, Verdict.APPLIED, Verdict.UPSTREAM):
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

    def to_json(self) -> dict:
        return {
            "id": self.id,
            "title": self.title,
            "verdict": self.verdict.value,
            "files": list(self.files),
            "detail": self.detail,
            "edits": [e.to_json() for e in self.edits],
        }


@dataclass(frozen=True)
class Report:
    """What one command found and did in one environment."""

    command: str
    target: str
    vllm_version: str | None
    flashinfer_version: str | None
    flashinfer_source: str | None
    patches: tuple[PatchReport, ...]
    state: str  # "none" | "current" | "stale"
    exit_code: int
    summary: str
    changed_files: tuple[str, ...] = ()
    diff: str | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)
    build: dict | None = None  # {"known": bool, "detail": str}: is this a release recorded in anchors/?
    next_step: str | None = None  # the command that resolves what failed, with the same target

    def to_json(self) -> dict:
        data = {
            "command": self.command,
            "target": self.target,
            "vllm_version": self.vllm_version,
            "flashinfer_version": self.flashinfer_version,
            "flashinfer_source": self.flashinfer_source,
            "state": self.state,
            "patches": [p.to_json() for p in self.patches],
            "changed_files": list(self.changed_files),
            "notes": list(self.notes),
            "exit_code": self.exit_code,
            "summary": self.summary,
        }
        if self.diff is not None:
            data["diff"] = self.diff
        if self.build is not None:
            data["build"] = self.build
        return data
