"""2-D convolution: forward, data gradient and weight gradient (stride, padding, dilation, groups).

Shapes are logical NCHW (weights KCRS) whatever the memory layout; a TensorSpec with
layout "NHWC" is channels-last in memory and the output keeps the input's layout.
FLOPs of each of the three ops: 2 * N * K * Ho * Wo * (C / groups) * R * S."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
import torch.nn.grad

from ..errors import DTypeError, ShapeError, UnsupportedError
from ..ir import dtypes
from ..ir.node import Attrs
from ..ir.registry import MATMUL, Cost, define
from ..ir.spec import TensorSpec

Pair = tuple[int, int]


def as_pair(value: int | Sequence[int], what: str) -> Pair:
    if isinstance(value, int):
        return (value, value)
    pair = tuple(value) if isinstance(value, list | tuple) else ()
    if len(pair) != 2 or not all(isinstance(v, int) for v in pair):
        raise ShapeError(f"{what} must be an int or a pair, got {value!r}")
    return (pair[0], pair[1])


def conv_params(attrs: Attrs) -> tuple[Pair, Pair, Pair, int]:
    """(stride, padding, dilation, groups), validated."""
    stride = as_pair(attrs.get("stride", 1), "stride")
    padding = as_pair(attrs.get("padding", 0), "padding")
    dilation = as_pair(attrs.get("dilation", 1), "dilation")
    groups = int(attrs.get("groups", 1))
    if min(stride) < 1 or min(dilation) < 1 or min(padding) < 0 or groups < 1:
        raise ShapeError(f"need stride >= 1, dilation >= 1, padding >= 0, groups >= 1; got stride={stride}, "
                         f"padding={padding}, dilation={dilation}, groups={groups}")
    return stride, padding, dilation, groups


def conv_output_hw(hw: Sequence[int], rs: Sequence[int], attrs: Attrs) -> Pair:
    stride, padding, dilation, _ = conv_params(attrs)
    out = tuple((hw[i] + 2 * padding[i] - dilation[i] * (rs[i] - 1) - 1) // stride[i] + 1 for i in range(2))
    if min(out) < 1:
        raise ShapeError(f"input spatial size {tuple(hw)} with kernel {tuple(rs)}, stride {stride}, padding "
                         f"{padding}, dilation {dilation} gives an empty output {out}")
    return (out[0], out[1])


def check_conv_shapes(x: Sequence[int], w: Sequence[int], attrs: Attrs) -> tuple[int, ...]:
    """The NCHW output shape of conv2d(x, w); raises ShapeError on channel/group mismatches."""
    _, _, _, groups = conv_params(attrs)
    if len(x) != 4 or len(w) != 4:
        raise ShapeError(f"conv2d takes a 4-D input [N, C, H, W] and a 4-D weight [K, C/groups, R, S]; "
                         f"got input {tuple(x)} and weight {tuple(w)}")
    n, c, h, wd = x
    k, c_per_group, r, s = w
    if c % groups or k % groups:
        raise ShapeError(f"groups={groups} must divide input channels C={c} and output channels K={k}")
    if c_per_group != c // groups:
        raise ShapeError(f"weight {tuple(w)} has {c_per_group} input channels per group, but input {tuple(x)} "
                         f"with groups={groups} has C/groups={c // groups}")
    ho, wo = conv_output_hw((h, wd), (r, s), attrs)
    return (n, k, ho, wo)


def _check_dtypes(specs: Sequence[TensorSpec], names: Sequence[str]) -> str:
    for name, s in zip(names, specs, strict=False):
        if not dtypes.is_float(s.dtype) or s.dtype in dtypes.FP8:
            raise DTypeError(f"{name} must be float64/32/16 or bfloat16, got {s.dtype}")
    found = {s.dtype for s in specs}
    if len(found) != 1:
        listed = ", ".join(f"{n}={s.dtype}" for n, s in zip(names, specs, strict=False))
        raise DTypeError(f"conv operands must share one dtype, got {listed}")
    return specs[0].dtype


def conv_flops(out_nkhw: Sequence[int], weight: Sequence[int]) -> int:
    n, k, ho, wo = out_nkhw
    _, c_per_group, r, s = weight
    return 2 * n * k * ho * wo * c_per_group * r * s


def _conv_infer(specs: Sequence[TensorSpec], attrs: Attrs) -> TensorSpec:
    x, w = specs[0], specs[1]
    dtype = _check_dtypes(specs, ("input", "weight", "bias"))
    out = check_conv_shapes(x.shape, w.shape, attrs)
    if len(specs) == 3 and specs[2].shape != (w.shape[0],):
        raise ShapeError(f"bias has shape {specs[2].shape}, expected ({w.shape[0]},)")
    return TensorSpec(out, dtype, layout=x.layout, device=x.device)


def _acc(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


def _exact_fp32() -> Any:
    """cuDNN convolutions default to TF32 for fp32 on GPUs; the reference defines fp32 semantics."""
    cudnn = torch.backends.cudnn
    return cudnn.flags(enabled=cudnn.enabled, benchmark=cudnn.benchmark, deterministic=cudnn.deterministic,
                       allow_tf32=False)


def _torch_params(a: Any) -> dict[str, Any]:
    stride, padding, dilation, groups = conv_params(a)
    return {"stride": stride, "padding": padding, "dilation": dilation, "groups": groups}


def _conv_ref(xs: list[torch.Tensor], a: Any) -> torch.Tensor:
    bias = _acc(xs[2]) if len(xs) == 3 else None
    with _exact_fp32():
        return F.conv2d(_acc(xs[0]), _acc(xs[1]), bias, **_torch_params(a))


def _conv_cost(ins: Sequence[TensorSpec], outs: Sequence[TensorSpec], a: Attrs) -> Cost:
    bias_adds = outs[0].numel if len(ins) == 3 else 0
    return Cost(sum(s.nbytes for s in ins) + outs[0].nbytes, conv_flops(outs[0].shape, ins[1].shape) + bias_adds)


define("conv2d", _conv_infer, _conv_ref, num_inputs=(2, 3), props={MATMUL}, cost_fn=_conv_cost,
       extra={"kernel_kind": "conv", "params": conv_params},
       doc="F.conv2d(x, weight, bias, stride, padding, dilation, groups) on logical NCHW; output keeps x's "
           "layout. FLOPs 2*N*K*Ho*Wo*C/groups*R*S (+ N*K*Ho*Wo with a bias).")


def _shape_attr(attrs: Attrs, key: str) -> tuple[int, ...]:
    shape = tuple(int(v) for v in attrs[key])
    if len(shape) != 4 or min(shape) < 1:
        raise ShapeError(f"{key} must be 4 positive sizes, got {shape}")
    return shape


def _conv_bwd_input_infer(specs: Sequence[TensorSpec], attrs: Attrs) -> TensorSpec:
    grad_out, w = specs
    dtype = _check_dtypes(specs, ("grad_out", "weight"))
    x_shape = _shape_attr(attrs, "input_shape")
    expected = check_conv_shapes(x_shape, w.shape, attrs)
    if grad_out.shape != expected:
        raise ShapeError(f"grad_out has shape {grad_out.shape}, but conv2d of input_shape {x_shape} with weight "
                         f"{w.shape} produces {expected}")
    return TensorSpec(x_shape, dtype, layout=grad_out.layout, device=grad_out.device)


def _conv_bwd_weight_infer(specs: Sequence[TensorSpec], attrs: Attrs) -> TensorSpec:
    x, grad_out = specs
    dtype = _check_dtypes(specs, ("input", "grad_out"))
    w_shape = _shape_attr(attrs, "weight_shape")
    expected = check_conv_shapes(x.shape, w_shape, attrs)
    if grad_out.shape != expected:
        raise ShapeError(f"grad_out has shape {grad_out.shape}, but conv2d of input {x.shape} with weight_shape "
                         f"{w_shape} produces {expected}")
    return TensorSpec(w_shape, dtype, device=x.device)


def _conv_bwd_input_ref(xs: list[torch.Tensor], a: Any) -> torch.Tensor:
    with _exact_fp32():
        return torch.nn.grad.conv2d_input(list(a["input_shape"]), _acc(xs[1]), _acc(xs[0]), **_torch_params(a))


def _conv_bwd_weight_ref(xs: list[torch.Tensor], a: Any) -> torch.Tensor:
    with _exact_fp32():
        return torch.nn.grad.conv2d_weight(_acc(xs[0]), list(a["weight_shape"]), _acc(xs[1]), **_torch_params(a))


def _conv_bwd_input_cost(ins: Sequence[TensorSpec], outs: Sequence[TensorSpec], a: Attrs) -> Cost:
    return Cost(sum(s.nbytes for s in ins) + outs[0].nbytes, conv_flops(ins[0].shape, ins[1].shape))


def _conv_bwd_weight_cost(ins: Sequence[TensorSpec], outs: Sequence[TensorSpec], a: Attrs) -> Cost:
    return Cost(sum(s.nbytes for s in ins) + outs[0].nbytes, conv_flops(ins[1].shape, outs[0].shape))


define("conv2d_backward_input", _conv_bwd_input_infer, _conv_bwd_input_ref, num_inputs=(2, 2), props={MATMUL},
       cost_fn=_conv_bwd_input_cost, extra={"kernel_kind": "conv", "params": conv_params},
       doc="Gradient of conv2d w.r.t. its input (torch.nn.grad.conv2d_input): inputs grad_out, weight; attrs "
           "input_shape and the forward's stride/padding/dilation/groups. Output keeps grad_out's layout.")
define("conv2d_backward_weight", _conv_bwd_weight_infer, _conv_bwd_weight_ref, num_inputs=(2, 2),
       props={MATMUL}, cost_fn=_conv_bwd_weight_cost, extra={"kernel_kind": "conv", "params": conv_params},
       doc="Gradient of conv2d w.r.t. its weight (torch.nn.grad.conv2d_weight): inputs x, grad_out; attrs "
           "weight_shape and the forward's stride/padding/dilation/groups.")


def _canon(value: Any) -> Any:
    """An int becomes a pair; anything else is left for the shape rule to validate (and name)."""
    if isinstance(value, int):
        return (value, value)
    return tuple(value) if isinstance(value, list | tuple) else value


def _resolve_padding(padding: Any, weight: Any, dilation: Any, stride: Any) -> Any:
    """F.conv2d's padding='valid' / 'same' as explicit pairs (symmetric 'same' only)."""
    if not isinstance(padding, str):
        return _canon(padding)
    if padding == "valid":
        return (0, 0)
    if padding != "same":
        raise ShapeError(f"conv2d: padding must be an int, a pair, 'valid' or 'same'; got {padding!r}")
    if _canon(stride) != (1, 1):
        raise ShapeError(f"conv2d: padding='same' needs stride 1 (as in torch), got stride={stride}")
    dil = _canon(dilation)
    total = [dil[i] * (weight.shape[2 + i] - 1) for i in range(2)]
    if any(t % 2 for t in total):
        raise UnsupportedError(f"conv2d: padding='same' with kernel {tuple(weight.shape[2:])} and dilation {dil} "
                               "needs asymmetric padding; pad explicitly with g.pad first")
    return (total[0] // 2, total[1] // 2)


class ConvMethods:
    """Graph-builder methods for convolutions (mixed into fusegraph.Graph)."""

    def _apply(self, op: str, *operands: Any, name: str | None = None, **attrs: Any) -> Any:
        raise NotImplementedError

    def conv2d(self, input: Any, weight: Any, bias: Any = None, stride: Any = 1, padding: Any = 0,
               dilation: Any = 1, groups: int = 1, name: str | None = None) -> Any:
        """F.conv2d on logical NCHW tensors (declare channels-last inputs with layout='NHWC')."""
        args = (input, weight) if bias is None else (input, weight, bias)
        return self._apply("conv2d", *args, stride=_canon(stride),
                           padding=_resolve_padding(padding, weight, dilation, stride),
                           dilation=_canon(dilation), groups=int(groups), name=name)

    def conv2d_backward_input(self, grad_out: Any, weight: Any, input_shape: Sequence[int], stride: Any = 1,
                              padding: Any = 0, dilation: Any = 1, groups: int = 1,
                              name: str | None = None) -> Any:
        """torch.nn.grad.conv2d_input(input_shape, weight, grad_out, ...)."""
        return self._apply("conv2d_backward_input", grad_out, weight, input_shape=tuple(input_shape),
                           stride=_canon(stride), padding=_canon(padding),
                           dilation=_canon(dilation), groups=int(groups), name=name)

    def conv2d_backward_weight(self, input: Any, grad_out: Any, weight_shape: Sequence[int], stride: Any = 1,
                               padding: Any = 0, dilation: Any = 1, groups: int = 1,
                               name: str | None = None) -> Any:
        """torch.nn.grad.conv2d_weight(input, weight_shape, grad_out, ...)."""
        return self._apply("conv2d_backward_weight", input, grad_out, weight_shape=tuple(weight_shape),
                           stride=_canon(stride), padding=_canon(padding),
                           dilation=_canon(dilation), groups=int(groups), name=name)
