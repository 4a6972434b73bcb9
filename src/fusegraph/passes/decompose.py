"""Decompose composite ops (layernorm, softmax, cross_entropy, ...) into reductions and
pointwise ops, so the partitioner fuses them through one general mechanism."""

from __future__ import annotations

from typing import Any

from ..ir.emit import Emitter
from ..ir.graph import Graph, map_nodes
from ..ir.node import Node
from ..ir.registry import COMPOSITE, get_op
from .base import Pass, graph_pass


def decompose_graph(graph: Graph, keep: frozenset[str] = frozenset()) -> Graph:
    """Expand every composite op not in `keep`, repeatedly, until only primitives remain."""
    expanded: dict[int, tuple[Node, ...]] = {}  # multi-output composite -> its decomposed outputs

    def expand(node: Node) -> Node:
        if node.op == "getitem" and node.inputs[0].id in expanded:
            return expanded[node.inputs[0].id][node.attrs["index"]]
        opdef = get_op(node.op)
        if not opdef.has(COMPOSITE) or opdef.decompose is None or node.op in keep:
            return node
        emitter = Emitter(prefix=f"{node.name}.", source=node.source)
        out: Any = opdef.decompose(emitter, list(node.inputs), node.attrs, graph.compute_dtype)
        if node.multi_output:
            results = tuple(_expand_all(o, graph.compute_dtype, keep) for o in out)
            expanded[node.id] = results
            return node
        return _expand_all(out, graph.compute_dtype, keep)

    return map_nodes(graph, expand)


def _expand_all(node: Node, compute_dtype: str, keep: frozenset[str]) -> Node:
    """A decomposition may itself use composites (mean inside var): expand those too."""
    sub = Graph("sub", inputs=(), outputs=(node,), compute_dtype=compute_dtype, order=None)
    if not any(get_op(n.op).has(COMPOSITE) and n.op not in keep for n in sub.nodes):
        return node
    return decompose_graph(sub, keep).outputs[0]


@graph_pass("decompose")
def decompose(graph: Graph) -> Graph:
    """Replace composite ops with their decompositions into primitive ops."""
    return decompose_graph(graph)


def decompose_keeping(keep: frozenset[str] | set[str] = frozenset()) -> Pass:
    """The decompose pass with the composites in `keep` left whole (for a library kernel to serve);
    as a Pass, it is recorded in the graph's provenance and verified like any other."""
    kept = frozenset(keep)
    suffix = f" (keeping {', '.join(sorted(kept))})" if kept else ""
    return Pass("decompose", lambda graph: decompose_graph(graph, kept),
                "Replace composite ops with their decompositions into primitive ops" + suffix)
