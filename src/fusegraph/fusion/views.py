"""Zero-copy views at kernel boundaries, and reshapes moved out of the way of GEMM epilogues.

Run on the primitive graph just before partitioning (compiler.py, fused lowering only):

1. `sink_reshapes`: AOTAutograd spells a Linear on [B, T, D] as view -> addmm -> view, so a
   reshape [B*T, N] -> [B, T, N] sits between a matmul (+ bias) and the residual add after it and
   the epilogue fuser, which needs the add to iterate the matmul's own output space, cannot claim
   it. A reshape that only regroups leading dims (the trailing dims are kept) commutes with a
   pointwise op when the op's other operands broadcast over those leading dims (a bias) or have
   the full shape (reshaped too: a free view of a materialized value): p(reshape(x), y) becomes
   reshape(p(x, reshape(y))). Chains of such reshapes then cancel (simplify), so bias + residual
   (or bias + gelu) land in the matmul's epilogue. With settings.norm_residual, a chain that ends
   in a row reduction over the trailing dims (the LayerNorm after a transformer's residual add) is
   left where it is: the residual add then fuses into that normalization's kernel (as Inductor
   does) and the matmul keeps only its bias, which cuBLAS computes itself.

2. `view_aliases` / `assign_view_strides`: a view node whose value must exist in memory (read by a
   library node such as a matmul or attention, a graph output, or a view the generated kernels
   cannot fold into indexing) is computed by torch as a strided view of its input's actual layout
   (no copy, no kernel launch: a Kernel of kind "view"), when the view can be expressed that way.
   Its TensorSpec then carries the real strides, which every consumer reads (generated Triton
   kernels bake spec strides into their indexing; the GEMM takes them as literals; library kernels
   take any strides). A reshape that regroups non-contiguous dims stays a copy. Graph outputs
   stay dense (an output view is an alias only when its strides are the contiguous ones), unless
   `output_strides` asks a view output for a layout with gaps and the alias has exactly that layout
   (the torch frontend does so for q, k, v saved for the backward: views of one qkv result). An
   output view of a value in memory anyway (a GEMM result or its epilogue, a value a library kernel
   reads) is an alias in the layout asked; other output views are stored by the kernel computing them.

   An attention output read only through transpose(1, 2) (then usually reshape [B, T, H*D]) is
   laid out as [B, T, H, D] in memory (what torch's SDPA backends produce anyway), so the
   transpose and the reshape feeding the output projection are free views; likewise the
   backward's dq / dk / dv (`attention_grad_layouts`). A pointwise result read
   only through permute -> regrouping reshape is stored permuted, so that reshape is a view too
   (`producer_relayouts`). An alias starting a non-multiple of 16 bytes into its base is a copy
   (generated kernels are compiled for aligned pointers).

Also in step 1, `_batched_matmul_rule`: bmm(reshape(a), reshape(b)) whose reshapes only merge batch
dims becomes the batched matmul of a and b (q @ k^T with q, k views of the qkv projection).

The build option `output_strides` (one entry per graph output; the torch frontend passes the
strides torch traced) returns view outputs in that layout (a dense permutation), so the frontend
need not restride them; without it outputs are row-major as before.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from ..ir.graph import Graph
from ..ir.node import Node
from ..ir.registry import MATMUL, POINTWISE, REDUCTION, VIEW, get_op
from ..ir.spec import TensorSpec, contiguous_strides, dense_in_order, same_strides, strides_for_order
from ..passes.base import Pass
from ..settings import settings
from .partition import _reduced_dims, fusable, is_literal, is_unit_reduction

ATTENTION_OPS = ("scaled_dot_product_attention",)
BTHD = (0, 2, 1, 3)
ALIGN = 16   # bytes: an alias starts this aligned from its base tensor, or it is a copy


# ---- 1. reshapes sunk below pointwise ops ----

def leading_regroup(node: Node) -> int | None:
    """For a reshape that regroups only leading dims, the number of trailing dims it keeps (> 0)."""
    if node.op != "reshape" or node.multi_output:
        return None
    src, out = node.inputs[0].shape, node.shape
    r = 0
    while r < min(len(src), len(out)) and src[len(src) - 1 - r] == out[len(out) - 1 - r]:
        r += 1
    if r == 0 or src == out or math.prod(src[:len(src) - r]) != math.prod(out[:len(out) - r]):
        return None
    return r


def _sink_rule(node: Node, single: list[bool], from_matmul: dict[int, bool]) -> Node | None:
    """p(..., reshape(x), ...) -> reshape(p'(...), p.shape) when the reshape regroups leading dims
    of a value that comes from a matmul (through pointwise ops) and p may read x instead. `single`,
    per input: p is the reshape's only reader, or (settings.sink_shared_reshapes) the reshape or x
    is a graph output, so x is stored anyway, and every reader of the reshape is a pointwise op of
    its shape, each then sunk alike (a training forward's activation function reading the saved
    linear result lands in the matmul's epilogue). Otherwise a reshape read by several ops stays,
    so x stays one stored value, not one recomputed in each reader's kernel. See the module docstring."""
    if not get_op(node.op).has(POINTWISE) or node.multi_output:
        return None
    for j, r_node in enumerate(node.inputs):
        kept = leading_regroup(r_node)
        if kept is None or not single[j] or r_node.shape != node.shape or \
                not from_matmul.get(r_node.inputs[0].id, False):
            continue
        x = r_node.inputs[0]
        inputs: list[Node] = []
        for i, other in enumerate(node.inputs):
            lead = other.spec.rank - kept
            if i == j:
                inputs.append(x)
            elif lead <= 0:
                inputs.append(other)                                  # broadcast over the leading dims
            elif all(s == 1 for s in other.shape[:lead]):
                inputs.append(_reshape(other, other.shape[lead:]))
            elif other.shape == node.shape:
                inputs.append(_reshape(other, x.shape))               # a free view when materialized
            else:
                break
        else:
            inner = _emit(node, node.op, inputs, dict(node.attrs), suffix="_flat")
            if inner is None or inner.shape != x.shape:
                continue
            return _emit(node, "reshape", [inner], {"shape": node.shape}, suffix="")
    return None


def _batched_matmul_rule(node: Node) -> Node | None:
    """matmul(reshape(a, [N, M, K]), reshape(b, [N, K, P])) where both reshapes only merge leading
    (batch) dims into N -> reshape(matmul(a, b), [N, M, P]): the GEMM takes the batch dims (and
    their strides) as they are, so q and k^T sliced out of a fused qkv projection need no copy
    (AOTAutograd spells a 4-D matmul as view -> bmm -> view). The reshape after it is a free view
    that the following ops sink or cancel."""
    if node.op != "matmul" or node.spec.rank != 3 or len(node.inputs) != 2:
        return None
    originals = []
    for operand in node.inputs:
        if operand.op != "reshape" or operand.spec.rank != 3 or operand.inputs[0].spec.rank < 3:
            return None
        src = operand.inputs[0]
        if src.shape[-2:] != operand.shape[-2:] or math.prod(src.shape[:-2]) != operand.shape[0]:
            return None
        originals.append(src)
    a, b = originals
    rank = max(a.spec.rank, b.spec.rank) - 2
    lead_a = (1,) * (rank - a.spec.rank + 2) + a.shape[:-2]
    lead_b = (1,) * (rank - b.spec.rank + 2) + b.shape[:-2]
    # the same batch elements on both sides (unit dims aside: both hold N elements), no broadcast
    if [x for x in lead_a if x != 1] != [y for y in lead_b if y != 1] or \
            any(x != y and 1 not in (x, y) for x, y in zip(lead_a, lead_b, strict=True)) or \
            math.prod(max(x, y) for x, y in zip(lead_a, lead_b, strict=True)) != node.shape[0]:
        return None
    batched = _emit(node, "matmul", [a, b], dict(node.attrs), suffix="_batched")
    if batched is None or batched.shape[-2:] != node.shape[-2:]:
        return None
    return _emit(node, "reshape", [batched], {"shape": node.shape}, suffix="")


def _reshape(node: Node, shape: tuple[int, ...]) -> Node:
    if node.op == "reshape" and node.inputs[0].shape == tuple(shape):
        return node.inputs[0]            # reshape(reshape(y)) back to y's shape: y
    out = _emit(node, "reshape", [node], {"shape": tuple(shape)}, suffix="_flat")
    assert out is not None
    return out


def _emit(like: Node, op: str, inputs: list[Node], attrs: dict[str, Any], suffix: str) -> Node | None:
    from ..passes.simplify import rebuild

    made = rebuild(like, op, inputs, **attrs)
    return None if made is None else made.replace(name=like.name + suffix)


def sink_reshapes(graph: Graph) -> Graph:
    """Move leading-dim regrouping reshapes of matmul results below the pointwise ops after them."""
    users = graph.users()
    to_norm = feeds_row_reduction(graph, users) if settings.norm_residual else set()
    output_ids = {n.id for n in graph.outputs}
    shared = {n.id for n in graph.nodes if n.op == "reshape" and output_ids & {n.id, n.inputs[0].id} and
              _pointwise_readers_alike(n, users)} if settings.sink_shared_reshapes else set()
    from_matmul: dict[int, bool] = {}
    mapping: dict[int, Node] = {}
    for node in graph.nodes:
        if node.op == "input":
            mapping[node.id] = node
            continue
        inputs = tuple(mapping[i.id] for i in node.inputs)
        changed = any(a is not b for a, b in zip(inputs, node.inputs, strict=True))
        new = node.replace(inputs=inputs) if changed else node
        single = [len({u.id for u in users.get(i.id, [])}) == 1 or i.id in shared for i in node.inputs]
        sunk = None if node.id in to_norm else _sink_rule(new, single, from_matmul)
        if sunk is not None and shared and any(i.id in shared for i in node.inputs) and \
                _pointwise_readers_alike(node, users):
            # the reshape now above this node's readers is shared as the one it came from was: sinking
            # stops only where the chain ends, not half-way with the value stored to be reshaped
            shared.add(node.id)
        new = _batched_matmul_rule(new) or sunk or new
        if new.op == "reshape" and new.inputs[0].op == "reshape":   # reshape(reshape(y)): one reshape
            inner_src = new.inputs[0].inputs[0]
            collapsed = inner_src if inner_src.shape == new.shape else \
                _emit(new, "reshape", [inner_src], {"shape": new.shape}, suffix="")
            new = collapsed or new
        for n in (*new.inputs, new):
            if n.id not in from_matmul:
                from_matmul[n.id] = _from_matmul(n, from_matmul)
        mapping[node.id] = new
    outputs = tuple(mapping[n.id] for n in graph.outputs)
    if all(a is b for a, b in zip(outputs, graph.outputs, strict=True)):
        return graph
    return graph.with_(outputs=outputs)


def _pointwise_readers_alike(node: Node, users: dict[int, list[Node]]) -> bool:
    """Is every reader of `node` a single-output pointwise op of its shape (each then sunk alike)?"""
    return all(get_op(u.op).has(POINTWISE) and not u.multi_output and u.shape == node.shape
               for u in users.get(node.id, []))


def feeds_row_reduction(graph: Graph, users: dict[int, list[Node]]) -> set[int]:
    """Ids of pointwise nodes whose value reaches, through pointwise ops of its own shape only, a
    reduction over trailing dims (a LayerNorm's mean and variance): the chains sink_reshapes leaves
    in the reduction's shape under settings.norm_residual."""
    found: set[int] = set()
    for node in reversed(graph.nodes):
        if not get_op(node.op).has(POINTWISE) or node.multi_output:
            continue
        for u in users.get(node.id, []):
            opdef = get_op(u.op)
            if opdef.has(REDUCTION) and u.inputs[0] is node and not is_unit_reduction(u):
                rank = len(node.shape)
                dims = _reduced_dims(u)
                if dims and dims == tuple(range(rank - len(dims), rank)) and len(dims) < rank:
                    found.add(node.id)
                    break
            if u.id in found and u.shape == node.shape:
                found.add(node.id)
                break
    return found


def _from_matmul(n: Node, known: dict[int, bool]) -> bool:
    opdef = get_op(n.op)
    if opdef.has(MATMUL) and opdef.extra.get("kernel_kind") == "matmul":
        return True
    if opdef.has(POINTWISE) and not n.multi_output:
        return any(known.get(i.id, False) and i.shape == n.shape for i in n.inputs)
    return n.op == "reshape" and known.get(n.inputs[0].id, False)


# ---- 2. strided views instead of copies ----

def _fold(node: Node, in_strides: tuple[int, ...]) -> tuple[tuple[int, ...], int] | None:
    fold = get_op(node.op).extra.get("fold")
    if fold is None:
        return None
    result = fold(node.inputs[0].spec, node.attrs, in_strides, 0)
    return None if result is None else (tuple(result[0]), int(result[1]))


def output_layouts(graph: Graph, output_strides: Sequence[Any] | None = None) -> dict[int, tuple[int, ...]]:
    """Graph outputs -> the strides they are to be returned in: `output_strides` (one entry per
    output, None = contiguous; the torch frontend asks for the strides torch would have produced, a
    dense permutation, or for a view output a layout with gaps, which only an alias can give: else
    it is returned dense in that order) where valid for the output's shape, else a spec's own
    explicit strides."""
    wanted: dict[int, tuple[int, ...]] = {}
    given = list(output_strides or [])
    for k, node in enumerate(graph.outputs):
        if node.multi_output:
            continue
        ask = given[k] if k < len(given) else None
        if ask is not None and (_dense_permutation(node.shape, tuple(ask)) or
                                (get_op(node.op).has(VIEW) and gapped(node.shape, tuple(ask)))):
            # a layout with gaps only for a view, which returns it as an alias or else dense (assign_view_strides)
            wanted[node.id] = tuple(int(s) for s in ask)
        elif node.spec.strides is not None:
            wanted[node.id] = node.spec.strides
        else:
            wanted[node.id] = node.spec.memory_strides
    return wanted


def gapped(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """Non-overlapping strides with gaps between elements (e.g. q as a view of a fused qkv result)."""
    return len(strides) == len(shape) and dense_in_order(shape, strides) is not None and \
        not _dense_permutation(shape, strides)


def _dense_permutation(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """Every element once, no gaps: the strides of a permuted contiguous tensor."""
    if len(strides) != len(shape):
        return False
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(shape, strides, strict=True) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def attention_out_layouts(graph: Graph, wanted: dict[int, tuple[int, ...]]) -> dict[int, tuple[int, ...]]:
    """Attention nodes whose output (index 0) is read only through transpose(1, 2): node id ->
    strides laying the output out as [B, T, H, D]. A graph output qualifies only when it is to be
    returned in that layout (`wanted`, see output_layouts)."""
    users = graph.users()
    out: dict[int, tuple[int, ...]] = {}
    for node in graph.nodes:
        if node.op not in ATTENTION_OPS or node.specs[0].rank != 4:
            continue
        bthd = strides_for_order(node.specs[0].shape, BTHD)
        value = node
        if node.multi_output:
            picks = [u for u in users.get(node.id, []) if u.op == "getitem" and u.attrs["index"] == 0]
            if len(picks) != 1:
                continue
            value = picks[0]
        if value.id in wanted and not same_strides(value.shape, wanted[value.id], bthd):
            continue
        readers = users.get(value.id, [])
        perm = [get_op(u.op).extra["view_params"](u.inputs[0].spec, u.attrs)["perm"]
                if get_op(u.op).extra.get("view") == "permute" else None for u in readers]
        if (readers or value.id in wanted) and all(p == BTHD for p in perm):
            out[node.id] = bthd
    return out


def attention_grad_layouts(graph: Graph, wanted: dict[int, tuple[int, ...]]) -> dict[int, dict[int, tuple[int, ...]]]:
    """sdpa_backward nodes whose dq / dk / dv (outputs 0, 1, 2) are each read only through
    transpose(1, 2): node id -> {output index: strides laying it out as [B, T, H, D]}. That is the
    layout torch's cuDNN / flash backward kernels return, and the transpose + reshape [B, T, H*D]
    feeding the qkv weight gradient are then free views instead of two copies per gradient."""
    users = graph.users()
    out: dict[int, dict[int, tuple[int, ...]]] = {}
    for node in graph.nodes:
        if node.op != "sdpa_backward" or not node.multi_output:
            continue
        chosen: dict[int, tuple[int, ...]] = {}
        for index in range(min(3, len(node.specs))):
            spec = node.specs[index]
            if spec.rank != 4 or spec.layout is not None or spec.strides is not None:
                continue
            picks = [u for u in users.get(node.id, []) if u.op == "getitem" and u.attrs["index"] == index]
            if len(picks) != 1 or picks[0].id in wanted:
                continue
            readers = users.get(picks[0].id, [])
            perms = [get_op(u.op).extra["view_params"](u.inputs[0].spec, u.attrs)["perm"]
                     if get_op(u.op).extra.get("view") == "permute" else None for u in readers]
            if readers and all(p == BTHD for p in perms):
                chosen[index] = strides_for_order(spec.shape, BTHD)
        if chosen:
            out[node.id] = chosen
    return out


def output_relayouts(graph: Graph, wanted: dict[int, tuple[int, ...]]) -> dict[int, tuple[int, ...]]:
    """Pointwise outputs written directly in the layout asked for them (node id -> strides), a dense
    permutation such as channels-last: a generated kernel walks its domain in its output's memory
    order, so the loads of operands laid out the same way coalesce too, and the frontend need not
    restride the result with a copy. (Before: relu + max-pool of a channels-last tensor iterated
    NCHW over NHWC loads, then was copied to channels-last: 1.38 ms on the H200 for b128 64x112x112,
    eager 0.51.) Only for results of fusable pointwise ops with no layout of their own (a named one
    is the layout pass's choice)."""
    out: dict[int, tuple[int, ...]] = {}
    for node in graph.outputs:
        ask = wanted.get(node.id)
        opdef = get_op(node.op)
        own_layout = node.spec.strides is not None or node.spec.layout not in (None, "strided")
        if ask is None or node.multi_output or own_layout or opdef.has(VIEW) or not opdef.has(POINTWISE) \
                or not fusable(node) or not _dense_permutation(node.shape, ask) \
                or same_strides(node.shape, ask, node.spec.memory_strides):
            continue
        out[node.id] = ask
    return out


def producer_relayouts(graph: Graph, wanted: dict[int, tuple[int, ...]]) -> dict[int, tuple[int, ...]]:
    """Pointwise results stored in the order a permute + reshape after them reads (node id ->
    strides), so that the reshape, which regroups permuted dims (a copy otherwise), is a view: the
    backward's dq/dk/dv stacked [3, B, H, T, D] -> permute -> reshape [B*T, 3*H*D] for the qkv
    weight gradient. Only for a value whose one reader is that chain and that is no output."""
    users = graph.users()
    out: dict[int, tuple[int, ...]] = {}
    for node in graph.nodes:
        if node.op != "reshape" or fusable(node) or node.id in wanted:
            continue
        chain: list[Node] = []
        src = node.inputs[0]
        while get_op(src.op).extra.get("view") == "permute" and len(users.get(src.id, [])) == 1 \
                and src.id not in wanted:
            chain.append(src)
            src = src.inputs[0]
        if not chain or src.multi_output or src.id in wanted or len(users.get(src.id, [])) != 1 or \
                src.spec.layout is not None or src.spec.strides is not None or \
                not get_op(src.op).has(POINTWISE) or not fusable(src):
            continue
        order = list(range(src.spec.rank))      # position k of the permuted value reads src dim order[k]
        for p in reversed(chain):
            perm = get_op(p.op).extra["view_params"](p.inputs[0].spec, p.attrs)["perm"]
            order = [order[i] for i in perm]
        target = contiguous_strides(chain[0].shape)   # the permuted value laid out row-major
        strides = [0] * src.spec.rank
        for k, dim in enumerate(order):
            strides[dim] = target[k]
        current = src.spec.memory_strides
        for p in reversed(chain):
            folded = _fold(p, current)
            current = folded[0] if folded else current
        if _fold(node, current) is None:           # a copy as things are: store src permuted
            out[src.id] = tuple(strides)
    return out


def view_aliases(graph: Graph, wanted: dict[int, tuple[int, ...]] | None = None
                 ) -> dict[int, tuple[tuple[int, ...], int]]:
    """View nodes computed as torch views of their input: node id -> (strides, element offset).
    A view is one when its value must be in memory (read by a library node, an output, or a view
    the generated kernels cannot fold) and it is a strided view of its input's layout, the input
    being in memory anyway or itself such a view (a chain reshape -> permute -> slice -> reshape
    of one GEMM result is views all the way down, though the generated kernels could fold the
    inner ones into indexing)."""
    wanted = output_layouts(graph) if wanted is None else wanted
    users = graph.users()
    layouts = attention_out_layouts(graph, wanted)
    strides: dict[int, tuple[int, ...]] = {}   # real strides of values whose spec is being changed
    chosen: dict[int, tuple[tuple[int, ...], int]] = {}
    refused: set[int] = set()
    offsets: dict[int, int] = {}               # element offset of an alias from its base tensor
    strides.update(producer_relayouts(graph, wanted))
    grads = attention_grad_layouts(graph, wanted)
    for node in graph.nodes:
        if node.id in layouts:
            strides[node.id] = layouts[node.id]
        elif node.op == "getitem" and node.inputs[0].id in layouts and node.attrs["index"] == 0:
            strides[node.id] = layouts[node.inputs[0].id]
        elif node.op == "getitem" and node.attrs["index"] in grads.get(node.inputs[0].id, {}):
            strides[node.id] = grads[node.inputs[0].id][node.attrs["index"]]

    def viewable(node: Node) -> bool:
        return get_op(node.op).has(VIEW) and len(node.inputs) == 1 and not node.inputs[0].multi_output \
            and "fold" in get_op(node.op).extra

    def alias(node: Node) -> bool:
        """Make `node` an alias if it can be one (its input first, when that is a view too)."""
        if node.id in chosen:
            return True
        if node.id in refused:
            return False
        src = node.inputs[0]
        base_ok = _materialized(src, node, chosen, users, wanted)
        if viewable(src) and src.id not in wanted and not (base_ok and not fusable(src)):
            base_ok = alias(src) or base_ok
        folded = _fold(node, strides.get(src.id, src.spec.memory_strides)) if base_ok else None
        readers = users.get(node.id, [])
        if folded is None or (node.id in wanted and not same_strides(node.shape, folded[0], wanted[node.id])) or \
                (any(s == 0 for s, size in zip(folded[0], node.shape, strict=True) if size > 1) and
                 any(get_op(u.op).has(MATMUL) for u in readers)):
            # not a view of its input's layout; an output asked for in another layout (a copy); a
            # broadcast (stride-0) GEMM operand (materialized as before)
            refused.add(node.id)
            return False
        offset = offsets.get(src.id, 0) + folded[1]
        if (offset * node.spec.itemsize) % ALIGN:
            # generated kernels are compiled for 16-byte aligned pointers (and TMA needs them)
            refused.add(node.id)
            return False
        chosen[node.id] = folded
        strides[node.id] = folded[0]
        offsets[node.id] = offset
        return True

    for node in graph.nodes:
        if node.id in layouts or not viewable(node):
            continue
        readers = users.get(node.id, [])
        # (a foldable view that is an output is stored by the kernel computing it, as before, unless
        # its input is in memory anyway: a GEMM result or its epilogue, or a value a library kernel
        # reads; the row slice of a zero-padded GEMM's result, passes/pad_dims.py, is an alias)
        if not fusable(node) or any(not fusable(u) and not is_literal(u) for u in readers) or \
                (node.id in wanted and _in_memory_anyway(node.inputs[0], users)):
            alias(node)
    return chosen


def _in_memory_anyway(value: Node, users: dict[int, list[Node]], depth: int = 4) -> bool:
    """Is `value` in memory anyway: a matmul's result, a same-shape pointwise chain of single readers
    after one (an epilogue the GEMM kernel stores), or a value a library kernel reads (a GEMM's
    zero-padded operand, passes/pad_dims.py), possibly through views of it?"""
    for _ in range(depth + 1):
        if value.multi_output:
            return False
        opdef = get_op(value.op)
        if opdef.has(MATMUL) or any(not fusable(u) and not get_op(u.op).has(VIEW) for u in users.get(value.id, [])):
            return True
        if opdef.has(VIEW) and len(value.inputs) == 1 and "fold" in opdef.extra:
            value = value.inputs[0]
            continue
        if not (opdef.has(POINTWISE) and fusable(value)):
            return False
        inner = [i for i in value.inputs if i.shape == value.shape]
        if len(inner) != 1 or len(users.get(inner[0].id, [])) != 1:
            return False
        value = inner[0]
    return False


def _materialized(src: Node, view: Node, chosen: dict[int, Any], users: dict[int, list[Node]],
                  outputs: dict[int, Any]) -> bool:
    """Is `src` in memory anyway (so a view of it costs nothing), or no smaller than the view?"""
    if src.op in ("input", "getitem") or src.id in chosen or src.id in outputs:
        return True
    opdef = get_op(src.op)
    if not fusable(src) or (opdef.has(REDUCTION) and not is_unit_reduction(src)):
        return True
    if any(not fusable(u) and u.id != view.id for u in users.get(src.id, [])):
        return True
    return view.spec.numel >= src.spec.numel or _in_memory_anyway(src, users)


def with_strides(spec: TensorSpec, strides: tuple[int, ...]) -> TensorSpec:
    """`spec` laid out with `strides` (a plain row-major spec when they are the contiguous ones)."""
    if spec.layout is None and spec.strides is None and \
            same_strides(spec.shape, strides, contiguous_strides(spec.shape)):
        return spec
    return spec.with_(strides=tuple(strides), layout="strided")


def assign_view_strides(graph: Graph, output_strides: Sequence[Any] | None = None) -> Graph:
    """The graph with the real strides of every aliased view, of attention outputs laid out as
    [B, T, H, D], and of view outputs copied into the layout `output_strides` asks for, in their
    TensorSpecs."""
    wanted = output_layouts(graph, output_strides)
    layouts = attention_out_layouts(graph, wanted)
    aliases = view_aliases(graph, wanted)
    grads = attention_grad_layouts(graph, wanted)
    new_specs: dict[int, tuple[int, ...]] = {**output_relayouts(graph, wanted), **producer_relayouts(graph, wanted)}
    for node in graph.nodes:
        if node.id in layouts:
            new_specs[node.id] = layouts[node.id]
        elif node.op == "getitem" and node.inputs[0].id in layouts and node.attrs["index"] == 0:
            new_specs[node.id] = layouts[node.inputs[0].id]
        elif node.op == "getitem" and node.attrs["index"] in grads.get(node.inputs[0].id, {}):
            new_specs[node.id] = grads[node.inputs[0].id][node.attrs["index"]]
        elif node.id in aliases:
            new_specs[node.id] = aliases[node.id][0]
        elif node.id in wanted and get_op(node.op).has(VIEW) and \
                not same_strides(node.shape, wanted[node.id], node.spec.memory_strides):
            # a copied view output, written in that layout (one asked with gaps: dense, in its order)
            ask = wanted[node.id]
            layout = dense_in_order(node.shape, ask) if gapped(node.shape, ask) else ask
            if layout is not None and not same_strides(node.shape, layout, node.spec.memory_strides):
                new_specs[node.id] = layout
    if not new_specs and not grads:
        return graph
    mapping: dict[int, Node] = {}
    for node in graph.nodes:
        if node.op == "input":
            mapping[node.id] = node
            continue
        inputs = tuple(mapping[i.id] for i in node.inputs)
        specs = node.specs
        if node.id in new_specs:
            specs = (with_strides(specs[0], new_specs[node.id]), *specs[1:])
        elif node.id in grads:
            specs = tuple(with_strides(spec, grads[node.id][k]) if k in grads[node.id] else spec
                          for k, spec in enumerate(specs))
        changed = specs is not node.specs or any(a is not b for a, b in zip(inputs, node.inputs, strict=True))
        mapping[node.id] = node.replace(inputs=inputs, specs=specs) if changed else node
    return graph.with_(outputs=tuple(mapping[n.id] for n in graph.outputs))


def prepare(graph: Graph, output_strides: Sequence[Any] | None = None) -> Graph:
    """sink_reshapes (then cse/dce), then assign_view_strides (see the module docstring).
    `output_strides`: per graph output, the strides to return it in (None: contiguous)."""
    from ..passes.cse import cse
    from ..passes.dce import dce

    sunk = Pass("sink_reshapes", sink_reshapes)(graph)
    if sunk.outputs != graph.outputs or len(sunk.nodes) != len(graph.nodes):
        sunk = dce(cse(sunk))
    return Pass("view_strides", lambda g: assign_view_strides(g, output_strides))(sunk)


def alias_kernel_specs(graph: Graph) -> dict[int, tuple[tuple[int, ...], int]]:
    """The aliases lower_fused turns into view kernels: those whose spec already carries the strides
    (the graph went through `prepare`); others stay copies."""
    out = {}
    by_id = {n.id: n for n in graph.nodes}
    for nid, (strides, offset) in view_aliases(graph).items():
        if same_strides(by_id[nid].shape, by_id[nid].spec.memory_strides, strides):
            out[nid] = (strides, offset)
    return out
