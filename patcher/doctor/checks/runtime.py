"""Runtime checks: the serving interpreter's packages, read as files.

Evidence aliases (R, L, P, V, FI, X, S) are those of DOCTOR-FACTS.md; the
rows follow its table D "Runtime".
"""

from __future__ import annotations

import ast
import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from patch_dsv4.doctor.readers.base import FAIL, INFO, PASS, SKIP, WARN, DoctorContext, Row, Runtime, check
from patch_dsv4.doctor.readers.family import V4
from patch_dsv4.doctor.readers.serving_env import (
    distributions,
    elf_machine,
    find_dist,
    find_package,
    gpus,
    locate_extension,
    normal_machine,
    older_than,
    quantization_config,
    read_utf8,
    release,
    scan_for,
    tensor_parallel_size,
    vision_pack,
    which,
)

PLUGIN_GROUP = "vllm.general_plugins"
# The modules vllm-exl3's entry point may name: the package, or the 0.1.x shim (P CHANGELOG.md:71-77).
PLUGIN_MODULES = ("vllm_exl3", "glm53_exl3_plugin")
GUARD_ENTRY_POINT = "patch_dsv4"
FLASHINFER_DSV4_FLOOR = (0, 6, 18)  # first release with topk 192/256 in the SM120 DSV4 decode table
EXLLAMAV3_FLOOR = (1, 4, 5)

PLUGIN_SOURCE = "git+https://github.com/vcruz305/vllm-exl3@v0.3.0"
PLUGIN_NOTE = " (vllm-exl3 is not on PyPI; the v0.3.1 tag's exl3.py does not import)"
INDEX_OPTIONS = ("--retries", "0", "--timeout", "5")  # doctor asks pip's index briefly, once a run
INDEX_TIMEOUT = 15.0  # seconds for that question at most (offline: the fix names a range instead)


def target_option(runtime: Runtime) -> str:
    """The patch-dsv4 option that names this environment as the user did (else its vLLM's site directory)."""
    if runtime.target_args is not None:
        return runtime.target_args
    root = runtime.vllm_root or (runtime.site_dirs[0] if runtime.site_dirs else None)
    return f" --site-packages {root}" if root else ""


def _target(runtime: Runtime) -> tuple[str | None, str | None]:
    """(the option, its value) that names the serving environment, as target_option gives it."""
    words = shlex.split(target_option(runtime))
    return (words[0], words[1]) if len(words) == 2 else (None, None)


def pip_python(runtime: Runtime) -> str:
    """The interpreter whose pip installs into the serving environment: ``--python EXE``'s, else this one's
    (``--site-packages DIR`` installs with ``pip install --target DIR``)."""
    option, value = _target(runtime)
    return value if option == "--python" and value else sys.executable


def _python_of_target(runtime: Runtime) -> str:
    """A command line's python that imports from the serving environment."""
    option, value = _target(runtime)
    if option == "--site-packages" and value:
        return f"PYTHONPATH={shlex.quote(value)} python3"
    return shlex.quote(pip_python(runtime))


def pip_install(runtime: Runtime, *args: str) -> str:
    """``pip install ARGS`` into the serving environment as the user named it (the form rt.patches and every
    command of the tool name it): ``EXE -m pip install`` for --python, ``pip install --no-deps --upgrade --target
    DIR`` for --site-packages, this interpreter's pip by default; never whichever pip is first on PATH."""
    option, value = _target(runtime)
    if option == "--site-packages" and value:
        head = ["pip", "install", "--no-deps", "--upgrade", "--target", shlex.quote(value)]
        args = tuple(a for a in args if a not in head)
    else:
        head = [shlex.quote(pip_python(runtime)), "-m", "pip", "install"]
    return " ".join([*head, *args])


def pip_remove(runtime: Runtime, dists: list) -> str:
    """The command that removes ``dists`` (serving_env.Dist) from the serving environment: pip uninstall, or for
    a --site-packages directory (which pip will not uninstall from) rm -r of what their RECORD installed."""
    option, value = _target(runtime)
    if option != "--site-packages":
        names = " ".join(dist.name for dist in dists)
        return f"{shlex.quote(pip_python(runtime))} -m pip uninstall -y {names}"
    paths = []
    for dist in dists:
        paths.append(dist.path)
        paths += [dist.path.parent / top for top in _top_level(dist) if top not in paths]
    return "rm -r " + " ".join(shlex.quote(str(p)) for p in paths)


_SHARED = frozenset({"bin", "share", "include", "etc", "lib", "lib64"})  # folders every package of a --target dir uses


def _top_level(dist) -> list[str]:
    """The top-level modules and packages a distribution installed (its RECORD's first path parts; its
    dist-info, what lies outside the directory and the folders all packages share left out)."""
    try:
        text = (dist.path / "RECORD").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    tops: list[str] = []
    for line in text.splitlines()[:100_000]:
        first = line.split(",", 1)[0].split("/", 1)[0]
        module = first.isidentifier() or first.endswith((".py", ".so", ".pth"))
        if module and first not in _SHARED and first != dist.path.name and first not in tops:
            tops.append(first)
    return tops


def flashinfer_served(runtime: Runtime, wanted: str) -> tuple[str | None, bool]:
    """(the FlashInfer an install fix names for ``wanted``, whether pip's index could be asked): ``wanted`` where
    the index serves it, else the nearest version it serves above it (vLLM 0.34.0 pins 0.7.3; the index serves
    0.7.2.post1 and 0.7.4); None when it serves none above it, or could not be asked."""
    from packaging.version import InvalidVersion, Version

    from patch_dsv4.tree.pip_index import index_versions

    python = pip_python(runtime)
    served = index_versions("flashinfer-python", INDEX_OPTIONS, python, INDEX_TIMEOUT, remember=True)
    if served is None and python != sys.executable:  # that interpreter has no pip, or none that answers: ours
        served = index_versions("flashinfer-python", INDEX_OPTIONS, sys.executable, INDEX_TIMEOUT, remember=True)
    if served is None:
        return None, False
    try:
        floor = Version(wanted)
    except InvalidVersion:
        return (wanted if wanted in served else None), True
    versions = []
    for text in served:
        try:
            versions.append(Version(text))
        except InvalidVersion:
            continue
    if floor in versions:
        return wanted, True
    above = sorted(v for v in versions if v > floor and not v.is_prerelease)
    return (str(above[0]) if above else None), True


