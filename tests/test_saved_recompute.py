"""frontends/saved_recompute.py: pointwise values the backward reads are recomputed there from a
value it saves anyway (GPT-2's tanh GELU saves x, not x and three functions of it)."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode

import fusegraph as fg
from conftest import assert_close, rand
from fusegraph.frontends.saved_recompute import _recipe
from fusegraph.frontends.torch_partition import FallbackWarning
from fusegraph.settings import override

aten = torch.ops.aten


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(16, 64), nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)                                  # Hugging Face GPT-2's tanh GELU, written out
        return self.down(0.5 * h * (1.0 + torch.tanh(0.7978845608028654 * (h + 0.044715 * torch.pow(h, 3.0)))))


def train(on: bool) -> tuple[list[torch.Tensor], Any]:
    """Gradients of one compiled step (checked against eager) and the backward graph's Plan, taken
    while the compiled model is alive (the report only holds it weakly)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Mlp()
    x, proj = rand(32, 16), rand(32, 16)
    with override(recompute_saved=on):
        compiled = fg.compile(model)
        (compiled(x) * proj).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    (model(x) * proj).sum().backward()
    for g, p in zip(grads, model.parameters(), strict=True):
        assert_close(g, p.grad, tol=1e-4, what="grad")
    plan = backward_plan(compiled.fusegraph_report)
    torch._dynamo.reset()
    return grads, plan


def backward_plan(report: Any) -> Any:
    (graph,) = [g for g in report.graphs if g.kind == "backward"]
    (part,) = [p for p in graph.partitions if p.plan is not None]
    return part.plan


def test_gelu_saves_its_input_only_and_matches_eager() -> None:
    grads_off, off = train(False)
    grads_on, on = train(True)
    for a, b in zip(grads_off, grads_on, strict=True):
        # recomputed, the backward sees tanh(u) itself and simplify writes 1 - tanh(u)^2 as sigmoids
        # (passes/simplify.py); saved, it reads the stored tanh: the same function, other roundings
        assert_close(a, b, tol=1e-5, what="grad, recomputed against saved")
    plan_off, plan_on = off, on
    hidden = [n for n in plan_off.graph.inputs if tuple(n.shape) == (32, 64)]
    assert len(hidden) >= 4                       # x, the GELU output and pointwise functions of x
    # x, and the GELU output the weight gradient's GEMM reads (recomputing it would materialize it again)
    assert len([n for n in plan_on.graph.inputs if tuple(n.shape) == (32, 64)]) == 2
    moved = [sum(k.cost.bytes for k in p.kernels) for p in (plan_off, plan_on)]
    assert moved[1] < moved[0], moved
    assert len(plan_on.kernels) <= len(plan_off.kernels)


def _graph(build: Any) -> tuple[fx.Graph, dict[str, fx.Node]]:
    """An FX graph with fake values, built by `build(graph, placeholder)`."""
    graph = fx.Graph()
    mode = FakeTensorMode()
    nodes: dict[str, fx.Node] = {}

    def placeholder(name: str, *shape: int) -> fx.Node:
        node = graph.placeholder(name)
        with mode:
            node.meta["val"] = torch.empty(shape)
        nodes[name] = node
        return node

    def call(name: str, target: Any, *args: Any) -> fx.Node:
        node = graph.call_function(target, args)
        with mode:
            node.meta["val"] = target(*fx.node.map_arg(args, lambda n: n.meta["val"]))
        nodes[name] = node
        return node

    build(placeholder, call)
    return graph, nodes


def test_recipes_stop_at_saved_values_and_refuse_randomness_and_growth() -> None:
    def build(placeholder: Any, call: Any) -> None:
        a, b = placeholder("a", 8, 8), placeholder("b", 8, 8)
        h = call("h", aten.mm.default, a, b)                       # not pointwise: a leaf if saved
        t = call("t", aten.tanh.default, call("s", aten.mul.Tensor, h, 0.5))
        call("one_plus", aten.add.Tensor, t, 1.0)
        call("sum2", aten.add.Tensor, h, call("h2", aten.mm.default, b, a))
        call("drop", aten.native_dropout.default, t, 0.5, True)

    _, n = _graph(build)
    assert _recipe(n["one_plus"], {n["h"], n["one_plus"]}) == [n["s"], n["t"], n["one_plus"]]
    assert _recipe(n["one_plus"], {n["one_plus"]}) is None        # h is not saved: mm is not recomputed
    # h + h2 from two saved tensors of its own size: recomputing would read twice its bytes
    assert _recipe(n["sum2"], {n["h"], n["h2"], n["sum2"]}) is None
    assert _recipe(n["drop"], {n["t"], n["drop"]}) is None        # random: never recomputed


@pytest.mark.parametrize("on", [False, True])
def test_setting_switches_it(on: bool) -> None:
    _, plan = train(on)
    inputs = len(plan.graph.inputs)
    with override(recompute_saved=not on):
        _, other = train(not on)
    assert (inputs < len(other.graph.inputs)) == on


