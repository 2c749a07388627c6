"""The shared call-following facility (patcher/patching/follow.py) on small trees written here, and on real releases."""

from __future__ import annotations

import ast

import pytest

from patch_dsv4.patching.follow import Follower
from patch_dsv4.patching.patch import Context

PKG = "vllm/models/toy"

TREE = {
    f"{PKG}/__init__.py": """\
from vllm.platforms import current_platform
if current_platform.is_rocm():
    from .amd import Model
else:
    from .nvidia import Model
""",
    f"{PKG}/amd.py": "class Model:\n    def load_weights(self, w):\n        return w\n",
    f"{PKG}/nvidia.py": "class Model:\n    def load_weights(self, w):\n        return w\n",
    f"{PKG}/common/__init__.py": "from .woa import GroupedWoA as GroupedWoA\n",
    f"{PKG}/common/woa.py": """\
class Linear:
    def forward(self, x):
        return x


class GroupedWoA(Linear):
    def grouped_forward(self, o):
        from vllm.models.toy.ops import project

        return project(o, self)
""",
    f"{PKG}/ops.py": """\
def project(o, wo_a):
    use_fp8 = wo_a.weight.dtype == torch.float8_e4m3fn
    return o
""",
    f"{PKG}/attention.py": """\
from abc import ABC

from .common import GroupedWoA
from . import ops
from .common.woa import Linear


class Base(ABC):
    def __init__(self, cpu):
        kind = Linear if cpu else GroupedWoA
        self.wo_a = kind(1, 2)
        self.wo_b = Linear()


class Attention(Base):
    def _o_proj(self, o):
        z = self.wo_a.grouped_forward(o)
        return self.wo_b(ops.project(z, self.wo_a))
""",
    "vllm/model_executor/models/registry.py": '_MODELS = {"ToyForCausalLM": ("vllm.models.toy", "Model")}\n',
    f"{PKG}/vl.py": """\
from vllm.model_executor.models.utils import init_vllm_registered_model


class Vision:
    def __init__(self):
        self.language_model = init_vllm_registered_model(architectures=["ToyForCausalLM"])
""",
}


@pytest.fixture()
def follower() -> Follower:
    return Follower(Context.from_texts(TREE))


def test_resolves_conditional_reexports_in_a_package_init(follower):
    found = follower.resolve("vllm.models.toy", "Model")
    assert [d.file for d in found] == [f"{PKG}/amd.py", f"{PKG}/nvidia.py"]


def test_attribute_class_through_a_local_variable_holding_a_conditional_pick(follower):
    attention = follower.class_def(f"{PKG}/attention.py", "Attention")
    classes = follower.classes_of_attribute(attention, "wo_a")  # assigned in the base class's __init__
    assert sorted(c.qualname for c in classes) == ["GroupedWoA", "Linear"]


def test_registered_model_through_the_registry(follower):
    vision = follower.class_def(f"{PKG}/vl.py", "Vision")
    classes = follower.classes_of_attribute(vision, "language_model")
    assert [c.file for c in classes] == [f"{PKG}/amd.py", f"{PKG}/nvidia.py"]


def test_walk_follows_methods_function_imports_modules_and_module_calls(follower):
    start = follower.function(f"{PKG}/attention.py", "Attention", "_o_proj")
    paths = {p.names(): p for p in follower.walk(follower.frame(start), 3)}
    assert "Attention._o_proj -> GroupedWoA.grouped_forward -> project" in paths  # import inside the function
    assert "Attention._o_proj -> project" in paths  # ops.project: a module's function
    assert "Attention._o_proj -> Linear.forward" in paths  # self.wo_b(...): the class's forward
    via = paths["Attention._o_proj -> GroupedWoA.grouped_forward -> project"]
    assert ast.unparse(via.frame.bindings["wo_a"]) == "self"  # grouped_forward passes itself as wo_a
    assert via.evidence().startswith(f"{PKG}/attention.py:Attention._o_proj:")
    assert f"{PKG}/ops.py:project:1" in via.evidence()


def test_follower_reads_each_file_once_and_only_vllm_files():
    reads: list[str] = []

    def read(rel):
        reads.append(rel)
        return TREE[rel].encode() if rel in TREE else None

    follower = Follower(Context("0.0.0", None, None, read))
    start = follower.function(f"{PKG}/attention.py", "Attention", "_o_proj")
    list(follower.walk(follower.frame(start), 3))
    assert len(reads) == len(set(reads))
    assert all(rel.startswith("vllm/") for rel in reads), reads  # abc (a base class) is not vLLM's: never read


def test_attribute_loads_along_a_walk(follower):
    from patch_dsv4.patching.follow import attribute_loads

    start = follower.function(f"{PKG}/attention.py", "Attention", "_o_proj")
    reads = {p.names(): attribute_loads(p.frame.node, "weight") for p in follower.walk(follower.frame(start), 3)}
    assert [ast.unparse(n) for n in reads["Attention._o_proj -> GroupedWoA.grouped_forward -> project"]] == [
        "wo_a.weight"
    ]
    assert reads["Attention._o_proj"] == []
