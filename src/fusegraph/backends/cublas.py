"""cuBLAS through torch: a matmul in the operands' own dtype (fp32 accumulation inside cuBLAS),
then the group's epilogue as a separate launch (our generated pointwise kernel, or its torch
reference off the GPU). A candidate of the matmul kernel like any Triton config, not a fallback.
Two epilogues cuBLAS computes itself, in the same launch (OwnEpilogue): a bias vector (addmm, as
eager PyTorch and Inductor run a linear layer) and a cast of a 16-bit product to fp32. An epilogue
that starts with the bias and goes on (a linear layer's activation, the value before it kept too)
splits (BiasFirst): addmm computes the biased product, our kernel the rest as the second launch.

Operands go to torch as they are (strided views: a padded row stride, passes/pad_align.py, reaches
cuBLAS as its leading dimension; nothing here calls .contiguous() on them), and a product whose spec
has non-contiguous strides (a padded row) is written into a buffer of those strides by torch.mm's
`out=` (cuBLAS takes the padded row as ldc; no copy), else copied into one."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..fusion.epilogue import MatmulGroup
from ..fusion.partition import Entry, KernelGroup
from ..ir import dtypes
from ..ir.node import Node
from ..ir.spec import contiguous_strides
from ..ops.linalg import exact_fp32_matmul
from ..runtime.kernel import in_strides
from ..settings import settings

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


@dataclass(frozen=True)
class OwnEpilogue:
    """An epilogue cuBLAS computes itself, so the candidate is one launch: `kind` "bias" (the product
    plus a per-column vector: torch.addmm, cuBLASLt's bias epilogue; `cast_bias` when the graph casts
    the vector to the product's dtype first) or "fp32" (the 16-bit product cast to fp32: torch.mm with
    out_dtype, cuBLAS writing fp32 from its fp32 accumulator). Both round once where the graph rounds
    the product to 16 bits first: they differ from it by at most that rounding."""

    kind: str
    bias: int = -1              # position of the vector in group.inputs ("bias")
    cast_bias: bool = False


def own_epilogue(group: MatmulGroup, device: str) -> OwnEpilogue | None:
    """The form of `group`'s epilogue cuBLAS can compute itself, or None: a 2-D 16-bit product whose
    whole epilogue is `+ bias[N]` (the bias possibly cast to the product's dtype) or one cast to fp32,
    stored row-major, with no claimed reductions. "fp32" only where torch's cuBLAS takes out_dtype."""
    mm = group.matmul
    nodes = group.epilogue_nodes
    outs = group.outputs
    if (not settings.cublas_epilogues or group.reductions or len(outs) != 1
            or mm.dtype not in ("bfloat16", "float16") or len(mm.shape) != 2
            or any(len(i.shape) != 2 for i in mm.inputs[:2]) or mm.inputs[0].dtype != mm.inputs[1].dtype
            or tuple(outs[0].spec.memory_strides) != contiguous_strides(outs[0].shape)):
        return None
    out = outs[0]
    if len(nodes) == 1 and nodes[0].op == "cast" and nodes[0].inputs[0].id == mm.id and out.dtype == "float32":
        return OwnEpilogue("fp32") if out_dtype_supported(device) else None
    if not nodes or nodes[-1].op != "add" or out.id != nodes[-1].id or out.dtype != mm.dtype or nodes[-1].attrs:
        return None
    add = nodes[-1]
    others = [i for i in add.inputs if i.id != mm.id]
    if len(others) != 1 or len(add.inputs) != 2:
        return None
    vec, cast = others[0], False
    if len(nodes) == 2:
        if nodes[0].id != vec.id or vec.op != "cast" or vec.dtype != mm.dtype:
            return None
        vec, cast = vec.inputs[0], True
    elif len(nodes) != 1 or vec.dtype != mm.dtype:
        return None
    n = mm.shape[1]
    positions = {node.id: k for k, node in enumerate(group.inputs)}
    if vec.id not in positions or tuple(vec.shape) not in ((n,), (1, n)):
        return None
    return OwnEpilogue("bias", positions[vec.id], cast)


@dataclass(frozen=True)
class BiasFirst:
    """The cuBLAS candidate of an epilogue that begins with `+ bias[N]` and goes on: torch.addmm (the
    bias in cuBLASLt's epilogue, the product rounded once, as eager's linear layer) computes `add`'s
    value, then `rest` (the epilogue reading that value, without the bias) is the second launch. It
    moves the same bytes as the product then the whole epilogue, and writes `add`'s value (when the
    plan keeps it: the pre-activation a training forward saves) straight from cuBLAS."""

    own: OwnEpilogue
    add: Node
    rest: KernelGroup


def bias_first(group: MatmulGroup, device: str) -> BiasFirst | None:
    """BiasFirst for a 2-D 16-bit product read only by a bias add that the epilogue goes on after
    (own_epilogue covers an epilogue that is the bias alone), or None."""
    mm, epi, product = group.matmul, group.epilogue, group.product
    if (not settings.cublas_epilogues or not device.startswith("cuda") or group.reductions
            or mm.dtype not in ("bfloat16", "float16") or len(mm.shape) != 2
            or any(len(i.shape) != 2 for i in mm.inputs[:2]) or mm.inputs[0].dtype != mm.inputs[1].dtype):
        return None
    entries = epi.entries
    by_key = {e.key: e for e in entries}
    readers = [e for e in entries if product.key in e.args]
    if len(readers) != 1:
        return None
    add = readers[0]
    if (add.kind != "op" or add.node.op != "add" or add.node.attrs or len(add.args) != 2
            or add.node.dtype != mm.dtype or add.emb != product.emb):
        return None
    dropped = {product.key}
    vec = by_key[add.args[1] if add.args[0] == product.key else add.args[0]]
    cast = False
    if vec.kind == "op" and vec.node.op == "cast" and len(vec.args) == 1 and vec.node.dtype == mm.dtype:
        if sum(vec.key in e.args for e in entries) != 1:
            return None
        dropped.add(vec.key)
        vec, cast = by_key[vec.args[0]], True
    elif vec.node.dtype != mm.dtype:
        return None
    positions = {n.id: k for k, n in enumerate(group.inputs)}
    if vec.kind != "load" or vec.node.id not in positions or tuple(vec.node.shape) not in ((mm.shape[1],),
                                                                                          (1, mm.shape[1])):
        return None
    if not any(vec.key in e.args for e in entries if e.key not in dropped and e.key != add.key):
        dropped.add(vec.key)
    stores = [e for e in epi.stores if e.key != add.key]
    if not stores or (len(stores) != len(epi.stores)
                      and tuple(add.node.spec.memory_strides) != contiguous_strides(add.node.shape)):
        return None   # nothing left to launch, or the kept biased product has a padded row
    value = Entry(add.key, add.node, add.emb, "load")
    rest = [value if e.key == add.key else e for e in entries if e.key not in dropped]
    if not any(e.kind != "load" for e in rest):
        return None
    kept = KernelGroup(epi.domain, [e.node for e in stores], rest, stores, [e for e in rest if e.kind == "load"])
    return BiasFirst(OwnEpilogue("bias", positions[vec.node.id], cast), add.node, kept)


def library_form(group: MatmulGroup, device: str) -> str | None:
    """What the cuBLAS candidate computes in its own call beside the product ("bias", "fp32",
    "bias_first"), or None: part of the tuning key (another form, another candidate)."""
    own = own_epilogue(group, device) if device.startswith("cuda") else None
    return form_of(own, bias_first(group, device) if own is None else None)


def form_of(own: OwnEpilogue | None, split: BiasFirst | None) -> str | None:
    """library_form from the group's own_epilogue and bias_first, already made."""
    return own.kind if own is not None else None if split is None else "bias_first"


_OUT_DTYPE: dict[str, bool] = {}


def out_dtype_supported(device: str) -> bool:
    """Whether torch.mm(bf16, bf16, out_dtype=float32) runs on `device` (CUDA builds of recent torch)."""
    if device not in _OUT_DTYPE:
        try:
            a = torch.ones((8, 8), dtype=torch.bfloat16, device=device)
            _OUT_DTYPE[device] = torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
        except (RuntimeError, TypeError, NotImplementedError):
            _OUT_DTYPE[device] = False
    return _OUT_DTYPE[device]


def cublas_launch(group: MatmulGroup, epilogue: LaunchFn | None, reductions: Sequence[LaunchFn] = (),
                  own: OwnEpilogue | None = None, split: BiasFirst | None = None) -> LaunchFn:
    """Launch function over `group.inputs`: torch.matmul, then `epilogue` (None: the product is
    the only output), then one launch per claimed reduction of the product (`group.reductions`, e.g.
    an amax), whose results follow the epilogue's. With `own` (own_epilogue(group)), one cuBLAS call
    computes the epilogue too and `epilogue` is not used. With `split` (bias_first(group)), torch.addmm
    computes the biased product and `epilogue` is split.rest's launch."""
    mm = group.matmul
    if own is not None:
        return _own_launch(group, own)
    if split is not None and epilogue is not None:
        return _bias_first_launch(group, split, epilogue)
    positions = {n.id: k for k, n in enumerate(group.inputs)}
    ia, ib, ta, tb = _operands(group)
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


def _operands(group: MatmulGroup) -> tuple[int, int, bool, bool]:
    """Positions of the matmul's two operands in group.inputs, and whether each is transposed."""
    mm = group.matmul
    positions = {n.id: k for k, n in enumerate(group.inputs)}
    return (positions[mm.inputs[0].id], positions[mm.inputs[1].id],
            bool(mm.attrs.get("trans_a", False)), bool(mm.attrs.get("trans_b", False)))


def _bias_first_launch(group: MatmulGroup, split: BiasFirst, rest: LaunchFn) -> LaunchFn:
    mm = group.matmul
    ia, ib, ta, tb = _operands(group)
    positions = {n.id: k for k, n in enumerate(group.inputs)}
    n, dtype, own = mm.shape[1], dtypes.to_torch(mm.dtype), split.own
    rest_args = [-1 if node.id == split.add.id else positions[node.id] for node in split.rest.inputs]
    at = {e.node.id: k for k, e in enumerate(split.rest.stores)}
    picks = [-1 if node.id == split.add.id else at[node.id] for node in group.outputs]

    def launch(args: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        lhs = args[ia].t() if ta else args[ia]
        rhs = args[ib].t() if tb else args[ib]
        bias = args[own.bias].reshape(n)
        value = torch.addmm(bias.to(dtype) if own.cast_bias else bias, lhs, rhs)
        outs = rest([value if k < 0 else args[k] for k in rest_args])
        return [value if k < 0 else outs[k] for k in picks]
    return launch


def _own_launch(group: MatmulGroup, own: OwnEpilogue) -> LaunchFn:
    mm = group.matmul
    ia, ib, ta, tb = _operands(group)
    n = mm.shape[1]

    if own.kind == "fp32":
        def launch_fp32(args: Sequence[torch.Tensor]) -> list[torch.Tensor]:
            lhs = args[ia].t() if ta else args[ia]
            rhs = args[ib].t() if tb else args[ib]
            return [torch.mm(lhs, rhs, out_dtype=torch.float32)]
        return launch_fp32

    dtype = dtypes.to_torch(mm.dtype)

    def launch_bias(args: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        lhs = args[ia].t() if ta else args[ia]
        rhs = args[ib].t() if tb else args[ib]
        bias = args[own.bias].reshape(n)
        return [torch.addmm(bias.to(dtype) if own.cast_bias else bias, lhs, rhs)]
    return launch_bias


def describe(group: MatmulGroup, own: OwnEpilogue | None = None, split: BiasFirst | None = None) -> str:
    mm = group.matmul
    ops = "+".join(n.op for n in group.epilogue_nodes) or "none"
    call = {None: "torch.matmul", "bias": "torch.addmm (the bias in cuBLASLt's epilogue)",
            "fp32": "torch.mm(out_dtype=float32)"}[None if own is None else own.kind]
    if split is not None:
        call = "torch.addmm (the bias in cuBLASLt's epilogue, the rest of the epilogue a second launch)"
    return (f"# cuBLAS via {call}(trans_a={mm.attrs.get('trans_a', False)}, "
            f"trans_b={mm.attrs.get('trans_b', False)}), epilogue: {ops}"
            + (" (computed by cuBLAS)" if own is not None else ""))


_ = Any
