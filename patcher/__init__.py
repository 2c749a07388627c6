"""patch-dsv4: versioned, verifiable source edits to vLLM's DeepSeek-V4 code.

The package's top holds what is called from outside: ``cli`` (the ``patch-dsv4`` console script, and
``python -m patch_dsv4`` through ``__main__``), ``app`` (the Typer command line it loads) and ``guard`` (the
vLLM plugin, entry point ``patch_dsv4.guard:check``). The engine lies in folders, each importing only folders
below it (bench/import_map.py counts the floors):

    doctor/    the doctor command: its checks/, and what they read (readers/)
    pipeline/  the commands (status, verify, apply, takeover, revert, drift) and their steps
    releases/  recorded anchors, a release to judge, release wheels
    fastpath/  what verify's fast path and the guard import: recorded verdicts by hashes, the serving fingerprint
    patching/  the patch model: Patch and its edits, the registry, code fingerprints, rewriting
    tree/      the target environment: the installed vLLM, safe file operations, our state
    output/    verdicts, reports, expected errors, and how they print

patch_dsv4.patches (patches/) holds one module per patch, patch_dsv4.anchors (anchors/) the recorded releases.
"""

# The one place the version is set: the package metadata reads it at build time (README: Releasing).
__version__ = "0.1.0"
