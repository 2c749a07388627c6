"""The values a command's steps pass on, defined once: every step imports them, and no step imports another.

    Snapshot  what reading gave: the state view, and every file, backup and pip's copy read, each once
    Judged    what judging gave: the verdicts of the tree (takeover: with pip's bytes in place)
    Plan      what planning gave: the files to write, the manifest to record, the refusal if any
    Committed what committing did beyond the plan

The shell (:mod:`patch_dsv4.pipeline.commands`) calls the steps in order: reading (:mod:`~patch_dsv4.pipeline.reading`),
judging (:mod:`~patch_dsv4.pipeline.judge`), taking over (:mod:`~patch_dsv4.pipeline.takeover`), planning
(:mod:`~patch_dsv4.pipeline.planning`), committing (:mod:`~patch_dsv4.pipeline.transaction`) and reporting
(:mod:`~patch_dsv4.pipeline.reporting`). Only reading touches the disk: a :class:`Snapshot` reads through the readers
reading gave it, each file once, when judging first asks for it; planning and reporting take only what it holds
(:meth:`Snapshot.held`), and fail loudly where it holds nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from patch_dsv4.output.errors import PatcherError, Refused
from patch_dsv4.output.verdicts import Outcome, PatchReport, Verdict
from patch_dsv4.patching.patch import Context, Edit, Patch
from patch_dsv4.tree.environment import Environment, record_digest
from patch_dsv4.tree.fs import sha256_bytes
from patch_dsv4.tree.state import Manifest, StateStore

if TYPE_CHECKING:
    from patch_dsv4.releases.release_wheel import ReleaseWheel


# -- reading: the snapshot --------------------------------------------------------------------
@dataclass
class StateView:
    manifest: Manifest | None
    kind: str  # "none" | "current" | "stale" | "interrupted"
    modified: dict[str, str]  # relpath -> why
    ours: set[str]  # files that are as we wrote them
    # staged copies an interrupted apply left in the state directory ("" for none), with " (completed)" where the
    # manifest names each as what we wrote (it was saved after them: the apply was done)
    leftover: str = ""


NO_STATE = StateView(None, "none", {}, set())


@dataclass
class LostState:
    """A state without a manifest to go by, as reading found it: its manifest is gone or cannot be read (or, for
    revert and status, there is no state directory at all). Nothing in it is trusted: apply and revert rebuild the
    state from proof (:func:`patch_dsv4.pipeline.commands.rebuild`), reading these bytes as candidates only."""

    unreadable: str  # why its manifest cannot be read ("" where there is none)
    present: bool  # the state directory holds something (False: there is none)
    backups: dict[str, bytes | None]  # each file a patch edits -> its backup's bytes (None: not a regular file of
    #   a source file's size)
    others: tuple[str, ...] = ()  # every other entry under backups/ (a path no patch edits, a link, a FIFO): never
    #   read, never used


@dataclass(frozen=True)
class Proof:
    """One file that carries our edits (judged applied, by their markers), and what proves the state that names it:
    pip's bytes by RECORD's sha256, and what those edits write on them."""

    relpath: str
    patches: tuple[str, ...]  # the patches whose edits stand applied there
    now: bytes  # the file as it is
    pip: bytes | None  # pip's bytes, their sha256 the one RECORD lists; None where nothing here proves them
    source: str  # where they come from ("backup": ours; a backup's name beside the file; the release wheel), or
    #   why nothing proves them
    written: bytes | None = None  # what those edits write on pip's bytes (None: not judged, or they do not apply)
    fetch: bool = False  # only the release wheel could prove them, and this command fetches nothing (status)


@dataclass
class Rebuild:
    """What rebuilding a lost state writes (planning decides it from the proofs; the transaction commits it)."""

    lost: LostState
    manifest: Manifest | None = None  # the state it records (None: no file carries our edit, there is none)
    backups: dict[str, bytes] = field(default_factory=dict)  # backups it writes: pip's bytes no backup of ours held
    sources: dict[str, str] = field(default_factory=dict)  # file -> where pip's bytes came from
    keep: tuple[str, ...] = ()  # backups it sets aside under saved-edits/ (neither used nor the file's own bytes)
    drop: tuple[str, ...] = ()  # backups it removes: each holds the file's bytes as they are
    fetch: bool = False  # a file's pip's bytes are only in the release wheel, which apply or revert fetches first
    refusal: PatcherError | None = None  # set: nothing is written, apply and revert refuse with it
    unproven: str = ""  # what left a file carrying our edits without proof, in words (the refusal's)
    kept_in: str = ""  # committed: where the kept files are (".patch-dsv4/saved-edits/<run>/")

    @property
    def writes(self) -> bool:
        return bool(self.lost.present or self.manifest is not None)


def context_for(
    env: Environment,
    view: StateView = NO_STATE,
    overlay: dict[str, bytes] | None = None,
    trust_overlay: bool = True,
    read: Callable[[str], bytes | None] | None = None,
    recorded: dict | None = None,
) -> Context:
    """A Context over the environment's files; ``overlay`` replaces some of them (planned or backed-up bytes).

    A file is taken as installed when pip's RECORD has its hash, or when the
    state says we wrote it (or accepted it with ``--force``), or (``trust_overlay``)
    when it is one of the overlay's. ``read`` reads a file of the tree (default: from disk, each time).
    ``recorded``: the probe answers the release's record holds (recalled where the files are the release's).
    """
    accepted: dict[str, set[str]] = {}
    if view.kind == "current" and view.manifest is not None:
        for relpath, entry in view.manifest.files.items():
            accepted.setdefault(relpath, set()).update((entry.after, entry.before))
        for relpath, sha in view.manifest.inputs.items():
            if sha is not None:
                accepted.setdefault(relpath, set()).add(sha)
    overlay = overlay or {}
    trusted = overlay if trust_overlay else {}
    read = env.read_bytes if read is None else read

    def read_bytes(relpath: str) -> bytes | None:
        return overlay[relpath] if relpath in overlay else read(relpath)

    def check_installed(relpath: str, data: bytes | None) -> str | None:
        recorded = env.recorded_hash(relpath)
        if data is None:
            return f"{relpath} is missing, but pip's RECORD lists it" if recorded else None
        if relpath in trusted or recorded == record_digest(data) or sha256_bytes(data) in accepted.get(relpath, ()):
            return None
        if recorded is None:
            return f"{relpath} is not in pip's RECORD"
        return f"{relpath} differs from pip's RECORD (changed by hand, truncated, or from another build)"

    return Context(
        vllm_version=env.vllm_version,
        flashinfer_version=env.flashinfer_version,
        flashinfer_source=env.flashinfer_source,
        read_bytes=read_bytes,
        read_flashinfer_bytes=env.read_flashinfer,
        check_installed=check_installed,
        recorded=recorded,
    )


#: (relpath, wheel) -> (where from, pip's bytes): the sibling backup that holds what pip installed, else (``wheel``
#: and the command reads it) the release's wheel; None when neither does
PipCopy = Callable[..., "tuple[str, bytes] | None"]


@dataclass
class Readers:
    """How a snapshot reads (:mod:`patch_dsv4.pipeline.reading` gives them): each is asked once per file."""

    file: Callable[[str], bytes | None]  # a file of the tree as it is now
    sha256: Callable[[str], str | None]  # ... its sha256, hashed where it lies
    backup: Callable[[str], bytes | None]  # the bytes a backup of ours holds (None: missing)
    pip_copy: Callable[[str, ReleaseWheel | None], tuple[str, bytes] | None]  # a backup beside it, else the wheel


@dataclass
class Build:
    """What the build identity is decided from, read with the snapshot: the files the anchors record lists (with
    their sha256 as read), the Python files of the model packages, and vLLM's dist-info."""

    record: dict | None = None  # the anchors record of this vLLM version
    unrecorded: str = ""  # why the build is unknown where no record is (decided without hashes)
    hashes: dict[str, str | None] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)
    served: str | None = None  # the build in a fingerprint: the digest of vLLM's METADATA and WHEEL (serving's)


