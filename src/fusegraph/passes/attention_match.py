"""Recognize unfused attention and rewrite it to one scaled_dot_product_attention node.

Matched (q, k, v are [B, H, S, D]; every intermediate has a single user):

    out = matmul(P, v)                      P = softmax(S, dim=-1), optionally cast afterwards
    S   = scaled (+ mask)                   an additive float mask broadcast to [B, H, Sq, Sk]
    scaled = mul(QK, c) | mul(c, QK) | div(QK, c) | QK
    QK  = matmul(q', k', trans_b=True)      (simplify has already folded transposes into trans_b)
    q'  = q | mul(q, c) | div(q, c)         the scale may sit on q or k instead (before the product)

The scale is the product of the constants found; the rewritten node computes in the graph's
compute dtype like the reference, so results match the unfused graph up to the rounding of the
intermediate 16-bit values it no longer produces.

Also matched: torch's math SDPA (what AOTAutograd traces where no fused kernel takes the call, e.g.
a Hugging Face encoder's boolean mask under torch.compile) on 16-bit q, k, v:
    out = cast(matmul(P, cast(v, fp32)), 16-bit)
    P   = where((S == -inf).all(-1, keepdim=True), 0, softmax(S))    its "safe" softmax
    S   = matmul(cast(q) * c, transpose(cast(k)) * c) (+ mask)       the scale split over q and k
The rewritten node reads the 16-bit q, k, v: the fused kernel accumulates in fp32 as torch's
flash / memory-efficient kernels do, without the fp32 copies of q, k, v and the [Sq, Sk] fp32
scores. A row whose every score is -inf gives 0 in both.

A boolean mask applied as masked_fill(S, ~keep, -inf) (where(~keep, -inf, S) or where(keep, S, -inf))
becomes the op's boolean mask. Not matched (left as is): a mask filled with a finite value (finfo.min),
softmax over another dim, P used elsewhere (e.g. returned).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from ..ir import dtypes
from ..ir.emit import Emitter
from ..ir.graph import Graph
from ..ir.node import Attrs, Node
from ..settings import settings
from .base import graph_pass
from .simplify import broadcast_literal, is_literal_zero, swaps_last_two


@dataclass(frozen=True)
class AttentionMatch:
    q: Node
    k: Node
    v: Node
    mask: Node | None
    scale: float
    k_transposed: bool = False      # `k` holds k^T ([B, H, D, Sk]): the rewrite transposes it back
    shapes: tuple[tuple[int, ...], ...] = ()   # q, k, v viewed as these 4-D shapes where they differ
    mask_negated: bool = False      # `mask` is True where keys are masked out: the rewrite negates it


def _scalar(node: Node) -> float | None:
    if node.op == "scalar" and node.spec.rank == 0:
        value = node.attrs.get("value")
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
    return None


def _split_scale(node: Node) -> tuple[Node, float]:
    """(x, c) for mul(x, c) / mul(c, x) / div(x, c) with a scalar constant c; else (node, 1)."""
    if node.op in ("mul", "div") and len(node.inputs) == 2:
        a, b = node.inputs
        cb = _scalar(b)
        if cb is not None and cb != 0:
            return a, (cb if node.op == "mul" else 1.0 / cb)
        ca = _scalar(a)
        if node.op == "mul" and ca is not None:
            return b, ca
    return node, 1.0


def _guard_of(guard: Node, scores: Node, users: dict[int, list[Node]]) -> Node | None:
    """The eq(scores, -inf) node when `guard` is "every element of this row of scores is -inf" in
    the form the torch frontend gives `(scores == -inf).all(-1, keepdim=True)`: ne(min(cast(eq(scores,
    -inf)), last dim, keepdim), 0). Its nodes must be used only along this chain."""
    last = scores.spec.rank - 1
    if guard.op != "ne" or _scalar(guard.inputs[1]) != 0.0:
        return None
    reduced = guard.inputs[0]
    dims = reduced.attrs.get("dims")
    dims = (dims,) if isinstance(dims, int) else tuple(dims or ())
    if reduced.op != "min" or [d % max(scores.spec.rank, 1) for d in dims] != [last] or \
            not reduced.attrs.get("keepdim", False) or len(users.get(reduced.id, ())) != 1:
        return None
    flag = reduced.inputs[0]
    if flag.op != "cast" or len(users.get(flag.id, ())) != 1:
        return None
    eq = flag.inputs[0]
    if eq.op != "eq" or len(users.get(eq.id, ())) != 1 or len(eq.inputs) != 2:
        return None
    a, b = eq.inputs
    other = b if a is scores else (a if b is scores else None)
    if other is None or _scalar(other) != float("-inf"):
        return None
    return eq


def _uncast(node: Node, dtype: str) -> Node | None:
    """x for node = cast(x) with x of `dtype` (the math path's upcast of a 16-bit operand), else None."""
    return node.inputs[0] if node.op == "cast" and node.inputs[0].dtype == dtype else None


Shape = tuple[int, ...]


def _matmul4(node: Node, single: Callable[[Node], bool]) -> tuple[Node, Shape, Node, Shape, Attrs] | None:
    """(a, a's 4-D shape, b, b's 4-D shape, attrs) when `node` is a 4-D matmul(a, b), or its AOTAutograd
    spelling view(bmm(view(a, [B*H, M, K]), view(b, [B*H, K, N])), [B, H, M, N]). There a and b may
    have any leading dims holding B*H elements (Hugging Face's repeat_kv gives k and v as [B, Hk, G, S, D]):
    viewed [B, H, ...] they are what the bmm multiplies, batch n = b*H + h on both sides."""
    if node.op == "matmul" and node.spec.rank == 4 and len(node.inputs) == 2:
        a, b = node.inputs
        return a, a.shape, b, b.shape, node.attrs
    if node.op != "reshape" or node.spec.rank != 4:
        return None
    mm = node.inputs[0]
    if mm.op != "matmul" or mm.spec.rank != 3 or len(mm.inputs) != 2 or not single(mm):
        return None
    lead = node.shape[:2]
    operands = []
    for operand in mm.inputs:
        if operand.op != "reshape" or operand.inputs[0].spec.rank < 3:
            return None
        src = operand.inputs[0]
        if src.shape[-2:] != operand.shape[1:] or math.prod(src.shape[:-2]) != lead[0] * lead[1]:
            return None
        operands.append(src)
    if mm.shape[0] != lead[0] * lead[1] or mm.shape[1:] != node.shape[2:] or not single(mm.inputs[0]):
        return None
    a, b = operands
    return a, (*lead, *a.shape[-2:]), b, (*lead, *b.shape[-2:]), mm.attrs


def match_attention(out: Node, users: dict[int, list[Node]], outputs: frozenset[int] = frozenset()) -> \
        AttentionMatch | None:
    """The attention computed by `out` = matmul(P, v), or None. `outputs`: ids of graph outputs
    (an intermediate that is an output is used elsewhere). Also torch's math SDPA on 16-bit inputs:
    `out` = cast(matmul(P, cast(v)), 16-bit), q, k, v upcast to fp32, P a "safe" softmax."""
    def single(n: Node) -> bool:
        return len(users.get(n.id, ())) == 1 and n.id not in outputs

    low: str | None = None          # the 16-bit dtype the math path upcast from
    if out.op == "cast" and dtypes.is_float(out.dtype) and out.inputs[0].op in ("matmul", "reshape") and \
            single(out.inputs[0]) and out.inputs[0].dtype in ("float32", "float64") and \
            dtypes.itemsize(out.dtype) < dtypes.itemsize(out.inputs[0].dtype):
        low, product = out.dtype, out.inputs[0]
    else:
        product = out
    pv = _matmul4(product, single)
    if pv is None or pv[4].get("trans_a", False) or pv[4].get("trans_b", False):
        return None
    probs, p_shape, v, v_shape, _ = pv
    if p_shape != probs.shape:          # P viewed from another shape: not the softmax's rows
        return None
    if low is not None:
        v_low = _uncast(v, low)
        if v_low is None:
            return None
        v = v_low
    if probs.op == "cast" and single(probs):
        probs = probs.inputs[0]
    guard_eq: Node | None = None
    if probs.op == "where" and single(probs) and is_literal_zero(probs.inputs[1]):
        # torch's _safe_softmax: where(row all -inf, 0, softmax(s)); our attention gives 0 there too
        soft = probs.inputs[2]
        if soft.op == "softmax" and single(soft):
            guard_eq = _guard_of(probs.inputs[0], soft.inputs[0], users)
            if guard_eq is not None:
                probs = soft
    if probs.op != "softmax" or not single(probs) or probs.attrs.get("dim", -1) % max(probs.spec.rank, 1) != \
            probs.spec.rank - 1:
        return None
    scores = probs.inputs[0]
    readers = {probs.id} | ({guard_eq.id} if guard_eq is not None else set())
    if guard_eq is None and scores.op == "cast" and dtypes.is_float(scores.inputs[0].dtype) and \
            dtypes.itemsize(scores.inputs[0].dtype) < dtypes.itemsize(scores.dtype) and single(scores):
        # 16-bit scores upcast for the softmax (T5: softmax(scores.float()).type_as(scores)): the
        # attention op's softmax is fp32 anyway
        readers, scores = {scores.id}, scores.inputs[0]

    def only_softmax(n: Node) -> bool:   # n feeds the softmax (and the safe softmax's guard) only
        return n.id not in outputs and {u.id for u in users.get(n.id, ())} <= readers

    softmax_input = scores
    if guard_eq is not None and not only_softmax(scores):
        return None
    mask = None
    mask_negated = False
    def is_qk(n: Node) -> bool:          # n is q @ k^T, scaled or not
        return _matmul4(_split_scale(n)[0], single) is not None

    if scores.op == "add" and only_softmax(scores):
        a, b = scores.inputs
        for s, m in ((a, b), (b, a)):
            if is_qk(s) and m.spec.rank >= 1 and dtypes.is_float(m.dtype):
                scores, mask = s, m
                break
    elif scores.op == "where" and only_softmax(scores) and scores.inputs[0].dtype == "bool" and \
            scores.inputs[0].spec.rank >= 1:
        # masked_fill(scores, ~keep, -inf) = where(~keep, -inf, scores), or where(keep, scores, -inf):
        # a boolean mask, True where a key takes part (SDPA's convention)
        cond, a, b = scores.inputs
        if broadcast_literal(a) == float("-inf") and b.shape == scores.shape:
            scores, mask, mask_negated = b, cond, True
        elif broadcast_literal(b) == float("-inf") and a.shape == scores.shape:
            scores, mask = a, cond
        else:
            return None
        if mask_negated and mask.op == "logical_not":
            mask, mask_negated = mask.inputs[0], False
    elif guard_eq is None and not single(scores):
        return None
    scale = 1.0
    if scores.op in ("mul", "div"):
        if not single(scores):
            return None
        scores, scale = _split_scale(scores)
    qk = _matmul4(scores, single)
    if qk is None or not (only_softmax(scores) if scores is softmax_input else single(scores)) or \
            qk[4].get("trans_a", False):
        return None
    q, q_shape, k, k_shape, qk_attrs = qk
    for operand in (q, k):
        inner, c = _split_scale(operand)
        if inner is not operand and single(operand):
            scale *= c
            if operand is q:
                q = inner
            else:
                k = inner
    k_transposed = False
    if not qk_attrs.get("trans_b", False):
        # k^T as a value: a transpose (under a scale simplify could not fold it through), or any
        # view [B, H, D, Sk] (a permute of the projection) that the rewrite transposes back
        if swaps_last_two(k) and single(k) and k.shape == k_shape:
            k = k.inputs[0]
            k_shape = (*k_shape[:2], k_shape[3], k_shape[2])
        else:
            k_transposed = True
    if low is not None:
        q_low, k_low = _uncast(q, low), _uncast(k, low)
        if q_low is None or k_low is None:
            return None
        q, k = q_low, k_low
    if not q.dtype == k.dtype == v.dtype == out.dtype:
        return None
    kt = (*k_shape[:2], k_shape[3], k_shape[2]) if k_transposed else k_shape      # [B, H, Sk, D]
    if q_shape[:2] != kt[:2] or kt[:3] != v_shape[:3] or q_shape[3] != kt[3]:
        return None
    if mask is not None:
        full = (q_shape[0], q_shape[1], q_shape[2], kt[2])
        if mask.spec.rank > 4 or any(m not in (1, f) for m, f in zip(reversed(mask.shape), reversed(full),
                                                                       strict=False)):
            return None
    return AttentionMatch(q, k, v, mask, scale, k_transposed, (q_shape, k_shape, v_shape), mask_negated)


@graph_pass("attention_match")
def attention_match(graph: Graph) -> Graph:
    """Rewrite matmul -> scale -> (mask) -> softmax -> matmul into scaled_dot_product_attention."""
    users = graph.users()
    outputs = frozenset(n.id for n in graph.outputs)
    matches = {n.id: m for n in graph.nodes if (m := match_attention(n, users, outputs)) is not None}
    if not matches:
        return graph
    if settings.debug >= 1:
        for node in graph.nodes:
            if node.id in matches:
                m = matches[node.id]
                how = "none" if m.mask is None else f"{m.mask.dtype}{list(m.mask.shape)}"
                print(f"[fusegraph] {graph.name}: attention_match: {node.name} -> one attention op "
                      f"(q {list(m.shapes[0])} {m.q.dtype}, scale {m.scale:.6g}, mask {how})")
    mapping: dict[int, Node] = {}
    for node in graph.nodes:
        if node.op == "input":
            mapping[node.id] = node
            continue
        match = matches.get(node.id)
        if match is not None:
            e = Emitter(prefix=f"{node.name}.", source=node.source)
            q, k, v = (mapping[t.id] if mapping[t.id].shape == shape else e.op("reshape", mapping[t.id], shape=shape)
                       for t, shape in zip((match.q, match.k, match.v), match.shapes, strict=True))
            if match.k_transposed:
                k = e.op("transpose", k, dim0=2, dim1=3)
            args = [q, k, v]
            if match.mask is not None:
                mask = mapping[match.mask.id]
                args.append(e.op("logical_not", mask) if match.mask_negated else mask)
            mapping[node.id] = e.op("scaled_dot_product_attention", *args, _name=node.name,
                                    has_mask=match.mask is not None,
                                    dropout_p=0.0, is_causal=False, scale=match.scale, enable_gqa=False,
                                    return_lse=False)
            continue
        inputs = tuple(mapping[i.id] for i in node.inputs)
        changed = any(a is not b for a, b in zip(inputs, node.inputs, strict=True))
        mapping[node.id] = node.replace(inputs=inputs) if changed else node
    return graph.with_(outputs=tuple(mapping[n.id] for n in graph.outputs))


# ---- grouped-query attention: k/v repeated per query group, fed to attention as their kv heads ----

def repeat_source(node: Node) -> tuple[Node, int, tuple[int, int, int, int]] | None:
    """(src, groups, (B, Hk, S, D)) when `node` is a [B, Hk, S, D] value repeated `groups` times per
    head into [B, Hk*groups, S, D] (repeat_interleave on dim 1, or Hugging Face's repeat_kv:
    reshape(expand(unsqueeze(x, 2)))); `src` holds that value in any shape of the same elements in
    the same order (the unsqueeze may be folded into an earlier reshape). Else None."""
    if node.op != "reshape" or node.spec.rank != 4:
        return None
    expanded = node.inputs[0]
    if expanded.op != "expand" or expanded.spec.rank != 5:
        return None
    unsqueezed = expanded.inputs[0]
    b, hk, groups, s, d = expanded.shape
    if unsqueezed.op != "reshape" or unsqueezed.shape != (b, hk, 1, s, d) or node.shape != (b, hk * groups, s, d):
        return None
    src = unsqueezed.inputs[0]
    return (src, groups, (b, hk, s, d)) if groups > 1 and src.spec.numel == b * hk * s * d else None


@graph_pass("gqa_match")
def gqa_match(graph: Graph) -> Graph:
    """Attention whose k and v are both their kv heads repeated per query group takes the kv heads
    directly (enable_gqa: query head h reads kv head h // groups, which is what the repeat built):
    no [B, H, S, D] copies of k and v (a decode step's whole KV cache, each step). Forward attention
    only: a backward's dk/dv have the repeated shape the graph expects."""
    Repeat = tuple[Node, int, tuple[int, int, int, int]]
    rewrites: dict[int, tuple[Repeat, Repeat]] = {}
    for node in graph.nodes:
        if node.op != "scaled_dot_product_attention":
            continue
        k, v = repeat_source(node.inputs[1]), repeat_source(node.inputs[2])
        if k is None or v is None or k[1] != v[1] or k[2][:2] != v[2][:2]:
            continue
        rewrites[node.id] = (k, v)
    if not rewrites:
        return graph
    from .simplify import rebuild

    def kv_heads(like: Node, repeat: Repeat) -> Node | None:
        src, _, shape = repeat
        src = mapping[src.id]
        if src.shape == shape:
            return src
        made = rebuild(like, "reshape", [src], shape=shape)
        return None if made is None else made.replace(name=f"{like.name}.kv_heads")

    mapping: dict[int, Node] = {}
    for node in graph.nodes:
        if node.op == "input":
            mapping[node.id] = node
            continue
        inputs = [mapping[i.id] for i in node.inputs]
        if node.id in rewrites:
            k_heads, v_heads = (kv_heads(i, r) for i, r in zip(node.inputs[1:3], rewrites[node.id], strict=True))
            made = None if k_heads is None or v_heads is None else \
                rebuild(node, node.op, [inputs[0], k_heads, v_heads, *inputs[3:]], **dict(node.attrs, enable_gqa=True))
            if isinstance(made, tuple):         # a multi-output node (return_lse): its getitems are remapped
                made = made[0].inputs[0]
            if made is not None:
                mapping[node.id] = made.replace(name=node.name)
                continue
        changed = any(a is not b for a, b in zip(inputs, node.inputs, strict=True))
        mapping[node.id] = node.replace(inputs=tuple(inputs)) if changed else node
    return graph.with_(outputs=tuple(mapping[n.id] for n in graph.outputs))
