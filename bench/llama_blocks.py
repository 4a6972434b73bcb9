"""A Llama decoder block written twice: as a torch nn.Module (what a PyTorch user runs, eagerly or
under torch.compile) and through the fusegraph Graph API, on the same weights.

Llama-2/3 shape: pre-norm RMSNorm (fp32 statistics), Q/K/V projections without bias, rotary
embeddings (rotate-half form, as Hugging Face's Llama), causal attention with grouped-query heads,
output projection, residual, RMSNorm, SwiGLU MLP w2(silu(w1 x) * w3 x), residual.

- LlamaBlock.forward(x, cos, sin): prefill over a whole sequence (bench_compute_gpu llama_prefill).
- LlamaDecodeBlock.forward(x, input_pos): one decode step with a static KV cache updated in place
  with index_copy_ (the gpt-fast pattern; bench/targets_gpu.py llama_decode).
- llama_prefill_graph(block, size): the prefill block as an fg.Graph, weights as static inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

import fusegraph as fg


@dataclass(frozen=True)
class LlamaSize:
    batch: int
    seq: int
    dim: int
    heads: int
    kv_heads: int
    ffn: int
    eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    @property
    def params(self) -> int:
        hd = self.head_dim
        return self.dim * (2 * self.heads * hd + 2 * self.kv_heads * hd) + 3 * self.dim * self.ffn + 2 * self.dim

    def prefill_flops(self) -> int:
        """2*params*tokens for the projections + causal attention (4*B*H*S*S*D halved)."""
        tokens = self.batch * self.seq
        attention = 4 * self.batch * self.heads * self.seq * self.seq * self.head_dim // 2
        return 2 * (self.params - 2 * self.dim) * tokens + attention

    def __str__(self) -> str:
        return (f"B{self.batch} S{self.seq} d{self.dim} H{self.heads} KV{self.kv_heads} ffn{self.ffn}")


class RMSNorm(nn.Module):
    """Hugging Face's LlamaRMSNorm: statistics in fp32, the weight applied in the input dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, Hkv, S, D] -> [B, Hkv*groups, S, D], as Hugging Face's repeat_kv."""
    if groups == 1:
        return x
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, groups, s, d).reshape(b, h * groups, s, d)


def rope_tables(seq: int, head_dim: int, dtype: torch.dtype, device: str | torch.device,
                base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [seq, head_dim] (the rotate-half layout: frequencies repeated twice)."""
    inv = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv)
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos().to(dtype=dtype, device=device), emb.sin().to(dtype=dtype, device=device)


class LlamaBlock(nn.Module):
    def __init__(self, size: LlamaSize) -> None:
        super().__init__()
        d, hd = size.dim, size.head_dim
        self.size = size
        self.attention_norm, self.ffn_norm = RMSNorm(d, size.eps), RMSNorm(d, size.eps)
        self.wq = nn.Linear(d, size.heads * hd, bias=False)
        self.wk = nn.Linear(d, size.kv_heads * hd, bias=False)
        self.wv = nn.Linear(d, size.kv_heads * hd, bias=False)
        self.wo = nn.Linear(size.heads * hd, d, bias=False)
        self.w1 = nn.Linear(d, size.ffn, bias=False)  # gate
        self.w3 = nn.Linear(d, size.ffn, bias=False)  # up
        self.w2 = nn.Linear(size.ffn, d, bias=False)  # down
        with torch.no_grad():  # norm weights near 1, not exactly 1, so a dropped weight shows
            for norm in (self.attention_norm, self.ffn_norm):
                norm.weight.normal_(1.0, 0.1)

    def heads(self, t: torch.Tensor, n: int) -> torch.Tensor:
        b, s, _ = t.shape
        return t.view(b, s, n, self.size.head_dim).transpose(1, 2)

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(h)) * self.w3(h))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        size = self.size
        h = self.attention_norm(x)
        q, k = self.heads(self.wq(h), size.heads), self.heads(self.wk(h), size.kv_heads)
        v = self.heads(self.wv(h), size.kv_heads)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        groups = size.heads // size.kv_heads
        attn = F.scaled_dot_product_attention(q, repeat_kv(k, groups), repeat_kv(v, groups), is_causal=True)
        x = x + self.wo(attn.transpose(1, 2).reshape(b, s, d))
        return x + self.mlp(self.ffn_norm(x))