@dataclass
class Snapshot:
    """One command's reading of the environment: the state view, and every byte it read besides.

    Each file is read once, when judging first asks for it (:meth:`bytes_of`, :meth:`backup`, :meth:`pip_copy`):
    every judgement of one command, its plan and its report see the same bytes. Planning and reporting take
    only what is held (:meth:`held`, :meth:`held_backup`, :meth:`held_sha256`).
    """

    env: Environment
    store: StateStore
    patches: list[Patch]
    view: StateView
    readers: Readers
    build: Build = field(default_factory=Build)
    recorded_holds: bool = False  # the judgement the manifest records still vouches for the tree (verify's)
    wheel: ReleaseWheel | None = None  # takeover: pip's bytes from the release's wheel where no backup holds them
    # the patches' files another tool bind-mounted over site-packages (patch_dsv4.tree.mounts), and why: planning
    # refuses to write them (exit 1); and those that cannot be replaced otherwise (a read-only file system, an immutable
    # file), and why: named up front, refused by the transaction's write probe as before (an environment error)
    mounted: dict[str, str] = field(default_factory=dict)
    unreplaceable: dict[str, str] = field(default_factory=dict)
    hooks: tuple = ()  # start-up hooks on the target's import path that name vLLM (patch_dsv4.tree.hooks.Hook)
    lost: LostState | None = None  # a state without a manifest to go by, which apply and revert rebuild
    _bytes: dict[str, bytes | None] = field(default_factory=dict, repr=False)
    _hashes: dict[str, str | None] = field(default_factory=dict, repr=False)
    _backups: dict[str, bytes | None] = field(default_factory=dict, repr=False)
    _pip_copies: dict[tuple[str, bool], tuple[str, bytes] | None] = field(default_factory=dict, repr=False)

    @property
    def kind(self) -> str:
        return self.view.kind

    @property
    def opt_in_kept(self) -> set[str]:
        """The opt-in patches an earlier apply took (kept by later applies)."""
        manifest = self.view.manifest
        return set(manifest.opt_in) if self.kind in ("current", "interrupted") and manifest else set()

    def context(self, overlay: dict[str, bytes] | None = None) -> Context:
        """The tree as it is (files we wrote count as installed), with ``overlay`` in place of some files."""
        recorded = self.build.record.get("probes") if self.build.record else None
        return context_for(self.env, self.view, overlay, read=self.bytes_of, recorded=recorded)

    def reverted_context(self, restore: dict[str, bytes]) -> Context:
        """The tree as revert leaves it: ``restore`` in place, judged as a tree without a state is."""
        return context_for(self.env, NO_STATE, restore, trust_overlay=False, read=self.bytes_of)

    def bytes_of(self, relpath: str) -> bytes | None:
        """A file of the tree as it is now (read once; one that cannot be read is asked for again, and its sha256
        taken as it lies, as the fingerprint names it)."""
        if relpath not in self._bytes:
            try:
                self._bytes[relpath] = self.readers.file(relpath)
            except Exception:
                self.sha256(relpath)
                raise
        return self._bytes[relpath]

    def held(self, relpath: str) -> bytes | None:
        """A file of the tree as it was read (KeyError: never read)."""
        return self._bytes[relpath]

    def sha256(self, relpath: str) -> str | None:
        """The sha256 of a file of the tree as it is now (of the bytes read, once read)."""
        if relpath in self._bytes:
            data = self._bytes[relpath]
            return None if data is None else sha256_bytes(data)
        if relpath not in self._hashes:
            self._hashes[relpath] = self.readers.sha256(relpath)
        return self._hashes[relpath]

    def held_sha256(self, relpath: str) -> str | None:
        """The sha256 of a file of the tree as it was read or hashed (KeyError: neither)."""
        if relpath in self._bytes:
            data = self._bytes[relpath]
            return None if data is None else sha256_bytes(data)
        return self._hashes[relpath]

    def differs_from_record(self, relpath: str) -> bool:
        data = self.bytes_of(relpath)
        return data is not None and self.env.recorded_hash(relpath) not in (None, record_digest(data))

    def backup(self, relpath: str) -> bytes | None:
        """The release's bytes of a file we wrote, from its backup (read once); None when the backup is missing or
        does not match the manifest's hash."""
        if relpath not in self._backups:
            data = self.readers.backup(relpath)
            if data is not None and sha256_bytes(data) != self.view.manifest.files[relpath].before:
                data = None
            self._backups[relpath] = data
        return self._backups[relpath]

    def held_backup(self, relpath: str) -> bytes | None:
        return self._backups[relpath]

    def pip_copy(self, relpath: str, wheel: bool = True) -> tuple[str, bytes] | None:
        """(where from, bytes) of exactly what pip installed at ``relpath``: the sibling backup (another tool's)
        that holds them, else (``wheel``, when the command reads it) the release's wheel; None when neither does."""
        key = (relpath, wheel and self.wheel is not None)
        if key not in self._pip_copies:
            self._pip_copies[key] = self.readers.pip_copy(relpath, self.wheel if key[1] else None)
        return self._pip_copies[key]

    def held_pip_copy(self, relpath: str, wheel: bool = True) -> tuple[str, bytes] | None:
        return self._pip_copies[(relpath, wheel and self.wheel is not None)]

    def build_identity(self, installed: dict[str, str] | None = None) -> dict:
        """Whether this vLLM build is a release recorded in anchors/, from the hashes read.

        ``installed`` maps files to the sha256 pip installed them with, where the file on disk is ours (default:
        the files we wrote, as the state says); every other file counts as it was read.
        """
        from patch_dsv4.releases.anchors_store import known_release

        if self.build.record is None:
            return {"known": False, "detail": self.build.unrecorded}
        installed = as_pip_installed(self.view) if installed is None else installed

        def as_installed(relpath: str) -> str | None:
            return installed.get(relpath) or self.build.hashes[relpath]

        match = known_release(self.env.vllm_version, as_installed, files=self.build.files, record=self.build.record)
        return {"known": match.known, "detail": match.detail}


