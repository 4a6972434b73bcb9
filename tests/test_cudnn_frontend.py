"""cuDNN frontend candidates (backends/cudnn_frontend.py): not offered without a GPU or the package,
a failing cuDNN build falls back with a FUSEGRAPH_DEBUG reason instead of raising, and the graph we
describe to the frontend (NHWC strides, conv parameters, bias, activation, build steps, bindings)
computes conv + bias + activation, checked on CPU with a stand-in for the `cudnn` module whose
execute() runs torch."""

from __future__ import annotations

import pickle
import types
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import fusegraph as fg
from conftest import assert_close, rand, single_conv_group
from fusegraph.backends import cudnn_frontend
from fusegraph.backends.attention_kernel import attention_problem
from fusegraph.backends.conv_kernel import library_candidates
from fusegraph.fusion.epilogue import ConvGroup
from fusegraph.settings import override


def _conv_group(activation: str, bias: bool = True, layout: str | None = "NHWC") -> ConvGroup:
    group: ConvGroup = single_conv_group((2, 4, 6, 6), (8, 4, 3, 3), activation=activation, bias=bias, layout=layout)
    return group


def test_no_frontend_candidates_without_a_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    group = _conv_group("relu")
    assert library_candidates(group, "cpu", "k") == {}
    assert cudnn_frontend.unavailable("cpu") == "device cpu is not a GPU"
    with override(debug=1):
        offered = library_candidates(group, "cuda", "k")   # planned for a GPU that is not here
    assert "cudnn_frontend" not in offered
    if not torch.cuda.is_available():
        assert "cuDNN frontend not used: no GPU visible" in capsys.readouterr().out


def test_no_frontend_sdpa_candidate_without_a_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    g = fg.Graph(name="attn")
    q, k, v = (g.tensor((1, 2, 16, 64), dtype="float16", name=n) for n in "qkv")
    g.scaled_dot_product_attention(q, k, v, is_causal=True).set_output()
    node = next(n for n in g.to_ir().nodes if n.op == "scaled_dot_product_attention")
    with override(debug=1):
        assert cudnn_frontend.sdpa_candidate(node, attention_problem(node), "cpu", "attn") is None
    assert "cuDNN frontend not used" in capsys.readouterr().out


def test_which_epilogues_the_frontend_serves() -> None:
    assert cudnn_frontend.conv_activation(_conv_group("relu").epilogue_nodes) == "relu"
    assert cudnn_frontend.conv_activation(_conv_group("silu").epilogue_nodes) == "swish"
    assert cudnn_frontend.conv_activation(_conv_group("gelu").epilogue_nodes) == "gelu"
    assert cudnn_frontend.conv_activation(_conv_group("", bias=False).epilogue_nodes) == ""
    assert cudnn_frontend.conv_activation(_conv_group("sigmoid").epilogue_nodes) is None
    # NCHW input: the layout pass adds the exit copy to the epilogue; the frontend still serves it
    nchw = _conv_group("relu", layout=None)
    assert [n.op for n in nchw.epilogue_nodes] == ["relu", "to_layout"]
    assert cudnn_frontend.conv_activation(nchw.epilogue_nodes) == "relu"
    assert "grouped" in (cudnn_frontend.conv_unsupported(_grouped_conv(), "relu") or "")


def _grouped_conv() -> Any:
    g = fg.Graph(name="grouped")
    x = g.tensor((1, 4, 5, 5), dtype="float16", name="x")
    w = g.tensor((4, 2, 3, 3), dtype="float16", name="w")
    g.conv2d(x, w, groups=2).set_output()
    return next(n for n in g.to_ir().nodes if n.op == "conv2d")


class _FakeTensor:
    def __init__(self, name: str, dim: list[int], stride: list[int]) -> None:
        self.name, self.dim, self.stride = name, dim, stride
        self.uid: int | None = None
        if _FakeGraph.last is not None:
            _FakeGraph.last.all.append(self)

    def set_uid(self, uid: int) -> _FakeTensor:
        self.uid = uid
        return self

    def set_output(self, flag: bool) -> _FakeTensor:
        return self

    def set_data_type(self, dt: Any) -> _FakeTensor:
        return self

    def set_dim(self, dim: list[int]) -> _FakeTensor:
        self.dim = dim
        return self

    def set_stride(self, stride: list[int]) -> _FakeTensor:
        self.stride = stride
        return self


