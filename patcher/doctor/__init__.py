"""`patch-dsv4 doctor`: will this environment serve this pack? Read-only checks, in seconds.

Every check is one function registered with :func:`base.check`; it reads files,
``os.environ``, ``/proc`` or distribution metadata only (never imports torch,
vLLM, exllamav3 or the plugin, never loads a weight, never writes to the pack)
and returns :class:`base.Row` s. :func:`base.run_checks` runs them all.

The checks, one module per concern, are listed once, in report order, by ``checks.MODULES``.
What they share: ``pack`` (the pack read once), ``safetensors`` (the header reader),
``serving_env`` (where the serving interpreter finds things), ``base`` (rows, context).
``fix_config`` writes the config edits the pack rows ask for; ``run`` runs doctor.

Layout: ``run`` (the command) and ``fix_config`` (``--fix-config``'s writer) here; the checks in ``checks/``;
what they read, and the rows and context they share, in ``readers/``.

May import: patch_dsv4.doctor, patch_dsv4.pipeline, patch_dsv4.fastpath, patch_dsv4.patching, patch_dsv4.tree,
patch_dsv4.output.
"""