def to_restore(view: StateView) -> list[str]:
    """The files revert restores: those we wrote, as we wrote them or changed since (one reinstalled since holds
    the release's own bytes already)."""
    if view.kind in ("none", "stale"):
        return []
    return [rel for rel in view.manifest.files if rel in view.ours or rel in view.modified]


def as_pip_installed(view: StateView) -> dict[str, str]:
    """The sha256 pip installed each file we wrote (and that is as we wrote it) with."""
    if view.kind != "current" or view.manifest is None:
        return {}
    return {rel: entry.before for rel, entry in view.manifest.files.items() if rel in view.ours}


# -- judging: the judgement -------------------------------------------------------------------
@dataclass
class Judgement:
    """Every edit's outcome, the files as read, and the files as the pending edits would write them."""

    outcomes: dict[str, list[tuple[Edit, Outcome]]]  # patch id -> its edits, in order
    originals: dict[str, bytes | None]  # every edited file as read
    planned: dict[str, bytes] = field(default_factory=dict)  # only files that change, encoded as stored
    reads: dict[str, set[str]] = field(default_factory=dict)  # patch id -> every file its judgement read
    unrecorded: dict[str, str] = field(default_factory=dict)  # file read -> why it is not what pip installed

    def patch_files(self, patch_id: str) -> tuple[str, ...]:
        """The files of a patch's edits, leaving out those it has no code path in (where another edit has one)."""
        pairs = self.outcomes[patch_id]
        here = [edit.file for edit, outcome in pairs if outcome.verdict is not Verdict.NOT_APPLICABLE]
        return tuple(dict.fromkeys(here or [edit.file for edit, _ in pairs]))

    def foreign_files(self) -> dict[str, tuple[str, ...]]:
        """Every file holding a recognised foreign edit (of any patch, opt-ins too), with the scripts seen there."""
        found: dict[str, dict[str, None]] = {}
        for pairs in self.outcomes.values():
            for edit, outcome in pairs:
                if outcome.verdict is Verdict.FOREIGN:
                    found.setdefault(edit.file, {})[outcome.foreign or "another tool"] = None
        return {rel: tuple(scripts) for rel, scripts in sorted(found.items())}

    def foreign_patches(self) -> set[str]:
        return {pid for pid, pairs in self.outcomes.items() if any(o.verdict is Verdict.FOREIGN for _, o in pairs)}

    def kept_edits(self) -> list[str]:
        """The other tools' edits patch-dsv4 has no equivalent for, found where the patches read: takeover leaves
        them in place ("<file>: <script> (<tool>)")."""
        return sorted({who for pairs in self.outcomes.values() for _, outcome in pairs for who in outcome.kept})


