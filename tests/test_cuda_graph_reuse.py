"""graph_outputs="reuse" and "copy" (runtime/cuda_graph.py): a captured plan returns its captured output buffers
while the caller holds none of the previous call's outputs, runs kernel by kernel when it does, and
reads an input in place when it lies in another reuse plan's captured outputs (a training backward
reading its forward's activations). On CPU with the stand-in graph of test_runtime_cuda_graph.py."""

from __future__ import annotations

import copy
import gc
from typing import Any

import pytest
import torch

import fusegraph as fg
import test_runtime_cuda_graph as base
from conftest import assert_close, rand
from fusegraph.runtime import cuda_graph
from test_runtime_cuda_graph import block, eager

fake_cuda = base.fake_cuda   # fixtures: CPU plans capture with the stand-in graph; partitions built
built_partitions = base.built_partitions


@pytest.fixture(autouse=True)
def track_small_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """These plans' outputs are a few hundred bytes: track them all, as large outputs are."""
    monkeypatch.setattr(cuda_graph, "SMALL_OUTPUT_BYTES", 0)


def stage(name: str, scale: float) -> fg.Graph:
    """x -> (tanh(x) * scale + 1, exp(x)): two outputs, two kernels at most."""
    g = fg.Graph(name=name, compute_dtype="float32")
    x = g.tensor((8, 16), dtype="float32", name="x")
    g.add(g.mul(g.tanh(x), scale), 1.0).set_output()
    g.exp(x).set_output()
    return g


def run_stage(x: torch.Tensor, scale: float) -> list[torch.Tensor]:
    return [torch.tanh(x) * scale + 1, torch.exp(x)]


def check(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for g, r in zip(got, want, strict=True):
        assert_close(g, r)


@pytest.mark.usefixtures("fake_cuda")
def test_reuse_captures_on_the_second_call_and_returns_the_captured_buffers() -> None:
    plan, _ = block(graph_outputs="reuse")
    w = rand(16, 12)
    x1 = rand(8, 16)
    y1, _ = plan(x1, w)
    assert not plan.cuda_graph_captured                     # the first call only warms up
    assert_close(y1, eager(x1, w)[0])
    del y1
    x2 = rand(8, 16)
    y2, h2 = plan(x2, w)                                    # captured, then replayed
    runner = plan.cuda_graph
    assert plan.cuda_graph_captured and runner.captured.graph.replays == 1
    assert_close(y2, eager(x2, w)[0]) and assert_close(h2, eager(x2, w)[1])
    assert y2.data_ptr() == runner.captured.static_outputs[0].data_ptr()
    assert "USE(" in runner.replay_source and ".clone()" not in runner.replay_source
    del y2, h2
    x3 = rand(8, 16)
    y3, _ = plan(x3, w)                                     # the previous outputs were dropped: replay
    assert runner.captured.graph.replays == 2 and runner.live_calls == 0
    assert_close(y3, eager(x3, w)[0])


@pytest.mark.usefixtures("fake_cuda")
def test_reuse_never_overwrites_outputs_the_caller_still_holds() -> None:
    plan, _ = block(graph_outputs="reuse")
    w = rand(16, 12)
    plan(rand(8, 16), w)
    x2 = rand(8, 16)
    y2, h2 = plan(x2, w)
    view = h2[2:4]                                          # a view keeps the storage referenced too
    del h2
    kept = y2.clone()
    x3 = rand(8, 16)
    y3, h3 = plan(x3, w)                                    # y2 and the view are alive: kernel by kernel
    runner = plan.cuda_graph
    assert runner.live_calls == 1 and runner.captured.graph.replays == 1
    assert torch.equal(y2, kept) and y3.data_ptr() != y2.data_ptr()
    assert_close(y3, eager(x3, w)[0]) and assert_close(view, eager(x2, w)[1][2:4])
    del y2, view, y3, h3
    gc.collect()
    x4 = rand(8, 16)
    y4, _ = plan(x4, w)                                     # all dropped: replays again
    assert runner.captured.graph.replays == 2 and runner.live_calls == 1
    assert_close(y4, eager(x4, w)[0])


@pytest.mark.usefixtures("fake_cuda")
def test_a_plan_fed_by_a_reuse_plan_reads_its_outputs_in_place() -> None:
    first = stage("first", 2.0).build(graph_outputs="reuse")
    second = stage("second", 3.0).build(graph_outputs="reuse")

    def step(x: torch.Tensor) -> list[torch.Tensor]:
        a, _ = first(x)
        return second(a)

    for _ in range(2):                                      # warm-up, then both capture
        step(rand(8, 16))
    runner = second.cuda_graph
    assert runner.chained_inputs == frozenset({0}) and runner.captured.static_inputs[0] is None
    assert ".copy_(" not in runner.replay_source            # nothing copied: read in place
    assert "another plan's captured outputs" in second.cuda_graph_note
    for _ in range(3):
        x = rand(8, 16)
        check(step(x), run_stage(run_stage(x, 2.0)[0], 3.0))   # the outputs die with the call
    assert runner.moved_calls == 0 and runner.live_calls == 0 and runner.captured.graph.replays == 4


@pytest.mark.usefixtures("fake_cuda")
def test_a_chained_input_elsewhere_runs_kernel_by_kernel() -> None:
    first = stage("first", 2.0).build(graph_outputs="reuse")
    second = stage("second", 3.0).build(graph_outputs="reuse")
    for _ in range(2):
        second(first(rand(8, 16))[0])                       # every output dropped at once
    x = rand(8, 16)
    check(second(x), run_stage(x, 3.0))                     # not first's buffer: moved, kernel by kernel
    assert second.cuda_graph.moved_calls == 1
    # the first plan's outputs are not held by the second's capture
    first(rand(8, 16))
    assert first.cuda_graph.live_calls == 0


def test_reuse_is_a_known_option() -> None:
    plan, _ = block(graph_outputs="reuse")
    assert plan.graph_outputs == "reuse"
    assert cuda_graph.check_graph_outputs("reuse") == "reuse"


def _mlp_training() -> tuple[Any, ...]:
    """A small MLP, its eager twin, the MLP compiled with mode="reduce-overhead", and an SGD for each."""
    from fusegraph.frontends.torch_backend import Session

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend=Session("reduce-overhead"))
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    return model, ref, compiled, opt, ref_opt


