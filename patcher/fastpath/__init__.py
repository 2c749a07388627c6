"""What the fast paths import: verify's, before Typer loads, and the serve guard's, in every vLLM process.

    quick    are the recorded verdicts still true here? Hashes only, no judging (the state, RECORD, anchors/)
    serving  what a tree will serve, as one string: the fingerprint the nodes of a cluster compare

Nothing heavy at module level: no libcst, Typer, rich, importlib.metadata or packaging, nor typing (bench/bench_guard.py
times the guard's first call in a cold interpreter, imports included); json and hashlib, which a vLLM process has
imported already, where a function needs them. Every file is read through patch_dsv4.tree.installed. This
``__init__`` imports nothing: both fast paths import it.

May import: patch_dsv4.tree (at module level, patch_dsv4.tree.installed and patch_dsv4.tree.manifest_rules alone),
patch_dsv4.output.
"""