@dataclass(frozen=True)
class Restore:
    """One foreign-edited file and the sibling backup whose bytes are pip's."""

    relpath: str
    backup: str | None  # where pip's bytes come from: the backup's file name beside it, or the release wheel
    data: bytes | None  # pip's bytes; None when neither a backup nor the wheel holds them
    scripts: tuple[str, ...]  # the tools whose edits were recognised in it


@dataclass
class Judged:
    """A state judged once: the tree the command acts on, and what acting needs to know of it."""

    now: Judgement  # the tree as it is (takeover: with pip's bytes where another tool's edit stood)
    ctx: Context  # what ``now`` read
    reports: tuple[PatchReport, ...]  # per patch, from ``now``; edits we wrote, since changed, are modified
    base: Judgement | None = None  # files we wrote whose edits the patches now write differently, from backups
    base_ctx: Context | None = None
    found: Judgement | None = None  # takeover: the tree as it is, before any restore
    restores: list[Restore] = field(default_factory=list)  # takeover: the files to restore, and their bytes
    way_out: str = ""  # where another tool's edit stands: the command that moves the tree to ours
    refusal: Refused | None = None  # set: the tree cannot be judged (a backup it needs is gone); nothing else is


def as_opt_in(reports: tuple[PatchReport, ...], patches: list[Patch], asked: set[str]) -> tuple[PatchReport, ...]:
    """An opt-in patch nobody asked for is reported as opt-in, whatever its scopes hold: verify and the guard
    ignore it. Another tool's edit there is named, with the command that takes it over."""
    opt = {p.id for p in patches if p.opt_in} - asked
    out = []
    for r in reports:
        if r.id in opt and r.verdict is Verdict.FOREIGN:
            r = replace(
                r,
                verdict=Verdict.OPT_IN,
                detail=f"opt-in: {r.foreign}'s edit stands there; takeover --with {r.id} replaces it ({r.detail})",
            )
        elif r.id in opt and r.verdict in (Verdict.PENDING, Verdict.DRIFTED):
            r = replace(r, verdict=Verdict.OPT_IN, detail=f"opt-in: apply --with {r.id} to use it ({r.detail})")
        out.append(r)
    return tuple(out)


