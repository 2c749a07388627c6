"""loader-skips: the patched code run on CPU torch (skipped alone without torch)."""

from __future__ import annotations

import ast
import collections.abc
import itertools
import logging
from pathlib import Path

import pytest

from patch_dsv4.patches import loader_skips
from patch_dsv4.patches.loader_skips import DSPARK, MODEL
from tests.injected import function_node
from tests.patches.test_loader_skips import UTILS, loader_call
from tests.records import releases_needing

torch = pytest.importorskip("torch")
nn = torch.nn
NEEDED = releases_needing("loader-skips")
GATE_HELPER = loader_skips._patch_dsv4_gate_bias_without_home
VISION_HELPER = loader_skips._patch_dsv4_vision_tower_prefixes


def _copy_into(param, loaded_weight):
    param.data.copy_(loaded_weight)


LOADER_CALL = "weight_loader = getattr(param, 'weight_loader', default_weight_loader)"


def _plain_param_branch(func: ast.FunctionDef) -> list[ast.stmt]:
    """The statement list of ``func`` that loads a plain parameter: the one holding
    ``weight_loader = getattr(param, "weight_loader", default_weight_loader)``."""
    for node in ast.walk(func):
        for field in ("body", "orelse"):
            block = getattr(node, field, None)
            if isinstance(block, list) and any(
                isinstance(stmt, ast.Assign) and ast.unparse(stmt) == LOADER_CALL for stmt in block
            ):
                return block
    raise AssertionError(f"{func.name} has no plain-parameter branch")


def load_loader_branch(path: Path, cls: str, namespace: dict):
    """The plain-parameter branch of ``cls.load_weights``, exactly as written in ``path``,
    run over ``weights`` as the loader's ``for name, loaded_weight in weights`` does."""
    block = _plain_param_branch(function_node(path, cls, "load_weights"))
    run = ast.parse(
        "def run(self, weights, params_dict):\n"
        "    loaded_params = set()\n"
        "    for name, loaded_weight in weights:\n"
        "        pass\n"
        "    return loaded_params\n"
    ).body[0]
    run.body[1].body = block
    module = ast.fix_missing_locations(ast.Module(body=[run], type_ignores=[]))
    scope = dict(namespace)
    exec(compile(module, str(path), "exec"), scope)  # noqa: S102 - the patched vLLM branch
    return scope["run"], ast.unparse(module)


def _params(*names):
    return {n: nn.Parameter(torch.zeros(4), requires_grad=False) for n in names}


def _weights(*names):
    return [(n, torch.full((4,), float(i + 1))) for i, n in enumerate(names)]


@pytest.fixture(scope="module", params=NEEDED)
def patched(request, tmp_path_factory):
    from tests.conftest import run_cli
    from tests.releases import copy_tree, pristine_tree

    tree = copy_tree(pristine_tree(request.param), tmp_path_factory.mktemp("skips") / "sp")
    pristine = pristine_tree(request.param)
    assert run_cli("apply", "--site-packages", tree, "--only", "loader-skips").code == 0
    return tree, pristine


# (file, loader class, checkpoint names as they reach the loader's branch)
LOADERS = [
    pytest.param(MODEL, "DeepseekV4Model", "layers.{}.ffn.gate.{}", id="target"),
    pytest.param(DSPARK, "DSparkDeepseekV4ForCausalLM", "model.layers.{}.ffn.gate.{}", id="dspark"),
]
# vLLM functions the branch calls; not what is under test here
STUBS = {"is_pp_missing_parameter": lambda name, model: False, "default_weight_loader": _copy_into}


def _branch(tree, file, cls):
    namespace = {**STUBS, GATE_HELPER.__name__: GATE_HELPER}
    run, code = load_loader_branch(tree / file, cls, namespace)
    assert f"if {GATE_HELPER.__name__}(name, params_dict):" in code
    return run


@pytest.mark.parametrize("file,cls,pattern", LOADERS)
def test_gate_biases_without_a_parameter_are_skipped(patched, file, cls, pattern):
    tree, _ = patched
    run = _branch(tree, file, cls)
    # 0.28/0.29 homes: hash layer 0 has no e_score_correction_bias, no layer has bias_vl.
    home = pattern.format(1, "e_score_correction_bias")
    params = _params(home)
    # the target loader sees gate.bias already mapped; the draft loader renames it itself
    bias = "bias" if file == DSPARK else "e_score_correction_bias"
    names = [
        pattern.format(0, bias),  # hash layer: no e_score_correction_bias here
        pattern.format(1, bias),  # routed layer: has one
        pattern.format(0, "bias_vl"),
        pattern.format(1, "bias_vl"),
    ]
    loaded = run(None, _weights(*names), params)
    assert loaded == {home}
    assert torch.equal(params[home].data, torch.full((4,), 2.0))


@pytest.mark.parametrize("file,cls,pattern", LOADERS)
def test_gate_biases_with_a_parameter_are_loaded(patched, file, cls, pattern):
    """Where the model has the parameters (as 0.30+ vision models do), nothing is dropped."""
    tree, _ = patched
    run = _branch(tree, file, cls)
    homes = [pattern.format(i, leaf) for i in (0, 1) for leaf in ("e_score_correction_bias", "bias_vl")]
    params = _params(*homes)
    names = [h.replace("e_score_correction_bias", "bias") if file == DSPARK else h for h in homes]
    loaded = run(None, _weights(*names), params)
    assert loaded == set(homes)
    for i, home in enumerate(homes):
        assert torch.equal(params[home].data, torch.full((4,), float(i + 1))), home


