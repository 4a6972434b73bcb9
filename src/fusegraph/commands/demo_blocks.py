"""The demo's built-in blocks: each is built through the Graph API and, beside it, written in eager
PyTorch (torch.nn.functional) on the same tensors, so the two can be compared."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import fusegraph as fg
from fusegraph.ir.emit import USER_CODE_FILES

USER_CODE_FILES.add(os.path.abspath(__file__))  # node sources point at the lines below, as for user code

# Graph API methods the demo's blocks use; a build that lacks one cannot run the demo.
TRANSFORMER_OPS = ("layernorm", "rmsnorm", "linear", "reshape", "transpose", "scaled_dot_product_attention",
                   "gelu", "add")
CONV_OPS = ("conv2d", "batch_norm", "relu")


@dataclass(frozen=True)
class TransformerSize:
    batch: int
    seq: int
    dim: int
    heads: int
    ffn: int

    def __str__(self) -> str:
        return f"batch {self.batch}, seq {self.seq}, dim {self.dim}, {self.heads} heads, ffn {self.ffn}"


@dataclass(frozen=True)
class ConvSize:
    batch: int
    channels: int
    height: int
    width: int
    filters: int
    kernel: int

    def __str__(self) -> str:
        return (f"batch {self.batch}, {self.channels}->{self.filters} channels, {self.height}x{self.width}, "
                f"{self.kernel}x{self.kernel} filter")


SIZES: dict[str, tuple[TransformerSize, ConvSize]] = {
    "small": (TransformerSize(batch=2, seq=16, dim=64, heads=4, ffn=256),
              ConvSize(batch=2, channels=8, height=12, width=12, filters=16, kernel=3)),
    "medium": (TransformerSize(batch=4, seq=1024, dim=1024, heads=16, ffn=4096),
               ConvSize(batch=32, channels=64, height=56, width=56, filters=64, kernel=3)),
}


@dataclass
class DemoBlock:
    """A graph, its feeds (in declaration order), its output handle, and the same block in eager PyTorch."""

    name: str
    description: str
    graph: fg.Graph
    feeds: dict[fg.Tensor, torch.Tensor]
    output: fg.Tensor
    eager: Callable[[dict[str, torch.Tensor]], torch.Tensor]   # named tensors -> output

    @property
    def named_tensors(self) -> dict[str, torch.Tensor]:
        return {handle.name: t for handle, t in self.feeds.items()}

    def eager_in(self, dtype: torch.dtype) -> torch.Tensor:
        """The eager block on this block's tensors cast to `dtype` (float32 gives the accurate answer)."""
        # .to() keeps each tensor's memory format, so an NHWC block stays NHWC in eager too.
        return self.eager({k: (v.to(dtype) if v.is_floating_point() else v) for k, v in self.named_tensors.items()})


class _Weights:
    """Fresh random tensors from one seeded generator, scaled so activations stay near unit size."""

    def __init__(self, dtype: torch.dtype, device: str, seed: int) -> None:
        self.dtype, self.device = dtype, device
        self.gen = torch.Generator().manual_seed(seed)

    def normal(self, *shape: int, std: float = 1.0, mean: float = 0.0) -> torch.Tensor:
        t = torch.randn(*shape, generator=self.gen) * std + mean
        return t.to(dtype=self.dtype, device=self.device)

    def positive(self, *shape: int, low: float = 0.5) -> torch.Tensor:
        t = torch.rand(*shape, generator=self.gen) + low
        return t.to(dtype=self.dtype, device=self.device)