def user_name(uid: int) -> str:
    """A user's name, or ``uid N`` where the system has none for it."""
    import pwd

    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def state_notes(view: StateView) -> list[str]:
    if view.kind == "stale":
        return [f"state written for vLLM {view.manifest.vllm_version} is stale: its backups will never be restored"]
    if view.kind == "interrupted":
        return ["an earlier apply or revert was interrupted; the next apply or revert finishes it"]
    if view.leftover.endswith(" (completed)"):
        return [
            f"an apply completed and was interrupted while it removed its staged copies: "
            f"{view.leftover.removesuffix(' (completed)')} holds them, which the next apply or revert removes "
            "(nothing else to do: the files are as this report says)"
        ]
    if view.leftover:
        return [
            f"an apply was interrupted before it changed a file: {view.leftover} holds what it prepared, which the "
            "next apply or revert removes (nothing else to do: the files are as this report says)"
        ]
    return []


def unreplaceable_notes(state: Snapshot) -> list[str]:
    """Each file another tool owns (or that cannot be replaced where it is), named up front with the reason."""
    return [f"{rel}: {why}" for rel, why in sorted({**state.unreplaceable, **state.mounted}.items())]


def unrecorded_notes(judgement: Judgement, view: StateView, restored: dict[str, bytes] | None = None) -> list[str]:
    """A file that is not what pip installed, said once: it changes no verdict, but guards the writes."""
    return [
        f"{why}: each patch is judged from its own code there; apply writes it only with --force"
        for rel, why in judgement.unrecorded.items()
        if rel not in view.ours and rel not in (restored or {})
    ]


