"""rt.hooks: start-up hooks of the serving interpreter that name vLLM.

A kit may change vLLM when the interpreter starts rather than in its files:
sfxnz's V4.1 kit ships a ``sitecustomize.py`` (42 versions of it) whose hook
calls ``text_only_max_image_tokens(..., True)`` unconditionally, so vision can
never load (Snail3D/dsv41-vision-2xspark PATCHES.md @b39e078; MiaAI-Lab's kit
carries an ``adapter/sitecustomize.py``; notes/backbone-hooks.md). Python runs
the first ``sitecustomize`` and ``usercustomize`` on its import path, and each
``.pth`` line that begins with ``import`` in a site directory. No RECORD check
and no fingerprint sees what such a hook changes at import: this row names each
one that names vLLM (patch_dsv4.tree.hooks reads them; nothing is run).

WARN per hook, naming the file and the vLLM modules it names; PASS where none.
"""

from __future__ import annotations

import shlex

from patch_dsv4.doctor.readers.base import PASS, WARN, DoctorContext, Row, check


@check("rt.hooks", needs=("runtime",))
def start_up_hooks(ctx: DoctorContext) -> list[Row]:
    """Each sitecustomize, usercustomize or .pth line on the serving interpreter's import path that names vllm."""
    from patch_dsv4.tree.hooks import find_hooks

    runtime = ctx.runtime
    directories = [str(d) for d in runtime.site_dirs]
    site_only = (runtime.target_args or "").startswith(" --site-packages")
    found = find_hooks(directories, directories if site_only else None)
    if not found:
        return [Row("rt.hooks", PASS, "no sitecustomize, usercustomize or .pth line on the import path names vllm.")]
    rows = []
    for hook in found:
        read = "" if hook.whole else " (read to 1 MiB only: it is larger)"
        via = f" through {hook.via}" if hook.via else ""
        rows.append(
            Row(
                "rt.hooks",
                WARN,
                f"{hook.path} ({hook.kind}) runs at interpreter start{via} and names {hook.named()}{read}: "
                "patch-dsv4 verifies files, not what a hook changes at import.",
                f"read it; to serve vLLM as verified, set it aside: mv {shlex.quote(hook.path)} "
                f"{shlex.quote(hook.path + '.disabled')}",
            )
        )
    return rows
