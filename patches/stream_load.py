"""Stream the checkpoint through the vision class's loader instead of sorting it.

vLLM 0.30.0-0.32.0 `DeepseekV4ForConditionalGeneration.load_weights`
(`vllm/models/deepseek_v4/common/vl_model.py`) keeps the language model's
weights in one contiguous group, as a child that finalizes during load needs,
by sorting the whole weight iterator by name: every tensor of the checkpoint
(about 95 GB for DeepSeek-V4-Flash-Vision) sits in host memory before the first
one is loaded. The patch yields `language_model.*` tensors as they arrive and
defers only the rest (vision tower, aligner, image tokens: well under 1 GB),
cloned so that they do not keep the loader's per-shard storage alive.

Fixed upstream in vLLM 0.33.0 (`stream_language_model_first` in the same file:
language-model tensors stream, the small rest is deferred) and again, completely,
in vLLM 0.34.0 (the mapper's output goes straight to the loader, and the text
class no longer finalizes inside `load_weights`, so its tensors may arrive in
several runs).

What the probes check, whatever the code is called: the defect is anything on
the path from `load_weights`'s `weights` to the loader that holds the stream
whole or reorders it (`sorted`, `list`, `tuple`, a comprehension, `.sort()`, a
generator that takes every item before it yields one, or a helper, in any
module, that does). The fix is a path free of those that reaches the loader,
and either a generator on it that yields `language_model.*` tensors as they
arrive (0.33.0), or a language model (the class of `self.language_model`,
every platform's candidate) from whose `load_weights` no
`process_weights_after_loading` is reachable (0.34.0). A call on the path that
cannot be followed is no evidence either way: the patch then goes by its anchors.
No vision class in the releases before 0.30.0; nightlies between 0.29.0 and
0.30.0 define it in `nvidia/vl_model.py` (from 0.30.0 a re-export shim), with
the same sort: the patch streams it wherever the package defines the class.

DeepSeek-V4.1's vision class, `DeepseekV41ForCausalLM.load_weights`
(`deepseek_v41/nvidia/vl_model.py` and its `amd/` copy; `deepseek_v4_1/` in the
nightlies), sorts the mapper's whole output the same way on vLLM 0.30.0-0.32.0
(a 196 GiB pack for V4.1-Flash): the same helper streams it. vLLM 0.33.0 streams
it with V4's `stream_language_model_first`, 0.34.0 as V4's.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field

from patch_dsv4.output.verdicts import Outcome, Verdict
from patch_dsv4.patches._v41 import in_layouts
from patch_dsv4.patching.edits import ForeignEdit, ReplaceStatements, Variant, mentions_injected
from patch_dsv4.patching.fingerprint import find_scope
from patch_dsv4.patching.follow import Follower, calls_in
from patch_dsv4.patching.patch import Context, Example, Patch, Scope

VL_MODEL = "vllm/models/deepseek_v4/common/vl_model.py"
#: Where nightlies between 0.29.0 and 0.30.0 define the vision class (0.30.0 on: a re-export shim).
NIGHTLY_VL_MODEL = "vllm/models/deepseek_v4/nvidia/vl_model.py"
VISION_CLASS = "DeepseekV4ForConditionalGeneration"
V41_VISION_CLASS = "DeepseekV41ForCausalLM"
UPSTREAM_HELPER = "stream_language_model_first"


# The helpers below are written into vLLM as they stand here (edits.helper_source): not formatted.
# fmt: off
def _patch_dsv4_stream_language_model_first(weights):
    """Yield ``language_model.*`` weights as they arrive, then the rest.

    Written by patch-dsv4 (stream-load). Sorting the whole iterator held every
    tensor of the checkpoint in host memory; this keeps the language model's
    weights in one contiguous group while holding only the small rest, cloned
    so it does not pin the loader's per-shard storage. The rest is grouped by
    top-level module (stable, so arrival order holds within a group).
    """
    rest = []
    handoff = []
    for item in weights:
        if item[0].startswith("language_model."):
            # Hand the tensor over without keeping a reference in this frame,
            # so the caller can free it before asking for the next one.
            handoff.append(item)
            del item
            yield handoff.pop()
        else:
            name, tensor = item
            rest.append((name, tensor.clone()))
            del item, name, tensor
    rest.sort(key=lambda entry: entry[0].split(".", 1)[0])
    rest.reverse()
    while rest:
        yield rest.pop()
# fmt: on


#: Calls that hold every item of an iterator at once (``sorted`` reorders too).
MATERIALIZERS = ("sorted", "list", "tuple", "dict", "set")
LM_PREFIX = "language_model."


@dataclass
class StreamPath:
    """What the weight stream meets between ``load_weights``'s parameter and the loader."""

    materialized: list[str] = field(default_factory=list)  # where the stream is held whole or reordered
    grouped: list[str] = field(default_factory=list)  # generators that yield language-model tensors as they arrive
    followed: list[str] = field(default_factory=list)  # helpers the stream went through
    opaque: list[str] = field(default_factory=list)  # calls the stream enters that could not be followed
    configured: list[str] = field(default_factory=list)  # calls of a loop's callables (a list of transforms)
    loader: list[str] = field(default_factory=list)  # the loader calls the stream reaches