class LlamaDecodeBlock(LlamaBlock):
    """One decode step with a static KV cache of `size.seq` positions (gpt-fast style): the new
    token's k and v are written at input_pos with index_copy_, then attention reads the whole cache
    under a mask of the positions <= input_pos."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    rope_cos: torch.Tensor
    rope_sin: torch.Tensor
    causal: torch.Tensor

    def __init__(self, size: LlamaSize) -> None:
        super().__init__(size)
        cache = (size.batch, size.kv_heads, size.seq, size.head_dim)
        self.register_buffer("k_cache", torch.zeros(cache), persistent=False)
        self.register_buffer("v_cache", torch.zeros(cache), persistent=False)
        cos, sin = rope_tables(size.seq, size.head_dim, torch.float32, "cpu")
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.register_buffer("causal", torch.ones(size.seq, size.seq, dtype=torch.bool).tril(), persistent=False)

    def forward(self, x: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        b, s, d = x.shape
        size = self.size
        cos, sin = self.rope_cos[input_pos], self.rope_sin[input_pos]            # [s, head_dim]
        h = self.attention_norm(x)
        q, k = self.heads(self.wq(h), size.heads), self.heads(self.wk(h), size.kv_heads)
        v = self.heads(self.wv(h), size.kv_heads)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k_all = self.k_cache.index_copy_(2, input_pos, k)
        v_all = self.v_cache.index_copy_(2, input_pos, v)
        mask = self.causal[None, None, input_pos]                               # [1, 1, s, seq]
        groups = size.heads // size.kv_heads
        attn = F.scaled_dot_product_attention(q, k_all.repeat_interleave(groups, dim=1),
                                              v_all.repeat_interleave(groups, dim=1), attn_mask=mask)
        x = x + self.wo(attn.transpose(1, 2).reshape(b, s, d))
        return x + self.mlp(self.ffn_norm(x))


DECODE_SIZE = LlamaSize(batch=1, seq=2048, dim=4096, heads=32, kv_heads=8, ffn=11008)


def decode_setup(size: LlamaSize = DECODE_SIZE, device: str = "cuda"
                 ) -> tuple[LlamaDecodeBlock, torch.Tensor, torch.Tensor]:
    """The decode benchmarks' block (fp32, random weights, seed 0) with its KV cache full of random
    earlier tokens, one bf16 input token x, and pos = the cache's last slot (attention reads every
    position): what bench/targets_gpu.py, ab_gpu.py, decode_host_gpu.py and profile_targets_gpu.py time."""
    torch.manual_seed(0)
    base = LlamaDecodeBlock(size).to(device)
    with torch.no_grad():
        base.k_cache.normal_()
        base.v_cache.normal_()
    x = torch.randn(size.batch, 1, size.dim, device=device, dtype=torch.bfloat16)
    return base, x, torch.tensor([size.seq - 1], device=device)


def llama_prefill_graph(block: LlamaBlock, size: LlamaSize, dtype: torch.dtype,
                        device: str) -> tuple[fg.Graph, list[torch.Tensor]]:
    """The prefill block through the Graph API; returns the graph and its feeds after (x, cos, sin):
    the block's parameters, declared static (read in place by a captured plan)."""
    B, S, D, H, KV, hd = size.batch, size.seq, size.dim, size.heads, size.kv_heads, size.head_dim
    dt = str(dtype).replace("torch.", "")
    g = fg.Graph(name="llama_block", compute_dtype="float32")
    x = g.tensor((B, S, D), dtype=dt, name="x")
    cos, sin = g.tensor((S, hd), dtype=dt, name="cos"), g.tensor((S, hd), dtype=dt, name="sin")
    params = dict(block.named_parameters())
    w = {name: g.tensor_like(p, name=name.replace(".", "_"), static=True) for name, p in params.items()}

    def heads(t: fg.Tensor, n: int) -> fg.Tensor:            # (B, S, n*hd) -> (B, n, S, hd)
        return g.transpose(g.reshape(t, (B, S, n, hd)), 1, 2)

    def rope(t: fg.Tensor) -> fg.Tensor:
        first, second = g.slice(t, 3, 0, hd // 2), g.slice(t, 3, hd // 2, hd)
        return t * cos + g.cat([g.neg(second), first], dim=3) * sin

    a = g.rmsnorm(x, weight=w["attention_norm.weight"], eps=size.eps)
    q = rope(heads(g.linear(a, w["wq.weight"]), H))
    k = rope(heads(g.linear(a, w["wk.weight"]), KV))
    v = heads(g.linear(a, w["wv.weight"]), KV)
    attn = g.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=KV != H)
    x1 = x + g.linear(g.reshape(g.transpose(attn, 1, 2), (B, S, D)), w["wo.weight"])
    n = g.rmsnorm(x1, weight=w["ffn_norm.weight"], eps=size.eps)
    y = x1 + g.linear(g.silu(g.linear(n, w["w1.weight"])) * g.linear(n, w["w3.weight"]), w["w2.weight"])
    y.set_output()
    return g, [p.detach() for p in params.values()]