def flashinfer_install(runtime: Runtime, wanted: str, why: str = "", *, no_deps: bool = False) -> str:
    """The command that installs FlashInfer ``wanted`` (vLLM's pin, or the DeepSeek-V4 floor) into the serving
    environment, ``why`` said after it: a version pip's index serves (flashinfer_served), said as such where it is
    not ``wanted``; where the index cannot be asked, the range from ``wanted`` to the next minor release and the
    command that lists what the index serves."""
    extra = ("--no-deps",) if no_deps else ()
    listing = f"{shlex.quote(pip_python(runtime))} -m pip index versions flashinfer-python"
    near, asked = flashinfer_served(runtime, wanted)
    if near == wanted:
        return pip_install(runtime, *extra, f"flashinfer-python=={wanted}") + why
    if not asked:
        major, _, rest = wanted.partition(".")
        minor = rest.partition(".")[0]
        upper = f"{major}.{int(minor) + 1}" if major.isdigit() and minor.isdigit() else None
        spec = f"'flashinfer-python>={wanted},<{upper}'" if upper else f"'flashinfer-python>={wanted}'"
        return (
            pip_install(runtime, *extra, spec)
            + f"{why} (pip's index could not be asked whether it serves {wanted}; {listing} lists what it serves)"
        )
    if near is None:
        return (
            f"pip's index serves no flashinfer-python at or above {wanted} ({listing} lists what it serves); "
            f"install {wanted} from where it is published{why}"
        )
    if why.endswith("'s pin)"):  # the pin is what is not served: said once, not as the version installed
        why = f" (vLLM {runtime.vllm_version} pins {wanted}, which pip's index does not serve; {near} is the nearest"
        return pip_install(runtime, *extra, f"flashinfer-python=={near}") + f"{why} above it)"
    return pip_install(runtime, *extra, f"flashinfer-python=={near}") + (
        f"{why} ({wanted} is not on pip's index; {near} is the nearest above it that it serves)"
    )


def plugin_install(runtime: Runtime) -> str:
    return pip_install(runtime, PLUGIN_SOURCE) + PLUGIN_NOTE


def vllm_dist(runtime: Runtime):
    return find_dist([runtime.vllm_root] if runtime.vllm_root else runtime.site_dirs, "vllm")


def vllm_file(runtime: Runtime, relpath: str) -> Path | None:
    for directory in ([runtime.vllm_root] if runtime.vllm_root else []) + list(runtime.site_dirs):
        if (directory / relpath).is_file():
            return directory / relpath
    return None


def parse_python(path: Path) -> tuple[ast.Module | None, str | None]:
    """The module's AST, or None and why it cannot be parsed."""
    text, problem = read_utf8(path)
    if text is None:
        return None, problem
    try:
        return ast.parse(text, filename=str(path)), None
    except (SyntaxError, ValueError) as exc:
        return None, f"{path.name} does not parse ({type(exc).__name__}: {exc})"


def module_assignment(tree: ast.Module, name: str) -> ast.expr | None:
    """The value of the module-level ``name = ...`` (or ``name: T = ...``)."""
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return node.value
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
            return node.value
    return None


@check("rt.python", needs=("runtime",))
def serving_python(ctx: DoctorContext) -> Row:
    """The serving interpreter's version.

    FAIL below 3.12 (vllm-exl3 declares requires-python >=3.12); WARN above
    3.12 (the recipes are verified on 3.12 only). Evidence: P pyproject.toml:10;
    R scripts/preflight.py:64-70.
    """
    version = ctx.runtime.python_version
    found = release(version)
    if found is None or len(found) < 2:
        return Row("rt.python", SKIP, "the serving interpreter's version could not be told")
    fix = "create the serving venv with Python 3.12 (python3.12 -m venv ~/venvs/vllm-vl) and install the stack into it"
    if found[:2] < (3, 12):
        return Row("rt.python", FAIL, f"the serving interpreter is Python {version}; vllm-exl3 needs >= 3.12.", fix)
    if found[:2] > (3, 12):
        return Row(
            "rt.python",
            WARN,
            f"the serving interpreter is Python {version}; the recipes are verified on 3.12 only.",
            fix,
        )
    return Row("rt.python", PASS, f"the serving interpreter is Python {version}.")


def has_vision_class(runtime: Runtime) -> bool:
    """Whether this build defines vLLM's DeepSeek-V4 vision class (read in its code, so nightlies count right)."""
    models = vllm_file(runtime, "vllm/models/deepseek_v4/__init__.py")
    for path in sorted(models.parent.rglob("*.py")) if models else ():
        try:
            if b"class DeepseekV4ForConditionalGeneration" in path.read_bytes():
                return True
        except OSError:
            continue
    return False