def _sgd_step(m: Any, o: Any, x: torch.Tensor) -> torch.Tensor:
    o.zero_grad(set_to_none=True)
    y = m(x)
    (y ** 2).mean().backward()
    o.step()
    return y


def _lockstep(setup: tuple[Any, ...], step: Any = _sgd_step, steps: int = 4, after: Any = None) -> None:
    """`steps` steps of the compiled model and its eager twin on the same fresh inputs; gradients and
    weights compared after each; `after(outputs)` with both steps' outputs."""
    model, ref, compiled, opt, ref_opt = setup
    for _ in range(steps):
        x = rand(8, 16)
        outs = [step(m, o, x) for m, o in ((compiled, opt), (ref, ref_opt))]
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            assert_close(p.grad, q.grad, tol=1e-5, what="gradient")
            assert_close(p, q, tol=1e-5, what="weights after the step")
        if after is not None:
            after(outs)
        del outs   # not kept into the next step (unless `after` keeps them)


@pytest.mark.usefixtures("fake_cuda")
def test_reduce_overhead_training_reuses_activations_and_gradients(built_partitions: list[Any]) -> None:
    """torch.compile(mode="reduce-overhead") training: forward and backward plans are captured with
    graph_outputs="reuse", the backward reads the forward's captured activations in place, and four
    optimizer steps match eager step for step."""
    from fusegraph.frontends.torch_backend import Session

    built = built_partitions
    assert Session("reduce-overhead")._build_options("backward")["graph_outputs"] == "reuse"
    assert "graph_outputs" not in Session("reduce-overhead")._build_options("inference")
    _lockstep(_mlp_training())
    torch._dynamo.reset()
    runners = {p.plan.graph.name.split("_")[0]: p.plan.cuda_graph for p in built
               if p.plan is not None and p.plan.cuda_graph is not None}
    assert set(runners) == {"forward", "backward"}, runners
    assert all(r.captured is not None and r.outputs == "reuse" for r in runners.values())
    assert runners["backward"].chained_inputs, runners["backward"].replay_source
    assert all(r.live_calls == 0 and r.moved_calls == 0 for r in runners.values())
    assert all(r.captured.graph.replays == 3 for r in runners.values())


