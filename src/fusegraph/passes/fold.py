"""Constant folding: a node whose inputs are all known at build time (scalars, constants) is
evaluated once, with the reference executor, and replaced by a `scalar` (0-d) or `constant` node.

Not folded: graph inputs, RANDOM ops (not pure), results larger than `max_elements` (a folded
tensor is read from memory at run time; a big one would also cost build-time memory), and nodes
whose evaluation fails (the error then surfaces at execute time, where it belongs).
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import FusegraphError
from ..ir import dtypes
from ..ir.graph import Graph, map_nodes
from ..ir.node import Attrs, Node
from ..ir.registry import RANDOM, SOURCE, get_op
from ..ir.spec import TensorSpec
from ..reference import run_node
from .base import graph_pass

FOLD_MAX_ELEMENTS = 1 << 20


def is_known(node: Node) -> bool:
    """A value known at build time: a scalar or a constant (not a graph input)."""
    return node.op in ("scalar", "constant")


def known_value(node: Node) -> torch.Tensor:
    """The value of a scalar or constant node, as the reference executor sees it."""
    return run_node(node, [], "float32", None)  # type: ignore[no-any-return]


def as_literal(node: Node, value: torch.Tensor) -> Node:
    """A scalar (0-d) or constant node holding `value`, replacing `node` (same name and source)."""
    dtype = dtypes.canonical(value.dtype)
    if value.dim() == 0:
        return Node(op="scalar", inputs=(), attrs=Attrs(value=value.item()), specs=(TensorSpec((), dtype),),
                    name=node.name, source=node.source)
    spec = TensorSpec(tuple(value.shape), dtype, device=node.spec.device)
    return Node(op="constant", inputs=(), attrs=Attrs(value=value.contiguous()), specs=(spec,),
                name=node.name, source=node.source)


def fold_constants(graph: Graph, max_elements: int = FOLD_MAX_ELEMENTS) -> Graph:
    """Replace every foldable node by its value (see the module docstring)."""
    evaluated: dict[int, Any] = {}  # multi-output nodes evaluated once for all their getitems

    def evaluate(node: Node) -> Any:
        if node.id not in evaluated:
            args = [known_value(i) for i in node.inputs]
            evaluated[node.id] = run_node(node, args, graph.compute_dtype, None)
        return evaluated[node.id]

    def foldable(node: Node) -> bool:
        opdef = get_op(node.op)
        if opdef.has(SOURCE) or opdef.has(RANDOM) or node.multi_output:
            return False
        if sum(s.numel for s in node.specs) > max_elements:
            return False
        if node.op == "getitem":
            parent = node.inputs[0]
            return not get_op(parent.op).has(RANDOM) and all(is_known(i) for i in parent.inputs)
        return all(is_known(i) for i in node.inputs)

    def fold(node: Node) -> Node:
        if not foldable(node):
            return node
        try:
            if node.op == "getitem":
                value = evaluate(node.inputs[0])[node.attrs["index"]]
            else:
                value = evaluate(node)
        except FusegraphError:
            return node
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != node.shape:
            return node
        return as_literal(node, value.to(dtypes.to_torch(node.dtype)))

    return map_nodes(graph, fold)


@graph_pass("fold")
def fold(graph: Graph) -> Graph:
    """Constant folding: evaluate nodes whose inputs are all scalars or constants."""
    return fold_constants(graph)
