"""The fused cuDNN-frontend conv epilogue candidate (backends/cudnn_conv_epilogue.py) on CPU: the
epilogue read by meaning from real plans compiled through fg.compile (conv+BN+ReLU, conv+BN+add+ReLU,
the downsample block's conv+BN + BN(conv) + ReLU), an unsupported epilogue refused with a reason,
the per-channel folding against BatchNorm in fp32, and the graph we describe to the frontend, run by a
stand-in `cudnn` module whose graph records the ops and executes them with torch."""

from __future__ import annotations

import time
import types
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fusegraph as fg
from conftest import assert_close, rand
from fusegraph.backends import cudnn_conv_epilogue as cce
from fusegraph.backends import cudnn_frontend, cudnn_plans
from fusegraph.backends.conv_kernel import library_candidates
from fusegraph.fusion.epilogue import ConvGroup, claim_epilogues
from fusegraph.fusion.partition import partition_graph
from fusegraph.settings import override


class ConvBN(nn.Module):
    """conv -> BN [-> + residual, or + BN(conv2(x)) for "downsample"] -> activation."""

    def __init__(self, residual: str = "", act: str = "relu") -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(4, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.conv2, self.bn2 = nn.Conv2d(4, 8, 1, bias=False), nn.BatchNorm2d(8)
        self.residual, self.act = residual, act
        for bn in (self.bn, self.bn2):   # non-trivial running statistics and affine
            assert bn.running_mean is not None and bn.running_var is not None
            bn.running_mean.uniform_(-1, 1)
            bn.running_var.uniform_(0.5, 2)
            bn.weight.data.uniform_(0.5, 1.5)
            bn.bias.data.uniform_(-1, 1)

    def forward(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        y = self.bn(self.conv(x))
        if self.residual == "add":
            y = y + r
        elif self.residual == "downsample":
            y = y + self.bn2(self.conv2(x))
        if self.act == "sigmoid_mul":
            return y * torch.sigmoid(y)
        return torch.relu(y)


def _groups(model: nn.Module, dtype: torch.dtype = torch.float16) -> tuple[list[ConvGroup], Any]:
    """The ConvGroups of the plan fg.compile builds for `model` (eval, channels-last)."""
    model = model.eval().to(dtype).to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    x = rand(2, 4, 6, 6, dtype=dtype).to(memory_format=torch.channels_last)
    r = rand(2, 8, 6, 6, dtype=dtype).to(memory_format=torch.channels_last)
    torch._dynamo.reset()    # each block variant is a new frame to compile (not a recompile of the last)
    compiled = fg.compile(model)
    with torch.no_grad():
        compiled(x, r)
    (part,) = [p for g in compiled.fusegraph_report.graphs for p in g.partitions]
    plan = part.plan
    items = claim_epilogues(partition_graph(plan.graph).items, plan.graph)
    return [i for i in items if isinstance(i, ConvGroup)], plan


def _main(groups: list[ConvGroup]) -> ConvGroup:
    """The ConvGroup whose epilogue does the most (the other convolutions store their result)."""
    return max(groups, key=lambda g: len(g.epilogue_nodes))


def _names(nodes: list[Any]) -> list[str]:
    return [n.name for n in nodes]


def test_conv_bn_relu_is_affine_then_relu() -> None:
    group = _main(_groups(ConvBN())[0])
    epi = cce.classify(group.compute, group.epilogue_nodes, group.inputs)
    assert epi.scale is not None and epi.shift is not None
    assert epi.residual is None and epi.residual_scale is None and epi.activation == "relu"
    # the four BatchNorm tensors (mean, var, weight, bias) are the per-channel plan inputs read
    assert len(epi.leaves) == 4 and all(n.op == "input" and n.spec.shape == (8,) for n in epi.leaves)
    assert [n.op for n in epi.constants] == ["scalar"]                   # eps
    assert epi.describe() == "conv_fprop -> mul(scale) -> add(shift) -> relu"


def test_conv_bn_add_relu_has_the_residual_input() -> None:
    group = _main(_groups(ConvBN("add"))[0])
    epi = cce.classify(group.compute, group.epilogue_nodes, group.inputs)
    assert epi.residual is not None and epi.residual.op == "input" and epi.residual.spec.shape == (2, 8, 6, 6)
    assert epi.residual_scale is None and epi.activation == "relu"
    assert len(epi.leaves) == 4
    assert epi.describe() == "conv_fprop -> mul(scale) -> add(shift) -> add(residual) -> relu"


def test_downsample_block_scales_the_residual() -> None:
    groups = _groups(ConvBN("downsample"))[0]
    group = _main(groups)
    epi = cce.classify(group.compute, group.epilogue_nodes, group.inputs)
    other = next(g for g in groups if g is not group)
    assert epi.residual is not None and epi.residual.id == other.compute.id    # the other conv's result
    assert epi.residual_scale is not None and len(epi.leaves) == 8            # two BatchNorms
    assert epi.describe() == "conv_fprop -> mul(scale) -> add(shift) -> add(mul(residual, rscale)) -> relu"


def test_unsupported_epilogue_is_not_offered_with_a_reason(monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    group = _main(_groups(ConvBN(act="sigmoid_mul"))[0])
    with pytest.raises(cce.NotServed, match="sigmoid"):
        cce.classify(group.compute, group.epilogue_nodes, group.inputs)
    monkeypatch.setattr(cudnn_frontend, "unavailable", lambda device: None)   # as if on a GPU with cuDNN
    with override(debug=1):
        got = cce.candidate(group.compute, group.epilogue_nodes, group.inputs, group.outputs[0].spec.memory_strides,
                            "float32", "cuda", "fg_k0_conv")
    assert got is None
    assert "fg_k0_conv: cuDNN frontend not used: epilogue not served: sigmoid" in capsys.readouterr().out


def test_not_offered_off_the_gpu() -> None:
    group = _main(_groups(ConvBN("add"))[0])
    assert library_candidates(group, "cpu", "k") == {}
    assert cce.candidate(group.compute, group.epilogue_nodes, group.inputs, group.outputs[0].spec.memory_strides,
                         "float32", "cpu", "k") is None


def _graph_api_block() -> tuple[ConvGroup, dict[str, torch.Tensor]]:
    """relu(BN(conv(x)) + BN2(z)) built with the Graph API (named inputs), with fp32 BN tensors."""
    g = fg.Graph(name="conv_bn_bn", compute_dtype="float32")
    x = g.tensor((2, 4, 6, 6), dtype="float16", name="x", layout="NHWC")
    w = g.tensor((8, 4, 3, 3), dtype="float16", name="w")
    z = g.tensor((2, 8, 6, 6), dtype="float16", name="z", layout="NHWC")
    names = ["mean", "var", "gamma", "beta", "mean2", "var2", "gamma2", "beta2"]
    t = {n: g.tensor((8,), dtype="float32", name=n) for n in names}
    y = g.batch_norm(g.conv2d(x, w, stride=1, padding=1), t["mean"], t["var"], t["gamma"], t["beta"], eps=1e-5)
    y2 = g.batch_norm(z, t["mean2"], t["var2"], t["gamma2"], t["beta2"], eps=1e-3)
    g.relu(g.add(y, y2)).set_output()
    plan = g.build(device="cpu")
    items = claim_epilogues(partition_graph(plan.graph).items, plan.graph)
    (group,) = [i for i in items if isinstance(i, ConvGroup)]
    values = {n: (rand(8, low=0.5) if n.startswith("var") else rand(8)) for n in names}
    return group, values


def test_folded_scale_and_shift_match_batchnorm_fp32() -> None:
    group, values = _graph_api_block()
    epi = cce.classify(group.compute, group.epilogue_nodes, group.inputs)
    assert sorted(n.name for n in epi.leaves) == sorted(values)
    vec = cce.fold(epi, [values[n.name] for n in epi.leaves], "float32", torch.device("cpu"))
    y, z = rand(2, 8, 6, 6), rand(2, 8, 6, 6)
    got = vec["scale"].view(1, -1, 1, 1) * y + vec["shift"].view(1, -1, 1, 1) + vec["rscale"].view(1, -1, 1, 1) * z
    v = values
    bn_y = F.batch_norm(y, v["mean"], v["var"], v["gamma"], v["beta"], eps=1e-5)
    bn_z = F.batch_norm(z, v["mean2"], v["var2"], v["gamma2"], v["beta2"], eps=1e-3)
    assert_close(got, bn_y + bn_z, tol=1e-6, what="folded BN")
    wrong_eps = F.batch_norm(z, v["mean2"], v["var2"], v["gamma2"], v["beta2"], eps=1e-5)
    assert (got - (bn_y + wrong_eps)).abs().max() > 1e-5      # each BN's own eps was folded in
    # the rescaled form computes the same sum: ((scale/r) y + shift/r + z) r
    res = cce.rescaled(vec, 8)
    again = (res["scale"].view(1, -1, 1, 1) * y + res["shift"].view(1, -1, 1, 1) + z) * res["rscale"].view(1, -1, 1, 1)
    assert_close(again, bn_y + bn_z, tol=1e-5, what="rescaled form")


# ---- a stand-in cudnn module: the graph records ops and executes them with torch ----

class _T:
    uids = iter(range(1, 1 << 30))

    def __init__(self, graph: _Graph, op: str, args: tuple[Any, ...] = (), **attrs: Any) -> None:
        self.graph, self.op, self.args, self.attrs = graph, op, args, attrs
        self.uid = next(_T.uids)
        self.dim: list[int] = attrs.get("dim", [])
        self.stride: list[int] = attrs.get("stride", [])

    def set_output(self, flag: bool) -> _T:
        self.graph.output = self
        return self

    def set_data_type(self, dt: Any) -> _T:
        self.data_type = dt
        return self

    def set_dim(self, dim: list[int]) -> _T:
        self.dim = dim
        return self

    def set_stride(self, stride: list[int]) -> _T:
        self.stride = stride
        return self

    def set_uid(self, uid: int) -> _T:
        self.uid = uid
        return self


class _Graph:
    fail_direct = False          # no engine when a pointwise op reads the residual directly
    last: _Graph | None = None

    def __init__(self, **kw: Any) -> None:
        self.kw = kw
        self.ops: list[tuple[str, Any]] = []
        self.steps: list[str] = []
        self.tensors: dict[str, _T] = {}
        self.output: _T | None = None
        _Graph.last = self

    def tensor(self, name: str, dim: list[int], stride: list[int], data_type: Any) -> _T:
        self.tensors[name] = _T(self, "tensor", name=name, dim=dim, stride=stride, data_type=data_type)
        return self.tensors[name]

    def _op(self, op: str, *args: Any, **attrs: Any) -> _T:
        self.ops.append((op, attrs.get("name")))
        return _T(self, op, args, **attrs)

    def conv_fprop(self, image: _T, weight: _T, padding: list[int], stride: list[int], dilation: list[int],
                   compute_data_type: Any, name: str) -> _T:
        return self._op("conv_fprop", image, weight, padding=padding, stride_=stride, dilation=dilation, name=name)

    def mul(self, a: _T, b: _T, compute_data_type: Any, name: str) -> _T:
        return self._op("mul", a, b, name=name)

    def add(self, a: _T, b: _T, compute_data_type: Any, name: str) -> _T:
        return self._op("add", a, b, name=name)

    def relu(self, input: _T, name: str) -> _T:
        return self._op("relu", input, name=name)

    def gelu(self, input: _T, name: str) -> _T:
        return self._op("gelu", input, name=name)

    def validate(self) -> None:
        self.steps.append("validate")
        if _Graph.fail_direct and any(op == "mul" and name == "residual_scale" for op, name in self.ops):
            raise RuntimeError("cudnnGraphNotSupportedError: no engine for a pointwise op off the conv chain")

    def build_operation_graph(self) -> None: self.steps.append("build_operation_graph")
    def create_execution_plans(self, modes: list[Any]) -> None: self.steps.append("create_execution_plans")
    def check_support(self) -> None: self.steps.append("check_support")
    def build_plans(self) -> None: self.steps.append("build_plans")
    def get_workspace_size(self) -> int: return 0
    plans_built: list[int] = []    # every build_plan_at_index, across graphs (the serialized route)

    def get_execution_plan_count(self) -> int:
        return 3

    def build_plan_at_index(self, index: int) -> None:
        _Graph.plans_built.append(index)
        self.selected = index

    def serialize(self, as_bytes: bool = False) -> bytes:
        import pickle
        return pickle.dumps({"ops": self.ops, "tensors": self.tensors, "output": self.output,
                             "selected": getattr(self, "selected", 0)})

    def deserialize(self, handle: Any, blob: bytes) -> None:
        import pickle
        state = pickle.loads(blob)
        self.ops, self.tensors, self.output, self.selected = (state["ops"], state["tensors"], state["output"],
                                                              state["selected"])
        self.steps.append("deserialize")

    def execute(self, bindings: Any, workspace: torch.Tensor, handle: Any = None,
                tensor_uids: tuple[int, ...] | None = None) -> None:
        if tensor_uids is not None:   # the ordered form: buffers in the order of their tensors' uids
            bindings = dict(zip(tensor_uids, bindings, strict=True))
        bindings = {k.uid if isinstance(k, _T) else k: v for k, v in bindings.items()}   # by tensor or by uid
        if getattr(self, "selected", 0) != 1:
            time.sleep(0.05)    # plan 1 is the fast one (by a margin host noise on a loaded machine does not cover)

        def value(t: _T) -> torch.Tensor:
            if t.op == "tensor":
                v = bindings[t.uid]
                assert list(v.shape) == t.dim and list(v.stride()) == t.stride, (t.attrs["name"], v.stride())
                return v.float()
            a = [value(i) for i in t.args]
            if t.op == "conv_fprop":
                return F.conv2d(a[0], a[1], stride=t.attrs["stride_"], padding=t.attrs["padding"],
                                dilation=t.attrs["dilation"])
            return {"mul": lambda: a[0] * a[1], "add": lambda: a[0] + a[1], "relu": lambda: F.relu(a[0]),
                    "gelu": lambda: F.gelu(a[0])}[t.op]()

        assert self.output is not None
        bindings[self.output.uid].copy_(value(self.output))

    def _all(self) -> list[_T]:
        seen: dict[int, _T] = {}

        def walk(t: _T) -> None:
            seen[t.uid] = t
            for a in t.args:
                walk(a)
        assert self.output is not None
        walk(self.output)
        return list(seen.values())


def _fake_cudnn(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = types.SimpleNamespace(
        pygraph=_Graph, data_type=types.SimpleNamespace(HALF="half", BFLOAT16="bf16", FLOAT="float"),
        heur_mode=types.SimpleNamespace(A="A", FALLBACK="FALLBACK"), set_stream=lambda h, s: None)
    monkeypatch.setattr(cudnn_frontend, "_load", lambda: (fake, None))
    monkeypatch.setattr(cudnn_frontend, "unavailable", lambda device: None)
    monkeypatch.setattr(cudnn_frontend, "_handle", lambda module, device: None)


@pytest.mark.parametrize("residual", ["", "add", "downsample"])
@pytest.mark.parametrize("fail_direct", [False, True])
def test_the_graph_we_describe_computes_the_block(monkeypatch: pytest.MonkeyPatch, residual: str,
                                                  fail_direct: bool) -> None:
    _fake_cudnn(monkeypatch)
    monkeypatch.setattr(_Graph, "fail_direct", fail_direct)
    groups, _ = _groups(ConvBN(residual))
    group = _main(groups)
    epi = cce.classify(group.compute, group.epilogue_nodes, group.inputs)
    launch = cce.build(epi, group.inputs, group.outputs[0].spec.memory_strides, "float32", torch.device("cpu"), "k")
    assert launch is not None
    graph = _Graph.last
    assert graph is not None and graph.steps[-1] == "build_plans"
    ops = [op for op, _ in graph.ops]
    want = {"": ["conv_fprop", "mul", "add", "relu"],
            "add": ["conv_fprop", "mul", "add", "add", "relu"],
            "downsample": ["conv_fprop", "mul", "add", "mul", "add", "relu"]}[residual]
    if residual == "downsample" and fail_direct:     # the rescaled chain: mul(scale/r), add(shift/r), add(z), mul(r)
        want = ["conv_fprop", "mul", "add", "add", "mul", "relu"]
    assert ops == want
    assert launch.mode == ("rescaled" if residual == "downsample" and fail_direct else "direct")
    # a convolution of the same shapes and epilogue form reuses the built plan
    twin = cce.build(epi, group.inputs, group.outputs[0].spec.memory_strides, "float32", torch.device("cpu"), "k2")
    assert twin is not None and twin.plan is launch.plan and _Graph.last is graph
    assert graph.tensors["x"].stride == [144, 1, 24, 4] and graph.tensors["scale"].dim == [1, 8, 1, 1]
    # run it on the group's example inputs against our conv + generated epilogue (the reference)
    from fusegraph.backends.conv_kernel import conv_group_kernel
    from fusegraph.lower import _example_inputs

    args = _example_inputs(group.inputs, "cpu")
    for k in launch.leaf_at:          # valid BatchNorm statistics (variance > 0)
        args[k] = args[k].abs() + 0.5
    plain = conv_group_kernel(group, "k", "float32", "cpu", {})
    (want_out,) = plain.launch(args)
    (got,) = launch(args)
    assert got.stride() == want_out.stride()
    assert launch.ordered is True          # the ordered binding path agreed with the dict path
    assert_close(got, want_out, tol=2e-3, what=f"fused {residual or 'conv+bn+relu'}")
    # the per-channel vectors are folded once and reused while the inputs are unchanged ...
    launch(args)
    assert launch.folds == 1
    # an alias of the same memory (what a wrapper's detach() passes) shares the version: still reused
    aliased = list(args)
    aliased[launch.leaf_at[0]] = args[launch.leaf_at[0]].detach()
    launch(aliased)
    assert launch.folds == 1
    # ... refolded after an in-place change of a BatchNorm tensor (the version counter moves)
    leaf = args[launch.leaf_at[-1]]
    leaf.add_(0.5)
    (changed,) = launch(args)
    assert launch.folds == 2
    assert_close(changed, plain.launch(args)[0], tol=2e-3, what="after an in-place BN update")
    # ... and for another tensor with other values (new memory)
    args[launch.leaf_at[0]] = args[launch.leaf_at[0]].clone() + 0.25
    (again,) = launch(args)
    assert launch.folds == 3
    assert_close(again, plain.launch(args)[0], tol=2e-3, what="with another BN tensor")


class _RankedPlans:
    """A graph with three execution plans: 0 slow, 1 fast, 2 fails to build."""

    def __init__(self) -> None:
        self.selected = 0
        self.built: list[int] = []

    def get_execution_plan_count(self) -> int:
        return 3

    def build_plan_at_index(self, index: int) -> None:
        if index == 2:
            raise RuntimeError("cudnnGraphNotSupportedError: engine 2 does not build")
        self.selected = index
        self.built.append(index)

    def get_workspace_size(self) -> int:
        return 16

    def execute(self, bindings: dict[Any, torch.Tensor], workspace: torch.Tensor, handle: Any = None) -> None:
        if self.selected == 0:
            time.sleep(0.002)


@pytest.fixture
def tuning_cache(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A GPU identity and an empty on-disk tuning cache (the plan choice goes through the autotuner)."""
    from fusegraph.tune import clear_memo, keys

    monkeypatch.setattr(keys, "gpu_identity", lambda: {"name": "Fake GPU H200", "capability": "9.0"})
    clear_memo()
    with override(cache_dir=str(tmp_path), autotune=True):
        yield
    clear_memo()


KEY = {"conv": "stride=(1, 1)", "x": "bfloat16[8x64x56x56]", "cudnn": "91900"}


@pytest.mark.usefixtures("tuning_cache")
def test_the_fastest_cudnn_plan_is_selected(capsys: pytest.CaptureFixture[str]) -> None:
    graph = _RankedPlans()
    with override(debug=1):
        cce.pick_fastest_plan(graph, types.SimpleNamespace(), None, {"y": torch.zeros(4)}, "k", KEY)
    assert graph.selected == 1 and graph.built[-1] == 1
    assert "plan 1 (tuned" in capsys.readouterr().out


@pytest.mark.usefixtures("tuning_cache")
def test_a_warm_compile_builds_only_the_remembered_cudnn_plan() -> None:
    from fusegraph.tune import clear_memo

    cce.pick_fastest_plan(_RankedPlans(), types.SimpleNamespace(), None, {"y": torch.zeros(4)}, "k", KEY)
    clear_memo()                                   # a new process: only the on-disk cache is left
    warm = _RankedPlans()
    cce.pick_fastest_plan(warm, types.SimpleNamespace(), None, {"y": torch.zeros(4)}, "k", KEY)
    assert warm.built == [1]                       # no other plan built, none timed
    other = _RankedPlans()                         # another graph (key) is timed again
    cce.pick_fastest_plan(other, types.SimpleNamespace(), None, {"y": torch.zeros(4)}, "k", {**KEY, "x": "other"})
    assert sorted(other.built[:-1]) == [0, 1] and other.selected == 1


@pytest.mark.usefixtures("tuning_cache")
def test_a_remembered_cudnn_plan_that_no_longer_builds_falls_back_to_the_heuristics() -> None:
    from fusegraph.tune import clear_memo

    class Drifted(_RankedPlans):
        """The same graph where the remembered engine (1) no longer builds (another library build)."""

        def build_plan_at_index(self, index: int) -> None:
            if index == 1:
                raise RuntimeError("engine 1 does not build here")
            super().build_plan_at_index(index)

        def build_plans(self) -> None:
            self.selected = -1                     # the heuristics' walk

    cce.pick_fastest_plan(_RankedPlans(), types.SimpleNamespace(), None, {"y": torch.zeros(4)}, "k", KEY)
    clear_memo()
    drifted = Drifted()
    cce.pick_fastest_plan(drifted, types.SimpleNamespace(), None, {"y": torch.zeros(4)}, "k", KEY)
    assert drifted.selected == -1


# ---- the serialized route (GPU + autotuning): plans built serialized, timed, stored, reloaded ----

@pytest.fixture
def serialized_route(monkeypatch: pytest.MonkeyPatch, tuning_cache: Any) -> Any:
    """The stand-in cudnn, the route a GPU takes (taken here on the CPU), no plans built yet."""
    _fake_cudnn(monkeypatch)
    monkeypatch.setattr(cce, "_serialized_route", lambda device: True)
    monkeypatch.setattr(cce, "_BUILT", {})
    monkeypatch.setattr(cudnn_plans, "_PENDING", {})
    monkeypatch.setattr(_Graph, "plans_built", [])
    with override(build_workers=0):
        yield


def _build_main(residual: str = "add") -> tuple[Any, ConvGroup]:
    groups, _ = _groups(ConvBN(residual))
    group = _main(groups)
    epi = cce.classify(group.compute, group.epilogue_nodes, group.inputs)
    launch = cce.build(epi, group.inputs, group.outputs[0].spec.memory_strides, "float32", torch.device("cpu"), "k")
    assert launch is not None
    return launch, group


def _check_against_plain(launch: Any, group: ConvGroup, what: str) -> None:
    from fusegraph.backends.conv_kernel import conv_group_kernel
    from fusegraph.lower import _example_inputs

    args = _example_inputs(group.inputs, "cpu")
    for k in launch.leaf_at:
        args[k] = args[k].abs() + 0.5
    (want,) = conv_group_kernel(group, "k", "float32", "cpu", {}).launch(args)
    (got,) = launch(args)
    assert_close(got, want, tol=2e-3, what=what)


def _new_process() -> None:
    """What a new process has: nothing built or remembered in memory, the disk caches."""
    from fusegraph.tune import clear_memo

    cce._BUILT.clear()
    clear_memo()
    _Graph.plans_built.clear()


@pytest.mark.usefixtures("serialized_route")
def test_serialized_plans_are_timed_stored_and_a_warm_build_builds_none(tmp_path: Any) -> None:
    launch, group = _build_main()
    assert sorted(_Graph.plans_built) == [0, 1, 2]          # every candidate plan built once, serialized
    assert launch.plan.graph.selected == 1                   # the fast one, deserialized
    assert set(launch.tensors.values()) <= set(cce.plans.UIDS.values())   # bound by uid
    _check_against_plain(launch, group, "serialized plan")
    assert launch.ordered is True
    (stored,) = (tmp_path / "cudnn_plans").glob("*.plan")
    _new_process()
    warm, group = _build_main()
    assert _Graph.plans_built == [] and warm.plan.graph.selected == 1
    assert warm.plan.graph.steps == ["deserialize"]
    _check_against_plain(warm, group, "stored plan")
    # a corrupt entry is deleted with a warning and the plan built again
    stored.write_bytes(b"{not json\n" + b"garbage")
    _new_process()
    with pytest.warns(cce.plans.CacheWarning, match="corrupt"):
        again, group = _build_main()
    assert sorted(_Graph.plans_built) == [0, 1, 2] and again.plan.graph.selected == 1
    _check_against_plain(again, group, "rebuilt plan")
    assert stored.read_bytes().split(b"\n", 1)[0].startswith(b'{"key"')   # rewritten whole


@pytest.mark.usefixtures("serialized_route")
def test_a_stored_plan_that_does_not_load_is_built_in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    _build_main()
    _new_process()

    def broken(self: _Graph, handle: Any, blob: bytes) -> None:
        raise RuntimeError("CUDNN_STATUS_BAD_PARAM: a plan serialized by another library build")

    monkeypatch.setattr(_Graph, "deserialize", broken)
    with pytest.warns(cce.plans.CacheWarning, match="not loadable"):
        launch, group = _build_main()
    # nothing deserializes now: built in-process (the heuristics' walk, then the timed plans)
    assert "build_plans" in launch.plan.graph.steps and "deserialize" not in launch.plan.graph.steps
    _check_against_plain(launch, group, "in-process after a bad store")


@pytest.mark.usefixtures("serialized_route")
def test_prefetched_builds_are_taken_from_the_worker(in_process_workers: list[Any]) -> None:
    from fusegraph.backends.conv_kernel import prefetch_library_plans

    jobs = in_process_workers
    groups, _ = _groups(ConvBN("add"))
    group = _main(groups)
    assert prefetch_library_plans(group, "cuda:0")
    ((function, (recipes, max_plans, device_index)),) = jobs
    assert function == "fusegraph.backends.cudnn_plans:build_serialized"
    assert max_plans == cce.MAX_PLANS and device_index == 0 and recipes[0].residual is not None
    assert not prefetch_library_plans(group, "cuda:0")        # one job per distinct plan
    built = list(_Graph.plans_built)
    launch, group = _build_main()
    assert _Graph.plans_built == built and not cudnn_plans._PENDING  # the worker's plans were used, none built here
    _check_against_plain(launch, group, "prefetched plan")
    _new_process()
    assert not prefetch_library_plans(group, "cuda:0")        # stored on disk: nothing to build


def test_recipes_pickle_and_name_the_graph_they_describe() -> None:
    import pickle

    groups, _ = _groups(ConvBN("downsample"))
    group = _main(groups)
    epi = cce.classify(group.compute, group.epilogue_nodes, group.inputs)
    recipes = cce.recipes_for(epi)
    assert [(r.form, r.vector_dtype) for r in recipes] == [("direct", "float32"), ("rescaled", "float32"),
                                                           ("direct", "float16"), ("rescaled", "float16")]
    assert pickle.loads(pickle.dumps(recipes)) == recipes
    direct, rescaled = recipes[:2]
    assert direct.roles() == ("x", "w", "scale", "shift", "residual", "rscale", "y")
    assert direct.residual_scaled and not direct.rescale_after
    assert rescaled.rescale_after and not rescaled.residual_scaled and rescaled.scale and rescaled.shift


@pytest.mark.usefixtures("serialized_route")
def test_a_worker_that_built_nothing_is_checked_in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker whose environment has no usable cuDNN (its answer: no recipe built) must not drop the
    candidate: the plans are built in-process, where cuDNN works."""
    from concurrent.futures import Future

    from fusegraph.backends import build_workers
    from fusegraph.backends.conv_kernel import prefetch_library_plans

    class Broken:
        def submit(self, function: str, *args: Any) -> Future[Any]:
            done: Future[Any] = Future()
            done.set_result(cce.plans.Built(None, failures=["package nvidia-cudnn-frontend not importable"]))
            return done

    monkeypatch.setattr(build_workers, "pool", lambda: Broken())
    groups, _ = _groups(ConvBN("add"))
    assert prefetch_library_plans(_main(groups), "cuda:0")
    launch, group = _build_main()
    assert sorted(_Graph.plans_built) == [0, 1, 2] and launch.plan.graph.selected == 1
    _check_against_plain(launch, group, "built in-process after the worker built nothing")


@pytest.mark.usefixtures("serialized_route")
@pytest.mark.parametrize("activation", ["relu", "gelu", ""])
def test_conv_bias_activation_takes_the_epilogue_route(in_process_workers: list[Any], activation: str) -> None:
    """conv + bias (+ one activation) is served like any CNN epilogue: bias as a per-channel shift, its
    plans prefetched in a build worker once per distinct problem, the fastest one timed and kept, and
    checked against conv + our epilogue."""
    from conftest import single_conv_group
    from fusegraph.backends.conv_kernel import frontend_route, prefetch_library_plans

    group = single_conv_group((2, 4, 6, 6), (8, 4, 3, 3), activation=activation)
    assert frontend_route(group) == "epilogue"
    epi = cce.classify(group.compute, group.epilogue_nodes, group.inputs)
    want = "conv_fprop -> add(shift)" + (f" -> {activation}" if activation else "")
    assert epi.describe() == want and epi.scale is None and [n.name for n in epi.leaves] == ["b"]
    assert prefetch_library_plans(group, "cuda:0")
    ((function, (recipes, _, _)),) = in_process_workers
    assert function == "fusegraph.backends.cudnn_plans:build_serialized" and recipes[0].shift
    assert not prefetch_library_plans(single_conv_group((2, 4, 6, 6), (8, 4, 3, 3), activation=activation),
                                      "cuda:0")            # a second layer of the same problem: no second job
    launch = cce.build(epi, group.inputs, group.outputs[0].spec.memory_strides, "float32", torch.device("cpu"), "k")
    assert launch is not None and launch.plan.graph.selected == 1     # the fastest of the worker's plans
    _check_against_plain(launch, group, f"conv + bias + {activation or 'nothing'}")