@check("rt.vllm-route", needs=("runtime",))
def vllm_route(ctx: DoctorContext) -> Row:
    """The vLLM build and what it can serve of this pack.

    INFO: the build and whether it has the DeepSeek-V4 vision class (probed in
    vllm/models/deepseek_v4/, so nightly builds are judged by their code).
    WARN if a vision pack meets a build without that class (0.28/0.29: text
    only, the loader-skips patch drops the vision tensors); FAIL without any
    DeepSeek-V4 model. Evidence: R README.md:444-445; S FINDINGS.md;
    V0.30.0 vllm/models/deepseek_v4/common/vl_model.py.
    """
    runtime = ctx.runtime
    version = runtime.vllm_version or "(unknown version)"
    fi = (
        f", FlashInfer {runtime.flashinfer_version} ({runtime.flashinfer_source})" if runtime.flashinfer_version else ""
    )
    if vllm_file(runtime, "vllm/models/deepseek_v4/__init__.py") is None:
        return Row(
            "rt.vllm-route",
            FAIL,
            f"vLLM {version} has no vllm/models/deepseek_v4: it cannot load DeepSeek-V4.",
            "install a vLLM release with DeepSeek-V4 (0.28.0 or later; the recipes use 0.28.0 or a nightly)",
        )
    if has_vision_class(runtime):
        return Row(
            "rt.vllm-route", INFO, f"vLLM {version}{fi} has the DeepSeek-V4 vision class: text, vision and DSpark."
        )
    if ctx.pack is not None and vision_pack(ctx):
        return Row(
            "rt.vllm-route",
            WARN,
            f"vLLM {version}{fi} has no DeepSeek-V4 vision class but the pack ships a vision tower "
            "(vision_n_layers > 0): it serves text only.",
            f"to serve images install vLLM 0.30.0 or later; for text only keep this build with "
            f"patch-dsv4 apply{target_option(runtime)} (loader-skips skips the vision tensors)",
        )
    return Row("rt.vllm-route", INFO, f"vLLM {version}{fi} serves DeepSeek-V4 text and DSpark (no vision class).")


def serve_impact(patch_id: str) -> str:
    """What serving without ``patch_id`` does, as its Patch class says (``Patch.serve_impact``). The patches are
    imported only here, for a patch that is needed and missing (~0.3 s): doctor's usual run never pays for it."""
    from patch_dsv4.patching.registry import discover_patches

    impact = {patch.id: patch.serve_impact for patch in discover_patches()}.get(patch_id)
    return impact or "the fix it carries is missing"


_GOOD_VERDICTS = ("applied", "upstream", "not-applicable")


@check("rt.patches", needs=("runtime",))
def patches(ctx: DoctorContext) -> list[Row]:
    """One row per patch-dsv4 patch, from its verdict on this environment.

    FAIL for pending, drifted and modified (each names the late symptom it
    causes); PASS for applied, upstream and not-applicable; INFO for an opt-in
    patch nobody asked for. Evidence: R README.md:321-352, docs/LOADER_NOTES.md:100-118,
    docs/TEST_VISION.md §6; S FINDINGS.md.
    """
    runtime = ctx.runtime
    verdicts = runtime.patch_verdicts
    if verdicts is None:
        return [Row("rt.patches", SKIP, "patch-dsv4 verdicts are not available for this environment")]
    version = runtime.vllm_version or "this vLLM"
    target = target_option(runtime)
    rows = []
    for patch_id, verdict in verdicts.items():
        if verdict in _GOOD_VERDICTS:
            rows.append(Row("rt.patches", PASS, f"patch {patch_id} is {verdict} on vLLM {version}."))
        elif verdict == "opt-in":
            rows.append(
                Row(
                    "rt.patches",
                    INFO,
                    f"patch {patch_id} is opt-in and not asked for "
                    f"(patch-dsv4 apply --with {patch_id}{target} adds it).",
                )
            )
        elif verdict == "pending":
            symptom = serve_impact(patch_id)
            rows.append(
                Row(
                    "rt.patches",
                    FAIL,
                    f"patch {patch_id} is needed on vLLM {version} and not applied; without it {symptom}.",
                    f"patch-dsv4 apply{target}",
                )
            )
        elif verdict == "modified":
            symptom = serve_impact(patch_id)
            rows.append(
                Row(
                    "rt.patches",
                    FAIL,
                    f"patch {patch_id} was applied but its file changed since; without it {symptom}.",
                    f"patch-dsv4 status{target} names the file; reinstall it "
                    f"({pip_install(runtime, '--no-deps', '--force-reinstall', f'vllm=={version}')}), "
                    f"then patch-dsv4 apply{target}",
                )
            )
        elif verdict == "drifted":
            symptom = serve_impact(patch_id)
            rows.append(
                Row(
                    "rt.patches",
                    FAIL,
                    f"patch {patch_id} is needed but vLLM {version}'s code no longer matches its anchor; "
                    f"without it {symptom}.",
                    f"patch-dsv4 drift --vllm-version {version} shows what moved; use a vLLM release this "
                    f"patch-dsv4 knows (or a newer patch-dsv4), then patch-dsv4 apply{target}",
                )
            )
        else:
            rows.append(Row("rt.patches", SKIP, f"patch {patch_id} has a verdict doctor does not know: {verdict!r}."))
    return rows


@dataclass(frozen=True)
class DecodeTable:
    """FlashInfer's SM120 DeepSeek-V4 decode dispatch, as written in its source.

    ``pairs`` is the literal (heads, topk) set; None when the table is computed
    at run time (0.7.x makes it a predicate) or was not found.
    """

    source: Path | None
    pairs: frozenset | None


def decode_table(flashinfer: Path) -> DecodeTable:
    candidates = sorted(flashinfer.glob("mla/_sparse_mla_sm120*.py")) + sorted(
        flashinfer.glob("mla/_sparse_mla_sm120/*.py")
    )
    for path in candidates:
        tree, _ = parse_python(path)
        value = module_assignment(tree, "_DECODE_DSV4_DISPATCH") if tree else None
        if value is None:
            continue
        if (
            isinstance(value, ast.Call)
            and isinstance(value.func, ast.Name)
            and value.func.id in ("frozenset", "set")
            and len(value.args) == 1
        ):
            try:
                pairs = frozenset(ast.literal_eval(value.args[0]))
            except (ValueError, TypeError, SyntaxError):
                return DecodeTable(path, None)
            return DecodeTable(path, pairs)
        return DecodeTable(path, None)
    return DecodeTable(None, None)