def transformer_block(size: TransformerSize, dtype: torch.dtype, device: str, seed: int = 0,
                      second_norm: str = "layernorm", gelu_approximate: str = "none",
                      static_weights: bool = True) -> DemoBlock:
    """Pre-norm transformer block: x + O(attn(LN(x))), then + MLP(norm(.)) with gelu. The weights are
    static inputs (read in place by a CUDA graph, not copied per call) unless static_weights=False."""
    B, S, D, H, Fd = size.batch, size.seq, size.dim, size.heads, size.ffn
    if D % H:
        raise ValueError(f"dim {D} is not a multiple of heads {H}")
    Dh = D // H
    w = _Weights(dtype, device, seed)
    tensors = {
        "x": w.normal(B, S, D),
        "ln1_w": w.normal(D, std=0.1, mean=1.0), "ln1_b": w.normal(D, std=0.1),
        "wq": w.normal(D, D, std=D ** -0.5), "bq": w.normal(D, std=0.02),
        "wk": w.normal(D, D, std=D ** -0.5), "bk": w.normal(D, std=0.02),
        "wv": w.normal(D, D, std=D ** -0.5), "bv": w.normal(D, std=0.02),
        "wo": w.normal(D, D, std=D ** -0.5), "bo": w.normal(D, std=0.02),
        "ln2_w": w.normal(D, std=0.1, mean=1.0),
        "w1": w.normal(Fd, D, std=D ** -0.5), "b1": w.normal(Fd, std=0.02),
        "w2": w.normal(D, Fd, std=Fd ** -0.5), "b2": w.normal(D, std=0.02),
    }
    if second_norm == "layernorm":
        tensors["ln2_b"] = w.normal(D, std=0.1)

    g = fg.Graph(name="transformer_block", compute_dtype="float32")
    h = {name: g.tensor_like(t, name=name, static=static_weights and name != "x") for name, t in tensors.items()}

    def heads(t: fg.Tensor) -> fg.Tensor:                   # (B, S, D) -> (B, H, S, Dh)
        return g.transpose(g.reshape(t, (B, S, H, Dh)), 1, 2)

    a = g.layernorm(h["x"], weight=h["ln1_w"], bias=h["ln1_b"], eps=1e-5)
    q = heads(g.linear(a, h["wq"], h["bq"]))
    k = heads(g.linear(a, h["wk"], h["bk"]))
    v = heads(g.linear(a, h["wv"], h["bv"]))
    attn = g.scaled_dot_product_attention(q, k, v, is_causal=True)
    attn = g.reshape(g.transpose(attn, 1, 2), (B, S, D))
    x1 = g.add(h["x"], g.linear(attn, h["wo"], h["bo"]))
    if second_norm == "layernorm":
        n = g.layernorm(x1, weight=h["ln2_w"], bias=h["ln2_b"], eps=1e-5)
    else:
        n = g.rmsnorm(x1, weight=h["ln2_w"], eps=1e-6)
    m = g.linear(g.gelu(g.linear(n, h["w1"], h["b1"]), approximate=gelu_approximate), h["w2"], h["b2"])
    y = g.add(x1, m)
    y.set_output()

    def eager(t: dict[str, torch.Tensor]) -> torch.Tensor:
        def split(u: torch.Tensor) -> torch.Tensor:
            return u.reshape(B, S, H, Dh).transpose(1, 2)

        a = F.layer_norm(t["x"], (D,), t["ln1_w"], t["ln1_b"], 1e-5)
        q, k, v = (split(F.linear(a, t["w" + c], t["b" + c])) for c in "qkv")
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, S, D)
        x1 = t["x"] + F.linear(attn, t["wo"], t["bo"])
        if second_norm == "layernorm":
            n = F.layer_norm(x1, (D,), t["ln2_w"], t["ln2_b"], 1e-5)
        else:
            n = F.rms_norm(x1, (D,), t["ln2_w"], 1e-6)
        hidden = F.gelu(F.linear(n, t["w1"], t["b1"]), approximate=gelu_approximate)
        return x1 + F.linear(hidden, t["w2"], t["b2"])

    return DemoBlock("transformer", f"pre-norm transformer block ({size}; causal attention, "
                     f"{second_norm}, gelu {gelu_approximate})", g,
                     {h[name]: t for name, t in tensors.items()}, y, eager)


def conv_block(size: ConvSize, dtype: torch.dtype, device: str, seed: int = 1,
               layout: str = "NHWC") -> DemoBlock:
    """conv2d (same padding) -> batchnorm with running statistics (inference) -> relu; the weights and
    statistics are static inputs."""
    N, C, Hh, Ww, K, R = size.batch, size.channels, size.height, size.width, size.filters, size.kernel
    w = _Weights(dtype, device, seed)
    tensors = {
        "x": w.normal(N, C, Hh, Ww),
        "w": w.normal(K, C, R, R, std=1.0 / math.sqrt(C * R * R)),
        "b": w.normal(K, std=0.1),
        "running_mean": w.normal(K, std=0.1),
        "running_var": w.positive(K),
        "bn_w": w.normal(K, std=0.1, mean=1.0),
        "bn_b": w.normal(K, std=0.1),
    }
    if layout == "NHWC":
        for name in ("x", "w"):
            tensors[name] = tensors[name].contiguous(memory_format=torch.channels_last)
    elif layout != "NCHW":
        raise ValueError(f"layout must be NCHW or NHWC, got {layout!r}")
    pad = R // 2

    g = fg.Graph(name="conv_block", compute_dtype="float32")
    h = {name: g.tensor_like(t, name=name, static=name != "x") for name, t in tensors.items()}
    c = g.conv2d(h["x"], h["w"], h["b"], stride=1, padding=pad)
    n = g.batch_norm(c, h["running_mean"], h["running_var"], weight=h["bn_w"], bias=h["bn_b"], training=False,
                     eps=1e-5)
    y = g.relu(n)
    y.set_output()

    def eager(t: dict[str, torch.Tensor]) -> torch.Tensor:
        c = F.conv2d(t["x"], t["w"], t["b"], stride=1, padding=pad)
        n = F.batch_norm(c, t["running_mean"], t["running_var"], t["bn_w"], t["bn_b"], training=False, eps=1e-5)
        return F.relu(n)

    return DemoBlock("conv", f"conv block ({size}, {layout}; conv2d -> batchnorm (inference) -> relu)", g,
                     {h[name]: t for name, t in tensors.items()}, y, eager)
