"""Shared builders for the perf tests: a small real plan, and synthetic kernels with known costs."""

from __future__ import annotations

from collections.abc import Sequence

import torch

import fusegraph as fg
from fusegraph.ir.node import Attrs, Node
from fusegraph.ir.registry import Cost
from fusegraph.ir.spec import TensorSpec
from fusegraph.runtime.kernel import Kernel


def small_plan(m: int = 32, n: int = 64) -> tuple[object, list[torch.Tensor]]:
    """add + layernorm + softmax on CPU, float32: a real Plan with at least one kernel."""
    g = fg.Graph(name="perf_block")
    x, r = g.tensor((m, n), "float32", name="x"), g.tensor((m, n), "float32", name="r")
    w, b = g.tensor((n,), "float32", name="w"), g.tensor((n,), "float32", name="b")
    h = g.add(x, r)
    y = g.layernorm(h, weight=w, bias=b)
    h.set_output()
    g.softmax(y, -1).set_output()
    return g.build(device="cpu"), [torch.randn(m, n), torch.randn(m, n), torch.randn(n), torch.randn(n)]


def value(name: str, numel: int, dtype: str = "float32") -> Node:
    return Node(op="input", inputs=(), attrs=Attrs(), specs=(TensorSpec((numel,), dtype),), name=name)


def kernel(name: str, nbytes: int, flops: int = 0, kind: str = "pointwise", inputs: Sequence[Node] = (),
           outputs: Sequence[Node] = (), nodes: Sequence[Node] = ()) -> Kernel:
    return Kernel(name=name, kind=kind, backend="triton", nodes=tuple(nodes), inputs=tuple(inputs),
                  outputs=tuple(outputs), cost=Cost(nbytes, flops), launch=lambda args: [])