def recommended_flashinfer(runtime: Runtime) -> tuple[str, str]:
    """The FlashInfer to install and a note on vLLM's pin (which 0.28.0 sets below the DSV4 floor)."""
    dist = vllm_dist(runtime)
    pin = dist.pinned("flashinfer-python") if dist else None
    if pin and older_than(pin, FLASHINFER_DSV4_FLOOR) is False:
        return pin, f" (vLLM {runtime.vllm_version}'s pin)"
    note = f" (vLLM {runtime.vllm_version} pins {pin}: override it)" if pin else ""
    return "0.6.18", note


def flashinfer_fix(runtime: Runtime) -> str:
    """rt.flashinfer's fix: the FlashInfer recommended_flashinfer names, as pip's index serves it."""
    wanted, note = recommended_flashinfer(runtime)
    return flashinfer_install(runtime, wanted, note)


# V4.1 decodes with sliding_window, not index_topk: v41.flashinfer
@check("rt.flashinfer", needs=("runtime", "pack"), family=V4)
def flashinfer_decode(ctx: DoctorContext) -> Row:
    """Has the installed FlashInfer an SM120 DeepSeek-V4 decode kernel for this pack?

    Reads ``_DECODE_DSV4_DISPATCH`` in flashinfer/mla/_sparse_mla_sm120*.py by
    AST and looks up (num_attention_heads / TP, index_topk). FAIL if the pair is
    absent; where the table is a run-time predicate (0.7.x) or missing, FAIL
    below 0.6.18. [late] abort at the first decode. INFO on GPUs that take
    FlashMLA instead. Evidence: R docs/LOADER_NOTES.md:189, install_local_runtime.sh:46;
    FI0.6.16.post3 mla/_sparse_mla_sm120.py:79-97,380; FI0.6.18 :78-106,389-399.
    """
    runtime, config = ctx.runtime, ctx.config()
    topk, heads = config.get("index_topk"), config.get("num_attention_heads")
    if not isinstance(topk, int) or not isinstance(heads, int):
        return Row("rt.flashinfer", SKIP, "config.json gives no integer index_topk and num_attention_heads")
    tp = tensor_parallel_size(ctx)
    if tp is None:
        return Row("rt.flashinfer", SKIP, "--tensor-parallel-size is not a positive integer")
    local_heads = heads // tp
    found_gpus, _ = gpus(ctx)
    if found_gpus and not any(gpu.sm // 10 == 12 for gpu in found_gpus):
        return Row("rt.flashinfer", INFO, f"GPU sm_{found_gpus[0].sm} takes FlashMLA, not FlashInfer's SM120 kernels.")
    package = find_package(runtime.site_dirs, "flashinfer")
    if package is None:
        return Row(
            "rt.flashinfer",
            FAIL,
            "flashinfer-python is not installed in the serving environment; DeepSeek-V4 on SM12x attends through it.",
            flashinfer_fix(runtime),
        )
    version = runtime.flashinfer_version or "(unknown version)"
    table = decode_table(package)
    shape = f"(heads={local_heads}, topk={topk})"
    if table.pairs is not None:
        where = table.source.relative_to(package.parent)
        if (local_heads, topk) in table.pairs:
            return Row(
                "rt.flashinfer", PASS, f"{shape} is in _DECODE_DSV4_DISPATCH of {where} (flashinfer-python {version})."
            )
        return Row(
            "rt.flashinfer",
            FAIL,
            f"flashinfer-python {version} has no SM120 DeepSeek-V4 decode kernel for topk={topk} "
            f"(heads={local_heads}): {shape} is not in {where}, so the first decode aborts.",
            flashinfer_fix(runtime),
        )
    how = "a run-time predicate" if table.source else "not found"
    below = older_than(runtime.flashinfer_version, FLASHINFER_DSV4_FLOOR)
    if below is None:
        return Row("rt.flashinfer", SKIP, f"the SM120 decode table is {how} and the FlashInfer version is unknown")
    if below:
        return Row(
            "rt.flashinfer",
            FAIL,
            f"flashinfer-python {version} predates the SM120 DeepSeek-V4 decode kernels "
            f"for topk={topk} (the table is {how}).",
            flashinfer_fix(runtime),
        )
    return Row(
        "rt.flashinfer", PASS, f"flashinfer-python {version} >= 0.6.18 serves {shape} (its decode table is {how})."
    )


@dataclass(frozen=True)
class JitRule:
    """How the installed vLLM's ``has_flashinfer()`` decides that FlashInfer can JIT (read from its code)."""

    which: frozenset  # tools it looks up on PATH by name ("nvcc", "ninja")
    home_variables: tuple  # environment variables it takes the CUDA toolkit from, in order
    default_home: str | None
    cubin_package: bool  # accepts an installed flashinfer_cubin
    cubin_variable: bool  # accepts VLLM_HAS_FLASHINFER_CUBIN


def _dotted(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def flashinfer_jit_rule(path: Path) -> JitRule | None:
    tree, _ = parse_python(path)
    if tree is None:
        return None
    functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    if "has_flashinfer" not in functions:
        return None
    reached, todo = [], ["has_flashinfer"]  # a list: the order the CUDA variables are read in must hold
    while todo:
        name = todo.pop(0)
        if name in reached or name not in functions:
            continue
        reached.append(name)
        todo += [
            c.func.id for c in ast.walk(functions[name]) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)
        ]
    tools, homes, cubin_package, cubin_variable = set(), [], False, False
    for name in reached:
        for node in ast.walk(functions[name]):
            if isinstance(node, ast.Attribute) and node.attr == "VLLM_HAS_FLASHINFER_CUBIN":
                cubin_variable = True
            if not isinstance(node, ast.Call) or not node.args:
                continue
            first = node.args[0]
            literal = first.value if isinstance(first, ast.Constant) and isinstance(first.value, str) else None
            callee = _dotted(node.func)
            if callee.endswith("which") and literal:
                tools.add(literal)
            elif (
                callee in ("os.environ.get", "os.getenv")
                and literal
                and literal.startswith("CUDA")
                and literal not in homes
            ):
                homes.append(literal)
            elif callee.endswith("find_spec") and literal == "flashinfer_cubin":
                cubin_package = True
    default_home = None
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and "CUDA_HOME" in t.id for t in node.targets)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            default_home = node.value.value
    return JitRule(frozenset(tools), tuple(homes), default_home, cubin_package, cubin_variable)


