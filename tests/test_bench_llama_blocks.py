"""bench/llama_blocks.py on CPU: the Graph API Llama block matches the nn.Module, and the decode module
(static KV cache, index_copy_) reproduces the prefill block token by token."""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))

from llama_blocks import LlamaBlock, LlamaDecodeBlock, LlamaSize, llama_prefill_graph, rope_tables

from conftest import rel_err

SIZE = LlamaSize(batch=2, seq=8, dim=32, heads=4, kv_heads=2, ffn=48)


def test_graph_block_matches_module() -> None:
    torch.manual_seed(0)
    block = LlamaBlock(SIZE)
    g, params = llama_prefill_graph(block, SIZE, torch.float32, "cpu")
    plan = g.build(device="cpu")
    x = torch.randn(SIZE.batch, SIZE.seq, SIZE.dim)
    cos, sin = rope_tables(SIZE.seq, SIZE.head_dim, torch.float32, "cpu")
    with torch.no_grad():
        want = block(x, cos, sin)
    assert rel_err(plan(x, cos, sin, *params), want) < 1e-5
    flipped = block.attention_norm.weight.detach().flip(0)  # the norm weight is used, not dropped
    params_flipped = [flipped if p is params[0] else p for p in params]
    assert rel_err(plan(x, cos, sin, *params_flipped), want) > 1e-3


def test_decode_steps_reproduce_prefill() -> None:
    torch.manual_seed(1)
    size = LlamaSize(batch=1, seq=SIZE.seq, dim=SIZE.dim, heads=SIZE.heads, kv_heads=SIZE.kv_heads, ffn=SIZE.ffn)
    decode = LlamaDecodeBlock(size)
    prefill = LlamaBlock(size)
    prefill.load_state_dict(decode.state_dict(), strict=False)
    x = torch.randn(1, size.seq, size.dim)
    cos, sin = rope_tables(size.seq, size.head_dim, torch.float32, "cpu")
    with torch.no_grad():
        want = prefill(x, cos, sin)
        steps = [decode(x[:, i:i + 1], torch.tensor([i])) for i in range(size.seq)]
    assert rel_err(torch.cat(steps, dim=1), want) < 1e-5
    assert decode.k_cache.abs().amin(dim=-1).gt(0).all()  # every cache position was written