def _where(frame, node: ast.AST) -> str:
    return f"{frame.defn.file}:{frame.defn.qualname}:{getattr(node, 'lineno', frame.defn.line)}"


def _own_nodes(func: ast.AST):
    """The nodes of a function, nested functions and classes excluded."""
    stack = list(ast.iter_child_nodes(func))
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        yield node
        stack.extend(ast.iter_child_nodes(node))


def _trace(follower: Follower, frame, stream: set[str], found: StreamPath, depth: int = 0) -> None:
    """Follow the names ``stream`` (holding the weight iterator) through ``frame``'s function, in source order."""
    func = frame.node
    names = set(stream)
    nodes = sorted(_own_nodes(func), key=lambda n: (getattr(n, "lineno", 0), getattr(n, "col_offset", 0)))

    def carries(expr: ast.AST) -> bool:
        return any(isinstance(n, ast.Name) and n.id in names for n in ast.walk(expr))

    done: set[int] = set()
    loop_targets = {
        t.id
        for n in nodes
        if isinstance(n, (ast.For, ast.AsyncFor))
        for t in ast.walk(n.target)
        if isinstance(t, ast.Name)
    }

    def expression(expr: ast.expr) -> bool:
        """Judge what ``expr`` does to the stream; whether its value carries the stream on."""
        if id(expr) in done:
            return carries(expr)
        done.add(id(expr))
        if isinstance(expr, ast.Name):
            return expr.id in names
        if isinstance(expr, (ast.ListComp, ast.SetComp, ast.DictComp)) and carries(expr):
            found.materialized.append(f"{ast.unparse(expr)[:60]} at {_where(frame, expr)}")
            return True
        if isinstance(expr, ast.GeneratorExp):
            return carries(expr)
        if isinstance(expr, ast.IfExp):
            body, orelse = expression(expr.body), expression(expr.orelse)
            return body or orelse
        if not isinstance(expr, ast.Call):
            return carries(expr)
        args = [a for a in (*expr.args, *(k.value for k in expr.keywords)) if expression(a)]
        callee = ast.unparse(expr.func)
        if isinstance(expr.func, ast.Attribute) and expr.func.attr == "sort" and carries(expr.func.value):
            found.materialized.append(f"{callee}() at {_where(frame, expr)}")
            return True
        if not args:
            return False
        if callee in MATERIALIZERS:
            found.materialized.append(f"{callee}() at {_where(frame, expr)}")
            return True
        if callee == "iter":
            return True
        if isinstance(expr.func, ast.Attribute) and expr.func.attr == "load_weights":
            found.loader.append(f"{callee}() at {_where(frame, expr)}")
            return False  # the loader: where the stream is meant to go
        callees = follower.callees(frame, expr)
        if not callees or depth >= 4:
            loop_bound = isinstance(expr.func, ast.Name) and expr.func.id in loop_targets
            (found.configured if loop_bound else found.opaque).append(f"{callee}() at {_where(frame, expr)}")
            return True
        for callee_frame in callees:
            params = {p for p, arg in callee_frame.bindings.items() if arg in args}
            if not params:  # the stream goes to *args, **kwargs or a starred argument: not followed
                found.opaque.append(f"{callee}() at {_where(frame, expr)}")
                continue
            found.followed.append(callee_frame.defn.qualname)
            _trace(follower, callee_frame, params, found, depth + 1)
        return True

    for node in nodes:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            if expression(node.value):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names.update(t.id for t in targets if isinstance(t, ast.Name))
        elif isinstance(node, (ast.Return, ast.Expr, ast.YieldFrom)) and getattr(node, "value", None) is not None:
            expression(node.value)
        elif isinstance(node, ast.Call):
            expression(node)
    loops = [n for n in nodes if isinstance(n, (ast.For, ast.AsyncFor)) and carries(n.iter)]
    generator = any(isinstance(n, (ast.Yield, ast.YieldFrom)) for n in nodes)
    for loop in loops:
        yields = [n for stmt in loop.body for n in ast.walk(stmt) if isinstance(n, ast.Yield)]
        if not yields:
            found.materialized.append(
                f"{frame.defn.qualname} takes every item of the stream before "
                f"{'it yields one' if generator else 'it returns'} ({_where(frame, loop)})"
            )
            continue
        first = [
            n
            for n in ast.walk(loop)
            if isinstance(n, ast.If)
            and f"startswith('{LM_PREFIX}')" in ast.unparse(n.test)
            and any(isinstance(y, ast.Yield) for stmt in n.body for y in ast.walk(stmt))
        ]
        if first:
            found.grouped.append(f"{frame.defn.qualname} ({frame.defn.file.removeprefix('vllm/models/')})")


