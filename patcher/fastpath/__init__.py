"""What the fast paths import: verify's, before Typer loads, and the serve guard's, in every vLLM process.

    quick    are the recorded verdicts still true here? Hashes only, no judging (the state, RECORD, anchors/)
    serving  what a tree will serve, as one string: the fingerprint the nodes of a cluster compare

Nothing heavy at module level: no libcst, Typer, rich, importlib.metadata or packaging, not even json, re or
typing (bench/bench_guard.py times the guard's first call in a cold interpreter, imports included). This
``__init__`` imports nothing: both fast paths import it.

May import: patch_dsv4.tree (at module level, patch_dsv4.tree.manifest_rules alone), patch_dsv4.output.
"""
