"""cuBLAS through torch: a matmul in the operands' own dtype (fp32 accumulation inside cuBLAS),
then the group's epilogue as a separate launch (our generated pointwise kernel, or its torch
reference off the GPU). A candidate of the matmul kernel like any Triton config, not a fallback.

Operands go to torch as they are (strided views: a padded row stride, passes/pad_align.py, reaches
cuBLAS as its leading dimension; nothing here calls .contiguous() on them), and a product whose spec
has non-contiguous strides (a padded row) is written into a buffer of those strides by torch.mm's
`out=` (cuBLAS takes the padded row as ldc; no copy), else copied into one."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..fusion.epilogue import MatmulGroup
from ..ir.spec import contiguous_strides
from ..ops.linalg import exact_fp32_matmul
from ..runtime.kernel import in_strides

LaunchFn = Callable[[Sequence[torch.Tensor]], Sequence[torch.Tensor]]


def torch_matmul(a: torch.Tensor, b: torch.Tensor, trans_a: bool, trans_b: bool) -> torch.Tensor:
    """a' @ b' through torch.matmul (cuBLAS on CUDA), fp32 kept exact (no TF32) as the reference."""
    if trans_a:
        a = a.transpose(-1, -2)
    if trans_b:
        b = b.transpose(-1, -2)
    if a.dtype == torch.float32:
        with exact_fp32_matmul():
            return torch.matmul(a, b)
    return torch.matmul(a, b)


def matmul_into(a: torch.Tensor, b: torch.Tensor, trans_a: bool, trans_b: bool,
                strides: tuple[int, ...]) -> torch.Tensor:
    """a' @ b' laid out with `strides` (a padded row stride): torch.mm(out=) writes a 2-D product in
    place (cuBLAS with ldc = the padded row); other products are computed, then copied into it."""
    lhs = a.transpose(-1, -2) if trans_a else a
    rhs = b.transpose(-1, -2) if trans_b else b
    if lhs.dim() == 2 and rhs.dim() == 2 and lhs.dtype == rhs.dtype:
        out = torch.empty_strided((lhs.shape[0], rhs.shape[1]), strides, dtype=lhs.dtype, device=lhs.device)
        if lhs.dtype == torch.float32:
            with exact_fp32_matmul():
                return torch.mm(lhs, rhs, out=out)
        return torch.mm(lhs, rhs, out=out)
    return in_strides(torch_matmul(a, b, trans_a, trans_b), strides)


def cublas_launch(group: MatmulGroup, epilogue: LaunchFn | None, reductions: Sequence[LaunchFn] = ()) -> LaunchFn:
    """Launch function over `group.inputs`: torch.matmul, then `epilogue` (None: the product is
    the only output), then one launch per claimed reduction of the product (`group.reductions`, e.g.
    an amax), whose results follow the epilogue's."""
    mm = group.matmul
    positions = {n.id: k for k, n in enumerate(group.inputs)}
    ia, ib = positions[mm.inputs[0].id], positions[mm.inputs[1].id]
    ta, tb = bool(mm.attrs.get("trans_a", False)), bool(mm.attrs.get("trans_b", False))
    epi_inputs = group.epilogue.inputs
    dense = mm.spec.memory_strides
    row_major = mm.spec.strides is None or tuple(dense) == contiguous_strides(mm.shape)
    epi_args = [(True, 0) if n.id == mm.id else (False, positions[n.id]) for n in epi_inputs]
    red_args = [[(True, 0) if n.id == mm.id else (False, positions[n.id]) for n in r.inputs]
                for r in group.reductions]

    def launch(args: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        if not row_major:   # a padded row stride (passes/pad_align.py): written in place
            product = matmul_into(args[ia], args[ib], ta, tb, dense)
        else:
            product = torch_matmul(args[ia], args[ib], ta, tb)
        product = in_strides(product, dense)   # consumers read the spec's strides
        outs = [product] if epilogue is None else list(
            epilogue([product if is_product else args[k] for is_product, k in epi_args]))
        for run, where in zip(reductions, red_args, strict=True):
            outs += run([product if is_product else args[k] for is_product, k in where])
        return outs

    return launch


def describe(group: MatmulGroup) -> str:
    mm = group.matmul
    ops = "+".join(n.op for n in group.epilogue_nodes) or "none"
    return (f"# cuBLAS via torch.matmul(trans_a={mm.attrs.get('trans_a', False)}, "
            f"trans_b={mm.attrs.get('trans_b', False)}), epilogue: {ops}")


_ = Any
