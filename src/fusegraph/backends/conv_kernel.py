"""The Kernel of a ConvGroup: the convolution through torch (cuDNN on CUDA; channels-last when
the layout pass chose NHWC), then the claimed epilogue (bias, batchnorm affine, activation,
residual) as our generated pointwise kernel reading the convolution's result once. Off the GPU
the convolution runs with the reference (exact fp32), the epilogue under the Triton interpreter."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from ..fusion.epilogue import ConvGroup
from ..ir.node import Node
from ..ir.registry import Cost, get_op
from ..passes.layout import already_nhwc
from ..reference import run_node
from ..runtime.kernel import Kernel
from ..settings import settings
from . import conv_gemm, cudnn, cudnn_conv_epilogue, cudnn_frontend, triton_conv


def conv_group_cost(group: ConvGroup) -> Cost:
    nbytes = sum(n.spec.nbytes for n in group.inputs) + sum(n.spec.nbytes for n in group.outputs)
    flops = sum(get_op(n.op).cost([i.spec for i in n.inputs], list(n.specs), n.attrs).flops for n in group.nodes)
    return Cost(nbytes, flops)


def conv_launch(node: Node, compute_dtype: str, device: str, allow_tf32: bool = False) -> Any:
    """Tensors -> the convolution's result in the node's memory layout. fp32 runs exact (the
    reference's semantics) unless the build allowed TF32 (build(allow_tf32=True))."""
    dense = node.spec.memory_strides
    tf32 = allow_tf32 and node.dtype == "float32"
    native = device.startswith("cuda") and (node.dtype in ("float16", "bfloat16") or tf32)
    if node.op != "conv2d":
        # the gradients: cuDNN's dgrad / wgrad in the operands' dtype, channels-last when the layout
        # pass made the activations NHWC or they arrive so (saved activations declared with NHWC
        # strides); the data gradient's output keeps grad_out's layout
        if node.op == "conv2d_backward_input":
            channels_last = already_nhwc(node.inputs[0])
            native_backward = cudnn.conv2d_input_grad(node.attrs, node.inputs[0].shape[2:], node.inputs[1].shape[2:],
                                                      channels_last)
        else:
            channels_last = already_nhwc(node.inputs[0]) or already_nhwc(node.inputs[1])
            native_backward = cudnn.conv2d_weight_grad(node.attrs, channels_last)
    else:
        channels_last = node.spec.layout == "NHWC"

    def launch(args: Sequence[torch.Tensor]) -> torch.Tensor:
        if native:  # cuDNN in the operands' dtype (fp32 accumulation inside)
            x, w = args[0], args[1]
            attrs = node.attrs
            with _tf32() if tf32 else contextlib.nullcontext():
                if node.op != "conv2d":   # (grad_out, weight) or (x, grad_out)
                    out = native_backward(args[0], args[1])
                elif channels_last:
                    out = cudnn.conv2d_channels_last(x, w, args[2] if len(args) == 3 else None, attrs)
                else:
                    out = F.conv2d(x, w, args[2] if len(args) == 3 else None, stride=attrs.get("stride", 1),
                                   padding=attrs.get("padding", 0), dilation=attrs.get("dilation", 1),
                                   groups=attrs.get("groups", 1))
        else:
            out = run_node(node, list(args), compute_dtype, args[0].device)
        if out.stride() != dense and out.numel() > 1:
            out = torch.empty_strided(out.shape, dense, dtype=out.dtype, device=out.device).copy_(out)
        return out

    return launch


def _tf32() -> Any:
    """cuDNN's TF32 tensor cores for fp32 convolutions (other cuDNN flags kept)."""
    flags = torch.backends.cudnn
    return flags.flags(enabled=flags.enabled, benchmark=flags.benchmark, deterministic=flags.deterministic,
                       allow_tf32=True)


def conv_group_kernel(group: ConvGroup, name: str, compute_dtype: str, device: str,
                      options: dict[str, Any]) -> Kernel:
    from ..lower import fused_kernel  # lower imports this module

    start = time.perf_counter()
    node = group.compute
    conv = conv_launch(node, compute_dtype, device, bool(options.get("allow_tf32", False)))
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
    library = library_candidates(group, device, name, compute_dtype, epilogue, bool(options.get("allow_tf32", False)))
    kernel.tuning = {"source": "default", "seconds": 0.0, "candidates": 1 + len(library)}
    chosen = _choose(kernel, group, launch, library, device) if library else None
    if chosen is not None:
        kernel.launch = library[chosen]
        kernel.config = {"candidate": chosen}
        kernel.note = f"{chosen} was faster than the convolution + our epilogue"
        kernel.source = library_source(chosen, library[chosen], node.op, layout, group)
        if isinstance(library[chosen], (triton_conv.ConvGroupLaunch, triton_conv.FusedGroupLaunch)):
            kernel.backend = "triton"
            kernel.config.update(library[chosen].prepare().config)
        elif isinstance(library[chosen], conv_gemm.ConvAsGemm):
            gemm = next(k for k in library[chosen].prepare().kernels if k.kind == "matmul")
            kernel.backend = gemm.backend
            kernel.config.update(gemm.config)
    kernel.tuning["build_s"] = round(time.perf_counter() - start, 4)
    return kernel


LIBRARY_SOURCES = {
    "cudnn_convolution_relu": "# torch.cudnn_convolution_relu: {op} + bias + relu in one cuDNN call, {layout}",
    "cudnn_frontend_epilogue": "# cuDNN frontend graph (Graph API), one fused plan, NHWC: {act}",
    "triton_conv": "# our Triton implicit-GEMM {op} ({layout}), then the group's epilogue: {act}",
    "triton_conv_fused": "# our Triton implicit-GEMM {op} ({layout}), the epilogue fused into its store: {act}",
    "conv_as_gemm": "# {op} 1x1 as a GEMM over the {layout} operands, planned by fusegraph: {act}",
}


def library_source(chosen: str, launch: Any, op: str, layout: str, group: ConvGroup) -> str:
    """The kernel's source line for the chosen library candidate."""
    if isinstance(launch, (triton_conv.ConvGroupLaunch, triton_conv.FusedGroupLaunch, conv_gemm.ConvAsGemm)):
        act = "+".join(epilogue_ops(group)) or "none"
        return LIBRARY_SOURCES[chosen].format(op=op, layout=layout, act=act) + "\n" + launch.describe()
    act = ""
    if isinstance(launch, cudnn_conv_epilogue.FusedConvLaunch):
        act = (f"{launch.epi.describe()} ({launch.mode} form, {launch.vector_dtype} per-channel vectors folded per "
               f"call, reused while their inputs are unchanged)")
    return LIBRARY_SOURCES[chosen].format(op=op, layout=layout, act=act)


def library_candidates(group: ConvGroup, device: str, name: str, compute_dtype: str = "float32",
                       epilogue: Kernel | None = None, allow_tf32: bool = False) -> dict[str, Any]:
    """Other implementations of the whole group (conv + epilogue) that apply here, by name: torch's
    fused cuDNN conv+bias+relu, a cuDNN frontend graph of conv + its epilogue (bias, per-channel affine,
    residual add, activation; backends/cudnn_conv_epilogue.py),
    our Triton conv (narrow input channels, or 1x1 as a GEMM: backends/triton_conv.py) followed by
    `epilogue` (the group's epilogue kernel, as the plain path runs it), or with a CNN inference
    epilogue fused into its store, and a 1x1 stride-1 channels-last conv with that epilogue as a
    fusegraph GEMM plan (backends/conv_gemm.py). Empty off the GPU."""
    out: dict[str, Any] = {}
    fused = cudnn_fused_relu(group, device)
    if fused is not None:
        out["cudnn_convolution_relu"] = fused
    node = group.compute
    if not device.startswith("cuda"):
        return out
    out.update(triton_conv.group_candidates(group, device, name, epilogue, compute_dtype, allow_tf32))
    out.update(conv_gemm.candidate(group, device, name, compute_dtype))
    if frontend_route(group) is None:
        cudnn_frontend.debug(name, "the epilogue stores more than its final value")
        return out
    out_strides = group.outputs[0].spec.memory_strides
    fused_epilogue = cudnn_conv_epilogue.candidate(node, group.epilogue_nodes, group.inputs, out_strides,
                                                   compute_dtype, device, name)
    if fused_epilogue is not None:
        out["cudnn_frontend_epilogue"] = fused_epilogue
    return out


def frontend_route(group: ConvGroup) -> str | None:
    """Which cuDNN frontend candidate a group gets: "epilogue" (conv + its epilogue as one fused plan,
    backends/cudnn_conv_epilogue.candidate: a bias and one activation as well as a CNN inference
    epilogue) or None (the epilogue stores more than its final value).

    conv + bias + activation takes the same route as any other epilogue (bias as a per-channel shift),
    so its plans are built in the build workers while the plan's Triton kernels compile, once per
    distinct problem, the fastest of cuDNN's first plans is timed and kept, and a warm compile loads it
    from the plan store. (cudnn_frontend.conv_candidate, the direct conv + bias + activation graph, built
    here with the heuristics' first plan, remains as the Graph API reference of the benchmarks.)"""
    node = group.compute
    if not (len(group.outputs) == 1 and group.outputs[0].id == (group.epilogue_nodes or [node])[-1].id):
        return None
    return "epilogue"


def prefetch_library_plans(group: ConvGroup, device: str) -> bool:
    """Start building the group's fused cuDNN epilogue plan in a build worker now (the kernel's own
    build takes the result); True when a job was submitted."""
    if device.startswith("cuda") and frontend_route(group) == "epilogue":
        return cudnn_conv_epilogue.prefetch(group.compute, group.epilogue_nodes, group.inputs, device)
    return False


def epilogue_ops(group: ConvGroup) -> list[str]:
    """The epilogue's ops, less a final layout conversion (the library call's result is copied into
    the output's layout anyway)."""
    ops = [n.op for n in group.epilogue_nodes]
    return ops[:-1] if ops and ops[-1] == "to_layout" else ops


def cudnn_fused_relu(group: ConvGroup, device: str) -> Any:
    """conv2d (+ bias) + relu as one cuDNN call (torch.cudnn_convolution_relu), when the epilogue
    is exactly a relu of the convolution; else None."""
    node = group.compute
    if not device.startswith("cuda") or node.op != "conv2d" or epilogue_ops(group) != ["relu"] \
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


def _choose(kernel: Kernel, group: ConvGroup, plain: Any, library: dict[str, Any], device: str) -> str | None:
    """Autotune the library candidates against conv + our epilogue. Each is checked against it on its
    first call, inside its timing: one that fails or differs is a failed candidate (the reason under
    FUSEGRAPH_DEBUG) and never chosen. A choice the autotuner remembers (this process's memo, the disk
    cache: the same shapes and epilogue, timed and checked then) is taken without running anything:
    a repeated block, or a warm compile, builds no losing candidate (a conv-as-GEMM inner plan is built
    at its first call). The cuDNN kinds are library calls, nothing to compile, so no launch-bound
    shortcut; ours (triton_conv*) compile and tune their tile config at their first call. The winner's
    name, or None for conv + epilogue. Recorded in kernel.tuning."""
    from ..lower import _example_inputs
    from ..tune import Config, bench_ms, tune
    from ..tune.autotuner import summary
    from .matmul_kernel import check_same

    name = kernel.name
    launches = {"conv+epilogue": plain, **library}
    made: list[list[torch.Tensor]] = []     # the example inputs and the plain result, made on first need

    def example() -> list[torch.Tensor]:
        if not made:
            args = _example_inputs(group.inputs, device)
            # per-channel inputs (BN statistics) positive: a negative variance gives NaN channels, whose
            # relu differs by library
            for fn in library.values():
                if isinstance(fn, (cudnn_conv_epilogue.FusedConvLaunch, triton_conv.FusedGroupLaunch,
                                   conv_gemm.ConvAsGemm)):
                    for k in fn.leaf_at:
                        args[k] = args[k].abs() + 0.5
            made.extend([args, plain(args)])
        return made[0]

    def bench(config: Config) -> float:
        label = str(config["candidate"])
        launch, args = launches[label], example()
        if label != "conv+epilogue":
            try:
                check_same(launch(args), made[1], f"{name} {label}")
            except Exception as err:  # not supported for this dtype/layout, or different results
                if settings.debug >= 1:
                    print(f"[fusegraph] {name}: {label} not used: {type(err).__name__}: {str(err)[:200]}")
                raise
        return bench_ms(lambda: launch(args))

    key = {"conv": repr(group.compute.attrs), "shapes": [str(n.spec) for n in group.inputs],
           "epilogue": [n.op for n in group.epilogue_nodes], "torch": torch.__version__}
    result = tune(name, key, [Config(candidate=c) for c in launches], bench)
    kernel.tuning = summary(result, len(launches))
    failed = [f"{t.config['candidate']}: {str(t.error)[:160]}" for t in result.timings if t.ms is None]
    if failed:
        kernel.tuning["failed"] = failed
    chosen = str(result.config["candidate"])
    return None if chosen == "conv+epilogue" else chosen
