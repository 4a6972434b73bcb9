"""Recognize unfused attention and rewrite it to one scaled_dot_product_attention node.

Matched (q, k, v are [B, H, S, D]; every intermediate has a single user):

    out = matmul(P, v)                      P = softmax(S, dim=-1), optionally cast afterwards
    S   = scaled (+ mask)                   an additive float mask broadcast to [B, H, Sq, Sk]
    scaled = mul(QK, c) | mul(c, QK) | div(QK, c) | QK
    QK  = matmul(q', k', trans_b=True)      (simplify has already folded transposes into trans_b)
    q'  = q | mul(q, c) | div(q, c)         the scale may sit on q or k instead (before the product)

The scale is the product of the constants found; the rewritten node computes in the graph's
compute dtype like the reference, so results match the unfused graph up to the rounding of the
intermediate 16-bit values it no longer produces. Not matched (left as is): masks applied with
`where`/masked_fill, softmax over another dim, P used elsewhere (e.g. returned).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..ir import dtypes
from ..ir.emit import Emitter
from ..ir.graph import Graph
from ..ir.node import Node
from .base import graph_pass


@dataclass(frozen=True)
class AttentionMatch:
    q: Node
    k: Node
    v: Node
    mask: Node | None
    scale: float


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


def match_attention(out: Node, users: dict[int, list[Node]], outputs: frozenset[int] = frozenset()) -> \
        AttentionMatch | None:
    """The attention computed by `out` = matmul(P, v), or None. `outputs`: ids of graph outputs
    (an intermediate that is an output is used elsewhere)."""
    def single(n: Node) -> bool:
        return len(users.get(n.id, ())) == 1 and n.id not in outputs

    if out.op != "matmul" or out.attrs.get("trans_a", False) or out.attrs.get("trans_b", False):
        return None
    probs, v = out.inputs
    if probs.op == "cast" and single(probs):
        probs = probs.inputs[0]
    if probs.op != "softmax" or not single(probs) or probs.attrs.get("dim", -1) % max(probs.spec.rank, 1) != \
            probs.spec.rank - 1:
        return None
    scores = probs.inputs[0]
    mask = None
    if scores.op == "add" and single(scores):
        a, b = scores.inputs
        for s, m in ((a, b), (b, a)):
            if s.op in ("mul", "div", "matmul") and m.spec.rank >= 1 and dtypes.is_float(m.dtype):
                scores, mask = s, m
                break
    scale = 1.0
    if scores.op != "matmul":
        if not single(scores):
            return None
        scores, scale = _split_scale(scores)
    if scores.op != "matmul" or not single(scores) or scores.attrs.get("trans_a", False) \
            or not scores.attrs.get("trans_b", False):
        return None
    q, k = scores.inputs
    for operand in (q, k):
        inner, c = _split_scale(operand)
        if inner is not operand and single(operand):
            scale *= c
            if operand is q:
                q = inner
            else:
                k = inner
    if not all(t.spec.rank == 4 for t in (q, k, v)) or not q.dtype == k.dtype == v.dtype == out.dtype:
        return None
    if q.shape[:2] != k.shape[:2] or k.shape[:3] != v.shape[:3] or q.shape[3] != k.shape[3]:
        return None
    if mask is not None:
        full = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        if mask.spec.rank > 4 or any(m not in (1, f) for m, f in zip(reversed(mask.shape), reversed(full),
                                                                       strict=False)):
            return None
    return AttentionMatch(q, k, v, mask, scale)


@graph_pass("attention_match")
def attention_match(graph: Graph) -> Graph:
    """Rewrite matmul -> scale -> (mask) -> softmax -> matmul into scaled_dot_product_attention."""
    users = graph.users()
    outputs = frozenset(n.id for n in graph.outputs)
    matches = {n.id: m for n in graph.nodes if (m := match_attention(n, users, outputs)) is not None}
    if not matches:
        return graph
    mapping: dict[int, Node] = {}
    for node in graph.nodes:
        if node.op == "input":
            mapping[node.id] = node
            continue
        match = matches.get(node.id)
        if match is not None:
            e = Emitter(prefix=f"{node.name}.", source=node.source)
            args = [mapping[match.q.id], mapping[match.k.id], mapping[match.v.id]]
            if match.mask is not None:
                args.append(mapping[match.mask.id])
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
