"""The Kernel of a ConvGroup: the convolution through torch (cuDNN on CUDA; channels-last when
the layout pass chose NHWC), then the claimed epilogue (bias, batchnorm affine, activation,
residual) as our generated pointwise kernel reading the convolution's result once. Off the GPU
the convolution runs with the reference (exact fp32), the epilogue under the Triton interpreter."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from ..fusion.epilogue import ConvGroup
from ..ir.node import Node
from ..ir.registry import Cost, get_op
from ..reference import run_node
from ..runtime.kernel import Kernel
from ..settings import settings
from . import cudnn


def conv_group_cost(group: ConvGroup) -> Cost:
    nbytes = sum(n.spec.nbytes for n in group.inputs) + sum(n.spec.nbytes for n in group.outputs)
    flops = sum(get_op(n.op).cost([i.spec for i in n.inputs], list(n.specs), n.attrs).flops for n in group.nodes)
    return Cost(nbytes, flops)


def conv_launch(node: Node, compute_dtype: str, device: str) -> Any:
    """Tensors -> the convolution's result in the node's memory layout."""
    dense = node.spec.memory_strides
    channels_last = node.op == "conv2d" and node.spec.layout == "NHWC"
    native = device.startswith("cuda") and node.op == "conv2d" and node.dtype in ("float16", "bfloat16")

    def launch(args: Sequence[torch.Tensor]) -> torch.Tensor:
        if native:  # cuDNN in the operands' dtype (fp32 accumulation inside)
            x, w = args[0], args[1]
            bias = args[2] if len(args) == 3 else None
            attrs = node.attrs
            if channels_last:
                out = cudnn.conv2d_channels_last(x, w, bias, attrs)
            else:
                out = F.conv2d(x, w, bias, stride=attrs.get("stride", 1), padding=attrs.get("padding", 0),
                               dilation=attrs.get("dilation", 1), groups=attrs.get("groups", 1))
        else:
            out = run_node(node, list(args), compute_dtype, args[0].device)
        if out.stride() != dense and out.numel() > 1:
            out = torch.empty_strided(out.shape, dense, dtype=out.dtype, device=out.device).copy_(out)
        return out

    return launch


def conv_group_kernel(group: ConvGroup, name: str, compute_dtype: str, device: str,
                      options: dict[str, Any]) -> Kernel:
    from ..lower import fused_kernel  # lower imports this module

    start = time.perf_counter()
    node = group.compute
    conv = conv_launch(node, compute_dtype, device)
    n_conv = len(node.inputs)
    positions = {n.id: k for k, n in enumerate(group.inputs)}
    conv_args = [positions[i.id] for i in node.inputs]
    epilogue = None
    if group.epilogue_nodes:
        epilogue = fused_kernel(group.epilogue, f"{name}_epilogue", compute_dtype, device, options)
    epi_args = [None if n.id == node.id else positions[n.id] for n in group.epilogue.inputs]

    def launch(args: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        product = conv([args[k] for k in conv_args])
        if epilogue is None:
            return [product]
        return list(epilogue.launch([product if k is None else args[k] for k in epi_args]))

    layout = "NHWC (channels-last)" if node.spec.layout == "NHWC" else "NCHW"
    ops = "+".join(n.op for n in group.epilogue_nodes) or "none"
    source = f"# {node.op} via torch/cuDNN, {layout}, {n_conv} operands; epilogue: {ops}"
    if epilogue is not None:
        source += f"\n# ---- epilogue kernel ({epilogue.backend}) ----\n{epilogue.source}"
    note = "convolution then our generated epilogue kernel" if epilogue is not None else ""
    kernel = Kernel(name=name, kind="convolution", backend="cudnn" if device.startswith("cuda") else "reference",
                    nodes=tuple(group.nodes), inputs=tuple(group.inputs), outputs=tuple(group.outputs),
                    cost=conv_group_cost(group), launch=launch, source=source, note=note)
    fused = cudnn_fused_relu(group, device)
    kernel.tuning = {"source": "default", "seconds": 0.0, "candidates": 1 if fused is None else 2}
    if fused is not None and _fused_wins(kernel, group, launch, fused, device):
        kernel.launch = fused
        kernel.source = f"# torch.cudnn_convolution_relu: {node.op} + bias + relu in one cuDNN call, {layout}"
        kernel.note = "cuDNN fused conv+bias+relu was faster"
        kernel.config = {"candidate": "cudnn_convolution_relu"}
    kernel.tuning["build_s"] = round(time.perf_counter() - start, 4)
    return kernel


def cudnn_fused_relu(group: ConvGroup, device: str) -> Any:
    """conv2d (+ bias) + relu as one cuDNN call (torch.cudnn_convolution_relu), when the epilogue
    is exactly a relu of the convolution; else None."""
    node = group.compute
    epilogue = group.epilogue_nodes
    if not device.startswith("cuda") or node.op != "conv2d" or [n.op for n in epilogue] != ["relu"] \
            or not hasattr(torch, "cudnn_convolution_relu") or len(group.outputs) != 1:
        return None
    stride, padding, dilation, groups = get_op(node.op).extra["params"](node.attrs)
    channels_last = node.spec.layout == "NHWC"
    dense = group.outputs[0].spec.memory_strides
    positions = {n.id: k for k, n in enumerate(group.inputs)}
    args_at = [positions[i.id] for i in node.inputs]

    def launch(args: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        x, w = args[args_at[0]], args[args_at[1]]
        bias = args[args_at[2]] if len(args_at) == 3 else None
        if channels_last:
            x, w = x.contiguous(memory_format=torch.channels_last), w.contiguous(memory_format=torch.channels_last)
        out = torch.cudnn_convolution_relu(x, w, bias, stride, padding, dilation, groups)
        if out.stride() != dense:
            out = torch.empty_strided(out.shape, dense, dtype=out.dtype, device=out.device).copy_(out)
        return [out]

    return launch


def _fused_wins(kernel: Kernel, group: ConvGroup, plain: Any, fused: Any, device: str) -> bool:
    """Autotune the fused cuDNN call against conv + our epilogue; the fused one must also agree.
    (Both are library calls: nothing to compile, so no launch-bound shortcut.) Recorded in kernel.tuning."""
    from ..lower import _example_inputs
    from ..tune import Config, bench_ms, tune
    from ..tune.autotuner import summary
    from .matmul_kernel import check_same

    name = kernel.name

    args = _example_inputs(group.inputs, device)
    try:
        check_same(fused(args), plain(args), f"{name} cudnn_convolution_relu")
    except Exception as err:  # not supported for this dtype/layout, or different results
        if settings.debug >= 1:
            print(f"[fusegraph] {name}: cudnn_convolution_relu not used: {type(err).__name__}: {str(err)[:200]}")
        return False
    launches = {"conv+epilogue": plain, "cudnn_convolution_relu": fused}

    def bench(config: Config) -> float:
        launch = launches[str(config["candidate"])]
        return bench_ms(lambda: launch(args))

    key = {"conv": repr(group.compute.attrs), "shapes": [str(n.spec) for n in group.inputs],
           "torch": torch.__version__}
    result = tune(name, key, [Config(candidate=c) for c in launches], bench)
    kernel.tuning = summary(result, len(launches))
    return bool(result.config["candidate"] == "cudnn_convolution_relu")
