"""ATen -> fusegraph translators for neural-network ops: normalization, matmul, convolution,
attention, losses, pooling. Same table as torch_ops (see its docstring)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx

from .torch_ops import Ctx, cast_to, node_users_only_first, translates

aten = torch.ops.aten


# ---------------- normalization ----------------

@translates(aten.native_layer_norm.default)
def _native_layer_norm(cx: Ctx, x: Any, normalized_shape: Sequence[int], weight: Any, bias: Any,
                       eps: float) -> Any:
    """(out, mean, rstd). When only `out` is read: the layernorm op. When the backward needs the
    statistics too: mean and rstd as reductions in the compute dtype (one fused kernel either way)."""
    if cx.used_outputs() <= {0}:
        out = cx.g.layernorm(x, tuple(normalized_shape), weight, bias, eps)
        return (out, None, None)
    dims = tuple(range(len(x.shape) - len(normalized_shape), len(x.shape)))
    xf = cast_to(cx, x, "float32")
    mean = cx.g.mean(xf, dims, keepdim=True)
    centered = cx.g.sub(xf, mean)
    var = cx.g.mean(cx.g.mul(centered, centered), dims, keepdim=True)
    rstd = cx.g.rsqrt(cx.g.add(var, float(eps)))
    y = cx.g.mul(centered, rstd)
    if weight is not None:
        y = cx.g.mul(y, cast_to(cx, weight, "float32"))
    if bias is not None:
        y = cx.g.add(y, cast_to(cx, bias, "float32"))
    return (cast_to(cx, y, x.dtype), mean, rstd)


def _batch_norm_eval_supports(node: torch.fx.Node) -> str | None:
    return None if node_users_only_first(node) else "saved statistics of an eval-mode batch norm are read"


@translates(aten._native_batch_norm_legit_no_training.default, supports=_batch_norm_eval_supports)
def _batch_norm_eval(cx: Ctx, x: Any, weight: Any, bias: Any, running_mean: Any, running_var: Any,
                     momentum: float, eps: float) -> Any:
    out = cx.g.batch_norm(x, running_mean, running_var, weight, bias, training=False, momentum=momentum, eps=eps)
    return (out, None, None)


@translates(aten._native_batch_norm_legit_functional.default, aten._native_batch_norm_legit.no_stats,
            aten._native_batch_norm_legit.default,
            supports=lambda n: _bn_training_problem(n))
def _batch_norm_train(cx: Ctx, x: Any, weight: Any, bias: Any, *args: Any) -> Any:
    """Batch statistics: (out, save_mean, save_invstd[, new_running_mean, new_running_var]).
    The _legit.default form updates running stats in place; AOTAutograd functionalizes that into
    the _functional form, so only the functional and no-stats forms reach us with running stats."""
    no_stats = cx.node.target is aten._native_batch_norm_legit.no_stats
    running_mean, running_var = (None, None) if no_stats else args[:2]
    momentum, eps = (args[1], args[2]) if no_stats else (args[3], args[4])
    out, mean, var_unbiased = cx.g.batch_norm(x, None, None, weight, bias, training=True, eps=eps)
    n = math.prod(x.shape) // x.shape[1]
    var_biased = cx.g.mul(var_unbiased, (n - 1) / n)
    invstd = cx.g.rsqrt(cx.g.add(var_biased, float(eps)))
    if cx.node.target is not aten._native_batch_norm_legit_functional.default:
        return (out, mean, invstd)
    new_mean = cx.g.add(cx.g.mul(running_mean, 1.0 - momentum), cx.g.mul(mean, momentum))
    new_var = cx.g.add(cx.g.mul(running_var, 1.0 - momentum), cx.g.mul(var_unbiased, momentum))
    return (out, mean, invstd, new_mean, new_var)


def _bn_training_problem(node: torch.fx.Node) -> str | None:
    if node.target is aten._native_batch_norm_legit.default:
        return "updates running statistics in place (only the functionalized form is translated)"
    training = node.args[3] if node.target is aten._native_batch_norm_legit.no_stats else node.args[5]
    return None if training else "batch statistics off without running statistics"


# ---------------- linear algebra ----------------

@translates(aten.mm.default, aten.bmm.default, aten.matmul.default)
def _mm(cx: Ctx, a: Any, b: Any) -> Any:
    dtype = cx.dtype
    return cx.g.matmul(cast_to(cx, a, dtype), cast_to(cx, b, dtype))


@translates(aten.addmm.default, aten.baddbmm.default)
def _addmm(cx: Ctx, bias: Any, a: Any, b: Any, *, beta: Any = 1, alpha: Any = 1) -> Any:
    prod = cx.g.matmul(a, b)
    if alpha != 1:
        prod = cx.g.mul(prod, alpha)
    if beta == 0:
        return prod
    return cx.g.add(prod, bias if beta == 1 else cx.g.mul(bias, beta))


def _conv_supports(node: torch.fx.Node) -> str | None:
    args = list(node.args) + [None] * 9
    x = node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) else None
    if x is None or x.dim() != 4:
        return "only 2-d convolutions (4-d inputs) are translated"
    if args[6]:
        return "transposed convolution"
    return None


@translates(aten.convolution.default, supports=_conv_supports)
def _convolution(cx: Ctx, x: Any, w: Any, bias: Any, stride: Any, padding: Any, dilation: Any,
                 transposed: bool, output_padding: Any, groups: int) -> Any:
    return cx.g.conv2d(x, w, bias, tuple(stride), tuple(padding), tuple(dilation), int(groups))


def _conv_backward_supports(node: torch.fx.Node) -> str | None:
    x = node.args[1].meta.get("val") if isinstance(node.args[1], torch.fx.Node) else None
    if x is None or x.dim() != 4:
        return "only 2-d convolutions (4-d inputs) are translated"
    return "transposed convolution" if node.args[7] else None


@translates(aten.convolution_backward.default, supports=_conv_backward_supports)
def _convolution_backward(cx: Ctx, grad: Any, x: Any, w: Any, bias_sizes: Any, stride: Any, padding: Any,
                          dilation: Any, transposed: bool, output_padding: Any, groups: int,
                          output_mask: Sequence[bool]) -> Any:
    common = {"stride": tuple(stride), "padding": tuple(padding), "dilation": tuple(dilation), "groups": int(groups)}
    dx = cx.g.conv2d_backward_input(grad, w, tuple(x.shape), **common) if output_mask[0] else None
    dw = cx.g.conv2d_backward_weight(x, grad, tuple(w.shape), **common) if output_mask[1] else None
    db = cx.g.sum(grad, (0, 2, 3)) if output_mask[2] else None
    return (dx, dw, db)


def _no_dropout(node: torch.fx.Node) -> str | None:
    dropout = node.args[3] if len(node.args) > 3 else node.kwargs.get("dropout_p", 0.0)
    return None if not dropout else "attention dropout"


@translates(aten._scaled_dot_product_flash_attention_for_cpu.default, supports=_no_dropout)
def _sdpa_cpu(cx: Ctx, q: Any, k: Any, v: Any, dropout_p: float = 0.0, is_causal: bool = False, *,
              attn_mask: Any = None, scale: Any = None) -> Any:
    """(out, logsumexp [B, H, L] fp32): the statistics the backward reads, in torch's own format."""
    if cx.used_outputs() <= {0}:
        return (cx.g.scaled_dot_product_attention(q, k, v, attn_mask, 0.0, is_causal, scale), None)
    return cx.g.scaled_dot_product_attention(q, k, v, attn_mask, 0.0, is_causal, scale, return_lse=True)


