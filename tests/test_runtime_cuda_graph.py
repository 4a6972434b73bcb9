"""CUDA-graph capture of Plans (runtime/cuda_graph.py): the decision rule, and on CPU the bookkeeping
around a stand-in graph whose replay re-runs the plan into the captured output buffers (what a real
CUDA graph does: fixed input buffers read, fixed output buffers overwritten). The real capture runs
in the last test on a GPU, and in bench/cuda_graph_gpu.py."""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from typing import Any

import pytest
import torch

import fusegraph as fg
from conftest import assert_close, rand
from fusegraph.frontends.torch_backend import Session
from fusegraph.ir.registry import Cost
from fusegraph.runtime import cuda_graph
from fusegraph.runtime import plan as plan_module
from fusegraph.runtime.cuda_graph import Captured, CudaGraphWarning, GraphDecision, decide
from fusegraph.runtime.kernel import Kernel
from fusegraph.settings import override


def block(static: bool = False, static_w: bool = False, **options: Any) -> tuple[Any, Any]:
    """x, w -> (softmax(relu(x + x) @ w), relu(x + x)): three kernels on CPU; static_w: w is a static input."""
    g = fg.Graph(name="three", compute_dtype="float32")
    x = g.tensor((8, 16), dtype="float32", name="x")
    w = g.tensor((16, 12), dtype="float32", name="w", static=static_w)
    h = g.relu(g.add(x, x))
    g.softmax(g.matmul(h, w), dim=-1).set_output()
    h.set_output()
    return g.build(static=static, **options), g


