"""cuDNN (and torch's other fused attention kernels) through torch: scaled dot-product attention
with a chosen torch.nn.attention backend, convolution with cuDNN in the layout the layout pass
picked. Each function is one candidate implementation of a Kernel."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F

from ..ir.registry import get_op

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


def conv2d_input_grad(attrs: Any, grad_hw: Sequence[int], kernel_hw: Sequence[int],
                      channels_last: bool) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """(grad_out, weight) -> the data gradient of conv2d (cuDNN's dgrad) in the operands' dtype: the
    transposed convolution of grad_out with the weight, its output padding chosen (once, here) to
    give back the forward's input shape. Its result takes grad_out's memory format (channels-last
    in, channels-last out; aten.convolution_backward would take it from the forward's input, which
    here is only a shape, and return a 1x1 convolution's gradient row-major, to be copied back)."""
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    stride, padding, dilation, groups = get_op("conv2d").extra["params"](attrs)
    in_hw = attrs["input_shape"][2:]
    output_padding = [in_hw[i] - ((grad_hw[i] - 1) * stride[i] - 2 * padding[i] + dilation[i] * (kernel_hw[i] - 1) + 1)
                      for i in range(2)]

    def run(grad_out: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.conv_transpose2d(grad_out.contiguous(memory_format=fmt), w.contiguous(memory_format=fmt), None,
                                  stride, padding, output_padding, groups, dilation)
    return run


def conv2d_weight_grad(attrs: Any, channels_last: bool) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """(x, grad_out) -> the weight gradient of conv2d (cuDNN's wgrad) in the operands' dtype (fp32
    accumulation inside); the weight is only a shape (an expanded scalar: nothing read or allocated)."""
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    stride, padding, dilation, groups = get_op("conv2d").extra["params"](attrs)
    pairs = [list(stride), list(padding), list(dilation)]
    weight_shape = tuple(attrs["weight_shape"])
    shapes: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}   # the weight's stand-in, made once

    def run(x: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
        w = shapes.get((x.device, x.dtype))
        if w is None:
            w = shapes[(x.device, x.dtype)] = x.new_empty(1).expand(weight_shape)
        grads = torch.ops.aten.convolution_backward(grad_out.contiguous(memory_format=fmt),
                                                    x.contiguous(memory_format=fmt), w, None, *pairs, False, [0, 0],
                                                    groups, [False, True, False])
        return grads[1]
    return run


class SdpaBackwardWithLse:
    """(dq, dk, dv) from the forward's own output and log-sum-exp through torch's cuDNN or flash
    backward kernel directly, without recomputing the forward (torch_sdpa_backward does). Our lse
    ([B, H, Sq] fp32, natural log) is what those kernels keep; the auxiliary values they also take
    (RNG seed/offset, sequence bookkeeping, the lse's own layout) come from one forward run on
    example tensors at build time. Raises RuntimeError (at build) where the backend does not apply."""

    def __init__(self, backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                 scale: float) -> None:
        if backend not in ("cudnn", "flash"):
            raise RuntimeError(f"no direct backward for SDPA backend {backend!r}")
        self.backend, self.causal, self.scale = backend, causal, scale
        aten = torch.ops.aten
        if backend == "cudnn":
            res = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)
            self.lse_shape = tuple(res[1].shape)
            self.aux = (res[6], res[7], res[2], res[3], res[4], res[5])  # seed, offset, cum_q, cum_k, max_q, max_k
        else:
            res = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
            self.lse_shape = tuple(res[1].shape)
            self.aux = (res[2], res[3], res[4], res[5], res[6], res[7])  # cum_q, cum_k, max_q, max_k, seed, offset

    def __call__(self, grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        aten = torch.ops.aten
        lse = lse.reshape(self.lse_shape)
        if self.backend == "cudnn":
            seed, offset, cum_q, cum_k, max_q, max_k = self.aux
            grads = aten._scaled_dot_product_cudnn_attention_backward(
                grad_out, q, k, v, out, lse, seed, offset, None, cum_q, cum_k, max_q, max_k, 0.0, self.causal,
                scale=self.scale)
        else:
            cum_q, cum_k, max_q, max_k, seed, offset = self.aux
            grads = aten._scaled_dot_product_flash_attention_backward(
                grad_out.contiguous(), q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, self.causal, seed, offset,
                scale=self.scale)
        return grads[0], grads[1], grads[2]