def _flag(value: str | None) -> bool:
    """vLLM's bool(int(os.getenv(...))) for a flag, with an unparsable value taken as off."""
    try:
        return bool(int(value or "0"))
    except ValueError:
        return False


@check("rt.flashinfer-jit", needs=("runtime",))
def flashinfer_jit(ctx: DoctorContext) -> Row:
    """Will the installed vLLM keep FlashInfer on, given the CUDA toolchain the serve environment sees?

    The rule is read from vllm/utils/flashinfer.py ``has_flashinfer()`` and what
    it calls: 0.28-0.31 need ``nvcc`` on PATH; 0.32+ resolve nvcc through
    CUDA_HOME/CUDA_PATH (else PATH's nvcc, else /usr/local/cuda) and need
    ``ninja`` on PATH; an installed flashinfer_cubin or VLLM_HAS_FLASHINFER_CUBIN=1
    waives both. FAIL when the rule fails (early: "No valid attention backend
    found"). Evidence: V0.28.0 utils/flashinfer.py:48-63; V0.33.0 :61-73,88-100;
    R serve_one_spark_dsv4.sh:6-30, README.md:135-138.
    """
    runtime, env = ctx.runtime, ctx.environ
    version = runtime.vllm_version or "this vLLM"
    source = vllm_file(runtime, "vllm/utils/flashinfer.py")
    rule = flashinfer_jit_rule(source) if source else None
    if rule is None:
        return Row("rt.flashinfer-jit", SKIP, "vllm/utils/flashinfer.py has no readable has_flashinfer()")
    if find_package(runtime.site_dirs, "flashinfer") is None:
        return Row("rt.flashinfer-jit", SKIP, "FlashInfer is not installed (rt.flashinfer reports it)")
    if rule.cubin_package and find_package(runtime.site_dirs, "flashinfer_cubin") is not None:
        return Row("rt.flashinfer-jit", PASS, f"flashinfer-cubin is installed: vLLM {version} needs no JIT toolchain.")
    if rule.cubin_variable and _flag(env.get("VLLM_HAS_FLASHINFER_CUBIN")):
        return Row(
            "rt.flashinfer-jit", PASS, f"VLLM_HAS_FLASHINFER_CUBIN is set: vLLM {version} skips its toolchain check."
        )
    problems, fixes = [], []
    if rule.home_variables:
        named = next((v for v in rule.home_variables if env.get(v)), None)
        if named:
            home, where = env[named], f"{named}={env[named]}"
        else:
            nvcc = which(ctx, "nvcc") if "nvcc" in rule.which else None
            home = os.path.dirname(os.path.dirname(nvcc)) if nvcc else rule.default_home
            where = f"the CUDA toolkit it falls back to ({home})"
        if home is None or which(ctx, os.path.join(home, "bin", "nvcc")) is None:
            problems.append(f"{where} has no bin/nvcc")
            fixes.append("export CUDA_HOME=/usr/local/cuda-13.0 (a toolkit with bin/nvcc)")
    elif "nvcc" in rule.which and which(ctx, "nvcc") is None:
        problems.append("nvcc is not on PATH")
        fixes.append("export PATH=/usr/local/cuda-13.0/bin:$PATH")
    for tool in sorted(rule.which - {"nvcc"}):
        if which(ctx, tool) is None:
            problems.append(f"{tool} is not on PATH")
            option, value = _target(ctx.runtime)
            bin_dir = f"{value}/bin" if option == "--site-packages" else "its bin/ (the serving venv's)"
            fixes.append(f"{pip_install(ctx.runtime, tool)} and put {bin_dir} on PATH")
    needs = (
        [f"bin/nvcc under {' or '.join(rule.home_variables)} (else PATH's nvcc, else {rule.default_home})"]
        if rule.home_variables
        else ["nvcc on PATH"]
        if "nvcc" in rule.which
        else []
    )
    needs += [f"{tool} on PATH" for tool in sorted(rule.which - {"nvcc"})]
    if problems:
        return Row(
            "rt.flashinfer-jit",
            FAIL,
            f"vLLM {version} will disable FlashInfer: {'; '.join(problems)}.",
            "; ".join(fixes),
        )
    return Row(
        "rt.flashinfer-jit",
        PASS,
        f"vLLM {version}'s FlashInfer check needs {' and '.join(needs) or 'no toolchain'}: all found.",
    )


def _arch_list(ctx: DoctorContext) -> str:
    found, _ = gpus(ctx)
    caps = sorted({gpu.compute_cap for gpu in found})
    if caps:
        return "'" + ";".join(f"{cap}a" if cap == "12.1" else cap for cap in caps) + "'"
    return "<the GPU's compute capability: 12.1a on GB10, 12.0 on RTX PRO>"


def build_exllamav3_fix(ctx: DoctorContext) -> str:
    aarch64 = normal_machine(ctx.runtime.machine) == "aarch64"
    return (
        "build the compiled extension into the serving venv: git clone https://github.com/turboderp-org/exllamav3 && "
        + ("(on aarch64, first apply the recipe's patch_exllamav3_aarch64.py to the clone) " if aarch64 else "")
        + f"TORCH_CUDA_ARCH_LIST={_arch_list(ctx)} {pip_install(ctx.runtime, '--no-build-isolation', './exllamav3')}; "
        + f'check with {_python_of_target(ctx.runtime)} -c "import torch, exllamav3_ext"'
    )


