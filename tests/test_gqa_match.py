"""passes/attention_match.gqa_match: k/v repeated per query group (repeat_kv / repeat_interleave)
feed attention as their kv heads (enable_gqa), with no [B, H, S, D] copies."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fusegraph as fg
from conftest import assert_close, rand

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from llama_blocks import LlamaDecodeBlock, LlamaSize, repeat_kv


class GQAAttention(nn.Module):
    """Causal GQA attention; bool_mask: the causal mask as a boolean tensor built from aranges (what a
    traced Hugging Face model passes) instead of is_causal."""

    def __init__(self, repeat: str, d: int = 32, heads: int = 4, kv_heads: int = 2, bool_mask: bool = False) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.hd, self.repeat = heads, kv_heads, d // heads, repeat
        self.bool_mask = bool_mask
        self.q, self.kv = nn.Linear(d, d), nn.Linear(d, 2 * kv_heads * (d // heads))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q = self.q(x).view(b, s, self.heads, self.hd).transpose(1, 2)
        k, v = self.kv(x).view(b, s, 2, self.kv_heads, self.hd).permute(2, 0, 3, 1, 4)
        groups = self.heads // self.kv_heads
        if self.repeat == "repeat_kv":
            k, v = repeat_kv(k, groups), repeat_kv(v, groups)
        else:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        if self.bool_mask:
            idx = torch.arange(s, device=x.device)
            causal = (idx[None, :] <= idx[:, None])[None, None].expand(b, 1, s, s)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=causal)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return out.transpose(1, 2).reshape(b, s, d)


def _attention_nodes(compiled: torch.nn.Module) -> list[tuple[str, dict, tuple]]:
    out = []
    for graph in compiled.fusegraph_report.graphs:
        for part in graph.partitions:
            for k in part.plan.kernels:
                if k.kind == "attention":
                    node = k.nodes[0]
                    out.append((graph.kind, dict(node.attrs), tuple(node.inputs[1].shape)))
    return out


@pytest.mark.parametrize("repeat", ["repeat_kv", "repeat_interleave"])
def test_repeated_kv_heads_feed_attention_directly_training(repeat: str):
    torch.manual_seed(0)
    model = GQAAttention(repeat)
    x = rand(2, 8, 32)
    torch._dynamo.reset()
    compiled = fg.compile(model)
    out = compiled(x)
    proj = rand(*out.shape)
    (out * proj).sum().backward()
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    ref = model(x)
    (ref * proj).sum().backward()
    assert_close(out, ref, what="forward")
    for g, p in zip(got, model.parameters(), strict=True):
        assert_close(g, p.grad, tol=1e-4, what="grad")
    forward = [a for a in _attention_nodes(compiled) if a[0] == "forward"]
    assert forward and all(attrs["enable_gqa"] and k_shape[1] == 2 for _, attrs, k_shape in forward), forward


def test_decode_step_reads_the_kv_cache_heads_without_copies():
    size = LlamaSize(batch=1, seq=32, dim=64, heads=4, kv_heads=2, ffn=128)
    torch.manual_seed(0)
    block = LlamaDecodeBlock(size)
    with torch.no_grad():
        block.k_cache.normal_()
        block.v_cache.normal_()
    ref_block = copy.deepcopy(block)
    x, pos = rand(1, 1, 64), torch.tensor([20])
    torch._dynamo.reset()
    compiled = fg.compile(block)
    with torch.no_grad():
        got, want = compiled(x, pos), ref_block(x, pos)
    assert_close(got, want, tol=1e-4)
    assert_close(block.k_cache, ref_block.k_cache, tol=1e-5, what="k cache (updated in place)")
    (kind, attrs, k_shape), = _attention_nodes(compiled)
    assert kind == "inference"
    assert attrs["enable_gqa"] and k_shape == (1, 2, 32, 16)
    kernels = [k for g in compiled.fusegraph_report.graphs for p in g.partitions for k in p.kernel_ops]
    assert not [k for k in kernels if k.endswith(": reshape")], kernels   # no repeated-cache copies