def vision_stream(ctx: Context, file: str, cls: str) -> tuple[StreamPath | None, str]:
    """The stream's path through ``cls.load_weights`` of ``file`` (None and why, where it cannot be traced)."""
    follower = Follower(ctx)
    start = follower.function(file, cls, "load_weights")
    if start is None:
        return None, f"{cls}.load_weights not found in {file}"
    params = [a.arg for a in start.node.args.args][1:2]
    if not params:
        return None, f"{cls}.load_weights takes no weights"
    found = StreamPath()
    _trace(follower, follower.frame(start), set(params), found)
    return found, f"{file.removeprefix('vllm/models/')}: {start.qualname}"


def text_class_finalizes(ctx: Context, file: str, cls: str) -> tuple[bool | None, str]:
    """Whether the language model of the vision class runs ``process_weights_after_loading`` inside its
    ``load_weights`` (None: its class could not be found), with the evidence."""
    follower = Follower(ctx)
    vision = follower.class_def(file, cls)
    classes = follower.classes_of_attribute(vision, "language_model") if vision is not None else []
    if not classes:
        return None, f"the class of {cls}.language_model could not be followed from {file}"
    checked = []
    for text_class in classes:
        load = follower.method(text_class, "load_weights")
        if load is None:
            return None, f"{text_class.where()} has no load_weights"
        checked.append(load)

        def on_self(frame, call: ast.Call) -> bool:
            return ast.unparse(call.func).startswith("self.")

        for path in follower.walk(follower.frame(load, text_class), 2, follow=on_self):
            for call in calls_in(path.frame.node):
                if ast.unparse(call.func).endswith("process_weights_after_loading"):
                    return True, f"{path.names()} calls {ast.unparse(call.func)}() ({_where(path.frame, call)})"
    by_name: dict[str, list[str]] = {}
    for load in checked:
        by_name.setdefault(load.qualname, []).append(load.file.rsplit("/", 2)[-2])
    where = "; ".join(f"{name} ({', '.join(dirs)})" if len(dirs) > 1 else name for name, dirs in by_name.items())
    return False, f"no process_weights_after_loading is reachable from {where}"


