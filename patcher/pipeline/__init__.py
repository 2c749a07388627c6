"""The commands and their pipeline: each command one pipeline of steps over values, written out top to bottom.

``commands`` holds status, verify, apply (and takeover) and revert, ``drift`` the judgement of a release before
it is installed (and ``anchors record``): they alone call the steps. The values the steps pass on (Snapshot,
Judgement and Judged, Plan, Committed) are defined once, in ``values``; each step imports them and no other step:

    reading      the Snapshot: the one step that reads the disk
    judge        every edit's verdict on a tree: the one step that judges
    takeover     the files to restore from another tool's edits, and the bytes that restore them
    planning     what apply or revert will write and record, as one Plan
    transaction  a plan committed as one write transaction: all files or none
    reporting    the Report, made from the snapshot or the plan, reading nothing

May import: patch_dsv4.releases, patch_dsv4.fastpath, patch_dsv4.patching, patch_dsv4.tree, patch_dsv4.output.
"""
