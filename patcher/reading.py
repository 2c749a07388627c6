"""Reading the state: the manifest, what it says of the files on disk now, and the views of the tree a judgement
reads (as it is, or with some files replaced by bytes we hold). Nothing here writes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from patch_dsv4.environment import Environment, record_digest
from patch_dsv4.errors import Refused
from patch_dsv4.fs import sha256_bytes
from patch_dsv4.patch import Context, Patch
from patch_dsv4.registry import declared_files
from patch_dsv4.state import Manifest, StateStore

if TYPE_CHECKING:
    from patch_dsv4.release_wheel import ReleaseWheel


@dataclass
class StateView:
    manifest: Manifest | None
    kind: str  # "none" | "current" | "stale" | "interrupted"
    modified: dict[str, str]  # relpath -> why
    ours: set[str]  # files that are as we wrote them


NO_STATE = StateView(None, "none", {}, set())


def state_store(env: Environment, patches: list[Patch]) -> StateStore:
    return StateStore(env.site_packages, declared_files(patches), [p.id for p in patches])


def read_view(env: Environment, store: StateStore) -> StateView:
    """The manifest and what it says about the files on disk now."""
    manifest = store.load()
    if manifest is None:
        return StateView(None, "none", {}, set())
    if manifest.vllm_version != env.vllm_version:
        return StateView(manifest, "stale", {}, set())
    modified, ours, reinstalled = {}, set(), 0
    for relpath, entry in manifest.files.items():
        now = env.sha256(relpath)
        if now == entry.after:
            ours.add(relpath)
        elif now == entry.before:
            reinstalled += 1
        else:
            modified[relpath] = "changed since patch-dsv4 wrote it"
    if manifest.transaction is not None:
        kind = "interrupted"
    elif manifest.files and reinstalled == len(manifest.files):
        kind = "stale"
    else:
        kind = "current"
    return StateView(manifest, kind, modified, ours)


def context_for(
    env: Environment,
    view: StateView = NO_STATE,
    overlay: dict[str, bytes] | None = None,
    trust_overlay: bool = True,
    read: Callable[[str], bytes | None] | None = None,
) -> Context:
    """A Context over the environment's files; ``overlay`` replaces some of them (planned or backed-up bytes).

    A file is taken as installed when pip's RECORD has its hash, or when the
    state says we wrote it (or accepted it with ``--force``), or (``trust_overlay``)
    when it is one of the overlay's. ``read`` reads a file of the tree (default: from disk, each time).
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
    )


@dataclass
class State:
    """One command's reading of the environment: the state view, and the bytes it holds besides the tree.

    Each file is read once, when first asked for: every judgement of one
    command, and its plan, see the same bytes. Nothing is written.
    """

    env: Environment
    store: StateStore
    patches: list[Patch]
    view: StateView
    _bytes: dict[str, bytes | None] = field(default_factory=dict, repr=False)
    _pip_copies: dict[tuple[str, bool], tuple[str, bytes] | None] = field(default_factory=dict, repr=False)
    wheel: ReleaseWheel | None = None  # takeover: pip's bytes from the release's wheel where no backup holds them

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
        return context_for(self.env, self.view, overlay, read=self.bytes_of)

    def reverted_context(self, restore: dict[str, bytes]) -> Context:
        """The tree as revert leaves it: ``restore`` in place, judged as a tree without a state is."""
        return context_for(self.env, NO_STATE, restore, trust_overlay=False, read=self.bytes_of)

    def bytes_of(self, relpath: str) -> bytes | None:
        """A file of the tree as it is now (read once)."""
        if relpath not in self._bytes:
            self._bytes[relpath] = self.env.read_bytes(relpath)
        return self._bytes[relpath]

    def sha256(self, relpath: str) -> str | None:
        """The sha256 of a file of the tree as it is now (of the bytes read, once read)."""
        if relpath in self._bytes:
            data = self._bytes[relpath]
            return None if data is None else sha256_bytes(data)
        return self.env.sha256(relpath)

    def differs_from_record(self, relpath: str) -> bool:
        data = self.bytes_of(relpath)
        return data is not None and self.env.recorded_hash(relpath) not in (None, record_digest(data))

    def backup(self, relpath: str) -> bytes | None:
        """The release's bytes of a file we wrote, from its backup; None when the backup is missing or does not
        match the manifest's hash."""
        data = self.store.read_copy("backups", relpath)
        if data is None or sha256_bytes(data) != self.view.manifest.files[relpath].before:
            return None
        return data

    def release_bytes(self, relpaths: list[str]) -> dict[str, bytes]:
        """The release's bytes of files we wrote, from their backups; refused when one is missing or damaged."""
        found = {}
        for relpath in relpaths:
            data = self.backup(relpath)
            if data is None:
                raise Refused(f"the backup of {relpath} is missing or damaged", "", self.env.reinstall_then())
            found[relpath] = data
        return found

    def pip_copy(self, relpath: str, wheel: bool = True) -> tuple[str, bytes] | None:
        """(where from, bytes) of exactly what pip installed at ``relpath``: the sibling backup (another tool's)
        that holds them, else (``wheel``, when the command reads it) the release's wheel; None when neither does."""
        from patch_dsv4.takeover import record_backup

        key = (relpath, wheel and self.wheel is not None)
        if key not in self._pip_copies:
            found = record_backup(self.env, relpath)
            if found is None and key[1]:
                found = self.wheel.pip_copy(relpath)
            self._pip_copies[key] = found
        return self._pip_copies[key]

    def recorded_judgement_holds(self) -> bool:
        """Whether the judgement recorded at the last write still vouches for this tree (verify's fast path)."""
        from patch_dsv4 import quick

        return quick.recorded_verdicts(quick.site_of(self.env)) is not None

    def build_identity(self, installed: dict[str, str] | None = None) -> dict:
        """Whether this vLLM build is a release recorded in anchors/.

        ``installed`` maps files to the sha256 pip installed them with, where the file on disk is ours (default:
        the files we wrote, as the state says); every other file counts as it is on disk.
        """
        from patch_dsv4.anchors_store import known_release, listed_package_files

        installed = as_pip_installed(self.view) if installed is None else installed

        def as_installed(relpath: str) -> str | None:
            return installed.get(relpath) or self.env.sha256(relpath)

        match = known_release(self.env.vllm_version, as_installed, files=listed_package_files(self.env.site_packages))
        return {"known": match.known, "detail": match.detail}


def as_pip_installed(view: StateView) -> dict[str, str]:
    """The sha256 pip installed each file we wrote (and that is as we wrote it) with."""
    if view.kind != "current" or view.manifest is None:
        return {}
    return {rel: entry.before for rel, entry in view.manifest.files.items() if rel in view.ours}


def read_state(env: Environment, store: StateStore, patches: list[Patch]) -> State:
    return State(env, store, patches, read_view(env, store))
