"""`patch-dsv4 doctor`: will this environment serve this pack? Read-only checks, in seconds.

Every check is one function registered with :func:`base.check`; it reads files,
``os.environ``, ``/proc`` or distribution metadata only (never imports torch,
vLLM, exllamav3 or the plugin, never loads a weight, never writes to the pack)
and returns :class:`base.Row` s. :func:`base.run_checks` runs them all.
"""