@translates(aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
            supports=lambda n: None if not n.args[6] else "attention dropout")
def _sdpa_cpu_backward(cx: Ctx, grad: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, dropout_p: float,
                       is_causal: bool, *, attn_mask: Any = None, scale: Any = None) -> Any:
    return cx.g.sdpa_backward(grad, q, k, v, out, lse, attn_mask, 0.0, is_causal, scale)


# The CUDA attention ops of training graphs. Their forward and backward are both translated onto
# our scaled_dot_product_attention(return_lse=True) / sdpa_backward, so only our own forward's lse
# (fp32, natural log, [B, H, Sq]) reaches our backward; it is stored in the shape torch's meta
# function gives (memory-efficient: padded to a multiple of 32; cuDNN: [B, H, Sq, 1]). The philox
# seed/offset outputs are meta tensors at trace time (dropout 0: nothing reads them); the
# partition hands on empty placeholders for them (torch_partition.CompiledPartition).

# Where the philox RNG state is: outputs of the forwards, arguments of the backwards.
RNG_OUTPUTS: dict[Any, tuple[int, ...]] = {
    aten._scaled_dot_product_efficient_attention.default: (2, 3),
    aten._scaled_dot_product_cudnn_attention.default: (6, 7),
    aten._scaled_dot_product_flash_attention.default: (6, 7),
}
RNG_ARGS: dict[Any, tuple[int, ...]] = {
    aten._scaled_dot_product_efficient_attention_backward.default: (7, 8),
    aten._scaled_dot_product_cudnn_attention_backward.default: (6, 7),
    aten._scaled_dot_product_flash_attention_backward.default: (12, 13),
}


