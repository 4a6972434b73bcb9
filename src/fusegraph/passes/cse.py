"""Common-subexpression elimination by structural hashing: two nodes with the same op, the same
(already deduplicated) inputs, equal attributes and equal output types compute the same value,
so the later one is replaced by the first.

Inputs of COMMUTATIVE ops are keyed in a canonical order (a+b and b+a merge). Never merged:
graph inputs, RANDOM ops (two dropouts are two draws), and constants holding tensors (comparing
their contents costs more than it saves; equal constants made from one tensor do merge).
Scalars merge when their values are equal *and* of the same Python type and sign (1, 1.0, True
and -0.0 stay apart: they mean different things).
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from typing import Any

import torch

from ..ir.graph import Graph, map_nodes
from ..ir.node import Attrs, Node
from ..ir.registry import COMMUTATIVE, RANDOM, get_op
from .base import graph_pass


def typed(value: Any) -> Hashable:
    """A hashable key for an attribute value that keeps 1, 1.0, True, 0.0 and -0.0 apart."""
    if isinstance(value, float):
        return ("float", value.hex() if not math.isnan(value) else "nan")
    if isinstance(value, bool | int | str) or value is None:
        return (type(value).__name__, value)
    if isinstance(value, tuple):
        return ("tuple", tuple(typed(v) for v in value))
    if isinstance(value, Attrs):
        return ("attrs", tuple((k, typed(v)) for k, v in value.items()))
    if isinstance(value, torch.Tensor):
        return ("tensor", id(value))
    try:
        hash(value)
    except TypeError:
        return ("object", id(value))
    return (type(value).__name__, value)


def structural_key(node: Node) -> Hashable | None:
    """What makes two nodes compute the same value; None for nodes that must never merge."""
    opdef = get_op(node.op)
    if node.op == "input" or opdef.has(RANDOM):
        return None
    input_ids = tuple(i.id for i in node.inputs)
    if opdef.has(COMMUTATIVE):
        input_ids = tuple(sorted(input_ids))
    types = tuple((s.shape, s.dtype, s.layout, s.strides, s.device) for s in node.specs)
    return (node.op, input_ids, typed(node.attrs), types)


def eliminate_common_subexpressions(graph: Graph) -> Graph:
    """Replace each node by the first structurally equal node seen before it (inputs first)."""
    first: dict[Hashable, Node] = {}

    def dedupe(node: Node) -> Node:
        key = structural_key(node)
        if key is None:
            return node
        return first.setdefault(key, node)

    return map_nodes(graph, dedupe)


@graph_pass("cse")
def cse(graph: Graph) -> Graph:
    """Common-subexpression elimination (structural hashing)."""
    return eliminate_common_subexpressions(graph)
