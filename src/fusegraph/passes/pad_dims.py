"""pad_dims: a GEMM whose M, N or K is misaligned runs on operands zero-padded to an aligned size.

pad_align gives a misaligned row (a 50257-token vocabulary) a padded *stride*, which is what our
Triton GEMM needs for TMA and aligned vector loads. cuBLAS needs more: with the dimension itself
odd it runs its align1 kernels whatever the strides (GPT-2-124M's LM head on the H200,
bench/results/pad_align_zero_20261202_0828.txt: logits = h @ W^T 6.67 ms, dh = g @ W 4.87 ms with
padded strides), and with the dimension padded with zeros it runs its best ones (0.89 and 0.82 ms,
709-776 TFLOP/s, where our Triton GEMMs on padded strides take 0.93-1.07 and 0.86). Inductor's
pad_mm does the same. Per GEMM (matmul node, both operands at least 2-D, FLOPs >= MIN_FLOPS):

- K misaligned where it is an operand's row (A not transposed, or B transposed): both operands get
  K padded with zeros; the products over the padding are 0 + 0 * 0;
- N misaligned (it is the result's row): B padded along N, the result [.., M, Np] sliced to N, so
  every reader reads a strided view with aligned rows;
- M misaligned where it is A's row (A transposed: a weight gradient g^T @ h): A padded along M, the
  result's rows sliced (a contiguous view).

A pad of a value that generated code computes and only padded GEMMs read fuses into the kernel
computing it (its padding stored as zeros: GPT-2's bf16 cast of the LM-head weight, its logits
gradient); so does one whose other readers take a strided view, which then read the padded value's
slice (the weight's cast also saved for the backward as W^T: a view of the padded buffer); any other
pad is a copy, taken when all of a GEMM's copies cost at most COPY_BUDGET of its floor. A pointwise
chain reading only the GEMM result and scalars (a cast to fp32) moves above the slice, where it stays
the GEMM's epilogue. A result sliced along N that is a graph output is
allowed only at `free_outputs`, positions whose caller takes padded rows (the torch backend's saved
activations, compiler.py's pad_outputs); elsewhere the GEMM is left as it is.

Setting pad_gemm_dims (FUSEGRAPH_PAD_GEMM_DIMS=0) builds without it; pad_align off turns it off too.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from ..ir.emit import Emitter
from ..ir.graph import Graph
from ..ir.node import Node
from ..ir.registry import POINTWISE, get_op
from ..ir.spec import TensorSpec, contiguous_strides, dense_in_order, same_strides
from ..ops.linalg import matmul_dims
from ..settings import settings
from .pad_align import (
    _default_device,
    _gemm_floor_s,
    _reader_accepts,
    _writes_own_layout,
    is_gemm,
    padded_row,
    view_base,
)
from .simplify import permutation_of

MIN_FLOPS = 1 << 30      # smaller GEMMs are not worth the pads
COPY_BUDGET = 0.25       # a GEMM's pad copies may cost up to this fraction of its floor
EPILOGUE_DEPTH = 4       # pointwise steps moved above the result's slice


@dataclass
class _Padding:
    gemm: Node
    operands: dict[int, dict[int, int]]          # operand position -> {dim (negative): padded size}
    out_dim: int | None = None                  # the result's sliced dim (negative), or None
    out_size: int = 0                           # its size before padding
    chain: list[Node] = field(default_factory=list)   # the pointwise steps moved above the slice

    def pads_of(self, position: int) -> tuple[tuple[int, int], ...]:
        return tuple(sorted(self.operands.get(position, {}).items()))


def _plan(gemm: Node, min_flops: int) -> _Padding | None:
    a, b = gemm.inputs
    if a.spec.rank < 2 or b.spec.rank < 2:
        return None
    trans_a, trans_b = bool(gemm.attrs.get("trans_a", False)), bool(gemm.attrs.get("trans_b", False))
    batch, m, n, k = matmul_dims(a.spec, b.spec, gemm.attrs)
    count = 1
    for d in batch:
        count *= d
    if 2 * m * n * k * count < min_flops:
        return None
    size = gemm.spec.itemsize
    operands: dict[int, dict[int, int]] = {}
    # padded_row: the aligned size of a misaligned dim (None: aligned, or it would grow too much)
    pad_k = padded_row(k, size) if (not trans_a or trans_b) else None
    if pad_k is not None:
        operands.setdefault(0, {})[-2 if trans_a else -1] = pad_k
        operands.setdefault(1, {})[-1 if trans_b else -2] = pad_k
    padding = _Padding(gemm, operands)
    pad_n = padded_row(n, size)
    pad_m = padded_row(m, size) if trans_a else None
    if pad_n is not None:
        operands.setdefault(1, {})[-2 if trans_b else -1] = pad_n
        padding.out_dim, padding.out_size = -1, n
    elif pad_m is not None:
        operands.setdefault(0, {})[-1] = pad_m
        padding.out_dim, padding.out_size = -2, m
    return padding if operands else None


def _movable(node: Node, value: Node, out_dim: int) -> bool:
    """Can pointwise `node` (reading `value`) be computed on the padded result instead: same shape,
    its other inputs constant along the padded dim?"""
    from ..fusion.partition import fusable

    if not get_op(node.op).has(POINTWISE) or not fusable(node) or node.multi_output or node.shape != value.shape:
        return False
    back = -out_dim
    return all(other.id == value.id or other.spec.rank < back or other.shape[-back] == 1 for other in node.inputs)


def _slice_returnable(node: Node, out_dim: int, outputs: set[int], free: set[int]) -> bool:
    """May `node`, sliced along `out_dim`, be a graph output? A row slice is a contiguous view;
    a column slice only where the caller takes padded rows."""
    return node.id not in outputs or out_dim == -2 or node.id in free


def _epilogue_chain(padding: _Padding, users: dict[int, list[Node]], outputs: set[int], free: set[int]
                    ) -> list[Node]:
    chain: list[Node] = []
    value = padding.gemm
    for _ in range(EPILOGUE_DEPTH):
        readers = users.get(value.id, [])
        if value.id in outputs or len(readers) != 1 or padding.out_dim is None or \
                not _movable(readers[0], value, padding.out_dim) or \
                not _slice_returnable(readers[0], padding.out_dim, outputs, free):
            break
        value = readers[0]
        chain.append(value)
    return chain


def _pad_is_fused(operand: Node, pads: tuple[tuple[int, int], ...], users: dict[int, list[Node]],
                  wanted: dict[int, dict[int, tuple[tuple[int, int], ...]]], outputs: set[int]) -> bool:
    """Does padding `operand` cost nothing: generated code computes it (through views) and every
    reader is a GEMM that pads it the same way (`wanted`: operand id -> GEMM id -> its pads), or
    reads the padded value's slice instead (_shares_pad)?"""
    base, _ = view_base(operand)
    if base.op == "input" or is_gemm(base) or not _writes_own_layout(base):
        return False
    readers = wanted.get(operand.id, {})
    return all(readers.get(u.id) == pads for u in users.get(operand.id, [])) or \
        _shares_pad(operand, users, wanted, outputs)


