"""cuDNN (and torch's other fused attention kernels) through torch: scaled dot-product attention
with a chosen torch.nn.attention backend, convolution with cuDNN in the layout the layout pass
picked. Each function is one candidate implementation of a Kernel."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F

SDPA_BACKENDS = ("cudnn", "flash", "efficient")


@contextmanager
def sdpa_backend(name: str) -> Iterator[None]:
    """Restrict torch's SDPA to one backend ("cudnn", "flash", "efficient", "math")."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
               "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[name]
    with sdpa_kernel([backend]):
        yield


def torch_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool,
               scale: float, backend: str) -> torch.Tensor:
    """F.scaled_dot_product_attention on one backend (raises RuntimeError where it does not apply)."""
    gqa = q.shape[1] != k.shape[1]
    with sdpa_backend(backend):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                              enable_gqa=gqa)


def torch_sdpa_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        mask: torch.Tensor | None, causal: bool, scale: float,
                        backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) through the backend's own backward (it recomputes the forward first)."""
    with torch.enable_grad():
        qg, kg, vg = (t.detach().requires_grad_(True) for t in (q, k, v))
        out = torch_sdpa(qg, kg, vg, mask, causal, scale, backend)
        dq, dk, dv = torch.autograd.grad(out, (qg, kg, vg), grad_out)
    return dq, dk, dv


def conv2d_channels_last(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, attrs: Any) -> torch.Tensor:
    """torch.conv2d (cuDNN on CUDA) with NHWC operands and an NHWC result."""
    x = x.contiguous(memory_format=torch.channels_last)
    w = w.contiguous(memory_format=torch.channels_last)
    return F.conv2d(x, w, bias, stride=attrs.get("stride", 1), padding=attrs.get("padding", 0),
                    dilation=attrs.get("dilation", 1), groups=attrs.get("groups", 1))
