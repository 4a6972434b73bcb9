"""Constant folding: a node whose inputs are all known at build time (scalars, constants) is
evaluated once, with the reference executor, and replaced by a `scalar` (0-d) or `constant` node.

Not folded: graph inputs, RANDOM ops (not pure), nodes whose evaluation fails (the error then
surfaces at execute time, where it belongs), and results that would cost memory: larger than
`max_elements`, or larger than the known values they are computed from (a broadcast, or a
generator such as rand_uniform, is cheaper computed inside a kernel than read from memory),
unless tiny (up to ALWAYS_FOLD_ELEMENTS).
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
ALWAYS_FOLD_ELEMENTS = 64


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
        computed_from = node.inputs[0] if node.op == "getitem" else node
        if get_op(computed_from.op).has(RANDOM) or not all(is_known(i) for i in computed_from.inputs):
            return False
        size = node.spec.numel
        known_size = sum(i.spec.numel for i in computed_from.inputs)
        return size <= max_elements and (size <= ALWAYS_FOLD_ELEMENTS or size <= known_size)

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