@check("rt.exllamav3-ext", needs=("runtime",))
def exllamav3_extension(ctx: DoctorContext) -> Row:
    """Is ``exllamav3_ext`` a compiled extension the serving interpreter will load?

    Finds the file ``find_spec("exllamav3_ext")`` would (no import), reads its
    ELF e_machine and cpython tag, searches it for ``exl3_moe``, and reads the
    exllamav3 version. FAIL if absent or JIT-only [late]: vllm-exl3 imports the
    compiled module only after every weight is loaded; FAIL on an architecture
    or Python mismatch; FAIL below exllamav3 1.4.5; WARN without ``exl3_moe``.
    Evidence: R README.md:164-178, verify_runtime.py:41-47; P exl3.py
    _install_exllamav3_namespace; X1.4.5 exllamav3/ext.py:20-30, exllamav3_ext/bindings.cpp:232-233.
    """
    runtime = ctx.runtime
    fix = build_exllamav3_fix(ctx)
    extension = locate_extension(runtime, "exllamav3_ext")
    dist = find_dist(runtime.site_dirs, "exllamav3")
    if extension.path is None:
        passed_over = f"; passed over: {', '.join(extension.unloadable)}" if extension.unloadable else ""
        jit = " (the exllamav3 wheel only JIT-builds it)" if dist else ""
        return Row(
            "rt.exllamav3-ext",
            FAIL,
            f"exllamav3_ext is not installed as a compiled extension for this interpreter{jit}{passed_over}; "
            "vllm-exl3 imports it only after the weights are loaded.",
            fix,
        )
    problems = []
    machine, unreadable = elf_machine(extension.path)
    wanted = normal_machine(runtime.machine)
    if unreadable:
        problems.append(unreadable)
    elif wanted and machine != wanted:
        problems.append(f"{extension.path.name} is built for {machine}, the serving machine is {wanted}")
    if dist is None or find_package(runtime.site_dirs, "exllamav3") is None:
        problems.append("the exllamav3 package itself is not installed (vllm-exl3 imports LinearEXL3 from it)")
    elif older_than(dist.version, EXLLAMAV3_FLOOR):
        problems.append(f"exllamav3 {dist.version} is older than 1.4.5")
    if problems:
        return Row("rt.exllamav3-ext", FAIL, f"{'; '.join(problems)}.", fix)
    if b"exl3_moe" not in scan_for(extension.path, [b"exl3_moe"]):
        return Row(
            "rt.exllamav3-ext",
            WARN,
            f"{extension.path} has no exl3_moe binding: the fused EXL3 MoE kernel "
            "vllm-exl3 calls is missing from this build.",
            fix,
        )
    return Row(
        "rt.exllamav3-ext",
        PASS,
        f"{extension.path} is a compiled {machine} extension with exl3_moe "
        f"(exllamav3 {dist.version or 'of unreadable version'}).",
    )


LINEAR_EXL3_KEYWORDS = ("mcg", "mul1", "out_dtype", "transformers_fix")


@check("rt.exllamav3-api", needs=("runtime",))
def exllamav3_api(ctx: DoctorContext) -> Row:
    """Does exllamav3's ``LinearEXL3.__init__`` take the keywords vllm-exl3 passes?

    AST of exllamav3/modules/quant/exl3.py. FAIL if it lacks mcg, mul1,
    out_dtype or transformers_fix [late]: the plugin builds its linears after
    loading. Evidence: P exl3.py make_linear_exl3; X1.4.0/X1.4.5 modules/quant/exl3.py.
    """
    runtime = ctx.runtime
    package = find_package(runtime.site_dirs, "exllamav3")
    if package is None or not (package / "modules/quant/exl3.py").is_file():
        return Row(
            "rt.exllamav3-api", SKIP, "exllamav3/modules/quant/exl3.py is not installed (rt.exllamav3-ext reports it)"
        )
    dist = find_dist(runtime.site_dirs, "exllamav3")
    version = (dist.version if dist else None) or "(unknown version)"
    fix = build_exllamav3_fix(ctx)
    tree, problem = parse_python(package / "modules/quant/exl3.py")
    if tree is None:
        return Row("rt.exllamav3-api", FAIL, f"exllamav3 {version}: {problem}.", fix)
    init = next(
        (
            f
            for c in tree.body
            if isinstance(c, ast.ClassDef) and c.name == "LinearEXL3"
            for f in c.body
            if isinstance(f, ast.FunctionDef) and f.name == "__init__"
        ),
        None,
    )
    if init is None:
        return Row("rt.exllamav3-api", FAIL, f"exllamav3 {version} defines no LinearEXL3.__init__.", fix)
    accepted = {a.arg for a in init.args.args + init.args.kwonlyargs}
    missing = [kw for kw in LINEAR_EXL3_KEYWORDS if kw not in accepted] if init.args.kwarg is None else []
    if missing:
        return Row(
            "rt.exllamav3-api",
            FAIL,
            f"exllamav3 {version}'s LinearEXL3 does not accept {', '.join(missing)}; "
            "vllm-exl3 would fail after loading.",
            fix,
        )
    return Row("rt.exllamav3-api", PASS, f"exllamav3 {version}'s LinearEXL3 accepts {', '.join(LINEAR_EXL3_KEYWORDS)}.")


def general_plugins(runtime: Runtime) -> dict[str, str]:
    """{entry-point name: value} of group vllm.general_plugins over every distribution (the first one wins)."""
    found: dict[str, str] = {}
    for dist in distributions(runtime.site_dirs):
        groups, _ = dist.entry_points()
        for name, value in groups.get(PLUGIN_GROUP, {}).items():
            found.setdefault(name, value)
    return found


