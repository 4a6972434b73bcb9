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


def _sdpa_supports(node: torch.fx.Node) -> str | None:
    if not node_users_only_first(node):
        return "attention statistics (logsumexp) are read, e.g. by the backward"
    dropout = node.args[3] if len(node.args) > 3 else node.kwargs.get("dropout_p", 0.0)
    return None if not dropout else "attention dropout"


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


@translates(aten._scaled_dot_product_efficient_attention.default, supports=_sdpa_supports)
def _sdpa_efficient(cx: Ctx, q: Any, k: Any, v: Any, attn_bias: Any, compute_log_sumexp: bool,
                    dropout_p: float = 0.0, is_causal: bool = False, *, scale: Any = None) -> Any:
    return (cx.g.scaled_dot_product_attention(q, k, v, attn_bias, 0.0, is_causal, scale), None, None, None)


@translates(aten._scaled_dot_product_flash_attention.default, supports=_sdpa_supports)
def _sdpa_flash(cx: Ctx, q: Any, k: Any, v: Any, dropout_p: float = 0.0, is_causal: bool = False,
                return_debug_mask: bool = False, *, scale: Any = None) -> Any:
    out = cx.g.scaled_dot_product_attention(q, k, v, None, 0.0, is_causal, scale)
    return (out,) + (None,) * 8


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
