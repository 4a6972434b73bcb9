"""Scaled dot-product attention, forward and backward, on [B, H, S, D] tensors.

Semantics are torch.nn.functional.scaled_dot_product_attention's (dropout_p must be 0):
  scores = scale * q @ k^T (+ float mask | masked_fill(~bool mask, -inf)), causal = top-left
  triangle (key j visible to query i when j <= i, as torch), out = softmax(scores) @ v.
GQA: k and v may have Hk heads with Hk dividing H; query head h reads kv head h // (H / Hk).
A query row with every key masked gives out = 0 and lse = -inf (what flash kernels do; torch's
math path gives NaN there). The reference is explicit fp32 math, independent of torch's SDPA.

Cost: FLOPs forward 2*B*H*Sq*Sk*(D + Dv) (= 4*B*H*Sq*Sk*D), halved for causal masks (the
convention: about half the scores are skipped); backward is 2.5x the forward. Bytes: each input
read once, each output written once."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from ..errors import DTypeError, ShapeError, UnsupportedError
from ..ir import dtypes
from ..ir.node import Attrs
from ..ir.registry import MATMUL, Cost, define
from ..ir.spec import TensorSpec
from . import _rules as R
from .linalg import exact_fp32_matmul

AttnDims = tuple[int, int, int, int, int, int, int]  # B, H, Hk, Sq, Sk, D, Dv


def attention_dims(q: TensorSpec, k: TensorSpec, v: TensorSpec, mask: TensorSpec | None,
                   attrs: Attrs) -> AttnDims:
    """Validate q/k/v/mask shapes and dtypes; (B, H, Hk, Sq, Sk, D, Dv)."""
    if float(attrs.get("dropout_p", 0.0)) != 0.0:
        raise UnsupportedError(f"dropout_p={attrs.get('dropout_p')} is not supported inside attention; "
                               "only dropout_p=0.0 (apply g.dropout outside)")
    for name, s in (("query", q), ("key", k), ("value", v)):
        if s.rank != 4:
            raise ShapeError(f"{name} must be 4-D [B, H, S, D], got shape {s.shape}")
        if not dtypes.is_float(s.dtype) or s.dtype in dtypes.FP8:
            raise DTypeError(f"{name} must be float64/32/16 or bfloat16, got {s.dtype}")
    if not q.dtype == k.dtype == v.dtype:
        raise DTypeError(f"query, key, value must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    b, h, sq, d = q.shape
    bk, hk, sk, dk = k.shape
    bv, hv, sv, dv = v.shape
    if not b == bk == bv:
        raise ShapeError(f"batch sizes differ: query {q.shape}, key {k.shape}, value {v.shape}")
    if dk != d:
        raise ShapeError(f"head dims differ: query {q.shape} has D={d}, key {k.shape} has D={dk}")
    if (hk, sk) != (hv, sv):
        raise ShapeError(f"key {k.shape} and value {v.shape} differ in heads or sequence length")
    if hk != h:
        if not attrs.get("enable_gqa", False):
            raise ShapeError(f"query has {h} heads but key/value have {hk}; pass enable_gqa=True for "
                             "grouped-query attention")
        if hk == 0 or h % hk:
            raise ShapeError(f"GQA needs key/value heads to divide query heads: query has H={h}, key/value "
                             f"have Hk={hk} (H % Hk = {h % hk if hk else 'undefined'})")
    if mask is not None:
        if mask.dtype != "bool" and not dtypes.is_float(mask.dtype):
            raise DTypeError(f"attn_mask must be bool or floating point, got {mask.dtype}")
        full = (b, h, sq, sk)
        try:
            fits = R.broadcast_shapes(mask.shape, full) == full
        except ShapeError:
            fits = False
        if not fits:
            raise ShapeError(f"attn_mask of shape {mask.shape} does not broadcast to [B, H, Sq, Sk] = {full}")
        if attrs.get("is_causal", False):
            raise UnsupportedError("attn_mask together with is_causal=True is not supported (torch rejects it "
                                   "too); fold the causal triangle into attn_mask")
    return b, h, hk, sq, sk, d, dv


def _sdpa_infer(specs: Sequence[TensorSpec], attrs: Attrs) -> TensorSpec | tuple[TensorSpec, ...]:
    q, k, v = specs[:3]
    mask = specs[3] if attrs.get("has_mask", False) else None
    if len(specs) != 3 + (mask is not None):
        raise ShapeError(f"expected {3 + (mask is not None)} inputs (has_mask={mask is not None}), got {len(specs)}")
    b, h, _, sq, _, _, dv = attention_dims(q, k, v, mask, attrs)
    out = TensorSpec((b, h, sq, dv), q.dtype, device=q.device)
    if attrs.get("return_lse", False):
        return out, TensorSpec((b, h, sq), "float32", device=q.device)
    return out


def _fp32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


def _expand_kv(t: torch.Tensor, heads: int) -> torch.Tensor:
    return t if t.shape[-3] == heads else t.repeat_interleave(heads // t.shape[-3], dim=-3)


def attention_probs(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None,
                    a: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(P, lse): softmax probabilities [B, H, Sq, Sk] and log-sum-exp [B, H, Sq], in fp32 math."""
    scale = a.get("scale")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    k = _expand_kv(_fp32(k), q.shape[-3])
    scores = torch.matmul(_fp32(q), k.transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + _fp32(mask)
    if a.get("is_causal", False):
        sq, sk = scores.shape[-2:]
        visible = torch.ones(sq, sk, dtype=torch.bool, device=scores.device).tril()
        scores = scores.masked_fill(~visible, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    weights = torch.exp(scores - row_max)
    total = weights.sum(dim=-1, keepdim=True)
    probs = weights / torch.where(total > 0, total, torch.ones_like(total))
    lse = (row_max + torch.log(total)).squeeze(-1)
    return probs, lse


def _sdpa_ref(xs: list[torch.Tensor], a: Any) -> Any:
    with exact_fp32_matmul():
        return _sdpa_math(xs, a)


def _sdpa_math(xs: list[torch.Tensor], a: Any) -> Any:
    q, k, v = xs[:3]
    mask = xs[3] if a.get("has_mask", False) else None
    probs, lse = attention_probs(q, k, mask, a)
    out = torch.matmul(probs, _expand_kv(_fp32(v), q.shape[-3]))
    return (out, lse.float()) if a.get("return_lse", False) else out


def attention_flops(dims: AttnDims, causal: bool) -> int:
    b, h, _, sq, sk, d, dv = dims
    flops = 2 * b * h * sq * sk * (d + dv)
    return flops // 2 if causal else flops


def _sdpa_cost(ins: Sequence[TensorSpec], outs: Sequence[TensorSpec], a: Attrs) -> Cost:
    mask = ins[3] if a.get("has_mask", False) else None
    dims = attention_dims(ins[0], ins[1], ins[2], mask, a)
    return Cost(sum(s.nbytes for s in ins) + sum(s.nbytes for s in outs),
                attention_flops(dims, bool(a.get("is_causal", False))))


define("scaled_dot_product_attention", _sdpa_infer, _sdpa_ref, num_inputs=(3, 4), props={MATMUL},
       cost_fn=_sdpa_cost, extra={"kernel_kind": "attention", "dims": attention_dims},
       doc="F.scaled_dot_product_attention(q, k, v, attn_mask, 0.0, is_causal, scale, enable_gqa); inputs "
           "q, k, v[, attn_mask if has_mask]; with return_lse also outputs the fp32 log-sum-exp [B, H, Sq].")


def _bwd_inputs(specs: Sequence[Any], attrs: Attrs) -> tuple[Any, Any, Any, Any, Any, Any, Any]:
    """(grad_out, q, k, v, out, mask | None, lse | None) from the backward's input list."""
    has_mask, has_lse = bool(attrs.get("has_mask", False)), bool(attrs.get("has_lse", False))
    if len(specs) != 5 + has_mask + has_lse:
        raise ShapeError(f"expected {5 + has_mask + has_lse} inputs (has_mask={has_mask}, has_lse={has_lse}), "
                         f"got {len(specs)}")
    mask = specs[5] if has_mask else None
    lse = specs[5 + has_mask] if has_lse else None
    return specs[0], specs[1], specs[2], specs[3], specs[4], mask, lse


def _sdpa_bwd_infer(specs: Sequence[TensorSpec], attrs: Attrs) -> tuple[TensorSpec, ...]:
    grad_out, q, k, v, out, mask, lse = _bwd_inputs(specs, attrs)
    b, h, _, sq, _, _, dv = attention_dims(q, k, v, mask, attrs)
    for name, s in (("grad_out", grad_out), ("out", out)):
        if s.shape != (b, h, sq, dv):
            raise ShapeError(f"{name} has shape {s.shape}, expected [B, H, Sq, Dv] = {(b, h, sq, dv)}")
        if s.dtype != q.dtype:
            raise DTypeError(f"{name} dtype {s.dtype} differs from query dtype {q.dtype}")
    if lse is not None and (lse.shape != (b, h, sq) or not dtypes.is_float(lse.dtype)):
        raise ShapeError(f"lse must be a float [B, H, Sq] = {(b, h, sq)} tensor, got {lse.dtype}{list(lse.shape)}")
    return (q.with_(strides=None, layout=None), k.with_(strides=None, layout=None),
            v.with_(strides=None, layout=None))


def _group_sum(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Sum the per-query-head gradients of a GQA group onto their shared kv head."""
    b, h, s, d = grad.shape
    return grad if h == kv_heads else grad.reshape(b, kv_heads, h // kv_heads, s, d).sum(dim=2)


def _sdpa_bwd_ref(xs: list[torch.Tensor], a: Any) -> tuple[torch.Tensor, ...]:
    with exact_fp32_matmul():
        return _sdpa_bwd_math(xs, a)


def _sdpa_bwd_math(xs: list[torch.Tensor], a: Any) -> tuple[torch.Tensor, ...]:
    # `out` and `lse` are statistics a kernel reuses; the reference recomputes P from q and k.
    grad_out, q, k, v, _, mask, _ = _bwd_inputs(xs, a)
    scale = a.get("scale")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    heads, kv_heads = q.shape[-3], k.shape[-3]
    probs, _ = attention_probs(q, k, mask, a)
    d_out = _fp32(grad_out)
    k_full, v_full = _expand_kv(_fp32(k), heads), _expand_kv(_fp32(v), heads)
    d_v = torch.matmul(probs.transpose(-1, -2), d_out)
    d_probs = torch.matmul(d_out, v_full.transpose(-1, -2))
    d_scores = probs * (d_probs - (probs * d_probs).sum(dim=-1, keepdim=True))
    d_q = torch.matmul(d_scores, k_full) * scale
    d_k = torch.matmul(d_scores.transpose(-1, -2), _fp32(q)) * scale
    return d_q, _group_sum(d_k, kv_heads), _group_sum(d_v, kv_heads)


def _sdpa_bwd_cost(ins: Sequence[TensorSpec], outs: Sequence[TensorSpec], a: Attrs) -> Cost:
    _, q, k, v, _, mask, _ = _bwd_inputs(ins, a)
    forward = attention_flops(attention_dims(q, k, v, mask, a), bool(a.get("is_causal", False)))
    return Cost(sum(s.nbytes for s in ins) + sum(s.nbytes for s in outs), forward * 5 // 2)


define("sdpa_backward", _sdpa_bwd_infer, _sdpa_bwd_ref, num_inputs=(5, 7), props={MATMUL},
       cost_fn=_sdpa_bwd_cost, extra={"kernel_kind": "attention_backward", "dims": attention_dims},
       doc="Gradients (dq, dk, dv) of scaled_dot_product_attention; inputs grad_out, q, k, v, out"
           "[, attn_mask if has_mask][, lse if has_lse]. FLOPs 2.5x the forward's.")


class AttentionMethods:
    """Graph-builder methods for attention (mixed into fusegraph.Graph)."""

    def _apply(self, op: str, *operands: Any, name: str | None = None, **attrs: Any) -> Any:
        raise NotImplementedError

    def scaled_dot_product_attention(self, query: Any, key: Any, value: Any, attn_mask: Any = None,
                                     dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                                     enable_gqa: bool = False, return_lse: bool = False,
                                     name: str | None = None) -> Any:
        """F.scaled_dot_product_attention; with return_lse=True returns (out, lse) for the backward."""
        args = (query, key, value) + (() if attn_mask is None else (attn_mask,))
        return self._apply("scaled_dot_product_attention", *args, has_mask=attn_mask is not None,
                           dropout_p=float(dropout_p), is_causal=bool(is_causal),
                           scale=None if scale is None else float(scale), enable_gqa=bool(enable_gqa),
                           return_lse=bool(return_lse), name=name)

    def sdpa_backward(self, grad_out: Any, query: Any, key: Any, value: Any, out: Any, lse: Any = None,
                      attn_mask: Any = None, dropout_p: float = 0.0, is_causal: bool = False,
                      scale: float | None = None, enable_gqa: bool = False, name: str | None = None) -> Any:
        """(dq, dk, dv) of scaled_dot_product_attention with the same options."""
        args = (grad_out, query, key, value, out) + (() if attn_mask is None else (attn_mask,)) \
            + (() if lse is None else (lse,))
        return self._apply("sdpa_backward", *args, has_mask=attn_mask is not None, has_lse=lse is not None,
                           dropout_p=float(dropout_p), is_causal=bool(is_causal),
                           scale=None if scale is None else float(scale), enable_gqa=bool(enable_gqa),
                           name=name)