@pytest.mark.usefixtures("fake_cuda")
def test_automatic_rule_decides_again_at_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    """A reuse plan the build-time estimate turned down (its inputs looked like copies) captures at its
    second call when those inputs turn out to be another plan's captured outputs, read in place."""
    from fusegraph.runtime import plan as plan_module
    from fusegraph.runtime.cuda_graph import GraphDecision

    def decide(requested: Any, device: Any, kernels: Any, inputs: Any, static_inputs: Any = ()) -> GraphDecision:
        copied = len(inputs) - len(set(static_inputs))
        if requested or (requested is None and copied == 0):
            return GraphDecision(True, f"test: capture, {copied} copies", copied)
        return GraphDecision(False, f"test: {copied} copies cost too much", copied, by_estimate=True)

    monkeypatch.setattr(plan_module, "decide", decide)
    first = stage("first", 2.0).build(graph_outputs="reuse", cuda_graphs=True)
    second = stage("second", 3.0).build(graph_outputs="reuse")
    assert second.cuda_graph is not None and "too much" in second.cuda_graph_note   # deferred, not refused
    for _ in range(3):
        x = rand(8, 16)
        check(second(first(x)[0]), run_stage(run_stage(x, 2.0)[0], 3.0))
    assert second.cuda_graph_captured and second.cuda_graph.chained_inputs == frozenset({0})
    assert "at capture: test: capture, 0 copies" in second.cuda_graph_note
    alone = stage("alone", 3.0).build(graph_outputs="reuse")
    for _ in range(3):                                      # fed by fresh tensors: copies, so never captured
        x = rand(8, 16)
        check(alone(x), run_stage(x, 3.0))
    assert not alone.cuda_graph_captured and "at capture" in alone.cuda_graph_note


@pytest.mark.usefixtures("fake_cuda")
def test_small_outputs_are_cloned_so_holding_them_costs_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """`loss = step()` keeps the previous loss alive during the next call: a small output is cloned,
    not tracked, so that call still replays."""
    monkeypatch.setattr(cuda_graph, "SMALL_OUTPUT_BYTES", 8 * 12 * 4)     # y (8x12 fp32) small, h (8x16) not
    plan, _ = block(graph_outputs="reuse")
    w = rand(16, 12)
    y = plan(rand(8, 16), w)[0]
    for _ in range(3):
        x = rand(8, 16)
        y = plan(x, w)[0]                                  # the previous y is alive during this call
        assert_close(y, eager(x, w)[0])
    runner = plan.cuda_graph
    assert runner.live_calls == 0 and runner.captured.graph.replays == 3
    assert "O0.clone()" in runner.replay_source and "O1.detach()" in runner.replay_source
    assert y.data_ptr() != runner.captured.static_outputs[0].data_ptr()


