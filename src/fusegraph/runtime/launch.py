"""Launchers: the per-call work of one kernel. Everything that can be decided at build time
(grid, constexprs, output shapes/strides/dtypes) is decided there; a call allocates the outputs
and launches once.

On CUDA, after the first launch through Triton's JIT (which compiles and specializes), calls go
straight to the compiled kernel's `run`, skipping the JIT's per-call argument binding.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..ir import dtypes
from ..ir.node import Node


class TritonLaunch:
    def __init__(self, fn: Any, grid: tuple[int, ...], constexprs: dict[str, Any], num_warps: int,
                 outputs: Sequence[Node], device: str, fast: bool = True) -> None:
        self.fn = fn
        self.grid = grid
        self.constexprs = constexprs
        self.const_values = tuple(constexprs.values())
        self.num_warps = num_warps
        self.out_specs = [(n.shape, n.spec.memory_strides, dtypes.to_torch(n.dtype)) for n in outputs]
        self.device = torch.device(device)
        self.fast = fast and self.device.type == "cuda"
        self._compiled: Any = None

    def allocate(self) -> list[torch.Tensor]:
        dev = self.device
        return [torch.empty_strided(shape, strides, dtype=dt, device=dev) for shape, strides, dt in self.out_specs]

    def __call__(self, args: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        outs = self.allocate()
        if self._compiled is not None:
            self._compiled(*args, *outs, *self.const_values)
            return outs
        kernel = self.fn[self.grid](*args, *outs, **self.constexprs, num_warps=self.num_warps)
        if self.fast and kernel is not None:
            self._compiled = _direct_runner(kernel, self.grid)
        return outs


def _direct_runner(kernel: Any, grid: tuple[int, ...]) -> Callable[..., None] | None:
    """A closure launching a compiled Triton kernel without the JIT's dispatch (None if this
    Triton does not expose what it needs)."""
    try:
        from triton import knobs

        run, function, packed = kernel.run, kernel.function, kernel.packed_metadata
        g0, g1, g2 = (tuple(grid) + (1, 1))[:3]
        stream_of = torch.cuda.current_stream
    except (ImportError, AttributeError):
        return None

    def launch(*args: Any) -> None:
        stream = stream_of().cuda_stream
        enter, exit_ = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
        meta = kernel.launch_metadata(grid, stream, *args) if enter is not None else None
        run(g0, g1, g2, stream, function, packed, meta, enter, exit_, *args)

    return launch
