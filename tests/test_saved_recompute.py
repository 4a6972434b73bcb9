"""frontends/saved_recompute.py: pointwise values the backward reads are recomputed there from a
value it saves anyway (GPT-2's tanh GELU saves x, not x and three functions of it)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode

import fusegraph as fg
from conftest import assert_close, rand
from fusegraph.frontends.saved_recompute import _recipe
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
        assert torch.equal(a, b)                  # the same ops, recomputed: the same numbers
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
    (fwd,) = [k for k in kernels["forward"] if "tanh" in [n.op for n in k.nodes]]
    (bwd,) = [k for k in kernels["backward"] if "tanh" in [n.op for n in k.nodes]]
    assert [n.dtype for n in fwd.outputs] == ["float16"], fwd.outputs        # only the down projection's input
    assert sorted(n.dtype for n in bwd.inputs) == ["float16", "float32"], bwd.inputs   # h and the gradient