def _attention(cx: Ctx, q: Any, k: Any, v: Any, mask: Any, is_causal: bool, scale: Any) -> Any:
    """(out, lse [B, H, Sq] or None when the node's statistics output is not read)."""
    gqa = q.shape[1] != k.shape[1]
    if cx.used_outputs() <= {0}:
        return cx.g.scaled_dot_product_attention(q, k, v, mask, 0.0, is_causal, scale, enable_gqa=gqa), None
    return cx.g.scaled_dot_product_attention(q, k, v, mask, 0.0, is_causal, scale, enable_gqa=gqa, return_lse=True)


def _lse_as(cx: Ctx, lse: Any, index: int) -> Any:
    """Our lse [B, H, Sq] in the shape of output `index` of the node (padded or with a unit dim)."""
    want = tuple(int(s) for s in cx.val[index].shape)
    if lse is None or want == tuple(lse.shape):
        return lse
    if len(want) == 3 and want[2] > lse.shape[2]:
        return cx.g.pad(lse, (0, want[2] - lse.shape[2]), value=0.0)
    return cx.g.reshape(lse, want)


def _lse_of(cx: Ctx, lse: Any, q: Any) -> Any:
    """A saved lse ([B, H, Sq] padded, or [B, H, Sq, 1]) back as [B, H, Sq]."""
    b, h, sq = q.shape[0], q.shape[1], q.shape[2]
    if len(lse.shape) == 3 and lse.shape[2] > sq:
        return cx.g.slice(lse, 2, 0, sq, 1)
    return lse if tuple(lse.shape) == (b, h, sq) else cx.g.reshape(lse, (b, h, sq))


def _arg(node: torch.fx.Node, index: int, name: str, default: Any) -> Any:
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)


def _bias_and_causal(node: torch.fx.Node, bias_index: int, causal_index: int) -> bool:
    return _arg(node, bias_index, "attn_bias", None) is not None and bool(_arg(node, causal_index, "is_causal", False))


def _efficient_supports(node: torch.fx.Node) -> str | None:
    if _arg(node, 5, "dropout_p", 0.0):
        return "attention dropout"
    if _bias_and_causal(node, 3, 6):
        return "attention bias together with is_causal"
    if _arg(node, 4, "compute_log_sumexp", False) is False and not node_users_only_first(node):
        return "attention statistics read without compute_log_sumexp"
    return None


@translates(aten._scaled_dot_product_efficient_attention.default, supports=_efficient_supports)
def _sdpa_efficient(cx: Ctx, q: Any, k: Any, v: Any, attn_bias: Any, compute_log_sumexp: bool,
                    dropout_p: float = 0.0, is_causal: bool = False, *, scale: Any = None) -> Any:
    """(out, log_sumexp, philox_seed, philox_offset)."""
    out, lse = _attention(cx, q, k, v, attn_bias, is_causal, scale)
    return (out, _lse_as(cx, lse, 1), None, None)


def _efficient_backward_supports(node: torch.fx.Node) -> str | None:
    if node.args[9]:
        return "attention dropout"
    if _bias_and_causal(node, 4, 11):
        return "attention bias together with is_causal"
    mask: Any = node.args[10]
    return "gradient of the attention bias" if node.args[4] is not None and mask[3] else None