@pytest.mark.usefixtures("fake_cuda")
def test_saved_activations_are_never_cloned_even_when_small(built_partitions: list[Any],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A training forward's small outputs: what the caller gets (the model output, kept past the next
    step here) is cloned; the activations saved for the backward are not (build option held_outputs
    leaves them out), so the backward reads them in place instead of a clone plus a copy each."""

    monkeypatch.setattr(cuda_graph, "SMALL_OUTPUT_BYTES", 1 << 20)   # every output of this model is small
    built = built_partitions
    kept: list[torch.Tensor] = []

    def keep(outs: list[torch.Tensor]) -> None:
        assert_close(outs[0], outs[1].detach(), tol=1e-5, what="model output")
        kept.extend(outs)                        # every step's output stays alive

    _lockstep(_mlp_training(), after=keep)
    torch._dynamo.reset()
    plans = {p.plan.graph.name.split("_")[0]: p.plan for p in built if p.plan is not None}
    forward, backward = plans["forward"], plans["backward"]
    held = forward.held_outputs
    assert held is not None and 0 < len(held) < len(forward.graph.outputs), held
    assert backward.held_outputs == ()                          # gradients: tracked, never cloned
    fw, bw = forward.cuda_graph, backward.cuda_graph
    assert fw.captured is not None and bw.captured is not None
    for j in range(len(forward.graph.outputs)):
        assert (f"O{j}.clone()" if j in held else f"O{j}.detach()") in fw.replay_source, fw.replay_source
    assert bw.chained_inputs, bw.replay_source                # the saved activations, read in place
    assert ".clone()" not in bw.replay_source, bw.replay_source
    assert fw.live_calls == 0 and bw.live_calls == 0 and fw.captured.graph.replays == 3
    assert kept[0].data_ptr() != kept[2].data_ptr()           # outputs kept by the caller are its own


def test_held_outputs_option_is_checked() -> None:
    from fusegraph.errors import InvalidValueError

    g = stage("held", 2.0)
    assert g.build(device="cpu", held_outputs=[1]).held_outputs == (1,)
    assert g.build(device="cpu").held_outputs is None
    with pytest.raises(InvalidValueError, match="held_outputs"):
        g.build(device="cpu", held_outputs=[2])


@pytest.mark.usefixtures("fake_cuda")
def test_gradients_kept_across_steps_stay_correct(built_partitions: list[Any],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """zero_grad(set_to_none=False) and two backwards per step: autograd accumulates each step's
    gradients into the .grad tensors it kept (made at the first, uncaptured call), so the backward's
    outputs (small ones included, which its plan does not clone) are never kept and every later call
    replays; accumulated gradients and weights match eager step for step."""
    monkeypatch.setattr(cuda_graph, "SMALL_OUTPUT_BYTES", 1 << 20)
    def accumulate(m: Any, o: Any, x: torch.Tensor) -> None:
        o.zero_grad(set_to_none=False)
        (m(x) ** 2).mean().backward()
        (m(x + 1) ** 2).mean().backward()         # accumulated into the kept gradients
        o.step()

    _lockstep(_mlp_training(), step=accumulate)
    backward = next(p.plan for p in built_partitions if p.plan is not None and p.plan.graph.name.startswith("back"))
    runner = backward.cuda_graph
    assert runner is not None and runner.captured is not None and runner.captured.graph.replays >= 5
    assert runner.live_calls == 0


@pytest.mark.usefixtures("fake_cuda")
def test_gradients_the_caller_keeps_are_never_overwritten(built_partitions: list[Any],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The previous step's gradients kept by the caller (g = p.grad, then zero_grad(set_to_none=True)):
    the next backward runs kernel by kernel rather than replay into them; they keep their values."""
    monkeypatch.setattr(cuda_graph, "SMALL_OUTPUT_BYTES", 1 << 20)
    setup = _mlp_training()
    model = setup[0]
    kept: list[list[torch.Tensor]] = []
    snapshot: list[list[torch.Tensor]] = []

    def keep(outs: list[torch.Tensor]) -> None:
        kept.append([p.grad for p in model.parameters()])               # the caller keeps them
        snapshot.append([p.grad.clone() for p in model.parameters()])   # their values when made

    _lockstep(setup, after=keep)
    for step, copies in zip(kept, snapshot, strict=True):
        for g, c in zip(step, copies, strict=True):
            assert torch.equal(g, c)
    backward = next(p.plan for p in built_partitions if p.plan is not None and p.plan.graph.name.startswith("back"))
    assert backward.cuda_graph is not None and backward.cuda_graph.live_calls > 0


@pytest.mark.usefixtures("fake_cuda")
def test_copy_returns_captured_buffers_while_the_caller_drops_them() -> None:
    """graph_outputs="copy": large outputs come back as the captured buffers (no clone doubling them)
    as long as each call's outputs are gone by the next call."""
    plan, _ = block(graph_outputs="copy")
    w = rand(16, 12)
    plan(rand(8, 16), w)                                    # warm-up + capture
    runner = plan.cuda_graph
    assert plan.cuda_graph_captured and "USE(" in runner.replay_source
    assert ".clone()" not in runner.replay_source
    for _ in range(3):
        x = rand(8, 16)
        y, h = plan(x, w)
        assert y.data_ptr() == runner.captured.static_outputs[0].data_ptr()
        assert_close(y, eager(x, w)[0])
        assert_close(h, eager(x, w)[1])
        del y, h
    assert runner.captured.graph.replays == 3 and runner.live_calls == 0 and not runner.cloning