def eager(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    h = torch.relu(x + x)
    return torch.softmax(h @ w, dim=-1), h


def fake_kernel(name: str, nbytes: int, host_sync: bool = False) -> Kernel:
    return Kernel(name=name, kind="pointwise", backend="triton", nodes=(), inputs=(), outputs=(),
                  cost=Cost(nbytes, 0), launch=lambda args: list(args), host_sync=host_sync)


class FakeGraph:
    """Replays by re-running the captured function on the static inputs and writing its results
    into the static outputs, like a CUDA graph's fixed buffers."""

    def __init__(self, run_plain: Any, static_inputs: list[torch.Tensor], static_outputs: list[torch.Tensor]) -> None:
        self.run_plain, self.static_inputs, self.static_outputs = run_plain, static_inputs, static_outputs
        self.ptrs = [t.data_ptr() for t in static_inputs]
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        inputs = [t if t is not None else at_address(ptr) for t, ptr in zip(self.static_inputs, self.ptrs, strict=True)]
        for out, new in zip(self.static_outputs, self.run_plain(inputs), strict=True):
            out.copy_(new)


def at_address(ptr: int) -> torch.Tensor:
    """An input a reuse plan reads in place from another plan's captured outputs (a real graph has the
    address baked in; the stand-in finds the buffer there)."""
    for captured in list(cuda_graph._reused_outputs.values()):
        for out in captured.static_outputs:
            if out.data_ptr() == ptr:
                return out
    raise AssertionError(f"no captured output at {ptr:#x}")


def fake_capture(run_plain: Any, inputs: Sequence[torch.Tensor], by_reference: Any = ()) -> Captured:
    with torch.no_grad():                                   # as capture() makes them
        static_inputs = cuda_graph.input_buffers(inputs, frozenset(by_reference))
        static_outputs = run_plain(static_inputs)
    return Captured(FakeGraph(run_plain, static_inputs, static_outputs), static_inputs, static_outputs, None,
                    frozenset(by_reference))


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU plans decide to capture (as a CUDA plan would) and capture with the stand-in graph."""
    monkeypatch.setattr(plan_module, "decide",
                        lambda requested, device, kernels, inputs, static_inputs=():
                        GraphDecision(requested is not False, "test: capture",
                                      len(inputs) - len(static_inputs)))
    monkeypatch.setattr(cuda_graph, "capture", fake_capture)


# ---- the decision rule ----

def test_decision_off_forced_and_not_capturable() -> None:
    plan, _ = block()
    ins = plan.graph.inputs
    cheap = [fake_kernel("a", 1000), fake_kernel("b", 1000)]
    assert "cpu" in plan.cuda_graph_note and plan.cuda_graph is None and not plan.cuda_graph_captured
    assert not decide(None, "cpu", cheap, ins).capture
    assert "cuda_graphs=False" in decide(False, "cuda", cheap, ins).note
    forced = decide(True, "cuda", [fake_kernel("big", 10**11)], ins)
    assert forced.capture and forced.copies == 2 and "forced" in forced.note   # the two inputs
    with override(cuda_graphs=False):
        off = decide(True, "cuda", cheap, ins)
        assert not off.capture and "settings.cuda_graphs" in off.note
    sync = decide(True, "cuda", [cheap[0], fake_kernel("item", 8, host_sync=True)], ins)
    assert not sync.capture and "item" in sync.note and "wait for the device" in sync.note
    assert "no kernels" in decide(True, "cuda", [], ins).note


def test_decision_automatic_rule() -> None:
    plan, _ = block()
    ins = plan.graph.inputs
    small = decide(None, "cuda", [fake_kernel(f"k{i}", 4096) for i in range(3)], ins)
    assert small.capture and small.note.startswith("auto: launch-bound") and small.copies == 2
    # one kernel: one launch would become one replay plus the copies
    one = decide(None, "cuda", [fake_kernel("k", 4096)], ins[:1])
    assert not one.capture and "one kernel" in one.note
    assert decide(True, "cuda", [fake_kernel("k", 4096)], ins[:1]).capture
    # many inputs and outputs to copy for two cheap kernels: the copies cost more than the launches
    many = decide(None, "cuda", [fake_kernel(f"k{i}", 4096) for i in range(2)], list(ins) * 4)
    assert not many.capture and "not worth it" in many.note
    # device-bound (10 GB moved per kernel): the launches hide behind the work; copies only add time
    big = decide(None, "cuda", [fake_kernel(f"k{i}", 10**10) for i in range(3)], ins)
    assert not big.capture and "not worth it" in big.note


def test_decision_refuses_overlapping_input_strides() -> None:
    g = fg.Graph(name="expanded", compute_dtype="float32")
    x = g.tensor((8, 16), dtype="float32", name="x", strides=(0, 1))
    g.exp(g.add(x, x)).set_output()
    plan = g.build()
    note = decide(True, "cuda", [fake_kernel("a", 10)], plan.graph.inputs).note
    assert "overlapping" in note and "x" in note


def test_bad_options_are_rejected() -> None:
    with pytest.raises(fg.InvalidValueError, match="graph_outputs"):
        block(graph_outputs="share")
    with pytest.raises(fg.InvalidValueError, match="cuda_graphs"):
        block(cuda_graphs="yes")


# ---- the bookkeeping around a captured plan ----

def test_captured_plan_copies_inputs_and_returns_fresh_outputs(fake_cuda: None) -> None:
    plan, _ = block()
    assert plan.cuda_graph is not None and not plan.cuda_graph_captured
    x1, w = rand(8, 16), rand(16, 12)
    y1, h1 = plan(x1, w)                       # warm-up, kernel by kernel, then capture
    assert plan.cuda_graph_captured and "captured" in plan.cuda_graph_note
    graph = plan.cuda_graph.captured.graph
    assert graph.replays == 0
    for out, ref in zip((y1, h1), eager(x1, w), strict=True):
        assert_close(out, ref)
    kept = [y1.clone(), h1.clone()]
    x2 = rand(8, 16)
    y2, h2 = plan(x2, w)                       # replay: x2 copied into the captured buffer
    assert graph.replays == 1
    for out, ref in zip((y2, h2), eager(x2, w), strict=True):
        assert_close(out, ref)
    x3 = rand(8, 16)
    y3, h3 = plan(x3, w)                       # y2, h2 (the captured buffers) still held: kernel by kernel
    assert graph.replays == 1 and plan.cuda_graph.live_calls == 1 and plan.cuda_graph.cloning
    assert_close(y2, eager(x2, w)[0])          # not overwritten
    assert y2.data_ptr() != y3.data_ptr()
    del y2, h2, out                            # (`out` held h2 since the check loop above)
    x4 = rand(8, 16)
    y4, h4 = plan(x4, w)                       # from now on a replay, its outputs cloned
    assert graph.replays == 2
    # earlier results are the caller's: the next replays did not overwrite them
    assert torch.equal(y1, kept[0]) and torch.equal(h1, kept[1])
    assert_close(y4, eager(x4, w)[0])
    assert all(o.data_ptr() != s.data_ptr() for o in (y3, h3, y4, h4) for s in plan.cuda_graph.captured.static_outputs)
    # the user's tensors are only read: the graph works on its own input buffers
    assert all(s.data_ptr() != t.data_ptr() for s, t in zip(plan.cuda_graph.captured.static_inputs, (x3, w),
                                                            strict=True))
    assert_close(y3, eager(x3, w)[0])


def test_replay_copies_each_input_once_and_leaves_autograd_alone(fake_cuda: None) -> None:
    plan, _ = block()
    w = rand(16, 12).requires_grad_()
    plan(rand(8, 16), w)
    source = plan.cuda_graph.replay_source
    assert source.count(".copy_(") == 2 == len(plan.graph.inputs)
    # outputs: the captured buffers while the caller drops them (no clone per call)
    assert source.count(".clone()") == 0 and "USE(" in source and plan.cuda_graph_copies == 2
    y, _ = plan(rand(8, 16), w)
    assert not y.requires_grad and torch.is_grad_enabled()
    assert not any(t.requires_grad for t in plan.cuda_graph.captured.static_inputs)


def test_alias_outputs_are_the_captured_buffers(fake_cuda: None) -> None:
    plan, _ = block(graph_outputs="alias")
    w = rand(16, 12)
    plan(rand(8, 16), w)
    x2 = rand(8, 16)
    y2, _ = plan(x2, w)
    assert_close(y2, eager(x2, w)[0])
    y3, _ = plan(rand(8, 16), w)
    assert y2.data_ptr() == y3.data_ptr() == plan.cuda_graph.captured.static_outputs[0].data_ptr()
    assert plan.graph_outputs == "alias" and ".clone()" not in plan.cuda_graph.replay_source


def test_output_that_is_an_input_is_not_aliased(fake_cuda: None) -> None:
    g = fg.Graph(name="passthrough", compute_dtype="float32")
    x = g.tensor((4, 8), dtype="float32", name="x")
    g.mul(x, 1.0).set_output()                 # simplifies to x itself
    g.exp(x).set_output()
    plan = g.build()
    x1 = rand(4, 8)
    plan(x1)
    x2 = rand(4, 8)
    same, e2 = plan(x2)
    assert plan.cuda_graph_captured
    assert torch.equal(same, x2) and same.data_ptr() != x2.data_ptr()
    assert_close(e2, torch.exp(x2))


def test_guards_run_before_the_copy(fake_cuda: None) -> None:
    plan, _ = block()
    w = rand(16, 12)
    plan(rand(8, 16), w)
    assert plan.cuda_graph_captured
    x_big = rand(4, 16)                        # another signature: a rebuilt variant, not the graph
    y, _ = plan(x_big, w)
    assert_close(y, eager(x_big, w)[0]) and plan.variants() == 1
    assert plan.cuda_graph.captured.graph.replays == 0
    static_plan, _ = block(static=True)
    static_plan(rand(8, 16), w)
    with pytest.raises(fg.ExecutionError):
        static_plan(rand(8, 16, dtype=torch.float64), w)
    with pytest.raises(fg.ExecutionError):
        static_plan(rand(4, 16), w)
    assert static_plan.cuda_graph.captured.graph.replays == 0


def test_capture_error_falls_back_with_a_warning(fake_cuda: None, monkeypatch: pytest.MonkeyPatch) -> None:
    attempts = []

    def failing(run_plain: Any, inputs: Sequence[torch.Tensor], by_reference: Any = ()) -> Captured:
        attempts.append(1)
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(cuda_graph, "capture", failing)
    plan, _ = block()
    x, w = rand(8, 16), rand(16, 12)
    with pytest.warns(CudaGraphWarning, match="not permitted"):
        y, _ = plan(x, w)
    assert_close(y, eager(x, w)[0])
    assert not plan.cuda_graph_captured and "capture failed" in plan.cuda_graph_note
    assert plan.cuda_graph_copies == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        x2 = rand(8, 16)
        assert_close(plan(x2, w)[0], eager(x2, w)[0])
    assert len(attempts) == 1                  # no second attempt


def test_no_capture_inside_the_callers_capture(fake_cuda: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cuda_graph, "stream_capturing", lambda: True)
    plan, _ = block()
    x, w = rand(8, 16), rand(16, 12)
    assert_close(plan(x, w)[0], eager(x, w)[0])
    assert not plan.cuda_graph_captured        # still pending: captured on a call outside theirs
    monkeypatch.setattr(cuda_graph, "stream_capturing", lambda: False)
    plan(x, w)
    assert plan.cuda_graph_captured


# ---- static inputs: captured by reference ----

def test_decision_counts_only_inputs_that_are_copied() -> None:
    g = fg.Graph(name="weights", compute_dtype="float32")
    x = g.tensor((8, 8192), dtype="float32", name="x")
    w = g.tensor((8192, 8192), dtype="float32", name="w")          # 268 MB: copying it costs ~100 us
    g.matmul(x, w).set_output()
    ir = g.to_ir()
    kernels = [fake_kernel(f"k{i}", 4096) for i in range(3)]
    copied = decide(None, "cuda", kernels, ir.inputs)
    assert not copied.capture and copied.copies == 2 and "2 copies of 268.70 MB" in copied.note
    in_place = decide(None, "cuda", kernels, ir.inputs, static_inputs=(1,))
    assert in_place.capture and in_place.copies == 1 and "1 static input(s) read in place" in in_place.note
    assert "1 copies of 0.26 MB" in in_place.note   # x (262 kB) is still copied
    forced = decide(True, "cuda", kernels, ir.inputs, static_inputs=(0, 1))
    assert forced.capture and forced.copies == 0


def test_static_input_is_read_in_place_not_copied(fake_cuda: None) -> None:
    plan, _ = block(static_w=True)
    assert plan.static_inputs == (1,) and plan.cuda_graph_copies == 1
    x, w = rand(8, 16), rand(16, 12).requires_grad_()
    plan(x, w)
    captured = plan.cuda_graph.captured
    assert captured.static_inputs[1].data_ptr() == w.data_ptr()                  # w itself, not a copy
    assert captured.static_inputs[0].data_ptr() != x.data_ptr()
    assert not captured.static_inputs[1].requires_grad
    source = plan.cuda_graph.replay_source
    assert source.count(".copy_(") == 1 and "I0.copy_(s0)" in source and "I1.copy_" not in source
    assert "s1.data_ptr() != P1" in source and "read in place" in plan.cuda_graph_note
    x2 = rand(8, 16)
    assert_close(plan(x2, w)[0], eager(x2, w)[0])
    with torch.no_grad():
        w.mul_(-2.0)                           # updated in place (an optimizer step): still the captured memory
    x3 = rand(8, 16)
    y3, h3 = plan(x3, w.detach())              # a view of the same memory is the same static input
    assert captured.graph.replays == 2 and plan.cuda_graph.moved_calls == 0
    for out, ref in zip((y3, h3), eager(x3, w.detach()), strict=True):
        assert_close(out, ref)


def test_another_tensor_for_a_static_input_runs_kernel_by_kernel(fake_cuda: None) -> None:
    plan, _ = block(static_w=True)
    w1 = rand(16, 12)
    kept = w1.clone()
    plan(rand(8, 16), w1)
    graph = plan.cuda_graph.captured.graph
    x, w2 = rand(8, 16), rand(16, 12)
    with pytest.warns(CudaGraphWarning, match="static input.* w .*kernel by kernel"):
        y, h = plan(x, w2)
    for out, ref in zip((y, h), eager(x, w2), strict=True):
        assert_close(out, ref)
    assert graph.replays == 0 and plan.cuda_graph.moved_calls == 1
    assert torch.equal(w1, kept)               # the captured tensor was not overwritten with w2
    with warnings.catch_warnings():
        warnings.simplefilter("error")         # warned once per plan
        assert_close(plan(x, w2)[0], eager(x, w2)[0])
        w1.data = rand(16, 12)                 # same object, storage moved: not the captured memory
        assert_close(plan(x, w1)[0], eager(x, w1)[0])
        assert plan.cuda_graph.moved_calls == 3 and graph.replays == 0
        w3 = plan.cuda_graph.captured.static_inputs[1]      # the captured memory again: replays
        assert_close(plan(x, w3)[0], eager(x, kept)[0])
        assert graph.replays == 1


def test_static_inputs_from_build_and_tensor_like(fake_cuda: None) -> None:
    w_t = rand(16, 12)
    g = fg.Graph(name="like", compute_dtype="float32")
    x = g.tensor((8, 16), dtype="float32", name="x")
    w = g.tensor_like(w_t, name="w", static=True)
    b = g.tensor((12,), dtype="float32", name="b")
    g.add(g.matmul(g.relu(x), w), b).set_output()
    plan = g.build(static_inputs=[b])
    assert plan.static_inputs == (1, 2)
    b_t = rand(12)
    plan(rand(8, 16), w_t, b_t)
    assert plan.cuda_graph.replay_source.count(".copy_(") == 1
    x2 = rand(8, 16)
    assert_close(plan(x2, w_t, b_t), torch.relu(x2) @ w_t + b_t)
    assert plan.cuda_graph.captured.graph.replays == 1
    assert g.build(static_inputs=b).static_inputs == (1, 2)
    other = fg.Graph(name="other")
    with pytest.raises(fg.GraphError, match="static_inputs"):
        g.build(static_inputs=[other.tensor((2,), name="y")])
    with pytest.raises(fg.GraphError, match="static_inputs"):
        g.build(static_inputs=[g.relu(x)])
    from fusegraph.compiler import compile_graph
    with pytest.raises(fg.InvalidValueError, match="static_inputs"):
        compile_graph(g.to_ir(), "cpu", static_inputs=[3])


@pytest.fixture
def built_partitions(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every torch-backend partition built while the test runs (its .plan)."""
    from fusegraph.frontends import torch_partition

    built: list[Any] = []
    original = torch_partition.CompiledPartition._build

    def spy(self: Any, input_vals: Any, build_options: Any) -> None:
        original(self, input_vals, build_options)
        built.append(self)

    monkeypatch.setattr(torch_partition.CompiledPartition, "_build", spy)
    return built


def test_torch_frontend_marks_parameters_static(built_partitions: list[Any]) -> None:
    built = built_partitions
    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(16, 12), torch.nn.ReLU())
    compiled = torch.compile(model, backend=Session("reduce-overhead"))
    x = rand(8, 16)
    with torch.no_grad():
        assert_close(compiled(x), model(x))
    torch._dynamo.reset()
    plans = [p.plan for p in built if p.plan is not None]
    assert plans
    for plan in plans:                         # weight and bias are static, x is not
        names = {plan.graph.inputs[i].name for i in plan.static_inputs}
        assert len(plan.static_inputs) == 2 == len(plan.graph.inputs) - 1, (names, plan.graph.inputs)