@translates(aten._scaled_dot_product_efficient_attention_backward.default, supports=_efficient_backward_supports)
def _sdpa_efficient_backward(cx: Ctx, grad: Any, q: Any, k: Any, v: Any, attn_bias: Any, out: Any, lse: Any,
                             philox_seed: Any, philox_offset: Any, dropout_p: float, grad_input_mask: Any,
                             is_causal: bool = False, *, scale: Any = None) -> Any:
    """(dq, dk, dv, d_bias = None)."""
    dq, dk, dv = cx.g.sdpa_backward(grad, q, k, v, out, _lse_of(cx, lse, q), attn_bias, 0.0, is_causal, scale,
                                    enable_gqa=q.shape[1] != k.shape[1])
    return (dq, dk, dv, None)


def _cudnn_supports(node: torch.fx.Node) -> str | None:
    if _arg(node, 5, "dropout_p", 0.0):
        return "attention dropout"
    if _bias_and_causal(node, 3, 6):
        return "attention bias together with is_causal"
    if _arg(node, 4, "compute_log_sumexp", False) is False and not node_users_only_first(node):
        return "attention statistics read without compute_log_sumexp"
    return None


@translates(aten._scaled_dot_product_cudnn_attention.default, supports=_cudnn_supports)
def _sdpa_cudnn(cx: Ctx, q: Any, k: Any, v: Any, attn_bias: Any, compute_log_sumexp: bool, dropout_p: float = 0.0,
                is_causal: bool = False, return_debug_mask: bool = False, *, scale: Any = None) -> Any:
    """(out, logsumexp [B, H, Sq, 1], cum_seq_q, cum_seq_k, max_q, max_k, philox_seed, philox_offset,
    debug_attn_mask): the sequence bookkeeping is None/ints for dense batches."""
    out, lse = _attention(cx, q, k, v, attn_bias, is_causal, scale)
    return (out, _lse_as(cx, lse, 1)) + (None,) * 7


@translates(aten._scaled_dot_product_cudnn_attention_backward.default,
            supports=lambda n: "attention dropout" if n.args[13] else
            "attention bias together with is_causal" if _bias_and_causal(n, 8, 14) else None)
def _sdpa_cudnn_backward(cx: Ctx, grad: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, philox_seed: Any,
                         philox_offset: Any, attn_bias: Any, cum_seq_q: Any, cum_seq_k: Any, max_q: Any, max_k: Any,
                         dropout_p: float, is_causal: bool, *, scale: Any = None) -> Any:
    return cx.g.sdpa_backward(grad, q, k, v, out, _lse_of(cx, lse, q), attn_bias, 0.0, is_causal, scale,
                              enable_gqa=q.shape[1] != k.shape[1])


@translates(aten._scaled_dot_product_flash_attention.default, supports=_no_dropout)
def _sdpa_flash(cx: Ctx, q: Any, k: Any, v: Any, dropout_p: float = 0.0, is_causal: bool = False,
                return_debug_mask: bool = False, *, scale: Any = None) -> Any:
    """(out, logsumexp [B, H, Sq], cum_seq_q, cum_seq_k, max_q, max_k, rng_state, unused, debug_attn_mask)."""
    out, lse = _attention(cx, q, k, v, None, is_causal, scale)
    return (out, lse) + (None,) * 7


@translates(aten._scaled_dot_product_flash_attention_backward.default,
            supports=lambda n: None if not n.args[10] else "attention dropout")
def _sdpa_flash_backward(cx: Ctx, grad: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, cum_seq_q: Any,
                         cum_seq_k: Any, max_q: Any, max_k: Any, dropout_p: float, is_causal: bool,
                         philox_seed: Any, philox_offset: Any, *, scale: Any = None) -> Any:
    return cx.g.sdpa_backward(grad, q, k, v, out, _lse_of(cx, lse, q), None, 0.0, is_causal, scale,
                              enable_gqa=q.shape[1] != k.shape[1])


