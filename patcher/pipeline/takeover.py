"""Taking over from another tool's edits, a step of its own: the files to restore, and the bytes that restore them.

    read -> judge as found -> plan the restores (here) -> judge the restored bytes -> plan

The recipes' patch scripts leave a backup beside each file they edit; a backup is chosen by its hash against pip's
RECORD, never by its name (:func:`patch_dsv4.pipeline.reading.record_backup`). Where no backup holds them (kits that
keep none), ``takeover`` reads them from the release's own wheel (:mod:`patch_dsv4.releases.release_wheel`). Both are
read through the :class:`~patch_dsv4.pipeline.values.Snapshot`. Nothing here writes: planning turns the restores into
files to write, the transaction commits.
"""

from __future__ import annotations

from collections.abc import Iterable

from patch_dsv4.output.verdicts import Verdict
from patch_dsv4.pipeline.values import Judgement, Restore, Snapshot


def plan_restores(state: Snapshot, found: Judgement, with_ids: Iterable[str] = ()) -> list[Restore]:
    """For each foreign-edited file of the tree as ``found``, the bytes that restore pip's (or None where there are
    none).

    Other files the patches would write but must refuse (they are not pip's bytes), where another tool's backup
    beside them holds pip's, are restored too (its edit is saved, as the recognised ones are); else left alone
    (never from the wheel: an edit nobody recognised is not taken over on a guess).
    """
    patches, view = state.patches, state.view
    wanted = state.opt_in_kept | set(with_ids) | found.foreign_patches()
    refused = {
        edit.file
        for p in patches
        if not p.opt_in or p.id in wanted
        for edit, outcome in found.outcomes[p.id]
        if outcome.verdict is Verdict.PENDING and edit.file not in view.ours
    }
    also = [rel for rel in sorted(refused) if state.differs_from_record(rel)]
    restores = []
    foreign = found.foreign_files()
    for relpath, scripts in foreign.items():
        copy = state.pip_copy(relpath)
        restores.append(Restore(relpath, copy[0] if copy else None, copy[1] if copy else None, scripts))
    for relpath in sorted(set(also) - set(foreign)):
        copy = state.pip_copy(relpath, wheel=False)
        if copy is not None:
            restores.append(Restore(relpath, copy[0], copy[1], ("an edit patch-dsv4 does not recognise",)))
    return restores
