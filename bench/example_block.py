"""An example target for `fusegraph explain` / `fusegraph whatif`: a transformer-style block
(residual add + layernorm, then a linear layer with a GELU epilogue), bf16.

    fusegraph explain bench/example_block.py --html report.html --png roofline.png
    fusegraph whatif bench/example_block.py --device B200

The convention: define build() returning (plan, inputs); inputs may be None (random inputs on a GPU).
"""

from __future__ import annotations

import torch

import fusegraph as fg

TOKENS, MODEL, HIDDEN = 8192, 4096, 16384


def build() -> tuple[object, list[torch.Tensor]]:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    t, d, h = (TOKENS, MODEL, HIDDEN) if device == "cuda" else (64, 128, 256)
    g = fg.Graph(name="example_block", compute_dtype="float32")
    x = g.tensor((t, d), "bfloat16", name="x")
    r = g.tensor((t, d), "bfloat16", name="residual")
    w_ln = g.tensor((d,), "bfloat16", name="ln_weight")
    b_ln = g.tensor((d,), "bfloat16", name="ln_bias")
    w = g.tensor((d, h), "bfloat16", name="w_up")
    b = g.tensor((h,), "bfloat16", name="b_up")
    hidden = g.add(x, r)
    normed = g.layernorm(hidden, weight=w_ln, bias=b_ln)
    up = g.gelu(g.add(g.matmul(normed, w), b), approximate="tanh")
    hidden.set_output()
    up.set_output()
    inputs = [torch.randn(t, d, device=device).to(torch.bfloat16), torch.randn(t, d, device=device).to(torch.bfloat16),
              torch.randn(d, device=device).to(torch.bfloat16), torch.randn(d, device=device).to(torch.bfloat16),
              (torch.randn(d, h, device=device) * d ** -0.5).to(torch.bfloat16),
              torch.randn(h, device=device).to(torch.bfloat16)]
    return g.build(device=device), inputs