@pytest.mark.usefixtures("fake_cuda")
def test_copy_clones_once_the_caller_keeps_outputs_across_calls() -> None:
    """The first call that finds the previous outputs referenced runs kernel by kernel; from then on
    every replay's outputs are clones, and the buffers the caller still holds are never overwritten."""
    plan, _ = block(graph_outputs="copy")
    w = rand(16, 12)
    plan(rand(8, 16), w)
    runner = plan.cuda_graph
    x2 = rand(8, 16)
    y2, _ = plan(x2, w)                                     # the captured buffer, kept below
    assert y2.data_ptr() == runner.captured.static_outputs[0].data_ptr()
    kept = y2.clone()
    x3 = rand(8, 16)
    y3, _ = plan(x3, w)                                     # y2 alive: kernel by kernel, then cloning
    assert runner.live_calls == 1 and runner.cloning and runner.captured.graph.replays == 1
    assert torch.equal(y2, kept)
    assert_close(y3, eager(x3, w)[0])
    assert ".clone()" in runner.replay_source and ".detach()" not in runner.replay_source
    x4 = rand(8, 16)
    y4, _ = plan(x4, w)                                     # y2 (the captured buffer) still held
    assert runner.live_calls == 2 and torch.equal(y2, kept)
    del y2
    gc.collect()
    outs = [plan(x, w)[0] for x in (x3, x4)]                # replays, clones the caller may keep
    assert runner.captured.graph.replays == 3 and runner.live_calls == 2
    assert all(o.data_ptr() != runner.captured.static_outputs[0].data_ptr() for o in outs)
    assert_close(outs[0], eager(x3, w)[0])
    assert_close(outs[1], eager(x4, w)[0])
    assert_close(y4, eager(x4, w)[0])


@pytest.mark.usefixtures("fake_cuda")
def test_reduce_overhead_inference_returns_captured_outputs_until_the_caller_keeps_one(
        built_partitions: list[Any]) -> None:
    """torch.compile inference through the backend (a copy plan): outputs the caller drops come back as
    the graph's buffers (no second copy of a large output); a caller keeping outputs across calls gets
    correct, distinct results from then on."""
    from fusegraph.frontends.torch_backend import Session

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    compiled = torch.compile(model, backend=Session("reduce-overhead"))
    with torch.no_grad():
        for _ in range(3):                                  # dropped before each next call
            x = rand(8, 16)
            assert_close(compiled(x), model(x))
        [runner] = [p.plan.cuda_graph for p in built_partitions if p.plan is not None]
        assert runner.outputs == "copy" and runner.captured.graph.replays == 2 and runner.live_calls == 0
        y = compiled(rand(8, 16))
        assert y.data_ptr() == runner.captured.static_outputs[0].data_ptr()   # the graph's buffer itself
        del y
        xs = [rand(8, 16) for _ in range(3)]
        kept = [compiled(x) for x in xs]                    # kept: the second call finds the first held
        for x, y in zip(xs, kept, strict=True):
            assert_close(y, model(x))
        assert runner.live_calls >= 1 and runner.cloning
    torch._dynamo.reset()


@pytest.mark.usefixtures("fake_cuda")
def test_copy_returns_small_outputs_as_captured_buffers_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy plan tracks its small outputs like large ones (no clone per call: a launch of host time);
    a caller keeping one sends that call kernel by kernel and the plan clones from then on."""
    monkeypatch.setattr(cuda_graph, "SMALL_OUTPUT_BYTES", 1 << 20)   # every output of this block is small
    plan, _ = block(graph_outputs="copy")
    w = rand(16, 12)
    plan(rand(8, 16), w)
    runner = plan.cuda_graph
    assert ".clone()" not in runner.replay_source and "USE(" in runner.replay_source
    x = rand(8, 16)
    y, _h = plan(x, w)
    assert y.data_ptr() == runner.captured.static_outputs[0].data_ptr()
    assert_close(y, eager(x, w)[0])
    kept = y.clone()
    x2 = rand(8, 16)
    y2, _ = plan(x2, w)                                     # y held: kernel by kernel, then cloning
    assert runner.live_calls == 1 and runner.cloning and torch.equal(y, kept)
    assert_close(y2, eager(x2, w)[0])
