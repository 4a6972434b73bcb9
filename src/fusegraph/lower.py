"""Lowering: turn an optimized Graph into Kernels. The reference lowering runs each op with
torch (one 'kernel' per op); the fusion compiler replaces it with partitioned, generated kernels."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .ir.graph import Graph
from .ir.node import Node
from .ir.registry import get_op
from .reference import run_node
from .runtime.kernel import Kernel


def node_kernel(node: Node, compute_dtype: str, backend: str = "reference", note: str = "") -> Kernel:
    """A kernel that runs one node with its reference implementation (also the eager fallback)."""
    inputs = tuple(i for i in node.inputs)
    opdef = get_op(node.op)

    def launch(args: Sequence[torch.Tensor]) -> list[Any]:
        device = args[0].device if args else None
        out = run_node(node, list(args), compute_dtype, device)
        return [out]

    cost = opdef.cost([i.spec for i in node.inputs], list(node.specs), node.attrs)
    return Kernel(name=f"{backend}_{node.name}", kind="eager" if backend == "eager" else "reference",
                  backend=backend, nodes=(node,), inputs=inputs, outputs=(node,), cost=cost,
                  launch=launch, source=f"# {node.op} via torch reference", note=note)


def lower_reference(graph: Graph) -> list[Kernel]:
    kernels = []
    for node in graph.nodes:
        if node.op == "input":
            continue
        kernels.append(node_kernel(node, graph.compute_dtype))
    return kernels