def _upstream_streams(file: str, cls: str = VISION_CLASS):
    """Upstream where nothing on the path from ``weights`` to the loader holds the stream whole or reorders it,
    and either a generator on the way yields the language model's tensors as they arrive (the rest deferred), or
    the language model does not finalize inside its ``load_weights`` (so it may take its tensors in several runs)."""

    def probe(ctx: Context, tree: ast.Module | None) -> Outcome | None:
        if tree is None:
            return Outcome.not_applicable(f"no vision class in this release ({file} is absent)")
        if find_scope(tree, cls, None) is None:
            return Outcome.not_applicable(f"{file} defines no {cls}")
        method = find_scope(tree, cls, "load_weights")
        if method is None or mentions_injected(method):
            return None  # absent: the anchors say drifted; ours: they tell applied from modified
        path, where = vision_stream(ctx, file, cls)
        if path is None or path.materialized or path.opaque or not path.loader:
            return None
        through = f" through {', '.join(dict.fromkeys(path.followed))}" if path.followed else ""
        if path.grouped:
            return Outcome.upstream(
                f"{where} passes the weights to the loader as a stream{through}; {path.grouped[0]} yields "
                f"{LM_PREFIX}* tensors as they arrive and defers only the rest"
            )
        finalizes, evidence = text_class_finalizes(ctx, file, cls)
        if finalizes is False:
            return Outcome.upstream(
                f"{where} passes the weights to the loader as they come{through}, nothing sorts or holds them, "
                f"and the language model finalizes after the load: {evidence}"
            )
        return None

    return probe


def _recipe_stream_load(tree: ast.Module, scope: ast.AST | None) -> str | None:
    """The DGX-Spark recipe's patch_dsv4_vl_stream_load.py: a nested generator replaces the eager sort."""
    if scope is None:
        return None
    for node in ast.walk(scope):
        if isinstance(node, ast.FunctionDef) and node.name == "_stream_language_model_first":
            return f"load_weights defines the nested generator {node.name}() in place of the sort"
    return None


RECIPE_STREAM_LOAD = ForeignEdit(
    script="patch_dsv4_vl_stream_load.py",
    recipe="DGX-Spark recipe",
    meaning="it streams the load as this patch does, but patch-dsv4 can neither verify nor revert it: take it over",
    found=_recipe_stream_load,
)


SORTED_MAPPED = Variant(
    anchor="mapped = iter(sorted(mapped, key=lambda x: x[0]))",
    replacement=(
        "# patch-dsv4 (stream-load): stream language-model tensors, defer the rest.\n"
        "mapped = _patch_dsv4_stream_language_model_first(mapped)\n"
    ),
    releases="0.30.0-0.32.0",
)
#: The 0.28.1rc nightlies sorted the mapper's output in one statement.
SORTED_MAPPER = Variant(
    anchor="mapped = sorted(self.hf_to_vllm_mapper.apply(weights), key=lambda x: x[0])",
    replacement=(
        "# patch-dsv4 (stream-load): stream language-model tensors, defer the rest.\n"
        "mapped = _patch_dsv4_stream_language_model_first(self.hf_to_vllm_mapper.apply(weights))\n"
    ),
    releases="0.28.1rc nightlies (vision class in nvidia/vl_model.py)",
)
#: V4.1's vision class sorts the mapper's output in one statement too.
V41_SORTED_MAPPER = Variant(
    anchor=SORTED_MAPPER.anchor, replacement=SORTED_MAPPER.replacement, releases="V4.1: 0.30.0-0.32.0"
)


class StreamLoad(Patch):
    id = "stream-load"
    title = "vision-class load_weights streams the checkpoint instead of sorting it in host memory"
    serve_impact = (
        "the vision loader sorts the checkpoint and holds the whole pack in host memory: a 128 GB unified-memory "
        "box wedges mid-load"
    )
    edits = tuple(
        ReplaceStatements(
            label=label,
            file=file,
            scope=Scope(cls, "load_weights"),
            variants=variants,
            helpers=(_patch_dsv4_stream_language_model_first,),
            probe=_upstream_streams(file, cls),
            foreign=(RECIPE_STREAM_LOAD,),
        )
        for label, file, cls, variants in (
            ("stream language-model tensors", VL_MODEL, VISION_CLASS, (SORTED_MAPPED,)),
            (
                "stream language-model tensors (nightly layout)",
                NIGHTLY_VL_MODEL,
                VISION_CLASS,
                (SORTED_MAPPED, SORTED_MAPPER),
            ),
            *(
                (f"stream language-model tensors ({tag}, {vendor})", file, V41_VISION_CLASS, (V41_SORTED_MAPPER,))
                for vendor in ("nvidia", "amd")
                for file, tag in in_layouts(f"{vendor}/vl_model.py")
            ),
        )
    )