class _FakeGraph:
    """Records what we describe; execute() computes it with torch (what cuDNN would)."""

    fail_at: str | None = None
    last: _FakeGraph | None = None
    wrong: float | None = None      # scale the result: a plan that computes something else
    made: list[_FakeGraph] = []

    serializable = True             # False: a frontend that cannot serialize the engine
    plans_built: list[Any] = []     # build_plan_at_index / build_plans calls, over all graphs

    def __init__(self, **kw: Any) -> None:
        self.kw, self.steps, self.ops = kw, [], []
        self.tensors: dict[str, _FakeTensor] = {}
        self.all: list[_FakeTensor] = []
        self.uid_names: dict[int, str] = {}
        _FakeGraph.last = self
        _FakeGraph.made.append(self)

    def tensor(self, name: str, dim: list[int], stride: list[int], data_type: Any) -> _FakeTensor:
        self.tensors[name] = _FakeTensor(name, dim, stride)
        return self.tensors[name]

    def conv_fprop(self, image: Any, weight: Any, padding: list[int], stride: list[int], dilation: list[int],
                   name: str) -> _FakeTensor:
        self.ops.append(("conv", padding, stride, dilation))
        return _FakeTensor("conv", [], [])

    def bias(self, name: str, input: Any, bias: Any) -> _FakeTensor:
        self.ops.append(("bias",))
        return _FakeTensor("bias", [], [])

    def relu(self, name: str, input: Any) -> _FakeTensor:
        self.ops.append(("relu",))
        self.out = _FakeTensor("y", [], [])
        return self.out

    def sdpa(self, name: str, q: Any, k: Any, v: Any, attn_scale: float, generate_stats: bool,
             use_causal_mask: bool = False) -> tuple[_FakeTensor, None]:
        self.ops.append(("sdpa", attn_scale, generate_stats, use_causal_mask))
        self.out = _FakeTensor("o", [], [])
        return self.out, (_FakeTensor("stats", [], []) if generate_stats else None)

    def sdpa_backward(self, name: str, q: Any, k: Any, v: Any, o: Any, dO: Any, stats: Any, attn_scale: float,
                      use_causal_mask: bool = False) -> list[_FakeTensor]:
        self.ops.append(("sdpa_backward", attn_scale, use_causal_mask))
        return [_FakeTensor(n, [], []) for n in ("dq", "dk", "dv")]

    def _step(self, step: str) -> None:
        self.steps.append(step)
        if step == _FakeGraph.fail_at:
            raise RuntimeError(f"cudnnGraphNotSupportedError: no engine for this graph at {step}")

    def validate(self) -> None: self._step("validate")
    def build_operation_graph(self) -> None: self._step("build_operation_graph")
    def create_execution_plans(self, modes: list[Any]) -> None: self._step("create_execution_plans")
    def check_support(self) -> None: self._step("check_support")
    def build_plans(self) -> None:
        self._step("build_plans")
        _FakeGraph.plans_built.append("heuristics")

    def get_execution_plan_count(self) -> int: return 1

    def build_plan_at_index(self, index: int) -> None:
        self._step("build_plans")
        _FakeGraph.plans_built.append(index)

    def get_workspace_size(self) -> int: return 64

    def serialize(self, as_bytes: bool = False) -> bytes:
        if not _FakeGraph.serializable:
            raise RuntimeError("this engine cannot be serialized")
        names = {t.uid: t.name for t in self.all if t.uid is not None}
        return pickle.dumps({"ops": self.ops, "uids": names})

    def deserialize(self, handle: Any, blob: bytes) -> None:
        data = pickle.loads(blob)
        self.ops, self.uid_names = data["ops"], data["uids"]

    def execute(self, bindings: dict[Any, torch.Tensor], workspace: torch.Tensor, handle: Any = None) -> None:
        by_name = {(self.uid_names[t] if isinstance(t, int) else t.name): v for t, v in bindings.items()}
        if self.ops[0][0] == "sdpa":
            _, scale, stats, causal = self.ops[0]
            q, k, v = (by_name[n].float() for n in "qkv")
            by_name["o"].copy_(F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
                               * (self.wrong or 1.0))
            if stats:   # cuDNN's statistics: the natural-log log-sum-exp of the scaled scores
                by_name["stats"].copy_(_lse(q, k, scale, causal).reshape(by_name["stats"].shape))
            return
        if self.ops[0][0] == "sdpa_backward":
            _, scale, causal = self.ops[0]
            q, k, v = (by_name[n].float() for n in "qkv")
            # the forward's out and statistics reached it (from a forward plan, or from the caller)
            assert_close(by_name["stats"].reshape(q.shape[:-1]), _lse(q, k, scale, causal), tol=1e-4, what="stats")
            assert_close(by_name["o"].float(), F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale),
                         tol=2e-3, what="o")
            qkv = [by_name[n].float().requires_grad_(True) for n in "qkv"]
            with torch.enable_grad():
                out = F.scaled_dot_product_attention(*qkv, is_causal=causal, scale=scale)
                grads = torch.autograd.grad(out, qkv, by_name["dO"].float())
            for n, gr in zip(("dq", "dk", "dv"), grads, strict=True):
                by_name[n].copy_(gr)
            return
        _, padding, stride, dilation = self.ops[0]
        y = F.conv2d(by_name["x"].float(), by_name["w"].float(), by_name["b"].float().flatten(), stride=stride,
                     padding=padding, dilation=dilation)
        by_name["y"].copy_(F.relu(y))


