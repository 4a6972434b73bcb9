"""The Kernel of a ConvGroup: the convolution through torch (cuDNN on CUDA; channels-last when
the layout pass chose NHWC), then the claimed epilogue (bias, batchnorm affine, activation,
residual) as our generated pointwise kernel reading the convolution's result once. Off the GPU
the convolution runs with the reference (exact fp32), the epilogue under the Triton interpreter."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from ..fusion.epilogue import ConvGroup
from ..ir.node import Node
from ..ir.registry import Cost, get_op
from ..reference import run_node
from ..runtime.kernel import Kernel
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
    return Kernel(name=name, kind="convolution", backend="cudnn" if device.startswith("cuda") else "reference",
                  nodes=tuple(group.nodes), inputs=tuple(group.inputs), outputs=tuple(group.outputs),
                  cost=conv_group_cost(group), launch=launch, source=source, note=note)
