"""frontends/causal_mask.py: SDPA masks that are the causal triangle computed from constants become
is_causal=True (forward and backward, inference and training); other masks stay."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fusegraph as fg
from conftest import assert_close, rand


class MaskedAttention(nn.Module):
    """q/k/v projections and SDPA with a mask built inside forward from aranges, as HF models do."""

    def __init__(self, mask_kind: str) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.mask_kind = mask_kind

    def mask(self, x: torch.Tensor, pad: torch.Tensor | None) -> torch.Tensor:
        s = x.shape[1]
        i = torch.arange(s, device=x.device)
        visible = i[None, :] <= i[:, None]                         # key j visible to query i iff j <= i
        if self.mask_kind == "window":                             # sliding window: not plain causal
            visible = visible & (i[:, None] - i[None, :] < 3)
        if self.mask_kind == "shifted":                            # bottom-right aligned off by one
            visible = i[None, :] <= i[:, None] + 1
        visible = visible[None, None].expand(x.shape[0], 1, s, s)
        if pad is not None:                                        # depends on an input: stays
            visible = visible & pad[:, None, None, :]
        if self.mask_kind == "float":
            return torch.zeros(visible.shape, device=x.device).masked_fill(~visible, float("-inf"))
        if self.mask_kind == "fp16min":                            # HF under autocast: float16's min
            return torch.zeros(visible.shape, device=x.device).masked_fill(~visible, torch.finfo(torch.float16).min)
        if self.mask_kind == "bias":                               # a real additive bias
            return torch.where(visible, 0.5, float("-inf"))
        if self.mask_kind == "soft":                               # a large but finite penalty: a bias
            return torch.zeros(visible.shape, device=x.device).masked_fill(~visible, -100.0)
        return visible

    def forward(self, x: torch.Tensor, pad: torch.Tensor | None = None) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 2, 8).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask(x, pad))
        return out.transpose(1, 2).reshape(b, s, 16)


def _attention_attrs(compiled: Any) -> list[dict[str, Any]]:
    out = []
    for graph in compiled.fusegraph_report.graphs:
        for part in graph.partitions:
            for k in part.plan.kernels if part.plan is not None else []:
                if k.kind == "attention":
                    out.append({"graph": graph.kind, **dict(k.nodes[0].attrs)})
    return out


def _train_and_check(kind: str, pad: torch.Tensor | None = None) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    model = MaskedAttention(kind)
    x = rand(2, 6, 16)
    compiled = fg.compile(model)
    out = compiled(x, pad)
    proj = rand(*out.shape)
    (out * proj).sum().backward()
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    ref = model(x, pad)
    (ref * proj).sum().backward()
    assert_close(out, ref, what="forward")
    for g, p in zip(got, model.parameters(), strict=True):
        assert_close(g, p.grad, tol=1e-4, what="grad")
    return _attention_attrs(compiled)


@pytest.mark.parametrize("kind", ["bool", "float", "fp16min"])
def test_constant_causal_mask_becomes_is_causal_in_forward_and_backward(kind: str):
    torch._dynamo.reset()
    attrs = _train_and_check(kind)
    assert {a["graph"] for a in attrs} == {"forward", "backward"}
    assert all(a["is_causal"] and not a["has_mask"] for a in attrs), attrs


@pytest.mark.parametrize("kind", ["window", "shifted", "bias", "soft"])
def test_other_constant_masks_stay_masks(kind: str):
    torch._dynamo.reset()
    attrs = _train_and_check(kind)
    assert attrs and all(a["has_mask"] and not a["is_causal"] for a in attrs), attrs


def test_mask_that_depends_on_an_input_stays():
    torch._dynamo.reset()
    pad = torch.ones(2, 6, dtype=torch.bool)
    pad[1, 4:] = False
    attrs = _train_and_check("bool", pad)
    assert attrs and all(a["has_mask"] for a in attrs), attrs


def test_inference_graph_is_rewritten_too():
    torch._dynamo.reset()
    model = MaskedAttention("bool").eval()
    x = rand(2, 6, 16)
    compiled = fg.compile(model)
    with torch.no_grad():
        assert_close(compiled(x), model(x), what="inference")
    attrs = _attention_attrs(compiled)
    assert [a["graph"] for a in attrs] == ["inference"] and attrs[0]["is_causal"] and not attrs[0]["has_mask"]