def test_forced_off_never_captures(fake_cuda: None) -> None:
    plan, _ = block(cuda_graphs=False)
    w = rand(16, 12)
    for _ in range(2):
        x = rand(8, 16)
        assert_close(plan(x, w)[0], eager(x, w)[0])
    assert plan.cuda_graph is None and not plan.cuda_graph_captured


def test_reduce_overhead_mode_forces_cuda_graphs() -> None:
    assert Session("reduce-overhead")._build_options()["cuda_graphs"] is True
    assert "cuda_graphs" not in Session("default")._build_options()
    assert Session("default")._build_options("forward")["graph_outputs"] == "reuse"   # training: never cloned
    assert Session("reduce-overhead", {"cuda_graphs": False})._build_options()["cuda_graphs"] is False


_INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"


# Under the Triton interpreter a kernel copies its CUDA arguments to the host, which no capture
# allows: this test means the compiled kernels (run the GPU tests with TRITON_INTERPRET=0).
@pytest.mark.skipif(not torch.cuda.is_available() or _INTERPRETING, reason="needs a GPU, compiled kernels")
def test_real_capture_on_gpu() -> None:
    g = fg.Graph(name="gpu_three", compute_dtype="float32")
    x = g.tensor((64, 128), dtype="float32", name="x")
    w = g.tensor((128, 96), dtype="float32", name="w")
    h = g.relu(g.add(x, x))
    g.softmax(g.matmul(h, w), dim=-1).set_output()
    plan = g.build("cuda", cuda_graphs=True)
    w_t = torch.randn(128, 96, device="cuda")
    outs = []
    for _ in range(3):
        x_t = torch.randn(64, 128, device="cuda")
        outs.append((plan(x_t, w_t), x_t))
    assert plan.cuda_graph_captured, plan.cuda_graph_note
    for y, x_t in outs:
        assert_close(y, torch.softmax(torch.relu(x_t + x_t) @ w_t, dim=-1), tol=1e-2)


