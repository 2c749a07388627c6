"""The serve guard: a vLLM plugin that checks the patches inside every vLLM process.

vLLM calls the functions of its ``vllm.general_plugins`` entry points in the
API/CLI process, in the engine core, in every worker before the model loads,
and in the model-inspection subprocess (once per process). :func:`check` is
ours (entry point ``patch_dsv4``). It judges the vLLM it runs in:

- every patch this release and FlashInfer need is ``applied``, ``upstream`` or
  ``not-applicable``: one debug line, nothing else;
- otherwise it names each patch, its verdict and its files, and the command that
  fixes it, and then, by ``PATCH_DSV4_GUARD``:
  ``warn`` (the default) logs that at ERROR once per process and lets vLLM start;
  ``strict`` raises, so that vLLM does not start; ``off`` does nothing.

With ``PATCH_DSV4_EXPECT`` set to a fingerprint (``patch-dsv4 status
--fingerprint`` of the image every node runs), it also compares what this
vLLM serves with it (:mod:`patch_dsv4.fastpath.serving`): a difference is reported the
same way, naming what differs, so that no rank of a cluster serves other code
than the others. The fingerprint is logged at DEBUG in every process.

It is cheap (a few ms on an applied tree: it reads and hashes every file the
state names, or, with no state on a known build, the files anchors/ recorded:
bench/bench_guard.py measures it in a vLLM process and in a bare interpreter)
and imports nothing heavy at module level, because an import error in a plugin
is only logged by vLLM and would make the guard vanish. Only an unknown build
pays a full judgement. A state or a dist-info it cannot read (malformed,
oversized, not a regular file) is said in one line, naming the file, read no
further than its format needs (patch_dsv4.tree.installed): never a pass, and
never a full judgement of it. A bug in the guard never stops vLLM in ``warn``
mode.
"""

import os
import sys

ENV = "PATCH_DSV4_GUARD"
EXPECT = "PATCH_DSV4_EXPECT"  # patch_dsv4.fastpath.serving.ENV_EXPECT (not imported here: the guard's imports are few)
MODES = ("warn", "strict", "off")
LOGGER = "vllm.patch_dsv4"  # under vLLM's logger: its handler and format
_reported = False


def _logger():
    """The guard's logger, imported when the guard has something to say (vLLM has imported logging by then)."""
    import logging

    return logging.getLogger(LOGGER)


def _debugging() -> bool:
    """Whether the guard's logger shows DEBUG lines; False where logging is not imported (no handler to show them)."""
    return "logging" in sys.modules and _logger().isEnabledFor(10)  # logging.DEBUG


class PatchesNotInPlace(RuntimeError):
    """Raised in strict mode: vLLM would serve without a patch this environment needs."""


def check() -> None:
    """The plugin function vLLM calls (entry point ``vllm.general_plugins: patch_dsv4``)."""
    global _reported
    mode = os.environ.get(ENV, "warn").strip().lower() or "warn"
    if mode == "off":
        return
    if mode not in MODES:
        _logger().warning("patch-dsv4: %s=%r is not one of warn, strict, off; warning only", ENV, mode)
        mode = "warn"
    from patch_dsv4.tree.installed import Unreadable

    try:
        writer = _writer()
        problems, fingerprint_of = ([], None) if writer else _judge()
        # the fingerprint only where it is compared or logged: nothing more to pay otherwise
        wanted = os.environ.get(EXPECT, "").strip() or _debugging()
        served = fingerprint_of() if wanted and fingerprint_of is not None else None
        differs = _differences(served)
    except Unreadable as exc:  # a malformed state or dist-info: named, never judged around
        if exc.path == "manifest.json":  # patch_dsv4.tree.installed.MANIFEST: apply rebuilds it from proof
            repair = f"run patch-dsv4 apply --python {sys.executable}, which rebuilds it from proof or says why not"
        elif ".dist-info/" in exc.path:  # pip's record of a project: pip writes it again, then apply our edits
            project, _, version = exc.path.split(".dist-info/")[0].rpartition("-")
            repair = (
                f"reinstall {project} ({sys.executable} -m pip install --force-reinstall --no-deps "
                f"{project}=={version}), then run patch-dsv4 apply --python {sys.executable}"
            )
        else:
            repair = f"run patch-dsv4 status --python {sys.executable}"
        message = f"patch-dsv4 cannot check this vLLM: {exc}; {repair} (or set {ENV}=off)"
        if mode == "strict":
            raise PatchesNotInPlace(message) from None
        if not _reported:
            _reported = True
            _logger().warning("%s", message)
        return
    except Exception as exc:  # a bug or a broken environment: never a reason to stop vLLM in warn mode
        if mode == "strict":
            raise PatchesNotInPlace(f"patch-dsv4 could not check this vLLM ({type(exc).__name__}: {exc})") from exc
        if not _reported:
            _reported = True
            _logger().warning("patch-dsv4: could not check this vLLM's patches (%s: %s)", type(exc).__name__, exc)
        return
    if writer:
        message = (
            f"patch-dsv4: an apply or revert is writing this vLLM's files now ({writer}): its patches cannot be "
            f"checked until it ends; start vLLM after it (or set {ENV}=off)"
        )
    elif not problems and not differs:
        # Said only where logging is in use (in vLLM it always is): elsewhere no handler would show a debug line,
        # and importing logging for it would double the cost of the guard's first call in a bare interpreter.
        if _debugging():
            _logger().debug("patch-dsv4: every patch this vLLM needs is in place; it serves %s", served)
        return
    else:
        if _debugging():
            _logger().debug("patch-dsv4: this vLLM serves %s", served)
        message = "; ".join(
            ([describe(problems)] if problems else [])
            + [f"apply cannot write {rel}: {why}" for rel, why in _owned_elsewhere(problems).items()]
            + ([f"patch-dsv4: this vLLM is not the tree {EXPECT} names: {'; '.join(differs)}"] if differs else [])
        )
        if differs:
            message += f" (it serves {served}; every node must run one image: see README, Clusters)"
    if mode == "strict":
        raise PatchesNotInPlace(message)
    if not _reported:
        _reported = True
        _logger().error("%s", message)