def _nll_supports(node: torch.fx.Node) -> str | None:
    first = 1 if node.target is aten.nll_loss_backward.default else 0   # the backward starts with grad
    lp, weight, reduction = node.args[first], node.args[first + 2], node.args[first + 3]
    if weight is not None:
        return "class weights"
    val = lp.meta.get("val") if isinstance(lp, torch.fx.Node) else None
    if val is None or val.dim() != 2:
        return "only [N, C] inputs"
    return None if reduction in (0, 1, 2) else f"reduction {reduction}"


def _nll_valid(cx: Ctx, target: Any, ignore_index: int, n_classes: int) -> tuple[Any, Any]:
    """([N, 1] safe class index, [N, 1] float validity) for targets that may hold ignore_index."""
    column = cx.g.reshape(target, (target.shape[0], 1))
    valid = cx.g.ne(column, ignore_index)
    return cx.g.where(valid, column, 0), cx.g.cast(valid, "float32")


@translates(aten.nll_loss_forward.default, supports=_nll_supports)
def _nll_loss_forward(cx: Ctx, lp: Any, target: Any, weight: Any, reduction: int, ignore_index: int) -> Any:
    """(loss, total_weight) of nll_loss on log-probabilities [N, C]; reduction 0 none, 1 mean, 2 sum."""
    safe, valid = _nll_valid(cx, target, ignore_index, lp.shape[1])
    picked = cx.g.mul(cx.g.neg(cx.g.cast(cx.g.gather(lp, 1, safe), "float32")), valid)   # [N, 1]
    total = cx.g.sum(valid)
    if reduction == 0:
        loss = cx.g.reshape(picked, (lp.shape[0],))
    elif reduction == 2:
        loss = cx.g.sum(picked)
    else:
        loss = cx.g.div(cx.g.sum(picked), total)
    return (loss, total)


@translates(aten.nll_loss_backward.default, supports=_nll_supports)
def _nll_loss_backward(cx: Ctx, grad: Any, lp: Any, target: Any, weight: Any, reduction: int, ignore_index: int,
                       total_weight: Any) -> Any:
    """d lp = -onehot(target) * grad (/ total_weight for mean), zero on ignored rows."""
    n, c = lp.shape
    safe, valid = _nll_valid(cx, target, ignore_index, c)
    onehot = cx.g.cast(cx.g.eq(cx.g.iota((n, c), 1, "int64"), safe), "float32")
    scale = cx.g.reshape(grad, (n, 1)) if reduction == 0 else cx.g.reshape(grad, (1, 1))
    if reduction == 1:
        scale = cx.g.div(scale, cx.g.reshape(total_weight, (1, 1)))
    return cx.g.mul(cx.g.mul(onehot, valid), cx.g.neg(cx.g.cast(scale, "float32")))


def _global_pool(node: torch.fx.Node) -> str | None:
    size: Any = node.args[1]
    return None if list(size) == [1, 1] else "adaptive pooling to a size other than 1x1"


def _grad_is_pooled(node: torch.fx.Node) -> str | None:
    grad: Any = node.args[0]
    return None if tuple(grad.meta["val"].shape[-2:]) == (1, 1) else "not a global pool"


@translates(aten._adaptive_avg_pool2d.default, supports=_global_pool)
def _adaptive_avg_pool(cx: Ctx, x: Any, output_size: Any) -> Any:
    return cx.g.mean(x, (len(x.shape) - 2, len(x.shape) - 1), keepdim=True)


@translates(aten._adaptive_avg_pool2d_backward.default, supports=_grad_is_pooled)
def _adaptive_avg_pool_backward(cx: Ctx, grad: Any, x: Any) -> Any:
    h, w = x.shape[-2:]
    return cx.g.expand(cx.g.div(cast_to(cx, grad, cx.dtype), float(h * w)), cx.shape)


@translates(aten.native_group_norm.default,
            supports=lambda n: None if node_users_only_first(n) else "group-norm statistics are read (backward)")
def _native_group_norm(cx: Ctx, x: Any, weight: Any, bias: Any, n: int, c: int, hw: int, groups: int,
                       eps: float) -> Any:
    return (cx.g.group_norm(x, groups, weight, bias, eps), None, None)

from . import torch_ops_more, torch_ops_scatter  # noqa: E402, F401  (zoo ops: pooling, indexing, ...; index_put & co.)
