"""`patch-dsv4 doctor`: will this environment serve this pack? Read-only checks, in seconds.

Every check is one function registered with :func:`base.check`; it reads files,
``os.environ``, ``/proc`` or distribution metadata only (never imports torch,
vLLM, exllamav3 or the plugin, never loads a weight, never writes to the pack)
and returns :class:`base.Row` s. :func:`base.run_checks` runs them all.

The checks, one module per concern, in report order (``run.CHECK_MODULES``):
    config   config.json and its quantization block
    shards   the shard files, the index, the links
    experts  every routed expert present, shaped as the config says, one K per layer
    bits     the declared K per layer, the codebook markers
    dense    the weights outside the routed experts, the MTP draft, the delegate
    model    the model keys against the serving vLLM and flags
    runtime  the serving interpreter's packages
    environ  environment variables and serve flags
    host     the GPUs, memory, page cache
What they share: ``pack`` (the pack read once), ``safetensors`` (the header reader),
``serving_env`` (where the serving interpreter finds things), ``base`` (rows, context).
``fix_config`` writes the config edits the pack rows ask for; ``run`` runs doctor.

Layout: ``run`` (the command) and ``fix_config`` (``--fix-config``'s writer) here; the checks in ``checks/``;
what they read, and the rows and context they share, in ``readers/``.

May import: patch_dsv4.doctor, patch_dsv4.pipeline, patch_dsv4.fastpath, patch_dsv4.patching, patch_dsv4.tree,
patch_dsv4.output.
"""
