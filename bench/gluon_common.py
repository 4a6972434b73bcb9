"""What the Gluon benches (gluon_gemm_gpu.py, gluon_attention_gpu.py) share: compiling a kernel for sm_90 on a
machine without a GPU, and checking each implementation against a reference before any is timed."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch


def compile_for_sm90(fn: Any, values: dict[str, Any], constexprs: dict[str, Any],
                     attrs: dict[Any, Any] | None = None) -> int:
    """Compile the Gluon kernel `fn` for sm_90 (no launch; Triton's compiler and ptxas run on the CPU) with
    these argument values and constexprs, and print its shared memory and what its PTX holds."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    signature = {name: "constexpr" if name in constexprs else mangle_type(values[name]) for name in fn.arg_names}
    start = time.perf_counter()
    compiled = triton.compile(GluonASTSource(fn, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": 4, "maxnreg": 168})
    ptx = compiled.asm["ptx"]
    print(f"compiled for sm_90 in {time.perf_counter() - start:.1f} s: shared {compiled.metadata.shared} bytes, "
          f"{ptx.count('wgmma.mma_async')} wgmma, {ptx.count('cp.async.bulk.tensor')} TMA copies, "
          f"{ptx.count('setmaxnreg')} setmaxnreg in the PTX")
    return 0


def checked(impls: dict[str, Callable[[], torch.Tensor]], ref: torch.Tensor, limit: float = 2e-2
            ) -> tuple[list[tuple[str, Callable[[], torch.Tensor]]], dict[str, str]]:
    """(the implementations whose output is within `limit` relative error of `ref`, to be timed; a note per
    implementation: its error, WRONG, or the error it raised)."""
    timed, notes = [], {}
    for name, fn in impls.items():
        try:
            out = fn()
            err = ((out.float() - ref).norm() / ref.norm()).item()
            if err > limit:
                notes[name] = f"WRONG: relative error {err:.3g}"
                continue
            notes[name] = f"(error {err:.2e})"
            timed.append((name, fn))
        except Exception as exc:  # report and go on
            notes[name] = f"ERROR {type(exc).__name__}: {str(exc)[:300]}"
    return timed, notes