def describe(problems: list[tuple[str, str, list[str]]]) -> str:
    items = "; ".join(f"{pid} is {verdict} ({', '.join(files) or 'no file'})" for pid, verdict, files in problems)
    return (
        f"patch-dsv4: this vLLM lacks patches it needs for DeepSeek-V4 packs: {items}. "
        f"Run: patch-dsv4 apply --python {sys.executable} "
        f"(or set {ENV}=off to silence this, {ENV}=strict to refuse to start)"
    )


def _owned_elsewhere(problems: list[tuple[str, str, list[str]]]) -> dict[str, str]:
    """Of the files of patches not in place, those bind-mounted over site-packages by another tool, and why
    (read only when there is something to report: the mount table is not read on a tree in order)."""
    site_dir = _vllm_site()
    if not problems or not site_dir:
        return {}
    from patch_dsv4.tree import mounts

    files = [f for _, _, names in problems for f in names]
    return mounts.mounted(site_dir, dict.fromkeys(files))


def _writer() -> str | None:
    """Who holds the lock of the environment this vLLM is in (a write under way), or None. Never waits."""
    from patch_dsv4.fastpath import quick

    site_dir = _vllm_site()
    return quick.write_in_progress(site_dir) if site_dir else None


def _vllm_site() -> str | None:
    """The directory holding the vLLM this process imported (the guard judges that one)."""
    module = sys.modules.get("vllm")
    path = getattr(module, "__file__", None)
    if not path:
        return None
    return os.path.dirname(os.path.dirname(os.path.abspath(path)))


NEEDS_ACTION = ("pending", "drifted", "modified", "foreign")


def judge_this_vllm() -> list[tuple[str, str, list[str]]]:
    """(patch id, verdict, files) for every patch that is not in place; empty when all are."""
    return _judge()[0]


def _differences(served) -> list[str]:
    """What differs between the tree this vLLM serves and the one PATCH_DSV4_EXPECT names ([]: unset, or equal)."""
    expected = os.environ.get(EXPECT, "").strip()
    if not expected or served is None:
        return []
    from patch_dsv4.fastpath.serving import BadFingerprint

    try:
        return served.differences(expected)
    except BadFingerprint as exc:
        return [f"{EXPECT} cannot be compared: {exc}"]


def _judge():
    """:func:`judge_this_vllm`, and a function that gives the fingerprint of what this vLLM serves
    (patch_dsv4.fastpath.serving)."""
    from patch_dsv4.fastpath import quick

    site_dir = _vllm_site()
    search = [site_dir] if site_dir else [p for p in sys.path if p]
    site = quick.locate([*search, *(p for p in sys.path if p and p != site_dir)])
    if site is not None and (site_dir is None or os.path.realpath(site.site_packages) == os.path.realpath(site_dir)):
        known = quick.known_judgement(site)
        if known is not None:

            def served():
                from patch_dsv4.fastpath.serving import of_recorded

                return of_recorded(site, known)

            return _failing(known.verdicts.items()), served
    return _full_judgement(site_dir)


def _failing(items) -> list[tuple[str, str, list[str]]]:
    return [(pid, v["verdict"], list(v["files"])) for pid, v in sorted(items) if v["verdict"] in NEEDS_ACTION]


def _full_judgement(site_dir: str | None):
    """An unknown build, or a state the hashes do not vouch for: judge the tree as status does."""
    from pathlib import Path

    from patch_dsv4.pipeline import commands
    from patch_dsv4.tree.environment import locate_vllm

    env = locate_vllm(site_packages=Path(site_dir)) if site_dir else locate_vllm()
    report = commands.status(env, lock_timeout=0)  # never wait: a write that starts now is reported
    problems = [(p.id, p.shown_verdict, list(p.files)) for p in report.patches if p.verdict.needs_action]
    return problems, lambda: report.fingerprint