# -- planning: the plan -----------------------------------------------------------------------
@dataclass(frozen=True)
class Options:
    """What the user asked of apply (or takeover)."""

    only: frozenset[str] = frozenset()
    with_: frozenset[str] = frozenset()
    force: bool = False
    takeover: bool = False
    dry_run: bool = False

    @property
    def command(self) -> str:
        return "takeover" if self.takeover else "apply"


@dataclass
class Plan:
    """One apply or revert, decided: what it writes and records, and the report it will make."""

    command: str  # "apply" | "takeover" | "revert"
    state: Snapshot  # what it was planned from
    reports: tuple[PatchReport, ...]  # the verdicts as judged (what a dry run shows, and a refusal)
    notes: list[str]
    refusal: Refused | None = None  # set: nothing is written, the command fails with it
    reported: bool = True  # the refusal carries the report of what was judged (not where nothing could be)
    old: dict[str, bytes | None] = field(default_factory=dict)  # each file to write, as it is now
    new: dict[str, bytes] = field(default_factory=dict)  # ... and as it will be
    owners: dict[str, list[str]] = field(default_factory=dict)  # each file to write -> the patches editing it
    originals: dict[str, bytes] = field(default_factory=dict)  # backups that are not the file as it is (takeover)
    restores: list[Restore] = field(default_factory=list)  # takeover: the other tools' files restored
    save: list[str] = field(default_factory=list)  # files saved under saved-edits/ before anything is written
    previous: Manifest | None = None  # the manifest on disk that the write replaces (restored if it fails)
    manifest: Manifest | None = None  # the manifest to record (None: the state is not written)
    to_judge: dict[str, bytes] | None = None  # the bytes whose judgement ``manifest`` records, when it records one
    remove_state: bool = False  # the state is removed first (stale, or revert)
    after: tuple[PatchReport, ...] = ()  # the verdicts as they will stand on disk
    installed_after: dict[str, str] = field(default_factory=dict)  # files ours after the write -> pip's sha256
    summary: str = ""

    @property
    def writes(self) -> bool:
        return bool(self.new)


@dataclass
class Planned:
    """The judgement of the tree as a plan leaves it: its verdicts, the sha256 of every file it read, and the digest
    of the patch definitions and the engine that made it."""

    reports: tuple[PatchReport, ...]
    inputs: dict[str, str | None]
    patch_digest: str


# -- committing: what it did ------------------------------------------------------------------
@dataclass
class Committed:
    """What committing a plan did beyond the plan itself: where edits were saved, and notes."""

    saved_edits: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