@pytest.mark.parametrize("file,cls,pattern", LOADERS)
def test_other_names_without_a_parameter_still_fail(patched, file, cls, pattern):
    tree, pristine = patched
    run = _branch(tree, file, cls)
    with pytest.raises(KeyError):
        run(None, _weights(pattern.format(1, "not_a_gate_param")), _params())
    # and the unpatched branch is what failed on the pack's bias_vl
    original, code = load_loader_branch(pristine / file, cls, STUBS)
    assert GATE_HELPER.__name__ not in code
    with pytest.raises(KeyError):
        original(None, _weights(pattern.format(1, "bias_vl")), _params())


# -- the vision tower through the release's own AutoWeightsLoader ------------------------
def load_auto_weights_loader(tree: Path):
    """AutoWeightsLoader as the release defines it (with maybe_prefix and, from 0.29,
    _get_tied_embedding_params); what it imports from elsewhere in vLLM is stubbed."""
    source = (tree / UTILS).read_text()
    wanted = {"AutoWeightsLoader", "maybe_prefix", "_get_tied_embedding_params"}
    nodes = [n for n in ast.parse(source).body if isinstance(n, (ast.ClassDef, ast.FunctionDef)) and n.name in wanted]

    class WeightsMapper:  # names reach the loader already mapped in these tests
        def __init__(self, **mappings):
            pass

        def __or__(self, other):
            return self

        def apply(self, weights):
            return weights

    namespace = {
        "torch": torch,
        "nn": nn,
        "itertools": itertools,
        "Iterable": collections.abc.Iterable,
        "logger": logging.getLogger("vllm-utils-under-test"),
        "default_weight_loader": _copy_into,
        "StageMissingLayer": type("StageMissingLayer", (nn.Module,), {}),
        "PPMissingLayer": type("PPMissingLayer", (nn.Identity,), {}),
        "VocabParallelEmbedding": type("VocabParallelEmbedding", (nn.Module,), {}),
        "support_quantized_model_reload_from_hp_weights": lambda f: f,
        "WeightsMapper": WeightsMapper,
    }
    exec(compile(ast.Module(body=nodes, type_ignores=[]), str(tree / UTILS), "exec"), namespace)  # noqa: S102
    return namespace["AutoWeightsLoader"]


def _make_loader(path: Path, model, auto_weights_loader):
    """Run the ``loader = AutoWeightsLoader(...)`` statement of ``path`` for ``model``."""
    namespace = {"self": model, "AutoWeightsLoader": auto_weights_loader, VISION_HELPER.__name__: VISION_HELPER}
    module = ast.Module(body=[loader_call(path)], type_ignores=[])
    exec(compile(module, str(path), "exec"), namespace)  # noqa: S102 - the patched vLLM statement
    return namespace["loader"]


class TextModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.lm_head = nn.Linear(4, 1, bias=False)


class VisionModel(TextModel):
    def __init__(self):
        super().__init__()
        self.vision = nn.Module()
        self.vision.proj = nn.Linear(4, 1, bias=False)
        self.aligner = nn.Linear(4, 1, bias=False)
        self.image_newline = nn.Parameter(torch.zeros(4), requires_grad=False)


VISION_CHECKPOINT = ("vision.proj.weight", "aligner.weight", "image_newline")


def _checkpoint(*names):
    return [(n, torch.full((1, 4) if n.endswith(".weight") else (4,), float(i + 1))) for i, n in enumerate(names)]


def test_vision_tower_without_a_module_is_skipped(patched):
    tree, pristine = patched
    awl = load_auto_weights_loader(tree)
    model = TextModel()
    loaded = _make_loader(tree / MODEL, model, awl).load_weights(
        iter(_checkpoint("lm_head.weight", *VISION_CHECKPOINT))
    )
    assert loaded == {"lm_head.weight"}
    assert torch.equal(model.lm_head.weight.data, torch.full((1, 4), 1.0))
    # the unpatched statement is what rejected the pack
    with pytest.raises(ValueError, match="no module or parameter named 'vision'"):
        _make_loader(pristine / MODEL, TextModel(), awl).load_weights(
            iter(_checkpoint("lm_head.weight", *VISION_CHECKPOINT))
        )


def test_vision_tower_with_a_module_is_loaded(patched):
    tree, _ = patched
    model = VisionModel()
    loaded = _make_loader(tree / MODEL, model, load_auto_weights_loader(tree)).load_weights(
        iter(_checkpoint("lm_head.weight", *VISION_CHECKPOINT))
    )
    assert loaded == {"lm_head.weight", *VISION_CHECKPOINT}
    assert torch.equal(model.vision.proj.weight.data, torch.full((1, 4), 2.0))
    assert torch.equal(model.aligner.weight.data, torch.full((1, 4), 3.0))
    assert torch.equal(model.image_newline.data, torch.full((4,), 4.0))
