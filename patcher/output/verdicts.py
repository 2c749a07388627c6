"""Typed outcomes: what the engine decides, and what the CLI renders.

Their JSON documents, closing lines and next commands are made by
:mod:`patch_dsv4.output.render` from plain values: verify's fast path makes its
document with the same functions, without importing this module.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace

from patch_dsv4.output import render

JSON_SCHEMA = render.JSON_SCHEMA  # the documents' version, read here by the app and doctor


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
        return self.value in render.NEEDS_ACTION


@dataclass(frozen=True)
class Outcome:
    """The judgement of one edit on one file's text.

    ``variant`` is set for PENDING and APPLIED: the index of the edit's
    (anchor, replacement) variant that matched; ``foreign`` for FOREIGN: the
    script whose edit stands there; ``kept`` for any verdict: the other tools'
    edits (with no equivalent here) its judgement read, which stay where they are.
    """

    verdict: Verdict
    detail: str
    variant: int | None = None
    expected: str | None = None
    found: str | None = None
    foreign: str | None = None
    kept: tuple[str, ...] = ()  # "<file>: <script> (<tool>)": other tools' edits read, which patch-dsv4 leaves alone

    @classmethod
    def upstream(cls, evidence: str) -> Outcome:
        return cls(Verdict.UPSTREAM, evidence)

    @classmethod
    def not_applicable(cls, reason: str) -> Outcome:
        return cls(Verdict.NOT_APPLICABLE, reason)

    @classmethod
    def drifted(cls, detail: str, expected: str | None = None, found: str | None = None) -> Outcome:
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
        return render.edit_document(
            self.label, self.file, self.scope, self.verdict.value, self.detail, self.expected, self.found, self.foreign
        )

    @classmethod
    def from_json(cls, data: dict) -> EditReport:
        """The edit of a document (the inverse of :meth:`to_json`)."""
        return cls(
            data["label"],
            data["file"],
            data["scope"],
            Verdict(data["verdict"]),
            data["detail"],
            data["expected"],
            data["found"],
            data["foreign"],
        )


def summary_line(command: str, reports: tuple[PatchReport, ...], extra: str = "") -> str:
    """The closing line of a report: the verdicts counted, and what was done."""
    return render.summary_text(command, (r.verdict.value for r in reports), extra)


def next_step(target_args: str, bad: list[PatchReport], foreign_next: str | None = None) -> str | None:
    """The one command that resolves the patches ``bad`` lists, naming the target as the user did.

    ``foreign_next`` is the way out of other tools' edits (takeover, or a reinstall where no backup serves).
    """
    return render.next_command(target_args, (r.verdict.value for r in bad), foreign_next)


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
        return render.foreign_scripts(self.verdict.value, (e.foreign for e in self.edits))

    @property
    def shown_verdict(self) -> str:
        """The verdict as people read it: a foreign edit names its script (``foreign: <script>``)."""
        return render.shown_verdict(self.verdict.value, self.foreign)

    def to_json(self) -> dict:
        return render.patch_document(
            self.id, self.title, self.verdict.value, self.files, self.detail, [e.to_json() for e in self.edits]
        )

    @classmethod
    def from_json(cls, data: dict) -> PatchReport:
        """The patch of a document (the inverse of :meth:`to_json`)."""
        return cls(
            data["id"],
            data["title"],
            Verdict(data["verdict"]),
            tuple(data["files"]),
            data["detail"],
            tuple(EditReport.from_json(e) for e in data["edits"]),
        )


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
    # what the tree serves (patch_dsv4.fastpath.serving.Fingerprint; its text in JSON); None where no tree is judged
    fingerprint: object | None = field(default=None, compare=False)
    # start-up hooks that name vLLM (patch_dsv4.tree.hooks.Hook.to_json: file, kind, modules, via)
    hooks: tuple[dict, ...] = ()

    def to_json(self) -> dict:
        """The document of status, verify, apply and revert: the same keys on every path."""
        return render.report_document(
            command=self.command,
            exit_code=self.exit_code,
            target=self.target,
            vllm_version=self.vllm_version,
            flashinfer_version=self.flashinfer_version,
            flashinfer_source=self.flashinfer_source,
            build=self.build,
            state=self.state,
            patches=[p.to_json() for p in self.patches],
            summary=self.summary,
            changed_files=self.changed_files,
            backups=self.backups,
            saved_edits=self.saved_edits,
            diff=self.diff,
            notes=self.notes,
            next_step=self.next_step,
            fingerprint=None if self.fingerprint is None else str(self.fingerprint),
            hooks=self.hooks,
        )

    @classmethod
    def from_json(cls, data: dict) -> Report:
        """The report of a document (the inverse of :meth:`to_json`)."""
        return cls(
            command=data["command"],
            target=data["target"],
            vllm_version=data["vllm_version"],
            flashinfer_version=data["flashinfer_version"],
            flashinfer_source=data["flashinfer_source"],
            patches=tuple(PatchReport.from_json(p) for p in data["patches"]),
            state=data["state"],
            exit_code=data["exit_code"],
            summary=data["summary"],
            changed_files=tuple(data["changed_files"]),
            diff=data["diff"],
            notes=tuple(data["notes"]),
            build=data["build"],
            next_step=data["next"],
            backups=data["backups"],
            saved_edits=tuple(data["saved_edits"]),
            fingerprint=data.get("fingerprint"),
            hooks=tuple(data.get("hooks", ())),
        )


def error_document(command: str, message: str, exit_code: int, report: Report | None = None) -> dict:
    """An error in the command's own document: every key present and empty, ``error`` and ``summary`` set;
    with ``report`` (a refused apply), its target, verdicts and notes instead of the empty ones."""
    if command == "list":
        empty = {"patches": []}
    elif command == "doctor":
        empty = {
            "target": None,
            "vllm_version": None,
            "pack": None,
            "checks": [],
            "config_fix": None,
            "summary": message,
        }
    elif report is not None:
        empty = replace(report, exit_code=exit_code, summary=message).to_json()
    else:
        empty = Report(command, None, None, None, None, (), None, exit_code, message).to_json()
        if command == "drift":
            empty.update(release=None, choices=[], flashinfer_given=False, files_read=[], strict=False)
    return {**empty, "schema": JSON_SCHEMA, "command": command, "exit_code": exit_code, "error": message}