def _lse(q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    scores = q.float() @ k.float().transpose(-1, -2) * scale
    if causal:
        scores = scores.masked_fill(~torch.ones(scores.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    return torch.logsumexp(scores, dim=-1)


def _fake_cudnn(monkeypatch: pytest.MonkeyPatch, fail_at: str | None) -> None:
    fake = types.SimpleNamespace(
        pygraph=_FakeGraph, data_type=types.SimpleNamespace(HALF="half", BFLOAT16="bf16", FLOAT="float"),
        heur_mode=types.SimpleNamespace(A="A", FALLBACK="FALLBACK"), set_stream=lambda h, s: None)
    monkeypatch.setattr(_FakeGraph, "fail_at", fail_at)
    monkeypatch.setattr(_FakeGraph, "made", [])
    monkeypatch.setattr(_FakeGraph, "plans_built", [])
    monkeypatch.setattr(_FakeGraph, "last", None)
    monkeypatch.setattr(cudnn_frontend, "_load", lambda: (fake, None))
    monkeypatch.setattr(cudnn_frontend, "unavailable", lambda device: None)
    monkeypatch.setattr(cudnn_frontend, "_handle", lambda module, device: None)


def test_the_graph_we_describe_computes_conv_bias_relu(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_cudnn(monkeypatch, fail_at=None)
    group = _conv_group("relu", layout=None)          # NCHW user output: the result is copied back
    node = group.compute
    launch = cudnn_frontend._conv_plan(node, "relu", group.outputs[0].spec.memory_strides, torch.device("cpu"))
    graph = _FakeGraph.last
    assert graph is not None
    assert graph.steps == ["validate", "build_operation_graph", "create_execution_plans", "check_support",
                           "build_plans"]
    assert [op[0] for op in graph.ops] == ["conv", "bias", "relu"]
    assert graph.tensors["x"].stride == [144, 1, 24, 4]          # NHWC strides of [2, 4, 6, 6]
    assert graph.tensors["w"].stride == [36, 1, 12, 4]           # KRSC
    assert graph.tensors["b"].dim == [1, 8, 1, 1]
    assert graph.out.dim == [2, 8, 6, 6] and graph.out.stride == [288, 1, 48, 8]
    x, w, b = rand(2, 4, 6, 6, dtype=torch.float16), rand(8, 4, 3, 3, dtype=torch.float16), rand(8, dtype=torch.float16)
    (out,) = launch([x, w, b])
    assert out.is_contiguous()                                    # in the output spec's (NCHW) strides
    assert_close(out, F.relu(F.conv2d(x.float(), w.float(), b.float(), padding=1)).half(), what="frontend conv")


@pytest.mark.parametrize("fail_at", ["validate", "check_support", "build_plans"])
def test_a_failing_cudnn_build_falls_back_with_a_debug_reason(monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str],
                                                               fail_at: str) -> None:
    _fake_cudnn(monkeypatch, fail_at=fail_at)
    group = _conv_group("relu")
    with override(debug=1):
        got = cudnn_frontend.conv_candidate(group.compute, group.epilogue_nodes,
                                            group.outputs[0].spec.memory_strides, "cuda", "fg_k0_conv")
    assert got is None
    printed = capsys.readouterr().out
    assert "fg_k0_conv: cuDNN frontend not used: conv plan build failed: RuntimeError" in printed
    assert fail_at in printed


def test_import_failure_is_a_reason_not_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    real_import = builtins.__import__

    def no_cudnn(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "cudnn":
            raise ImportError("No module named 'cudnn'")
        return real_import(name, *args, **kwargs)

    cudnn_frontend._load.cache_clear()
    monkeypatch.setattr(builtins, "__import__", no_cudnn)
    try:
        module, why = cudnn_frontend._load()
        assert module is None and why is not None and "nvidia-cudnn-frontend" in why
    finally:
        cudnn_frontend._load.cache_clear()


def test_the_sdpa_graph_we_describe_and_its_agreement_check(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_cudnn(monkeypatch, fail_at=None)
    g = fg.Graph(name="attn")
    q, k, v = (g.tensor((1, 2, 16, 64), dtype="float16", name=n) for n in "qkv")
    g.scaled_dot_product_attention(q, k, v, is_causal=True).set_output()
    node = next(n for n in g.to_ir().nodes if n.op == "scaled_dot_product_attention")
    problem = attention_problem(node)
    assert cudnn_frontend.sdpa_unsupported(node, problem) is None
    launch, _ = cudnn_frontend._sdpa_plan(node, problem, torch.device("cpu"))
    graph = _FakeGraph.made[0]                    # the one built (then serialized, deserialized)
    assert graph.ops == [("sdpa", 0.125, False, True)] and _FakeGraph.plans_built == [0]
    assert graph.out.dim == [1, 2, 16, 64] and graph.out.stride == [2048, 1024, 64, 1]
    _check_catches_a_wrong_plan(monkeypatch, launch, node, problem, "cuDNN frontend SDPA")


def test_the_sdpa_backward_plans_compute_the_gradients(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_cudnn(monkeypatch, fail_at=None)
    g = fg.Graph(name="attn_bwd")
    dy, q, k, v, o = (g.tensor((1, 2, 16, 64), dtype="float16", name=n) for n in ("dy", "q", "k", "v", "o"))
    dq, _, _ = g.sdpa_backward(dy, q, k, v, o, is_causal=True)
    dq.set_output()
    node = next(n for n in g.to_ir().nodes if n.op == "sdpa_backward")
    problem = attention_problem(node)
    assert cudnn_frontend.sdpa_unsupported(node, problem) is None
    launch, _ = cudnn_frontend._sdpa_backward_plan(node, problem, torch.device("cpu"))
    cudnn_frontend._check_sdpa_backward(launch, node, problem, "cpu", "attn_bwd")   # gradients agree


def test_the_sdpa_forward_returns_cudnn_statistics_as_lse(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_cudnn(monkeypatch, fail_at=None)
    g = fg.Graph(name="attn_lse")
    q, k, v = (g.tensor((1, 2, 16, 64), dtype="float16", name=n) for n in "qkv")
    out, lse = g.scaled_dot_product_attention(q, k, v, is_causal=True, return_lse=True)
    out.set_output()
    lse.set_output()
    node = next(n for n in g.to_ir().nodes if n.op == "scaled_dot_product_attention")
    problem = attention_problem(node)
    assert cudnn_frontend.sdpa_unsupported(node, problem) is None     # a candidate for training forwards too
    launch, _ = cudnn_frontend._sdpa_plan(node, problem, torch.device("cpu"))
    graph = _FakeGraph.made[0]
    assert graph.ops == [("sdpa", 0.125, True, True)]
    qt, kt, vt = (rand(1, 2, 16, 64, dtype=torch.float16) for _ in range(3))
    ((out_t, got_lse),) = launch([qt, kt, vt])
    assert out_t.shape == (1, 2, 16, 64)
    assert got_lse.shape == (1, 2, 16) and got_lse.dtype == torch.float32
    assert_close(got_lse, _lse(qt, kt, 0.125, True), what="lse")
    _check_catches_a_wrong_plan(monkeypatch, launch, node, problem, "out, lse")


def _check_catches_a_wrong_plan(monkeypatch: pytest.MonkeyPatch, launch: Any, node: Any, problem: Any,
                                message: str) -> None:
    """The plan agrees with torch, and the check raises once the plan computes something else."""
    cudnn_frontend._check_sdpa(launch, node, problem, "cpu", "attn")
    monkeypatch.setattr(_FakeGraph, "wrong", 1.5)
    with pytest.raises(ValueError, match=message):
        cudnn_frontend._check_sdpa(launch, node, problem, "cpu", "attn")


def test_the_sdpa_backward_with_the_forwards_lse_builds_no_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_cudnn(monkeypatch, fail_at=None)
    g = fg.Graph(name="attn_bwd_lse")
    dy, q, k, v = (g.tensor((1, 2, 16, 64), dtype="float16", name=n) for n in ("dy", "q", "k", "v"))
    o = g.tensor((1, 2, 16, 64), dtype="float16", name="o")
    lse = g.tensor((1, 2, 16), dtype="float32", name="lse")
    dq, _, _ = g.sdpa_backward(dy, q, k, v, o, is_causal=True, lse=lse)
    dq.set_output()
    node = next(n for n in g.to_ir().nodes if n.op == "sdpa_backward")
    assert node.attrs["has_lse"]
    problem = attention_problem(node)
    launch, _ = cudnn_frontend._sdpa_backward_plan(node, problem, torch.device("cpu"))
    assert {graph.ops[0][0] for graph in _FakeGraph.made} == {"sdpa_backward"}   # no recomputing forward plan
    # the fake asserts that the out and statistics it is given are the forward's
    cudnn_frontend._check_sdpa_backward(launch, node, problem, "cpu", "attn_bwd_lse")
    dyt, qt, kt, vt = (rand(1, 2, 16, 64, dtype=torch.float16) for _ in range(4))
    want_o = F.scaled_dot_product_attention(qt.float(), kt.float(), vt.float(), is_causal=True).half()
    with pytest.raises(AssertionError):   # statistics that are not the forward's are noticed by the fake
        launch([dyt, qt, kt, vt, want_o, torch.zeros(1, 2, 16)])


# ---- SDPA graphs as serialized plans: built (by a build worker when prefetched), stored, reloaded ----

def _attention_node(causal: bool = True) -> Any:
    g = fg.Graph(name="attn")
    q, k, v = (g.tensor((1, 2, 16, 64), dtype="float16", name=n) for n in "qkv")
    g.scaled_dot_product_attention(q, k, v, is_causal=causal).set_output()
    return next(n for n in g.to_ir().nodes if n.op == "scaled_dot_product_attention")


def _backward_node() -> Any:
    g = fg.Graph(name="attn_bwd")
    dy, q, k, v, o = (g.tensor((1, 2, 16, 64), dtype="float16", name=n) for n in ("dy", "q", "k", "v", "o"))
    dq, _, _ = g.sdpa_backward(dy, q, k, v, o, is_causal=True)
    dq.set_output()
    return next(n for n in g.to_ir().nodes if n.op == "sdpa_backward")


@pytest.fixture
def plan_store(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> Any:
    """The stand-in cudnn, a GPU identity (plans are stored per GPU) and an empty cache dir."""
    from fusegraph.backends import cudnn_plans
    from fusegraph.tune import keys

    _fake_cudnn(monkeypatch, fail_at=None)
    monkeypatch.setattr(keys, "gpu_identity", lambda: {"name": "Fake GPU H200", "capability": "9.0"})
    monkeypatch.setattr(cudnn_frontend, "_SDPA_BUILT", {})
    monkeypatch.setattr(cudnn_plans, "_PENDING", {})
    with override(cache_dir=str(tmp_path), build_workers=0):
        yield tmp_path


def _run_candidate(node: Any) -> list[Any]:
    problem = attention_problem(node)
    launch = cudnn_frontend.sdpa_candidate(node, problem, "cpu", "attn")
    assert launch is not None
    args = [rand(*i.shape, dtype=torch.float16) for i in node.inputs]
    return [args, launch(args)]


def test_sdpa_plans_are_stored_once_checked_and_a_new_process_builds_none(plan_store: Any,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    node = _attention_node()
    args, (out,) = _run_candidate(node)
    q, k, v = (a.float() for a in args)
    assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True).half(), what="serialized SDPA")
    assert _FakeGraph.plans_built == [0]
    assert len(list((plan_store / "cudnn_plans").glob("*.plan"))) == 1       # stored after its check
    monkeypatch.setattr(cudnn_frontend, "_SDPA_BUILT", {})                   # a new process
    monkeypatch.setattr(_FakeGraph, "plans_built", [])
    checks: list[str] = []
    monkeypatch.setattr(cudnn_frontend, "_check_sdpa", lambda *a: checks.append("forward"))
    args, (again,) = _run_candidate(node)
    q, k, v = (a.float() for a in args)
    assert_close(again, F.scaled_dot_product_attention(q, k, v, is_causal=True).half(), what="reloaded SDPA")
    assert _FakeGraph.plans_built == [] and checks == []     # deserialized: nothing built, checked when stored
    bwd = _backward_node()                                                   # the recomputing forward + backward
    _run_candidate(bwd)
    assert len(list((plan_store / "cudnn_plans").glob("*.plan"))) == 3


def test_an_sdpa_engine_that_cannot_be_serialized_is_built_directly(plan_store: Any,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_FakeGraph, "serializable", False)
    args, (out,) = _run_candidate(_attention_node(causal=False))
    q, k, v = (a.float() for a in args)
    assert_close(out, F.scaled_dot_product_attention(q, k, v).half(), what="directly built SDPA")
    assert _FakeGraph.plans_built == [0, "heuristics"]      # the serialized attempt, then the direct build
    assert not list((plan_store / "cudnn_plans").glob("*.plan"))


def test_sdpa_graphs_are_prefetched_to_the_build_workers(plan_store: Any, monkeypatch: pytest.MonkeyPatch,
                                                         in_process_workers: list[Any]) -> None:
    from fusegraph.backends import cudnn_plans
    from fusegraph.tune import autotuner

    jobs = in_process_workers
    node = _backward_node()
    assert cudnn_frontend.prefetch_sdpa(node, "cuda:0") == 0            # launch-bound: torch's backends first
    monkeypatch.setattr(autotuner, "launch_bound", lambda floor: False)
    assert cudnn_frontend.prefetch_sdpa(node, "cuda:0") == 2            # the recomputing forward and the backward
    assert [f for f, _ in jobs] == ["fusegraph.backends.cudnn_plans:build_serialized"] * 2
    assert [args[0][0].backward for _, args in jobs] == [False, True] and all(a[2] == 0 for _, a in jobs)
    assert cudnn_frontend.prefetch_sdpa(node, "cuda:0") == 0            # pending already
    built = list(_FakeGraph.plans_built)
    for _, (recipes, max_plans, _) in jobs:
        got = cudnn_plans.fetch(recipes, max_plans, torch.device("cuda:0"), "attn")
        assert got.blobs and got.recipe == 0
    assert _FakeGraph.plans_built == built and not cudnn_plans._PENDING   # the workers' plans, none built here
