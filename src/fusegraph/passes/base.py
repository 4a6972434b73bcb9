"""What a pass is: a named, pure Graph -> Graph function. Running it stamps provenance
("constructed by X (took N ms)") and, when verification is on, checks the result."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from ..ir.graph import Graph, PassRecord
from ..settings import settings


@dataclass(frozen=True)
class Pass:
    name: str
    fn: Callable[[Graph], Graph]
    doc: str = ""

    def __call__(self, graph: Graph) -> Graph:
        start = time.perf_counter()
        out = self.fn(graph)
        record = PassRecord(self.name, time.perf_counter() - start, len(graph.nodes), len(out.nodes))
        out = out.with_(record=record, order=out.nodes)   # the same nodes: no second topological sort
        if settings.verify or settings.debug >= 1:
            from ..ir.verify import verify

            verify(out, after=self.name)
        return out


def graph_pass(name: str) -> Callable[[Callable[[Graph], Graph]], Pass]:
    def wrap(fn: Callable[[Graph], Graph]) -> Pass:
        return Pass(name, fn, (fn.__doc__ or "").strip())
    return wrap
