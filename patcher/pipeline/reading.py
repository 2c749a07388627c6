"""Reading: the one step that reads the disk. It gives a command its :class:`~patch_dsv4.pipeline.values.Snapshot`: the
manifest and what it says of the files on disk now, the hashes the build identity is decided from, whether the
recorded judgement still vouches for the tree, and the readers through which each file, backup and copy of pip's
bytes is read once. Nothing here writes, and nothing here judges.
"""

from __future__ import annotations

import stat
from dataclasses import replace
from typing import TYPE_CHECKING

from patch_dsv4.output.errors import EnvironmentProblem
from patch_dsv4.patching.patch import Patch
from patch_dsv4.patching.registry import declared_files
from patch_dsv4.pipeline.values import (  # noqa: F401 - context_for re-exported: the view of a tree a judgement reads
    NO_STATE,
    Build,
    LostState,
    Readers,
    Snapshot,
    StateView,
    context_for,
    to_restore,
    user_name,
)
from patch_dsv4.tree.environment import Environment, record_digest
from patch_dsv4.tree.fs import MAX_SOURCE_BYTES, UnsafePath
from patch_dsv4.tree.state import STATE_DIR, Manifest, StateStore, UnreadableManifest

if TYPE_CHECKING:
    from patch_dsv4.releases.release_wheel import ReleaseWheel


def state_store(env: Environment, patches: list[Patch]) -> StateStore:
    return StateStore(env.site_packages, declared_files(patches), [p.id for p in patches])


def view_of(env: Environment, manifest: Manifest | None) -> StateView:
    """What ``manifest`` says about the files on disk now."""
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


def read_snapshot(
    env: Environment,
    store: StateStore,
    patches: list[Patch],
    manifest: Manifest | None | bool = True,
    vouch: bool = False,
    revert: bool | None = None,
    lost: LostState | None = None,
) -> Snapshot:
    """The snapshot a command judges, plans and reports from.

    ``manifest``: the manifest as recovery left it (True: load it here). ``lost`` (:func:`read_lost`): the state
    has no manifest to go by, and this is what it holds (``manifest`` is None). ``vouch``: also read whether the
    judgement the manifest records still vouches for the tree (apply records it again only where it does not).
    ``revert`` (revert's --discard-local-edits): also read the backups revert restores and the files they replace
    (not where a file changed since we wrote it and its edit is not to be discarded: revert refuses that).
    """
    from patch_dsv4.fastpath import quick
    from patch_dsv4.fastpath.serving import build_identity, dist_info_of
    from patch_dsv4.releases import anchors_store
    from patch_dsv4.tree import hooks, mounts

    view = view_of(env, store.load() if manifest is True else manifest)
    if manifest is True:  # as found, before any recovery: what an interrupted apply left is said
        view = replace(view, leftover=leftover(store, view))
    snapshot = Snapshot(env, store, patches, view, readers_of(env, store), lost=lost)
    build = snapshot.build
    build.record = anchors_store.load(env.vllm_version)
    if build.record is None:
        build.unrecorded = anchors_store.known_release(env.vllm_version, {}).detail
    build.files = quick.listed_package_files(env.site_packages)
    ours = set(view.manifest.files) if view.manifest is not None else set()
    files, table = sorted(declared_files(patches) | ours), mounts.read_mounts()
    snapshot.mounted = mounts.mounted(str(env.site_packages), [STATE_DIR, *files], table)
    unreplaceable = mounts.unreplaceable(str(env.site_packages), files, table)
    snapshot.unreplaceable = {rel: why for rel, why in unreplaceable.items() if rel not in snapshot.mounted}
    snapshot.hooks = tuple(hooks.find_hooks(*env.import_path()))
    build.hashes = {rel: env.sha256(rel) for rel in sorted(build.record["files"])} if build.record else {}
    try:
        snapshot.build.served = build_identity(dist_info_of(env))
    except quick.Unreadable as exc:
        raise EnvironmentProblem(f"cannot read {env.vllm.describe()}", str(exc), env.reinstall()) from None
    if vouch and view.kind == "current" and not view.modified:
        try:
            snapshot.recorded_holds = quick.recorded_verdicts(quick.site_of(env)) is not None
        except quick.Unreadable:
            snapshot.recorded_holds = False
    if revert is not None and view.kind not in ("none", "stale"):
        for relpath in to_restore(view):
            snapshot.backup(relpath)
        if revert or not view.modified:
            for relpath in to_restore(view):
                snapshot.bytes_of(relpath)
    return snapshot


def write_denied(env: Environment) -> tuple[str, str] | None:
    """(who runs this, who owns the site directory) where this user may not write it (its lock and state live
    there: apply, takeover and revert cannot run); None where it may. Asked before the lock is taken."""
    import os

    site = str(env.site_packages)
    effective = os.access in os.supports_effective_ids
    if os.access(site, os.W_OK | os.X_OK, effective_ids=effective):
        return None
    try:
        st = os.stat(site)
        read_only = bool(os.statvfs(site).f_flag & os.ST_RDONLY)
    except OSError:
        return None  # the write itself says what it can
    if read_only or os.geteuid() in (0, st.st_uid):
        return None  # not a matter of who runs it (a read-only mount, a mode its owner set): the write says which
    return user_name(os.geteuid()), user_name(st.st_uid)