EXAMPLES = (
    Example(
        "sorted-iterator",
        VL_MODEL,
        before="""\
import torch


class DeepseekV4ForConditionalGeneration(torch.nn.Module):
    def load_weights(self, weights):
        mapped = self.hf_to_vllm_mapper.apply(weights)
        if child_finalizes:
            # one contiguous delegation
            mapped = iter(sorted(mapped, key=lambda x: x[0]))
        return AutoWeightsLoader(self).load_weights(mapped)

    def other(self, mapped):
        mapped = iter(sorted(mapped, key=lambda x: x[0]))
        return mapped
""",
        after='''\
import torch


def _patch_dsv4_stream_language_model_first(weights):
    """Yield ``language_model.*`` weights as they arrive, then the rest.

    Written by patch-dsv4 (stream-load). Sorting the whole iterator held every
    tensor of the checkpoint in host memory; this keeps the language model's
    weights in one contiguous group while holding only the small rest, cloned
    so it does not pin the loader's per-shard storage. The rest is grouped by
    top-level module (stable, so arrival order holds within a group).
    """
    rest = []
    handoff = []
    for item in weights:
        if item[0].startswith("language_model."):
            # Hand the tensor over without keeping a reference in this frame,
            # so the caller can free it before asking for the next one.
            handoff.append(item)
            del item
            yield handoff.pop()
        else:
            name, tensor = item
            rest.append((name, tensor.clone()))
            del item, name, tensor
    rest.sort(key=lambda entry: entry[0].split(".", 1)[0])
    rest.reverse()
    while rest:
        yield rest.pop()


class DeepseekV4ForConditionalGeneration(torch.nn.Module):
    def load_weights(self, weights):
        mapped = self.hf_to_vllm_mapper.apply(weights)
        if child_finalizes:
            # one contiguous delegation
            # patch-dsv4 (stream-load): stream language-model tensors, defer the rest.
            mapped = _patch_dsv4_stream_language_model_first(mapped)
        return AutoWeightsLoader(self).load_weights(mapped)

    def other(self, mapped):
        mapped = iter(sorted(mapped, key=lambda x: x[0]))
        return mapped
''',
    ),
    Example(
        "reformatted-anchor",
        VL_MODEL,
        before="""\
class DeepseekV4ForConditionalGeneration:
    def load_weights(self, weights):
        mapped = iter(sorted(mapped,key=lambda x:(x[0])))  # sort by name
""",
        after='''\
def _patch_dsv4_stream_language_model_first(weights):
    """Yield ``language_model.*`` weights as they arrive, then the rest.

    Written by patch-dsv4 (stream-load). Sorting the whole iterator held every
    tensor of the checkpoint in host memory; this keeps the language model's
    weights in one contiguous group while holding only the small rest, cloned
    so it does not pin the loader's per-shard storage. The rest is grouped by
    top-level module (stable, so arrival order holds within a group).
    """
    rest = []
    handoff = []
    for item in weights:
        if item[0].startswith("language_model."):
            # Hand the tensor over without keeping a reference in this frame,
            # so the caller can free it before asking for the next one.
            handoff.append(item)
            del item
            yield handoff.pop()
        else:
            name, tensor = item
            rest.append((name, tensor.clone()))
            del item, name, tensor
    rest.sort(key=lambda entry: entry[0].split(".", 1)[0])
    rest.reverse()
    while rest:
        yield rest.pop()


class DeepseekV4ForConditionalGeneration:
    def load_weights(self, weights):
        # patch-dsv4 (stream-load): stream language-model tensors, defer the rest.
        mapped = _patch_dsv4_stream_language_model_first(mapped)
''',
    ),
    # 0.33.0's fix, spelled anew: a renamed generator yields the language model's tensors as they arrive
    Example(
        "upstream-groups-language-model-first",
        VL_MODEL,
        before="""\
def _lm_tensors_then_rest(stream):
    later = []
    for name, tensor in stream:
        if name.startswith("language_model."):
            yield name, tensor
        else:
            later.append((name, tensor.clone()))
    yield from later


class DeepseekV4ForConditionalGeneration:
    def load_weights(self, weights):
        mapped = _lm_tensors_then_rest(weights)
        return AutoWeightsLoader(self).load_weights(mapped)
""",
        after=None,
        verdict=Verdict.UPSTREAM,
    ),
    # 0.34.0's fix: the stream goes straight to the loader, and the text class finalizes after the load
    Example(
        "upstream-streams-to-a-text-class-that-finalizes-later",
        VL_MODEL,
        before="""\
class TextModel:
    def load_weights(self, weights):
        return AutoWeightsLoader(self).load_weights(weights)

    def process_weights_after_loading(self):
        pass


class DeepseekV4ForConditionalGeneration:
    def __init__(self, vllm_config):
        text_class = TextModel
        self.language_model = text_class(vllm_config)

    def load_weights(self, weights):
        loader = AutoWeightsLoader(self)
        return loader.load_weights(iter(weights))
""",
        after=None,
        verdict=Verdict.UPSTREAM,
    ),
    # streaming into a text class that finalizes inside load_weights cuts its group in runs: not the fix
    Example(
        "streams-into-a-text-class-that-finalizes-drifts",
        VL_MODEL,
        before="""\
class TextModel:
    def load_weights(self, weights):
        loaded = AutoWeightsLoader(self).load_weights(weights)
        self._finalize()
        return loaded

    def _finalize(self):
        self.process_weights_after_loading()


class DeepseekV4ForConditionalGeneration:
    def __init__(self, vllm_config):
        self.language_model = TextModel(vllm_config)

    def load_weights(self, weights):
        return AutoWeightsLoader(self).load_weights(weights)
""",
        after=None,
        verdict=Verdict.DRIFTED,
    ),
    # the upstream helper's name is no evidence: this one holds the whole stream before yielding
    Example(
        "helper-named-as-upstream-buffers-everything-drifts",
        VL_MODEL,
        before="""\
def stream_language_model_first(weights):
    held = []
    for item in weights:
        held.append(item)
    yield from held


class DeepseekV4ForConditionalGeneration:
    def load_weights(self, weights):
        mapped = stream_language_model_first(weights)
        return AutoWeightsLoader(self).load_weights(mapped)
""",
        after=None,
        verdict=Verdict.DRIFTED,
    ),
    # a list() in a renamed helper materializes the stream as sorted() did
    Example(
        "list-in-a-renamed-helper-drifts",
        VL_MODEL,
        before="""\
def _prepared(stream):
    return list(stream)


class DeepseekV4ForConditionalGeneration:
    def load_weights(self, weights):
        return AutoWeightsLoader(self).load_weights(_prepared(weights))
""",
        after=None,
        verdict=Verdict.DRIFTED,
    ),
    # .sort() on a list comprehension of the stream: materialized and reordered
    Example(
        "sort-on-a-materialized-list-drifts",
        VL_MODEL,
        before="""\
class DeepseekV4ForConditionalGeneration:
    def load_weights(self, weights):
        mapped = [item for item in weights]
        mapped.sort(key=lambda x: x[0])
        return AutoWeightsLoader(self).load_weights(mapped)
""",
        after=None,
        verdict=Verdict.DRIFTED,
    ),
    # the sort is gone but nothing shows where the stream goes: absence of the defect is no evidence of the fix
    Example(
        "no-sort-and-no-loader-drifts",
        VL_MODEL,
        before="""\
def stream_language_model_first(w):
    yield from w


class DeepseekV4ForConditionalGeneration:
    def load_weights(self, weights):
        mapped = stream_language_model_first(weights)
""",
        after=None,
        verdict=Verdict.DRIFTED,
    ),
    Example(
        "changed-key-drifts",
        VL_MODEL,
        before="""\
class DeepseekV4ForConditionalGeneration:
    def load_weights(self, weights):
        mapped = iter(sorted(mapped, key=lambda x: x[1]))
""",
        after=None,
        verdict=Verdict.DRIFTED,
    ),
    Example(
        "no-vision-class",
        VL_MODEL,
        before="class DeepseekV4ForCausalLM:\n    pass\n",
        after=None,
        verdict=Verdict.NOT_APPLICABLE,
    ),
)
