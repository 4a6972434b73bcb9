"""The optimization pipeline, in order. Read top to bottom."""

from __future__ import annotations

from ..ir.graph import Graph
from ..settings import settings
from .base import Pass
from .dce import dce

PIPELINE: list[Pass] = [
    dce,
]


def optimize(graph: Graph, passes: list[Pass] | None = None) -> Graph:
    for p in passes if passes is not None else PIPELINE:
        graph = p(graph)
        if settings.debug >= 4:
            print(f"--- after {p.name} ---\n{graph}")
    return graph