def leftover(store: StateStore, view: StateView) -> str:
    """Where an apply interrupted before its journal left what it prepared beside a manifest ("" where nothing is
    left): its staged copies, which the next apply or revert removes (patch_dsv4.pipeline.transaction.recover);
    until then status says so. (A state directory without a manifest is a lost state: :func:`read_lost`.)"""
    import hashlib

    try:
        staged = store.copies("staged") if view.kind == "current" else []
        if not staged:  # an empty staged/: the apply completed, interrupted while it removed the last copies
            return f"{STATE_DIR}/staged/ (completed)" if view.kind == "current" and store.has_staged() else ""
        files = view.manifest.files if view.manifest is not None else {}
        for relpath in staged:  # each copy what the manifest says we wrote: it was saved after them, the apply done
            data = store.read_copy("staged", relpath) if relpath in files else None
            if data is None or hashlib.sha256(data).hexdigest() != files[relpath].after:
                return f"{STATE_DIR}/staged/"
        return f"{STATE_DIR}/staged/ (completed)"
    except Exception:  # an unreadable state is recovery's to refuse, not a note's
        return ""


def read_lost(env: Environment, store: StateStore, absent_too: bool = False) -> LostState | None:
    """The state, where it has no manifest to go by: one whose manifest is missing (an apply interrupted before
    its journal, a manifest removed) or cannot be read; with ``absent_too`` (revert, status), also no state
    directory at all where a file the patches edit is not what pip installed (it may carry our edits). None where
    the manifest can be read, or there is nothing to rebuild.

    Nothing here is trusted: each backup of a file the patches edit is read as a candidate for pip's bytes (a
    regular file no bigger than a source file, never through a link); every other entry under backups/ is only
    named. A state directory that is not one (a link) stays unreadable, as :meth:`StateStore.load` says.
    """
    try:
        if store.load() is not None:
            return None
        unreadable = ""
    except UnreadableManifest as exc:
        unreadable = exc.why
    present = bool(unreadable) or store.holds_more_than_saved_edits()
    if not present and (not absent_too or all(_as_pip_installed(env, rel) for rel in sorted(store.declared))):
        return None
    backups: dict[str, bytes | None] = {}
    others = []
    for relpath, regular in store.backup_entries().items():
        if relpath not in store.declared:
            others.append(relpath)
        elif not regular:
            backups[relpath] = None
        else:
            try:
                backups[relpath] = store.read_copy("backups", relpath)
            except EnvironmentProblem:  # larger than a source file, or gone: not pip's bytes
                backups[relpath] = None
    return LostState(unreadable, present, backups, tuple(others))


def _as_pip_installed(env: Environment, relpath: str) -> bool:
    """Whether a file the patches edit is what pip installed (or absent, as RECORD says): it carries no edit."""
    import base64

    recorded, now = env.recorded_hash(relpath), env.sha256(relpath)
    if now is None:
        return True
    return recorded is not None and base64.urlsafe_b64encode(bytes.fromhex(now)).rstrip(b"=").decode() == recorded


def readers_of(env: Environment, store: StateStore) -> Readers:
    def pip_copy(relpath: str, wheel: ReleaseWheel | None) -> tuple[str, bytes] | None:
        found = record_backup(env, relpath)
        if found is None and wheel is not None:
            found = wheel.pip_copy(relpath)
        return found

    return Readers(env.read_bytes, env.sha256, lambda relpath: store.read_copy("backups", relpath), pip_copy)


def with_wheel(snapshot: Snapshot, fetch: bool = True) -> Snapshot:
    """The snapshot reading pip's bytes from the release's wheel too, where no backup beside a file holds them
    (takeover, a rebuild); the wheel is fetched when first needed (``fetch=False``: only from the cache)."""
    from patch_dsv4.releases.release_wheel import ReleaseWheel

    snapshot.wheel = ReleaseWheel(snapshot.env, fetch=fetch)
    return snapshot


def record_backup(env: Environment, relpath: str) -> tuple[str, bytes] | None:
    """The sibling backup of ``relpath`` that holds exactly what pip installed (by RECORD's hash), if any.

    The recipes' patch scripts leave a backup beside each file they edit (``<file>.orig``, ``.orig-wideswa``,
    ``.orig-lna``...). The first script to touch a file backs up what pip installed; a later script's backup of the
    same file holds the earlier script's edit. So a backup is chosen by its hash against pip's RECORD, never by
    its name: any regular file beside the edited one whose name starts with the file's name and whose sha256 is
    the one RECORD lists. Only regular files inside the package are read, never through a link; the candidates are
    tried in name order; one bigger than any source file is skipped unread.
    """
    recorded = env.recorded_hash(relpath)
    if recorded is None:
        return None
    try:
        directory, name = env.tree.parent_dir(relpath)
    except (OSError, UnsafePath):
        return None
    with directory:
        for candidate in sorted(directory.names()):
            if candidate == name or not candidate.startswith(name + ".") or candidate.endswith(".pyc"):
                continue
            st = directory.lstat(candidate)
            if st is None or not stat.S_ISREG(st.st_mode) or st.st_size > MAX_SOURCE_BYTES:
                continue
            try:
                data = directory.read_bytes(candidate, limit=MAX_SOURCE_BYTES)
            except OSError:
                continue
            if record_digest(data) == recorded:
                return candidate, data
    return None