def _shares_pad(operand: Node, users: dict[int, list[Node]], wanted: dict[int, dict[int, tuple[tuple[int, int], ...]]],
                outputs: set[int]) -> bool:
    """Do the operand's other readers read the slice of its zero-padded value instead of the value
    (a weight's bf16 cast, padded for the LM head, also saved for the backward as W^T: then a view of
    the padded buffer, not a second cast)? For a value generated code computes, padded one way, whose
    other readers all take a strided view (pad_align's rule), and not itself a graph output."""
    readers = wanted.get(operand.id, {})
    if len(set(readers.values())) != 1 or operand.id in outputs or operand.multi_output or \
            is_gemm(operand) or not _writes_own_layout(operand):
        return False
    others = [u for u in users.get(operand.id, []) if u.id not in readers]
    rows_only = all(d != -1 for d, _ in next(iter(readers.values())))   # the slice is a contiguous view
    return bool(others) and all(rows_only or _reader_accepts(u, users, outputs) for u in others)


def pad_gemm_dims_graph(graph: Graph, free_outputs: Collection[int] = (), device: Any = None,
                        min_flops: int | None = None) -> Graph:
    """The graph with misaligned GEMM dimensions zero-padded (module docstring). `free_outputs`:
    output positions whose caller takes padded rows; `device` prices the pad copies (default the
    present GPU, else H100); `min_flops` (default MIN_FLOPS) is the smallest GEMM padded."""
    min_flops = MIN_FLOPS if min_flops is None else min_flops
    users = graph.users()
    outputs = {n.id for n in graph.outputs}
    free = {graph.outputs[k].id for k in free_outputs} - \
        {n.id for k, n in enumerate(graph.outputs) if k not in set(free_outputs)}
    paddings: dict[int, _Padding] = {}
    for node in graph.nodes:
        if not is_gemm(node):
            continue
        padding = _plan(node, min_flops)
        if padding is None:
            continue
        padding.chain = _epilogue_chain(padding, users, outputs, free)
        end = padding.chain[-1] if padding.chain else node
        if padding.out_dim is not None and not _slice_returnable(end, padding.out_dim, outputs, free):
            continue   # the caller wants dense rows: a copy of the whole result
        paddings[node.id] = padding
    if not paddings:
        return graph
    device = device or _default_device()
    while True:
        wanted: dict[int, dict[int, tuple[tuple[int, int], ...]]] = {}
        for padding in paddings.values():
            for position in padding.operands:
                wanted.setdefault(padding.gemm.inputs[position].id, {})[padding.gemm.id] = padding.pads_of(position)
        dropped = []
        for gid, padding in paddings.items():
            copy_s = sum(2 * padding.gemm.inputs[p].spec.nbytes / device.bandwidth for p in padding.operands
                         if not _pad_is_fused(padding.gemm.inputs[p], padding.pads_of(p), users, wanted, outputs))
            if copy_s > COPY_BUDGET * _gemm_floor_s(padding.gemm, device):
                dropped.append(gid)
        if not dropped:
            break
        for gid in dropped:
            del paddings[gid]
        if not paddings:
            return graph
    by_id = {n.id: n for n in graph.nodes}
    shared = {x: next(iter(pads.values())) for x, pads in wanted.items()
              if _shares_pad(by_id[x], users, wanted, outputs)}
    return _rewrite(graph, paddings, shared, wanted)