def test_a_captured_plan_runs_kernel_by_kernel_inside_the_callers_capture(
        fake_cuda: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.cuda.graph around a compiled model that already captured its plan: a replay cannot be
    captured (torch raises), so those calls launch the kernels into the caller's graph instead."""
    capturing = [False]
    monkeypatch.setattr(cuda_graph, "stream_capturing", lambda: capturing[0])
    for outputs in ("copy", "reuse"):
        plan, _ = block(graph_outputs=outputs)
        w = rand(16, 12)
        for _ in range(2):
            plan(rand(8, 16), w)
        runner = plan.cuda_graph
        assert plan.cuda_graph_captured and "CAPTURING()" in runner.replay_source
        replays = runner.captured.graph.replays
        capturing[0] = True
        x = rand(8, 16)
        assert_close(plan(x, w)[0], eager(x, w)[0])
        assert runner.captured.graph.replays == replays and runner.nested_calls == 1
        capturing[0] = False
        plan(x, w)
        assert runner.captured.graph.replays == replays + 1


@pytest.mark.parametrize(("host_ms", "span_ms", "captured"), [(0.95, 1.0, True), (1.4, 1.0, True), (0.3, 1.0, False)])
def test_a_plan_the_estimate_turned_down_is_measured_then_captured_if_host_bound(
        monkeypatch: pytest.MonkeyPatch, host_ms: float, span_ms: float, captured: bool) -> None:
    """Device-bound on paper (the estimate said no): the second call times the host against the GPU
    span, and the plan captures only when the host took at least HOST_BOUND of it."""
    monkeypatch.setattr(plan_module, "decide",
                        lambda requested, device, kernels, inputs, static_inputs=():
                        GraphDecision(False, "test: not worth it", len(inputs), by_estimate=True))
    monkeypatch.setattr(cuda_graph, "capture", fake_capture)
    monkeypatch.setattr(cuda_graph, "measure_call", lambda run, inputs: (run(inputs), host_ms / 1e3, span_ms / 1e3))
    plan, _ = block()
    runner = plan.cuda_graph
    assert runner is not None and runner.measure
    w = rand(16, 12)
    plan(rand(8, 16), w)                                    # the warm-up: neither measured nor captured
    assert runner.measured is None and not plan.cuda_graph_captured
    x2 = rand(8, 16)
    assert_close(plan(x2, w)[0], eager(x2, w)[0])           # measured (and captured after it if host-bound)
    assert runner.measured == (host_ms / 1e3, span_ms / 1e3)
    assert plan.cuda_graph_captured == captured and "measured at the second call" in plan.cuda_graph_note
    assert ("host-bound" in plan.cuda_graph_note) == captured and plan.cuda_graph_copies == (2 if captured else 0)
    x3 = rand(8, 16)
    assert_close(plan(x3, w)[0], eager(x3, w)[0])
    assert (runner.captured.graph.replays == 1) if captured else runner.captured is None


def test_values_baked_into_a_capture_are_refreshed_before_every_replay(
        fake_cuda: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A launch that uses a value computed outside the graph while fusegraph records a capture (the
    fused cuDNN conv's folded BN vectors) registers a hook; the replay runs it before each replay.
    Inside anyone else's capture nothing is recorded, and the launch must compute in the graph."""
    seen: list[int] = []

    def capture_with_a_baked_value(run_plain: Any, inputs: Sequence[torch.Tensor], by_reference: Any = ()) -> Captured:
        with cuda_graph.recording_replay_hooks() as hooks:
            assert cuda_graph.refresh_before_replay(lambda: seen.append(captured.graph.replays))
            captured = fake_capture(run_plain, inputs, by_reference)
        captured.hooks = tuple(hooks)
        return captured

    monkeypatch.setattr(cuda_graph, "capture", capture_with_a_baked_value)
    assert not cuda_graph.refresh_before_replay(lambda: None)     # no recording: not kept
    plan, _ = block()
    w = rand(16, 12)
    plan(rand(8, 16), w)                                          # warm-up and capture
    assert plan.cuda_graph_captured and "hook()" in plan.cuda_graph.replay_source and seen == []
    for _ in range(2):
        x = rand(8, 16)
        assert_close(plan(x, w)[0], eager(x, w)[0])
    assert seen == [0, 1]                                         # before the first and the second replay


@pytest.mark.parametrize("profiled", [False, True])
def test_profiled_builds_report_where_the_first_calls_went(fake_cuda: None, profiled: bool,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """Under FUSEGRAPH_PROFILE_BUILD the first call reports its kernel-by-kernel run and the capture's
    warm-up and capture seconds (with the build profile, on stderr); without it, nothing."""
    with override(profile_build=profiled):
        plan, _ = block()
        capsys.readouterr()
        x, w = rand(8, 16), rand(16, 12)
        plan(x, w)
        plan(x, w)
    err = capsys.readouterr().err
    assert plan.cuda_graph_captured
    lines = [ln for ln in err.splitlines() if ln.startswith("first calls of plan")]
    if not profiled:
        assert lines == []
        return
    (line,) = lines                                  # one report, after the capture
    run_s = float(line.split("kernel-by-kernel run ")[1].split(" s")[0])
    assert run_s > 0.0 and round(plan.cuda_graph.first_run_s, 3) == run_s
    assert "; capture: side-stream warm-up 0.000 s, capture 0.000 s" in line   # the stand-in capture times nothing
    names = [k.name for k in plan.kernels]
    assert [label.split(" ")[0].split("[")[0] for label, _ in plan.cuda_graph.first_run_kernels] == names  # in order
    assert all(seconds >= 0.0 for _, seconds in plan.cuda_graph.first_run_kernels)
    assert "  first run by backend: " in err and "  slowest first launches: " in err
    assert_close(plan(x, w)[0], eager(x, w)[0])      # the timed first run computed what the plain one does


def test_timed_run_names_a_grouped_convolution() -> None:
    """run_timed labels each launch 'name[detail] backend': a grouped convolution says its groups (a
    chosen library candidate would be named too), a plain kernel only its name."""
    g = fg.Graph("dw")
    x = g.tensor((2, 8, 6, 6), "float32", "x")
    y = g.conv2d(x, g.tensor((8, 1, 3, 3), "float32", "w"), padding=1, groups=8)
    g.relu(g.add(y, g.tensor((2, 8, 6, 6), "float32", "r"))).set_output()
    plan = g.build(device="cpu")
    feeds = [rand(2, 8, 6, 6), rand(8, 1, 3, 3), rand(2, 8, 6, 6)]
    outs, times = plan.run_timed(feeds)
    assert_close(outs[0], plan(*feeds))
    labels = [label for label, _ in times]
    assert len(labels) == len(plan.kernels)
    conv = [label for label, k in zip(labels, plan.kernels, strict=True) if k.kind == "convolution"]
    assert conv and all("[groups=8] " in label for label in conv)
    assert all(label.rsplit(" ", 1)[-1] == k.backend for label, k in zip(labels, plan.kernels, strict=True))


def test_first_run_summary_groups_launches_by_backend() -> None:
    text = cuda_graph.first_run_summary([("k0 cudnn", 0.5), ("k1 triton", 0.01), ("k2 cudnn", 0.25)], top=2)
    assert "cudnn 0.750 s (2), triton 0.010 s (1)" in text
    assert text.endswith("slowest first launches: k0 cudnn 0.500 s, k2 cudnn 0.250 s")