class AutocastMlp(nn.Module):
    """The tanh GELU as CUDA autocast runs it on a 16-bit GEMM output: pow in fp32 (autocast's fp32
    list), 16-bit + fp32 promoted to fp32, 0.5 * h in 16 bits; the down projection in 16 bits (fp16
    here: the interpreter's bf16 dots are wrong)."""

    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w2 = nn.Parameter(rand(16, 64) / 4), nn.Parameter(rand(64, 16) / 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x @ self.w1.to(torch.float16)
        inner = 0.7978845608028654 * (h + 0.044715 * torch.pow(h.float(), 3.0))
        g = 0.5 * h * (1.0 + torch.tanh(inner))
        return (g.to(torch.float16) @ self.w2.to(torch.float16)).float()


def test_values_rooted_at_a_gemm_output_are_recomputed_from_it_when_that_saves_bytes() -> None:
    """Under CUDA autocast the GELU's saved values (x in fp32, tanh and 1 + tanh in fp32, 0.5 * h in
    bf16: 14 bytes an element) are all pointwise functions of the up projection's bf16 output, which
    nothing saved: it is saved instead (2 bytes), the forward GELU kernel stores only what the down
    projection reads, and the backward GELU kernel reads the gradient and h."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = AutocastMlp()
    x, proj = rand(2, 32, 16).to(torch.float16), rand(2, 32, 16)
    eager = AutocastMlp()
    eager.load_state_dict(model.state_dict())
    (eager(x) * proj).sum().backward()
    compiled = fg.compile(model)
    (compiled(x) * proj).sum().backward()
    for p, q in zip(model.parameters(), eager.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None
        assert_close(p.grad, q.grad, tol=2e-2, what="grad")
    kernels = {g.kind: [k for part in g.partitions for k in (part.plan.kernels if part.plan else [])]
               for g in compiled.fusegraph_report.graphs}
    def gelu(k: Any) -> bool:   # simplify turns the forward's 1 + tanh(u) into 2 sigmoid(2u)
        return any(n.op in ("tanh", "sigmoid") for n in k.nodes)
    (fwd,) = [k for k in kernels["forward"] if gelu(k)]
    (bwd,) = [k for k in kernels["backward"] if gelu(k)]
    assert [n.dtype for n in fwd.outputs] == ["float16"], fwd.outputs        # only the down projection's input
    assert sorted(n.dtype for n in bwd.inputs) == ["float16", "float32"], bwd.inputs   # h and the gradient


class ConvNet(nn.Module):
    """conv -> batchnorm -> relu twice, then a residual block's end relu(bn(conv) + x): each relu
    output is a convolution's input, which its weight gradient reads in the backward."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.c2, self.b2 = nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.c3, self.b3 = nn.Conv2d(8, 8, 1, bias=False), nn.BatchNorm2d(8)
        self.c4 = nn.Conv2d(8, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.b1(self.c1(x)))
        h = torch.relu(self.b2(self.c2(h)))
        h = torch.relu(self.b3(self.c3(h)) + h)
        return self.c4(h)


def conv_step(mode: str, batch: int = 4) -> tuple[list[torch.Tensor], list[torch.Tensor], Any, Any]:
    """One compiled training step of ConvNet under recompute_materialized=mode: (gradients, running
    statistics, forward Plan, backward Plan); the gradients are checked against eager's."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = ConvNet()
    eager = ConvNet()
    eager.load_state_dict(model.state_dict())
    x, proj = rand(batch, 3, 8, 8), rand(batch, 4, 8, 8)
    with override(recompute_materialized=mode):
        compiled = fg.compile(model)
        (compiled(x) * proj).sum().backward()
    (eager(x) * proj).sum().backward()
    for p, q in zip(model.parameters(), eager.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None
        assert_close(p.grad, q.grad, tol=1e-4, what="grad")
    for b, c in zip(model.buffers(), eager.buffers(), strict=True):   # running statistics updated once
        assert_close(b.float(), c.float(), tol=1e-5, what="buffer")
    plans = {g.kind: [p.plan for p in g.partitions if p.plan is not None] for g in compiled.fusegraph_report.graphs}
    (fwd,), (bwd,) = plans["forward"], plans["backward"]
    return [p.grad for p in model.parameters()], list(model.buffers()), fwd, bwd


def _saved_bytes(plan: Any) -> int:
    return sum(o.spec.nbytes for o in plan.graph.outputs if len(o.shape) == 4)


def test_relu_of_batchnorm_read_by_a_convolution_is_recomputed_from_the_saved_statistics() -> None:
    """With 'all' the three relu outputs (each a convolution's input) leave the saved set except the
    one the residual relu reads (a recipe's leaf stays saved); the backward rebuilds each from its
    convolution's output and the batch mean and 1/std the forward saved, so the gradients and the
    running statistics stay eager's."""
    _, _, fwd_off, bwd_off = conv_step("off")
    _, _, fwd_all, bwd_all = conv_step("all")
    act = 4 * 8 * 8 * 8 * 4          # one [4, 8, 8, 8] fp32 activation
    assert _saved_bytes(fwd_off) - _saved_bytes(fwd_all) == 2 * act, (_saved_bytes(fwd_off), _saved_bytes(fwd_all))
    assert len([n for n in bwd_all.graph.inputs if len(n.shape) == 4]) < \
        len([n for n in bwd_off.graph.inputs if len(n.shape) == 4])
    # no batch statistics are recomputed: the backward reduces over the batch only for gradients
    assert sum(k.kind == "reduction" for k in bwd_all.kernels) == sum(k.kind == "reduction" for k in bwd_off.kernels)


def test_held_recomputes_only_what_the_captured_step_holds_beyond_eager() -> None:
    """'held' stops once the bytes dropped cover the gradients and the non-parameter inputs: at a
    batch where those are smaller than one activation, one activation is recomputed (the largest);
    'all' recomputes two."""
    grads = sum(p.numel() for p in ConvNet().parameters()) * 4
    batch = 64
    act = batch * 8 * 8 * 8 * 4
    assert grads + batch * 3 * 8 * 8 * 4 < act
    _, _, fwd_off, _ = conv_step("off", batch)
    _, _, fwd_held, _ = conv_step("held", batch)
    assert _saved_bytes(fwd_off) - _saved_bytes(fwd_held) == act


def test_unknown_mode_warns_and_runs_eagerly() -> None:
    """A bad setting is a typed error inside the compiler, which the backend turns into a warning
    naming the setting and an eager graph: the step still runs and matches eager."""
    torch._dynamo.reset()
    model, eager = ConvNet(), ConvNet()
    eager.load_state_dict(model.state_dict())
    x = rand(2, 3, 8, 8)
    with override(recompute_materialized="sometimes"), \
            pytest.warns(FallbackWarning, match="recompute_materialized='sometimes'"):
        fg.compile(model)(x).sum().backward()
    eager(x).sum().backward()
    for p, q in zip(model.parameters(), eager.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None
        assert_close(p.grad, q.grad, tol=1e-5, what="grad")
    torch._dynamo.reset()


def test_the_report_says_what_was_recomputed() -> None:
    torch._dynamo.reset()
    model = ConvNet()
    with override(recompute_materialized="all"):
        compiled = fg.compile(model)
        compiled(rand(2, 3, 8, 8)).sum().backward()
    text = str(compiled.fusegraph_report)
    assert "saved activations recomputed in the backward:" in text and "2 materialized" in text, text
    torch._dynamo.reset()


def test_batchnorm_rebuilt_under_bf16_autocast_matches_eager() -> None:
    """Under autocast the convolution output is bf16 and batchnorm keeps fp32 statistics: the rebuilt
    output (fp32 arithmetic, cast back) gives eager's gradients within bf16 tolerance."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, eager = ConvNet(), ConvNet()
    eager.load_state_dict(model.state_dict())
    x, proj = rand(4, 3, 8, 8), rand(4, 4, 8, 8)
    with override(recompute_materialized="all", use_triton=False):
        compiled = fg.compile(model)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = compiled(x)
        (out.float() * proj).sum().backward()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = eager(x)
    (ref.float() * proj).sum().backward()
    # the two ReLU outputs, and the bf16 casts of the weights and of the input (from the fp32 primals)
    materialized = re.search(r"(\d+) materialized", str(compiled.fusegraph_report))
    assert materialized is not None and int(materialized.group(1)) >= 2, str(compiled.fusegraph_report)
    for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None
        assert_close(p.grad, q.grad, tol=3e-2, what=f"grad {name}")
    torch._dynamo.reset()


@pytest.mark.parametrize("affine", [True, False])
def test_batchnorm1d_rebuilt_from_saved_statistics_matches_eager(affine: bool) -> None:
    """A [N, C] batchnorm (no spatial dims; with and without weight and bias) before a linear layer,
    whose weight gradient reads the relu output: rebuilt with 'all', gradients as eager's."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    # no bias before the batchnorm: its gradient is zero up to rounding (the mean is removed), which a
    # relative comparison cannot judge
    model = nn.Sequential(nn.Linear(6, 8, bias=False), nn.BatchNorm1d(8, affine=affine), nn.ReLU(), nn.Linear(8, 4))
    eager = nn.Sequential(nn.Linear(6, 8, bias=False), nn.BatchNorm1d(8, affine=affine), nn.ReLU(), nn.Linear(8, 4))
    eager.load_state_dict(model.state_dict())
    x, proj = rand(16, 6), rand(16, 4)
    with override(recompute_materialized="all"):
        compiled = fg.compile(model)
        (compiled(x) * proj).sum().backward()
    (eager(x) * proj).sum().backward()
    assert "1 materialized" in str(compiled.fusegraph_report), str(compiled.fusegraph_report)
    for p, q in zip(model.parameters(), eager.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None
        assert_close(p.grad, q.grad, tol=1e-4, what="grad")
    for b, c in zip(model.buffers(), eager.buffers(), strict=True):
        assert_close(b.float(), c.float(), tol=1e-5, what="buffer")
    torch._dynamo.reset()
