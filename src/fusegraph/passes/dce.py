"""Dead-code elimination: keep only what the outputs need (graph inputs always stay)."""

from __future__ import annotations

from ..ir.graph import Graph
from .base import graph_pass


@graph_pass("dce")
def dce(graph: Graph) -> Graph:
    """Drop nodes no output depends on. Nodes are found from the outputs, so rebuilding the
    graph without an explicit order is exactly DCE."""
    return graph.with_()
