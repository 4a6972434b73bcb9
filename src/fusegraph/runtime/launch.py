"""Launchers: the per-call work of one kernel. Everything that can be decided at build time
(grid, constexprs, output shapes/strides/dtypes) is decided there; a call allocates the outputs
and launches once.

On CUDA, after the first launch through Triton's JIT (which compiles and specializes), calls go
straight to the compiled kernel's `run`, skipping the JIT's per-call argument binding.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..ir import dtypes
from ..ir.node import Node
from ..settings import settings


def pdl_enabled(device: str | torch.device) -> bool:
    """Whether generated kernels on `device` are launched with programmatic dependent launch
    (settings.pdl; codegen/triton_gen.py PDL_PROLOGUE): a CUDA GPU of compute capability >= 9 and a
    Triton with griddepcontrol (tl.extra.cuda.gdc_wait), never under the interpreter. Such a launch
    passes USE_PDL=True and launch_pdl=True (`pdl_options`)."""
    from ..codegen.compile import interpreting

    dev = torch.device(device)
    if not settings.pdl or dev.type != "cuda" or interpreting() or not torch.cuda.is_available():
        return False
    return _pdl_supported(torch.cuda.current_device() if dev.index is None else dev.index)


@functools.cache
def _pdl_supported(index: int) -> bool:
    try:
        import triton.language as tl

        has_gdc = hasattr(tl.extra.cuda, "gdc_wait")
    except (ImportError, AttributeError):
        return False
    return has_gdc and torch.cuda.get_device_capability(index)[0] >= 9


def pdl_options(device: str | torch.device) -> tuple[dict[str, Any], dict[str, Any]]:
    """(constexprs, launch options) a generated kernel's launch on `device` adds: USE_PDL and
    launch_pdl when `pdl_enabled`, else USE_PDL false. The constexpr is always given: the direct
    launch path passes every constexpr by position, and a missing last one (its default left to the
    JIT) made it launch with the arguments misplaced."""
    if pdl_enabled(device):
        return {"USE_PDL": True}, {"launch_pdl": True}
    return {"USE_PDL": False}, {}


class TritonLaunch:
    """Launches `stages` (jitted function, grid) in order over (inputs, outputs, workspaces)."""

    def __init__(self, stages: Sequence[tuple[Any, tuple[int, ...]]], constexprs: dict[str, Any], num_warps: int,
                 outputs: Sequence[Node], device: str, fast: bool = True,
                 workspaces: Sequence[tuple[int, ...]] = ()) -> None:
        self.stages = list(stages)
        self.fn, self.grid = self.stages[0]
        pdl_consts, self.launch_options = pdl_options(device)
        constexprs = {**constexprs, **pdl_consts}
        self.constexprs = constexprs
        self.const_values = tuple(constexprs.values())
        self.num_warps = num_warps
        self.out_specs = [(n.shape, n.spec.memory_strides, dtypes.to_torch(n.dtype)) for n in outputs]
        self.workspaces = list(workspaces)
        self.device = torch.device(device)
        self.fast = fast and self.device.type == "cuda"
        self._compiled: list[Callable[..., None]] | None = None
        # output k is written into args[into[k]] when that is not None (in place; runtime/memory.py)
        self.into: tuple[int | None, ...] = ()

    def reusing(self, into: Sequence[int | None]) -> TritonLaunch:
        """A launcher of the same kernel that writes output k into its input into[k] (None: a new
        buffer). Only for elementwise kernels whose output and input have one shape, dtype and strides."""
        clone = copy.copy(self)
        clone.into = tuple(into)
        return clone

    def allocate(self, args: Sequence[torch.Tensor] = ()) -> list[torch.Tensor]:
        dev = self.device
        if self.into:
            outs = [args[j] if j is not None else torch.empty_strided(shape, strides, dtype=dt, device=dev)
                    for (shape, strides, dt), j in zip(self.out_specs, self.into, strict=True)]
        else:
            outs = [torch.empty_strided(shape, strides, dtype=dt, device=dev) for shape, strides, dt in self.out_specs]
        return outs + [torch.empty(shape, dtype=torch.float32, device=dev) for shape in self.workspaces]

    def __call__(self, args: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        buffers = self.allocate(args)
        compiled = self._compiled
        if compiled is not None:
            consts = self.const_values
            for run in compiled:
                run(*args, *buffers, *consts)
            return buffers[:len(self.out_specs)] if self.workspaces else buffers
        n_out = len(self.out_specs)
        kernels = [fn[grid](*args, *buffers, **self.constexprs, num_warps=self.num_warps, **self.launch_options)
                   for fn, grid in self.stages]
        if self.fast and all(k is not None for k in kernels):
            runners = [_direct_runner(k, grid) for k, (_, grid) in zip(kernels, self.stages, strict=True)]
            if all(r is not None for r in runners):
                self._compiled = [r for r in runners if r is not None]
        return buffers[:n_out] if self.workspaces else buffers


def _direct_runner(kernel: Any, grid: tuple[int, ...]) -> Callable[..., None] | None:
    """A closure launching a compiled Triton kernel without the JIT's dispatch (None if this
    Triton does not expose what it needs). The stream is read per call (CUDA-graph capture and
    user streams change it) with the same raw call the JIT uses."""
    try:
        from triton import knobs

        run, function, packed = kernel.run, kernel.function, kernel.packed_metadata
        g0, g1, g2 = (*tuple(grid), 1, 1)[:3]
        device = torch.cuda.current_device()
        raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        hooks = knobs.runtime
    except (ImportError, AttributeError, RuntimeError):
        return None

    def current_stream(device: int) -> int:
        return int(torch.cuda.current_stream(device).cuda_stream)

    get_stream: Callable[[int], int] = raw_stream if raw_stream is not None else current_stream

    def launch(*args: Any) -> None:
        enter = hooks.launch_enter_hook
        stream = get_stream(device)
        meta = kernel.launch_metadata(grid, stream, *args) if enter is not None else None
        run(g0, g1, g2, stream, function, packed, meta, enter, hooks.launch_exit_hook, *args)

    return launch
