"""Recompute or materialize (fusion/recompute.py): a pointwise value that several kernels would each
rebuild, at more bytes than storing it once, becomes a kernel result; cheap ones stay inlined.

The case that matters is a backward pass through a residual stack: g_l = g_{l+1} + layernorm
backward_l(...). Rebuilt in every kernel that reads it, g_l drags all later layers' rebuilds with
it, so kernels grow with depth (O(L^2) bytes). Here kernels must not grow with depth."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fusegraph as fg
from conftest import assert_close, rand
from fusegraph.fusion import partition

M, N = 16, 32


# ------------------------------------------------------------------------------ graph level
def _residual_backward_chain(layers: int) -> tuple[fg.Graph, list[torch.Tensor]]:
    """g <- g + (t - mean(t) - x * mean(t * x)), t = dy * w, dy = (g * 0.5) @ W_l: the residual
    gradient through a stack of layer-scaled blocks and layernorm backwards (x the normalized
    input), each layer's gradient also read by a column sum (a bias gradient)."""
    g = fg.Graph(f"chain{layers}", compute_dtype="float32")
    grad = g.tensor((M, N), "float32", "g0")
    w = g.tensor((N,), "float32", "w")
    feeds = [rand(M, N, seed=0), rand(N, seed=1)]
    for k in range(layers):
        wk, x = g.tensor((N, N), "float32", f"W{k}"), g.tensor((M, N), "float32", f"x{k}")
        feeds += [rand(N, N, seed=2 + 2 * k) / N ** 0.5, rand(M, N, seed=3 + 2 * k)]
        t = g.mul(g.matmul(g.mul(grad, 0.5), wk), w)
        dx = g.sub(g.sub(t, g.mean(t, -1, keepdim=True)), g.mul(x, g.mean(g.mul(t, x), -1, keepdim=True)))
        grad = g.add(grad, dx)
        g.sum(grad, 0).set_output()
    grad.set_output()
    return g, feeds


def _longest_fused(plan: Any) -> int:
    return max(len(k.nodes) for k in plan.kernels if k.backend == "triton")


def _most_bytes(plan: Any) -> int:
    return max(k.cost.bytes for k in plan.kernels if k.backend == "triton")


def test_residual_gradient_chain_kernels_do_not_grow_with_depth() -> None:
    plans = {}
    for layers in (2, 6):
        g, feeds = _residual_backward_chain(layers)
        plan = g.build()
        for k, (o, r) in enumerate(zip(plan(*feeds), fg.reference(g)(*feeds), strict=True)):
            assert_close(o, r, what=f"{layers} layers, output {k}")
        plans[layers] = plan
    assert _longest_fused(plans[6]) <= _longest_fused(plans[2])
    assert _most_bytes(plans[6]) <= _most_bytes(plans[2])
    # every layer's gradient is written once and read, not rebuilt: no kernel reads the normalized
    # inputs x of more than one layer
    for k in plans[6].kernels:
        layers_read = {i.name for i in k.inputs if re.fullmatch(r"x\d+", i.name)}
        assert len(layers_read) <= 1, f"{k.name} reads {sorted(layers_read)}"


def test_without_the_rule_the_chain_grows(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same graphs grouped with no materializing round: what the rule fixes (keeps the test above
    honest about measuring the growth)."""
    monkeypatch.setattr(partition, "MATERIALIZE_ROUNDS", 1)
    lengths = {layers: _longest_fused(_residual_backward_chain(layers)[0].build()) for layers in (2, 6)}
    assert lengths[6] > 2 * lengths[2]


def test_cheap_shared_value_stays_inlined() -> None:
    """x * w read by a row and a column reduction: rebuilding it reads x, which storing it would
    only replace by a read of itself, plus a write. It is not materialized."""
    g = fg.Graph("shared", compute_dtype="float32")
    x, w = g.tensor((M, N), "float32", "x"), g.tensor((N,), "float32", "w")
    s = g.mul(x, w)
    g.sum(s, -1).set_output()
    g.sum(s, 0).set_output()
    feeds = [rand(M, N), rand(N)]
    plan = g.build()
    for o, r in zip(plan(*feeds), fg.reference(g)(*feeds), strict=True):
        assert_close(o, r)
    assert all(n.op != "mul" for k in plan.kernels for n in k.outputs)
    assert sum(1 for k in plan.kernels for n in k.nodes if n.op == "mul") >= 1


# ------------------------------------------------------------------------------ torch training
class _Block(nn.Module):
    """Pre-LN residual MLP block with a layer scale (the scale makes the residual gradient feed the
    matmul through a pointwise op, as autocast's cast does in GPT-2)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln, self.fc, self.proj = nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.gamma = nn.Parameter(torch.full((d,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.gamma * self.proj(F.gelu(self.fc(self.ln(x))))


class _Stack(nn.Module):
    def __init__(self, layers: int, d: int = 32) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block(d) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x)


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]


def _train_step(layers: int) -> tuple[list[str], list[torch.Tensor], list[torch.Tensor]]:
    """(backward kernels' "kind/backend: op+op" lines, compiled grads, eager grads) of one step."""
    torch.manual_seed(0)
    model = _Stack(layers)
    x = torch.randn(2, 8, 32)
    projection = torch.randn(2, 8, 32)   # a well-conditioned loss: sum(out * projection)
    (model(x) * projection).sum().backward()
    eager = _grads(model)
    model.zero_grad(set_to_none=True)
    compiled = fg.compile(model)
    (compiled(x) * projection).sum().backward()
    grads = _grads(model)
    # vertical chains only: a combo kernel (fusion/horizontal.py) runs independent kernels side by side
    lines = [f"{k.kind}/{k.backend}: {'+'.join(k.ops)}" for rec in compiled.fusegraph_report.graphs
             if rec.kind == "backward" for p in rec.partitions if p.plan is not None
             for k in p.plan.kernels if k.kind != "view" and "combo" not in k.name]
    torch._dynamo.reset()
    return lines, grads, eager


@pytest.fixture(scope="module")
def steps() -> dict[int, tuple[list[str], list[torch.Tensor], list[torch.Tensor]]]:
    return {layers: _train_step(layers) for layers in (2, 6)}


def _chain(line: str) -> int:
    return len(line.split(": ", 1)[1].split("+"))


def test_backward_of_a_residual_stack_matches_eager(steps: dict[int, Any]) -> None:
    for layers, (_, grads, eager) in steps.items():
        assert len(grads) == len(eager) == 7 * layers + 2
        for k, (got, want) in enumerate(zip(grads, eager, strict=True)):
            assert_close(got, want, tol=1e-4, what=f"{layers} layers, grad {k}")


def test_backward_kernels_of_a_residual_stack_do_not_grow_with_depth(steps: dict[int, Any]) -> None:
    longest = {layers: max(_chain(line) for line in lines if "/triton" in line)
               for layers, (lines, _, _) in steps.items()}
    assert longest[6] <= longest[2], longest
