"""Kernel: one launch. A connected subgraph, the values it reads and writes, its source and cost."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..ir.node import Node
from ..ir.registry import Cost

LaunchFn = Callable[[Sequence[torch.Tensor]], Sequence[torch.Tensor]]


def in_strides(t: torch.Tensor, strides: Sequence[int]) -> torch.Tensor:
    """`t` laid out with `strides` (what a consumer compiled for a spec's strides reads): `t` itself
    when it already is (strides of size-1 dims do not matter), else a copy into such a buffer."""
    if t.dim() == len(strides) and all(s == w for s, w, n in zip(t.stride(), strides, t.shape, strict=True) if n > 1):
        return t
    return torch.empty_strided(t.shape, tuple(strides), dtype=t.dtype, device=t.device).copy_(t)


@dataclass
class Kernel:
    name: str
    kind: str                      # pointwise | reduction | matmul | convolution | attention | library | eager
    backend: str                   # triton | reference | cublas | cudnn | eager
    nodes: tuple[Node, ...]        # the ops fused, in order
    inputs: tuple[Node, ...]       # values read from memory
    outputs: tuple[Node, ...]      # values written to memory
    cost: Cost                     # minimum bytes and FLOPs of the whole kernel
    launch: LaunchFn               # input tensors -> output tensors
    source: str = ""               # generated source (Triton), or a description of the library call
    config: dict[str, Any] = field(default_factory=dict)
    note: str = ""                 # why this backend was chosen / what fell back
    # how the config was chosen: {"source": default|launch-bound|single|memo|cache|tuned,
    # "seconds": tuning time, "candidates": how many, "build_s": the whole kernel's build time}
    tuning: dict[str, Any] = field(default_factory=dict)
    # True when a launch waits for the device (reads a value back, data-dependent output shapes):
    # a plan holding such a kernel is never captured as a CUDA graph (runtime/cuda_graph.py)
    host_sync: bool = False

    @property
    def ops(self) -> list[str]:
        return [n.op for n in self.nodes]

    def __repr__(self) -> str:
        return (f"Kernel({self.name}: {self.kind}/{self.backend}, {len(self.nodes)} ops, "
                f"{self.cost.bytes} B, {self.cost.flops} FLOP)")
