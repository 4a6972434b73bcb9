"""Attention masks that are the causal triangle, computed from nothing but constants, become is_causal.

Hugging Face models (GPT-2, Llama, ...) often hand SDPA a materialized mask built from aranges (position
j visible to query i when j <= i) instead of is_causal=True. The traced ATen graph then computes a
[B, 1, S, S] mask from aten.arange & co, every attention kernel reads it, and for training AOTAutograd
saves it for the backward: the attention backends lose their causal fast paths (tile skipping; cuDNN's
and flash's backward without a bias), and the backward cannot take the forward's log-sum-exp directly.

`rewrite_causal_masks(gm)` finds SDPA ops (forward and backward, every backend's ATen op) whose mask
argument depends on no graph input (no placeholder among its ancestors; deterministic ops only),
evaluates that subgraph once at compile time with real tensors, and when the mask equals torch's
is_causal triangle (top-left aligned: key j visible to query i iff j <= i, for every batch and head;
a bool mask, or a float mask of 0 and large negative values: -inf, the dtype's most negative value,
-65504, -1e4; see HIDDEN_BELOW), replaces the mask by
None and is_causal by True. The now unused mask subgraph is dropped. It runs on the joint graph
before AOTAutograd partitions it (so the mask is not saved for the backward either) and on inference
graphs. Anything it cannot decide is left alone.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

from ..settings import settings

SDPA_OPS = frozenset({
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward",
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward",
})
MASK_ARGS = ("attn_bias", "attn_mask")
MAX_MASK_ELEMENTS = 1 << 26   # evaluating a larger mask at compile time is not worth it
# An additive mask value at or below this hides its position exactly like -inf: softmax's exp(score - max
# + bias) underflows to 0.0 in fp32 once the exponent is below about -104, which any bias <= -1e4 ensures
# unless scores themselves differ by ~1e4. Masks use -inf, the dtype's most negative value, or, in Hugging
# Face models under autocast, float16's -65504 stored in bfloat16; older models used -10000.
HIDDEN_BELOW = -1e4


def rewrite_causal_masks(gm: fx.GraphModule) -> int:
    """Rewrite SDPA ops with a constant causal mask to is_causal=True (see the module doc); how many."""
    verdicts: dict[fx.Node, bool] = {}
    count = 0
    for node in list(gm.graph.nodes):
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload) or \
                target.overloadpacket.__name__ not in SDPA_OPS:
            continue
        names = [a.name for a in target._schema.arguments]
        mask_name = next((n for n in MASK_ARGS if n in names), None)
        if mask_name is None or "is_causal" not in names:
            continue
        mask = _get(node, names, mask_name)
        if not isinstance(mask, fx.Node) or _get(node, names, "is_causal"):
            continue
        query, key = _get(node, names, "query"), _get(node, names, "key")
        if mask not in verdicts:
            why_not = _why_not_constant_causal(gm, mask, _seq_len(query), _seq_len(key))
            verdicts[mask] = why_not is None
            if why_not is not None and settings.debug >= 1:
                print(f"[fusegraph] causal mask: {node.name} keeps its mask {mask.name}: {why_not}", file=sys.stderr)
        if not verdicts[mask]:
            continue
        _set(node, names, mask_name, None)
        _set(node, names, "is_causal", True)
        if "grad_input_mask" in names:          # no mask, so no gradient of it to ask for
            wanted = list(_get(node, names, "grad_input_mask"))
            _set(node, names, "grad_input_mask", [*wanted[:3], False, *wanted[4:]])
        count += 1
    if count:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return count


def _get(node: fx.Node, names: list[str], name: str) -> Any:
    index = names.index(name)
    if index < len(node.args):
        return node.args[index]
    if name in node.kwargs:
        return node.kwargs[name]
    return node.target._schema.arguments[index].default_value  # type: ignore[union-attr]


def _set(node: fx.Node, names: list[str], name: str, value: Any) -> None:
    index = names.index(name)
    if index < len(node.args):
        node.update_arg(index, value)
    else:
        node.update_kwarg(name, value)


def _seq_len(node: Any) -> int | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return int(val.shape[-2]) if isinstance(val, torch.Tensor) and val.dim() >= 2 else None


def _why_not_constant_causal(gm: fx.GraphModule, mask: fx.Node, sq: int | None, sk: int | None) -> str | None:
    """None when `mask` is a compile-time constant equal to the causal triangle; else why not."""
    if sq is None or sk is None:
        return "query or key without a known shape"
    val = mask.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() < 2 or val.numel() > MAX_MASK_ELEMENTS:
        return "not a tensor of at least 2 dims and at most 2**26 elements"
    order, culprit = _constant_ancestors(mask)
    if order is None:
        return f"depends on {culprit} (a graph input or a nondeterministic op)"
    try:
        with unset_fake_temporarily():
            value = _evaluate(gm, order)[mask]
            return None if _is_causal_value(value, sq, sk) else \
                f"its value is not the causal triangle ({_describe(value, sq, sk)})"
    except Exception as err:  # a subgraph we cannot run here is simply left as it is
        return f"could not be evaluated at compile time ({type(err).__name__}: {str(err)[:200]})"


def _constant_ancestors(mask: fx.Node) -> tuple[list[fx.Node] | None, str]:
    """The mask's ancestors in graph order, or (None, the node's name) when one is a graph input or
    not deterministic."""
    seen: set[fx.Node] = set()
    stack = [mask]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder" or n.op not in ("call_function", "get_attr"):
            return None, f"{n.op} {n.name}"
        if n.op == "call_function" and (not isinstance(n.target, torch._ops.OpOverload) and
                                        not callable(n.target)):
            return None, f"{n.name} ({n.target})"
        if isinstance(n.target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in n.target.tags:
            return None, f"{n.name} ({n.target})"
        stack.extend(n.all_input_nodes)
    return [n for n in mask.graph.nodes if n in seen], ""


def _evaluate(gm: fx.GraphModule, order: list[fx.Node]) -> dict[fx.Node, Any]:
    env: dict[fx.Node, Any] = {}
    for n in order:
        if n.op == "get_attr":
            value: Any = gm
            for part in str(n.target).split("."):
                value = getattr(value, part)
            env[n] = value
            continue
        args = fx.node.map_arg(n.args, lambda a: env[a])
        kwargs = fx.node.map_arg(n.kwargs, lambda a: env[a])
        env[n] = n.target(*args, **kwargs)  # type: ignore[operator]
    return env


def _is_causal_value(value: torch.Tensor, sq: int, sk: int) -> bool:
    """Does `value` (broadcast to [..., sq, sk]) mask exactly what is_causal masks?"""
    if value.dim() < 2:
        return False
    if value.dtype == torch.bool:
        visible = value
    elif value.is_floating_point():
        hidden = value <= HIDDEN_BELOW
        if not bool(((value == 0) | hidden).all()):
            return False                                      # a real bias, not only a mask
        visible = ~hidden
    else:
        return False
    visible = visible.expand(*visible.shape[:-2], sq, sk)
    causal = torch.ones(sq, sk, dtype=torch.bool, device=visible.device).tril()
    return bool((visible == causal).all())


def _describe(value: torch.Tensor, sq: int, sk: int) -> str:
    """Shape, dtype, value range and the first position that differs from the triangle, for the debug log."""
    text = f"{value.dtype} {list(value.shape)} strides {value.stride()}"
    try:
        flat = value.float()
        text += f", min {flat.min().item():.3g} max {flat.max().item():.3g}"
        visible = value if value.dtype == torch.bool else value > HIDDEN_BELOW
        visible = visible.expand(*visible.shape[:-2], sq, sk)
        causal = torch.ones(sq, sk, dtype=torch.bool, device=visible.device).tril()
        wrong = (visible != causal).nonzero()
        if len(wrong):
            text += f", {len(wrong)} positions differ, first {wrong[0].tolist()}"
    except Exception as err:  # only a description
        text += f" ({type(err).__name__})"
    return text
