"""Attention in the torch backend: layouts of library attention outputs inside a Plan, and the
training-time ATen attention ops (memory-efficient, cuDNN, forward and backward) translated onto
our scaled_dot_product_attention(return_lse=True) / sdpa_backward."""

from __future__ import annotations

import torch

import fusegraph as fg
from conftest import assert_close
from fusegraph.backends import attention_kernel

F16 = torch.float16


def test_attention_output_laid_out_like_torch_sdpa_is_read_correctly(monkeypatch):
    # torch's SDPA backends return out [B, H, S, D] laid out as [B, S, H, D]; the generated kernel
    # after it reads with the spec's (dense) strides, so the kernel must hand over dense memory
    def transposed_layout(node, problem, config):
        def launch(args):
            out = torch.nn.functional.scaled_dot_product_attention(
                args[0].float(), args[1].float(), args[2].float(), is_causal=problem.causal).to(args[0].dtype)
            return [out.transpose(1, 2).contiguous().transpose(1, 2)]
        return launch

    monkeypatch.setattr(attention_kernel, "_triton_forward", transposed_layout)
    g = fg.Graph(name="sdpa_then_reshape", compute_dtype="float32")
    q, k, v = (g.tensor((2, 2, 16, 16), dtype="float16", name=n) for n in "qkv")
    att = g.scaled_dot_product_attention(q, k, v, is_causal=True)
    y = g.mul(g.reshape(g.transpose(att, 1, 2), (2, 16, 32)), 2.0)
    y.set_output()
    plan = g.build(device="cpu")
    assert any(kern.kind == "attention" and kern.backend == "triton" for kern in plan.kernels)
    xs = [torch.randn(2, 2, 16, 16, dtype=F16) for _ in range(3)]
    assert_close(plan(*xs), fg.reference(g)(*xs), what="sdpa -> transpose -> reshape")
