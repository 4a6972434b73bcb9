"""Affine indices: slice and concat folded into a kernel's indexing.

An Embedding places each dim of a value in the kernel's domain: the domain dim it indexes (an
int), or None (a size-1 or broadcast dim, index 0). A slice reads its input at
`start + step * i` along one dim, and concat's k-th input is read at `i - off_k` along the concat
dim, so an embedding entry may also be an `Affine`: the index `offset + step * i_dim` (i_dim the
kernel's index along domain dim `dim`; `dim` None: the constant `offset`).

A load whose affine index can leave its tensor's range over the domain (concat inputs: outside
their own segment) is masked on that dim, so no address outside the tensor is read; concat picks
its input per element with `tl.where` on the output index, so the masked-off values are never
used. Concat is then a pointwise op of its inputs with shifted indices, fused with what it feeds
and what feeds it (RoPE's rotate-half, chunk -> silu(a) * b, ...).

A constant pad reads its input at `i - before` along each padded dim (negative pads crop: the
shift goes the other way) and is `tl.where(index inside the input, input value, pad value)`; the
input's loads are masked outside it, so no padded buffer exists. Pooling (pad + strided slices +
maximum / add, frontends/torch_ops_more) is then one kernel reading the pooled tensor directly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..ir import dtypes
from ..ir.node import Node
from ..ir.registry import get_op


@dataclass(frozen=True)
class Affine:
    """The index `offset + step * i[dim]` into one dim of a value (dim None: the constant offset)."""

    dim: int | None
    step: int = 1
    offset: int = 0


def domain_dim(e: int | Affine | None) -> int | None:
    """The domain dim an embedding entry's index varies with (None: constant)."""
    return e.dim if isinstance(e, Affine) else e


def shifted(e: int | Affine | None, start: int, step: int = 1) -> int | Affine | None:
    """The entry for index `start + step * e` (the input index of a slice or concat)."""
    if isinstance(e, Affine):
        dim, s, o = e.dim, e.step, e.offset
    else:
        dim, s, o = e, 1, 0
    s, o = (s * step, start + step * o) if dim is not None else (0, start + step * o)
    if dim is None:
        return None if o == 0 else Affine(None, 0, o)
    return dim if (s, o) == (1, 0) else Affine(dim, s, o)


def index_expr(e: int | Affine, dimvar: dict[int, str]) -> str:
    """The Triton expression of an entry's index, given the domain's per-dim index variables."""
    if not isinstance(e, Affine):
        return dimvar[e]
    if e.dim is None:
        return str(e.offset)
    var = dimvar[e.dim]
    term = var if e.step == 1 else f"{var} * {e.step}"
    if e.offset == 0:
        return term
    return f"({term} + {e.offset})" if e.offset > 0 else f"({term} - {-e.offset})"


def bounds_conditions(entry: int | Affine, size: int, domain_shape: tuple[int, ...],
                      dimvar: dict[int, str]) -> list[str]:
    """Conditions keeping the index `entry` in [0, size) wherever it can leave it over the domain."""
    e = entry if isinstance(entry, Affine) else Affine(entry)
    n = domain_shape[e.dim] if e.dim is not None else 1
    ends = (e.offset, e.offset + e.step * (n - 1))
    idx = index_expr(e, dimvar)
    conds = []
    if min(ends) < 0:
        conds.append(f"({idx} >= 0)")
    if max(ends) >= size:
        conds.append(f"({idx} < {size})")
    return conds


def range_mask(node: Node, emb: tuple[int | Affine | None, ...], domain_shape: tuple[int, ...],
               dimvar: dict[int, str]) -> str:
    """Conditions (joined by &, '' if none) keeping the indices of a load of `node` inside the
    tensor wherever they can leave it over the domain (a concat's first input is read at the plain
    domain index, past its own end; a padded input in the padding)."""
    conds = []
    for k, entry in enumerate(emb):
        if entry is None or node.shape[k] == 1:
            continue
        conds += bounds_conditions(entry, node.shape[k], domain_shape, dimvar)
    return " & ".join(conds)


def has_affine(emb: tuple[int | Affine | None, ...]) -> bool:
    return any(isinstance(e, Affine) for e in emb)


# ---- slice ----

def slice_input_embedding(node: Node, emb: tuple[int | Affine | None, ...]) -> tuple[int | Affine | None, ...]:
    """A slice's embedding carried to its input: the sliced dim is read at start + step * i."""
    params = get_op("slice").extra["view_params"](node.inputs[0].spec, node.attrs)
    dim = params["dim"]
    out = list(emb)
    out[dim] = None if node.inputs[0].shape[dim] == 1 else shifted(emb[dim], params["start"], params["step"])
    return tuple(out)


