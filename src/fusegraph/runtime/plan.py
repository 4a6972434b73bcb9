"""Plan: the compiled, runnable form of a graph. A launch list of Kernels over a buffer table.

Per call, the Plan does the input checks and one launch per kernel; which buffer each kernel
reads and writes is decided at build time (slot indices), not looked up per call.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..ir.graph import Graph
from ..ir.node import Node
from ..ir.printer import format_plan
from .guards import check_inputs, resolve_feeds
from .kernel import Kernel


class Plan:
    def __init__(self, graph: Graph, kernels: list[Kernel], device: str,
                 input_handles: Sequence[Any] = (), output_handles: Sequence[Any] = ()) -> None:
        self.graph = graph
        self.kernels = kernels
        self.device = device
        self.input_handles = list(input_handles) or list(graph.inputs)
        self.output_handles = list(output_handles) or list(graph.outputs)
        self._schedule = self._assign_slots()

    def _assign_slots(self) -> list[tuple[Kernel, tuple[int, ...], tuple[int, ...]]]:
        """Give every value a slot: inputs first, then each kernel's outputs in launch order."""
        slot: dict[int, int] = {n.id: k for k, n in enumerate(self.graph.inputs)}
        schedule = []
        for kernel in self.kernels:
            ins = tuple(slot[n.id] for n in kernel.inputs)
            outs = []
            for n in kernel.outputs:
                slot[n.id] = len(slot)
                outs.append(slot[n.id])
            schedule.append((kernel, ins, tuple(outs)))
        self._num_slots = len(slot)
        self._out_slots = tuple(slot[n.id] for n in self.graph.outputs)
        return schedule

    def run(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Execute on positional inputs; returns outputs in set_output order."""
        check_inputs(self.graph.inputs, inputs, self.device)
        buf: list[Any] = list(inputs) + [None] * (self._num_slots - len(inputs))
        for kernel, ins, outs in self._schedule:
            results = kernel.launch([buf[i] for i in ins])
            for k, r in zip(outs, results, strict=True):
                buf[k] = r
        return [buf[k] for k in self._out_slots]

    def execute(self, feeds: Mapping[Any, torch.Tensor]) -> dict[Any, torch.Tensor]:
        outs = self.run(resolve_feeds(self.graph.inputs, feeds))
        return dict(zip(self.output_handles, outs, strict=True))

    def __call__(self, *tensors: torch.Tensor) -> Any:
        outs = self.run(tensors)
        return outs[0] if len(outs) == 1 else tuple(outs)

    def explain(self) -> str:
        from ..perf.explain import explain_plan

        return explain_plan(self)

    def __str__(self) -> str:
        return format_plan(self)

    @property
    def nodes(self) -> tuple[Node, ...]:
        return self.graph.nodes