@check("rt.plugin", needs=("runtime",))
def plugin_registered(ctx: DoctorContext) -> Row:
    """Will vLLM load vllm-exl3 (and patch-dsv4's serve guard)?

    Reads the entry points of group vllm.general_plugins from every
    dist-info and VLLM_PLUGINS as vLLM parses it (unset: all load; set: a
    comma-separated allowlist of exact names; empty: none). FAIL without the
    distribution, its entry point or its package, or when the allowlist omits
    it (early: "Unknown quantization method: exl3"); WARN when the allowlist
    drops the installed patch_dsv4 guard. Evidence: P pyproject.toml:20-21;
    V0.28.0 vllm/plugins/__init__.py:40-68, envs.py VLLM_PLUGINS; S notes/real-vllm-probe.md §4.
    """
    runtime = ctx.runtime
    plugins = general_plugins(runtime)
    exl3 = {name: value for name, value in plugins.items() if value.split(":")[0].split(".")[0] in PLUGIN_MODULES}
    allowlist = ctx.environ.get("VLLM_PLUGINS")
    allowed = None if allowlist is None else allowlist.split(",")
    fix = f"{plugin_install(runtime)}; if you set VLLM_PLUGINS, include vllm_exl3"
    dist = find_dist(runtime.site_dirs, "vllm-exl3")
    if dist is None and not exl3:
        return Row("rt.plugin", FAIL, "vllm-exl3 is not installed in the serving environment.", fix)
    if not exl3:
        _, unreadable = dist.entry_points()
        why = f" ({unreadable})" if unreadable else ""
        return Row(
            "rt.plugin",
            FAIL,
            f"vllm-exl3 {dist.version or '(unknown version)'} is installed but registers "
            f"no {PLUGIN_GROUP} entry point{why}.",
            fix,
        )
    name, value = next(iter(exl3.items()))
    module = value.split(":")[0].split(".")[0]
    if find_package(runtime.site_dirs, module) is None:
        return Row(
            "rt.plugin",
            FAIL,
            f"the entry point {name} = {value} names the package {module}, which is not on the import path.",
            fix,
        )
    if allowed is not None and name not in allowed:
        near = (
            " (VLLM_PLUGINS names are not trimmed: remove the spaces)" if name in [a.strip() for a in allowed] else ""
        )
        return Row(
            "rt.plugin",
            FAIL,
            f"VLLM_PLUGINS={allowlist!r} does not allow {name}{near}, so vLLM will not register exl3.",
            f"export VLLM_PLUGINS={_allowlist_with(allowed, name, plugins)}",
        )
    if allowed is not None and GUARD_ENTRY_POINT in plugins and GUARD_ENTRY_POINT not in allowed:
        return Row(
            "rt.plugin",
            WARN,
            f"VLLM_PLUGINS={allowlist!r} drops patch-dsv4's serve guard ({GUARD_ENTRY_POINT}): "
            "an unpatched tree would start without a word.",
            f"export VLLM_PLUGINS={_allowlist_with(allowed, GUARD_ENTRY_POINT, plugins)}",
        )
    how = "by VLLM_PLUGINS" if allowed is not None else "(VLLM_PLUGINS unset: every plugin loads)"
    return Row("rt.plugin", PASS, f"vLLM loads the entry point {name} = {value} {how}.")


def _allowlist_with(allowed: list[str], name: str, plugins: dict) -> str:
    kept = [a.strip() for a in allowed if a.strip()]
    for wanted in (name, *(n for n in ("vllm_exl3", GUARD_ENTRY_POINT) if n in plugins)):
        if wanted not in kept:
            kept.append(wanted)
    return ",".join(kept)


# quantization_config keys vllm-exl3 learned over time (P CHANGELOG.md), and when a pack's value needs them.
PLUGIN_FEATURES = {
    "layer_bits": ("0.1.0", lambda v: bool(v)),
    "non_routed_quantization": ("0.1.1", lambda v: bool(v)),
    "mtp_experts": ("0.2.2", lambda v: v == "source"),
    "non_routed_exl3": ("0.2.3", lambda v: bool(v)),
    "non_routed_dtype_policy": ("0.2.3", lambda v: v == "bf16_as_stored"),
}


def config_keys_read(tree: ast.Module) -> set[str]:
    """String keys the module reads from a mapping: ``x.get("k")``, ``x["k"]`` and ``"k" in x``."""
    keys = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "get"
            and node.args
        ):
            first = node.args[0]
        elif isinstance(node, ast.Subscript):
            first = node.slice
        elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops):
            first = node.left
        else:
            continue
        if isinstance(first, ast.Constant) and isinstance(first.value, str):
            keys.add(first.value)
    return keys


