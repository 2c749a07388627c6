"""The patch model: what a patch is, how its edits find and rewrite code, and the rules every patch keeps.

    patch        Patch, Edit, Scope, Context: a patch declares its edits; a Context reads one tree's files
    edits        ReplaceStatements, the edit every patch is made of
    registry     the patches, found by walking patch_dsv4.patches, held to the rules
    follow       the one call-following facility: names resolved across vLLM's modules, calls followed from
                 the scope a patch patches to the code that does the work
    evaluate     the evaluator every probe states its defect and its fix with: what the code does to an
                 iterator, its tests under the cases a patch names, the objects it builds (tables in its docstring)
    resolve      static checks that injected code fits the release it is written into
    rewrite      the files as the pending edits write them (one libcst pass), proven idempotent
    fingerprint  structural fingerprints of code that ignore formatting (ast and hashlib only)
    source       Python source files decoded as Python decodes them, and written back in their own form

The patches themselves are patch_dsv4.patches (patches/), one module each.

May import: patch_dsv4.tree, patch_dsv4.output.
"""