# ---- concat ----

def concat_dim(node: Node) -> int:
    return int(node.attrs.get("dim", 0)) % len(node.shape)


def concat_parts(node: Node) -> list[tuple[int, Node, int]]:
    """(input position, input, offset along the concat dim) of the non-empty inputs."""
    dim = concat_dim(node)
    parts, off = [], 0
    for k, x in enumerate(node.inputs):
        if x.shape[dim] > 0:
            parts.append((k, x, off))
        off += x.shape[dim]
    return parts


def concat_fusable(node: Node) -> bool:
    """Generated as selects of shifted loads: every input of the output's dtype (no promotion)."""
    return node.spec.rank > 0 and all(x.dtype == node.dtype for x in node.inputs) and bool(concat_parts(node))


def concat_input_embedding(node: Node, emb: tuple[int | Affine | None, ...],
                           position: int) -> tuple[int | Affine | None, ...]:
    """The embedding of concat input `position`: shifted back by its offset along the concat dim."""
    dim = concat_dim(node)
    off = sum(i.shape[dim] for i in node.inputs[:position])
    out = list(emb)
    out[dim] = shifted(emb[dim], -off)   # a size-1 input is read at index 0 (offsets skip size-1 dims)
    return tuple(out)


def concat_expr(node: Node, emb: tuple[int | Affine | None, ...], args: list[str],
                dimvar: dict[int, str]) -> str:
    """tl.where over the output index along the concat dim: the segment's input, one per segment.
    `args` are the expressions of the non-empty inputs, in concat_parts order."""
    parts = concat_parts(node)
    e = emb[concat_dim(node)]
    if len(parts) == 1 or e is None:
        return args[0]
    idx = index_expr(e, dimvar)
    expr = args[-1]
    for (_, _, off), arg in zip(reversed(parts[1:]), reversed(args[:-1]), strict=True):
        expr = f"tl.where({idx} < {off}, {arg}, {expr})"
    return expr


# ---- pad (constant mode) ----

def pad_before(node: Node) -> dict[int, int]:
    """Padded dim -> elements added before it (negative: cropped), from F.pad's last-dim-first pairs."""
    pad = tuple(int(p) for p in node.attrs["pad"])
    rank = len(node.shape)
    return {rank - 1 - k: pad[2 * k] for k in range(len(pad) // 2) if (pad[2 * k], pad[2 * k + 1]) != (0, 0)}


def pad_fusable(node: Node) -> bool:
    """Generated as a select of a shifted, range-masked load: a float or integer value of the
    input's dtype (integers padded with an integral value), no empty input."""
    x = node.inputs[0]
    value = float(node.attrs.get("value", 0.0))
    if node.spec.rank == 0 or x.dtype != node.dtype or 0 in x.shape or 0 in node.shape:
        return False
    if dtypes.is_float(node.dtype):
        return True
    return node.dtype != "bool" and math.isfinite(value) and value == int(value)


def pad_input_embedding(node: Node, emb: tuple[int | Affine | None, ...]) -> tuple[int | Affine | None, ...]:
    """The input of a pad read at `i - before` along each padded dim (a size-1 input dim at 0: the
    padding around it is selected by pad_expr on the output index)."""
    x = node.inputs[0]
    out = list(emb)
    for dim, before in pad_before(node).items():
        out[dim] = None if x.shape[dim] == 1 else shifted(emb[dim], -before)
    return tuple(out)


def pad_value_literal(node: Node) -> str:
    """The pad value as a Triton literal, rounded to the node's dtype as torch's F.pad stores it."""
    import torch

    value = float(node.attrs.get("value", 0.0))
    if not dtypes.is_float(node.dtype):
        return str(int(value))
    rounded = float(torch.tensor(value, dtype=getattr(torch, node.dtype)).item())
    return f"float('{rounded}')" if not math.isfinite(rounded) else repr(rounded)


def pad_expr(node: Node, emb: tuple[int | Affine | None, ...], arg: str, domain_shape: tuple[int, ...],
             dimvar: dict[int, str]) -> str:
    """tl.where(the input index is inside the input, the input's value, the pad value): the padding
    is never loaded (the input's loads are masked by range_mask there)."""
    x = node.inputs[0]
    conds: list[str] = []
    for dim, before in pad_before(node).items():
        index = shifted(emb[dim], -before)
        if index is None:      # a size-1 output dim read at input index 0
            continue
        conds += bounds_conditions(index, x.shape[dim], domain_shape, dimvar)
    if not conds:
        return arg
    return f"tl.where({' & '.join(conds)}, {arg}, {pad_value_literal(node)})"