def _own_order(spec: TensorSpec, shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """Dense strides of `shape` in the dim order of `spec` when that is a dense layout other than
    row-major (a transposed input), else None."""
    strides = spec.memory_strides
    dense = dense_in_order(spec.shape, strides)
    if spec.rank < 2 or dense is None or not same_strides(spec.shape, strides, dense) or \
            same_strides(spec.shape, strides, contiguous_strides(spec.shape)):
        return None
    return dense_in_order(shape, strides)


def _rewrite(graph: Graph, paddings: dict[int, _Padding], shared: dict[int, tuple[tuple[int, int], ...]],
             wanted: dict[int, dict[int, tuple[tuple[int, int], ...]]]) -> Graph:
    """`shared`: operand id -> its padding, for operands whose other readers read the padded value's
    slice (_shares_pad); `wanted`: operand id -> the GEMMs padding it."""
    ends = {(p.chain[-1] if p.chain else p.gemm).id: p for p in paddings.values()}
    slices: dict[int, Node] = {}   # shared operand id -> the slice of its padded value
    mapping: dict[int, Node] = {}
    pads: dict[tuple[int, tuple[tuple[int, int], ...]], Node] = {}   # one pad node per value and padding

    def padded(value: Node, dims: tuple[tuple[int, int], ...], em: Emitter) -> Node:
        """`value` zero-padded to `dims` ((negative dim, size), ...); a transposed view is padded at
        its base and transposed again (a row copy of a weight, not a transposing one)."""
        key = (value.id, dims)
        if key in pads:
            return pads[key]
        perm = permutation_of(value) if len(value.inputs) == 1 and not value.inputs[0].multi_output else None
        if perm is not None:
            rank = value.spec.rank
            inner = tuple(sorted((perm[rank + d] - rank, size) for d, size in dims))
            base = padded(value.inputs[0], inner, em)
            pads[key] = em.op(value.op, base, _name=f"{value.name}.zero_padded", **dict(value.attrs))
            return pads[key]
        amounts = [0] * (2 * max(-d for d, _ in dims))
        for d, size in dims:
            amounts[2 * (-d - 1) + 1] = size - value.shape[d]
        pad = em.op("pad", value, pad=tuple(amounts), value=0.0, _name=f"{value.name}.zero_padded")
        own = _own_order(value.spec, pad.shape)
        if own is not None:   # a transposed input (a saved W^T): padded in its own order, a plain copy
            pad = pad.replace(specs=(pad.spec.with_(layout="strided", strides=own),))
        pads[key] = pad
        return pad

    for node in graph.nodes:
        if node.op == "input":
            mapping[node.id] = node
            continue
        inputs = tuple(slices[i.id] if i.id in slices and node.id not in wanted[i.id] else mapping[i.id]
                       for i in node.inputs)
        changed = any(a is not b for a, b in zip(inputs, node.inputs, strict=True))
        new = node.replace(inputs=inputs) if changed else node
        if node.id in shared:   # its other readers read the padded value, sliced back
            em = Emitter(prefix=f"{node.name}.", source=node.source)
            view = padded(new, shared[node.id], em)
            for d, _ in shared[node.id]:
                view = em.op("slice", view, dim=view.spec.rank + d, start=0, end=node.shape[d], step=1,
                             _name=f"{node.name}.unpadded")
            slices[node.id] = view
        padding = ends.get(node.id)
        if padding is not None:
            gemm = padding.gemm
            em = Emitter(prefix=f"{gemm.name}.", source=gemm.source)
            operands = [padded(mapping[x.id], padding.pads_of(p), em) if p in padding.operands else mapping[x.id]
                        for p, x in enumerate(gemm.inputs)]
            value = em.op(gemm.op, *operands, _name=f"{gemm.name}.padded", **dict(gemm.attrs))
            previous = gemm
            for step in padding.chain:
                args = [value if i.id == previous.id else mapping[i.id] for i in step.inputs]
                value = em.op(step.op, *args, _name=f"{step.name}.padded", **dict(step.attrs))
                previous = step
            if padding.out_dim is not None:
                dim = value.spec.rank + padding.out_dim
                value = em.op("slice", value, dim=dim, start=0, end=padding.out_size, step=1, _name=node.name)
            new = value
        mapping[node.id] = new
    return graph.with_(outputs=tuple(mapping[n.id] for n in graph.outputs))


def zero_padded(gemm: Node) -> bool:
    """Will pad_dims pad this GEMM (by its sizes; the copy budget and graph outputs aside)? pad_align
    then leaves its operands' strides alone, so the values the pads read can fuse into them."""
    return settings.pad_align and settings.pad_gemm_dims and _plan(gemm, MIN_FLOPS) is not None


def pad_gemm_dims(graph: Graph, free_outputs: Collection[int] = ()) -> Graph:
    """The pass as compiler.front_end runs it: settings.pad_gemm_dims and settings.pad_align on."""
    if not (settings.pad_align and settings.pad_gemm_dims):
        return graph
    return pad_gemm_dims_graph(graph, free_outputs)

