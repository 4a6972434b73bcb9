"""Matrix products: matmul (batched, broadcast, transposes as flags) and linear (a composite).

A transposed operand is an attribute (`trans_a`, `trans_b`), never a copy: the matmul code
generator and cuBLAS read the operand with swapped strides. Products accumulate in fp32 and the
result has the inputs' dtype."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from ..errors import DTypeError, ShapeError
from ..ir import dtypes
from ..ir.emit import Emitter
from ..ir.node import Attrs, Node
from ..ir.registry import COMPOSITE, MATMUL, Cost, define
from ..ir.spec import TensorSpec
from . import _rules as R


def _require_float_pair(a: TensorSpec, b: TensorSpec, what: tuple[str, str]) -> None:
    for name, s in zip(what, (a, b), strict=True):
        if not dtypes.is_float(s.dtype) or s.dtype in dtypes.FP8:
            raise DTypeError(f"{name} must be float64/32/16 or bfloat16, got {s.dtype}")
    if a.dtype != b.dtype:
        raise DTypeError(f"{what[0]} and {what[1]} must have the same dtype, got {a.dtype} and {b.dtype}")


def matmul_dims(a: TensorSpec, b: TensorSpec, attrs: Attrs) -> tuple[tuple[int, ...], int, int, int]:
    """(batch shape, M, N, K) of a matmul after transposes and 1-D promotion, with torch.matmul's
    rules: a 1-D `a` is a row [1, K] and a 1-D `b` a column [K, 1], their unit dim dropped after."""
    trans_a, trans_b = bool(attrs.get("trans_a", False)), bool(attrs.get("trans_b", False))
    if a.rank == 0 or b.rank == 0:
        raise ShapeError(f"matmul needs operands of rank >= 1, got a {a.shape} and b {b.shape}")
    if (trans_a and a.rank < 2) or (trans_b and b.rank < 2):
        raise ShapeError(f"a transpose flag needs a rank >= 2 operand: a {a.shape} trans_a={trans_a}, "
                         f"b {b.shape} trans_b={trans_b}")
    batch_a: tuple[int, ...] = ()
    batch_b: tuple[int, ...] = ()
    if a.rank == 1:
        m, ka = 1, a.shape[0]
    else:
        m, ka = (a.shape[-1], a.shape[-2]) if trans_a else (a.shape[-2], a.shape[-1])
        batch_a = a.shape[:-2]
    if b.rank == 1:
        kb, n = b.shape[0], 1
    else:
        kb, n = (b.shape[-1], b.shape[-2]) if trans_b else (b.shape[-2], b.shape[-1])
        batch_b = b.shape[:-2]
    if ka != kb:
        raise ShapeError(f"inner dims differ: a {a.shape} (trans_a={trans_a}) has K={ka}, "
                         f"b {b.shape} (trans_b={trans_b}) has K={kb}")
    try:
        batch = R.broadcast_shapes(batch_a, batch_b)
    except ShapeError as err:
        raise ShapeError(f"batch dims of a {a.shape} and b {b.shape} do not broadcast: {err}") from None
    return batch, m, n, ka


def _matmul_infer(specs: Sequence[TensorSpec], attrs: Attrs) -> TensorSpec:
    a, b = specs
    _require_float_pair(a, b, ("a", "b"))
    batch, m, n, _ = matmul_dims(a, b, attrs)
    shape = batch + ((m,) if a.rank > 1 else ()) + ((n,) if b.rank > 1 else ())
    return TensorSpec(shape, a.dtype, device=a.device)


@contextmanager
def exact_fp32_matmul() -> Iterator[None]:
    """fp32 products at full precision even where the user allowed TF32: the reference defines fp32."""
    previous = torch.get_float32_matmul_precision()
    if previous == "highest":
        yield
        return
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


def _acc(t: torch.Tensor) -> torch.Tensor:
    """fp32 accumulation for low-precision floats; float64 stays float64."""
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


def _matmul_ref(xs: list[torch.Tensor], a: Any) -> torch.Tensor:
    lhs, rhs = _acc(xs[0]), _acc(xs[1])
    if a.get("trans_a", False):
        lhs = lhs.transpose(-1, -2)
    if a.get("trans_b", False):
        rhs = rhs.transpose(-1, -2)
    with exact_fp32_matmul():
        return torch.matmul(lhs, rhs)


def _matmul_cost(ins: Sequence[TensorSpec], outs: Sequence[TensorSpec], attrs: Attrs) -> Cost:
    batch, m, n, k = matmul_dims(ins[0], ins[1], attrs)
    count = 1
    for d in batch:
        count *= d
    return Cost(ins[0].nbytes + ins[1].nbytes + outs[0].nbytes, 2 * m * n * k * count)


define("matmul", _matmul_infer, _matmul_ref, num_inputs=(2, 2), props={MATMUL}, cost_fn=_matmul_cost,
       extra={"kernel_kind": "matmul", "dims": matmul_dims},
       doc="torch.matmul(a', b') where a' = a^T if trans_a, b' = b^T if trans_b (last two dims); "
           "batch dims broadcast; 1-D operands as torch. Accumulates in fp32; output in the input dtype. "
           "FLOPs 2*M*N*K*batch. extra['dims'](a, b, attrs) -> (batch, M, N, K) for the code generator.")


def _linear_infer(specs: Sequence[TensorSpec], attrs: Attrs) -> TensorSpec:
    x, w = specs[0], specs[1]
    _require_float_pair(x, w, ("input", "weight"))
    if w.rank != 2:
        raise ShapeError(f"weight must be 2-D [out_features, in_features], got shape {w.shape}")
    if x.rank == 0 or x.shape[-1] != w.shape[1]:
        raise ShapeError(f"input {x.shape} has in_features {x.shape[-1] if x.rank else None} but weight "
                         f"{w.shape} expects {w.shape[1]}")
    if len(specs) == 3:
        bias = specs[2]
        if bias.shape != (w.shape[0],):
            raise ShapeError(f"bias has shape {bias.shape}, expected ({w.shape[0]},)")
        if bias.dtype != x.dtype:
            raise DTypeError(f"bias dtype {bias.dtype} differs from input dtype {x.dtype}")
    return TensorSpec((*x.shape[:-1], w.shape[0]), x.dtype, device=x.device)


def _linear_ref(xs: list[torch.Tensor], a: Any) -> torch.Tensor:
    bias = _acc(xs[2]) if len(xs) == 3 else None
    with exact_fp32_matmul():
        return torch.nn.functional.linear(_acc(xs[0]), _acc(xs[1]), bias)


def _linear_cost(ins: Sequence[TensorSpec], outs: Sequence[TensorSpec], attrs: Attrs) -> Cost:
    k = ins[1].shape[1]
    flops = 2 * outs[0].numel * k + (outs[0].numel if len(ins) == 3 else 0)
    return Cost(sum(s.nbytes for s in ins) + outs[0].nbytes, flops)


def _linear_dec(e: Emitter, xs: list[Node], attrs: Attrs, compute_dtype: str) -> Node:
    y = e.op("matmul", xs[0], xs[1], trans_a=False, trans_b=True)
    return e.op("add", y, xs[2]) if len(xs) == 3 else y


define("linear", _linear_infer, _linear_ref, num_inputs=(2, 3), props={COMPOSITE}, cost_fn=_linear_cost,
       decompose=_linear_dec,
       doc="F.linear: x @ weight^T + bias; decomposes to matmul(trans_b=True) + add (the add becomes the "
           "matmul kernel's epilogue). FLOPs 2*numel(out)*in_features (+ numel(out) with a bias).")


class LinalgMethods:
    """Graph-builder methods for matmul and linear (mixed into fusegraph.Graph)."""

    def _apply(self, op: str, *operands: Any, name: str | None = None, **attrs: Any) -> Any:
        raise NotImplementedError

    def matmul(self, a: Any, b: Any, transpose_a: bool = False, transpose_b: bool = False,
               name: str | None = None) -> Any:
        """torch.matmul(a, b); transpose_a/transpose_b swap the last two dims of an operand for free."""
        return self._apply("matmul", a, b, trans_a=bool(transpose_a), trans_b=bool(transpose_b), name=name)

    def linear(self, input: Any, weight: Any, bias: Any = None, name: str | None = None) -> Any:
        """F.linear(input, weight, bias) = input @ weight^T + bias."""
        args = (input, weight) if bias is None else (input, weight, bias)
        return self._apply("linear", *args, name=name)