@check("rt.plugin-features", needs=("runtime",))
def plugin_features(ctx: DoctorContext) -> Row:
    """Does the installed vllm_exl3/exl3.py compile, and read every quantization_config key the pack relies on?

    ``compile()`` of the file, then an AST search for the keys it reads
    (versions do not identify the code: 41 versions of exl3.py). FAIL if it does
    not compile; FAIL if the pack sets a key the plugin ignores (a policy
    ignored by a plugin < 0.2.3 is silent empty output [silent]). Evidence:
    P CHANGELOG.md:59-67,84-85; R docs/LOADER_NOTES.md:90-98,176.
    """
    package = find_package(ctx.runtime.site_dirs, "vllm_exl3")
    source = package / "exl3.py" if package is not None and package.is_dir() else None
    if source is None or not source.is_file():
        return Row("rt.plugin-features", SKIP, "vllm_exl3/exl3.py is not installed (rt.plugin reports it)")
    text, problem = read_utf8(source)
    try:
        # A full compile, not only a parse: it also rejects what is valid syntax but not a module.
        tree = ast.parse(text) if text is not None and compile(text, str(source), "exec") else None
    except (SyntaxError, ValueError) as exc:
        tree, problem = None, f"{type(exc).__name__}: {exc}"
    if tree is None:
        return Row(
            "rt.plugin-features",
            FAIL,
            f"{source} does not compile ({problem}); vLLM would log the plugin's import error and then reject exl3.",
            plugin_install(ctx.runtime),
        )
    read = config_keys_read(tree)
    if ctx.pack is None:
        known = ", ".join(k for k in PLUGIN_FEATURES if k in read) or "none"
        return Row("rt.plugin-features", INFO, f"{source} compiles; of the pack keys doctor knows it reads: {known}.")
    block = quantization_config(ctx)
    ignored = [
        key for key, (_, needed) in PLUGIN_FEATURES.items() if key in block and needed(block[key]) and key not in read
    ]
    if ignored:
        since = ", ".join(f'"{k}" (added in {PLUGIN_FEATURES[k][0]})' for k in ignored)
        return Row(
            "rt.plugin-features",
            FAIL,
            f"the pack sets {since} but the installed vllm-exl3 does not read it.",
            f"upgrade vllm-exl3 to a build that reads it: {plugin_install(ctx.runtime)}",
        )
    used = [k for k in PLUGIN_FEATURES if k in block]
    return Row(
        "rt.plugin-features",
        PASS,
        f"{source} compiles and reads every key the pack sets ({', '.join(used) or 'none'}).",
    )


@check("rt.plugin-native", needs=("runtime",))
def plugin_native(ctx: DoctorContext) -> Row:
    """Is vllm-exl3's optional native MoE extension ``vllm_exl3_c`` there, and loadable?

    Presence only: its ABI (P2B_MOE_ABI_VERSION) needs an import. INFO when
    present or absent (the plugin falls back to exllamav3's MoE); WARN when the
    file is there but built for another Python or machine (it will not load).
    Evidence: P CHANGELOG.md:5-10, exl3.py _load_native_exl3_ext, _apply_native_fused_moe.
    """
    runtime = ctx.runtime
    extension = locate_extension(runtime, "vllm_exl3_c")
    fix = "rebuild vllm-exl3 in the serving venv (its native part builds unless VLLM_EXL3_NO_CUDA=1)"
    if extension.path is None and extension.unloadable:
        return Row(
            "rt.plugin-native",
            WARN,
            f"vllm_exl3_c will not load ({', '.join(extension.unloadable)}); "
            "the MoE falls back to exllamav3 (correct, slower).",
            fix,
        )
    if extension.path is None:
        return Row("rt.plugin-native", INFO, "no vllm_exl3_c: routed experts run through exllamav3's MoE kernel.")
    machine, problem = elf_machine(extension.path)
    wanted = normal_machine(runtime.machine)
    if problem or (wanted and machine != wanted):
        return Row(
            "rt.plugin-native",
            WARN,
            f"{extension.path.name} will not load ({problem or f'built for {machine}'}); "
            "the MoE falls back to exllamav3 (correct, slower).",
            fix,
        )
    return Row(
        "rt.plugin-native",
        INFO,
        f"{extension.path} is present; its ABI needs an import to read "
        "(ABI < 2 falls back to exllamav3 for clipped SwiGLU).",
    )


def torch_build(runtime: Runtime) -> tuple[str | None, str | None, bool]:
    """(torch.__version__, torch.version.cuda, whether the torch package exists), read from torch/version.py."""
    package = find_package(runtime.site_dirs, "torch")
    if package is None or not package.is_dir():
        return None, None, False
    tree, _ = parse_python(package / "version.py")
    if tree is None:
        return None, None, True
    values = []
    for name in ("__version__", "cuda"):
        node = module_assignment(tree, name)
        values.append(node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None)
    return values[0], values[1], True


@check("rt.torch", needs=("runtime",))
def torch_matches(ctx: DoctorContext) -> Row:
    """torch's version and CUDA build, from torch/version.py read as text.

    FAIL without torch or for a CPU-only build; WARN if it is not the
    ``torch==`` vLLM's METADATA pins; WARN if CUDA is not 13.x on a GB10.
    Evidence: R preflight.py:96-108; V0.28.0 METADATA:82; S notes/real-vllm-probe.md §1
    (a +cpu torch satisfying vLLM's pin).
    """
    runtime = ctx.runtime
    version, cuda, installed = torch_build(runtime)
    dist = vllm_dist(runtime)
    pin = dist.pinned("torch") if dist else None
    wanted = shlex.quote(f"torch=={pin}") if pin else "'torch==<the version vLLM pins>'"
    reinstall = f"{pip_install(runtime, '--force-reinstall', wanted)} (the CUDA 13 build, not +cpu)"
    if not installed:
        return Row("rt.torch", FAIL, "torch is not installed in the serving environment.", reinstall)
    if version is None:
        return Row("rt.torch", SKIP, "torch/version.py gives no __version__")
    if cuda is None:
        return Row("rt.torch", FAIL, f"torch {version} is a CPU-only build (torch.version.cuda is None).", reinstall)
    if pin and release(version) != release(pin):
        return Row(
            "rt.torch",
            WARN,
            f"torch {version} (CUDA {cuda}) differs from what vLLM {runtime.vllm_version} "
            f"was built for (torch=={pin}).",
            reinstall,
        )
    found, _ = gpus(ctx)
    if any(gpu.compute_cap == "12.1" for gpu in found) and not cuda.startswith("13."):
        return Row(
            "rt.torch", WARN, f"torch {version} is built for CUDA {cuda}; the GB10 recipes need CUDA 13.", reinstall
        )
    pinned = f"is what vLLM {runtime.vllm_version} pins" if pin else "(vLLM's METADATA pins no torch version)"
    return Row("rt.torch", PASS, f"torch {version} (CUDA {cuda}) {pinned}.")
