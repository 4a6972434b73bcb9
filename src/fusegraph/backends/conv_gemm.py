"""A 1x1, stride-1, unpadded convolution over channels-last operands is a GEMM: output pixel m's
C_out channels are its input pixel's C_in channels times w[C_out, C_in]^T, and in NHWC memory the
input is a row-major [M = N*H*W, C_in] matrix and the output a row-major [M, C_out] one. This module
offers such a conv group (the conv and its CNN inference epilogue: per-channel scale and shift, a
residual, an activation; backends/cudnn_conv_epilogue.classify) one more candidate beside cuDNN's:
an inner fusegraph plan declaring exactly that GEMM with the epilogue, so the GEMM machinery builds
it (generated Triton GEMM with the epilogue in its store, or cuBLAS and an epilogue kernel, tuned
per shape) and the conv's autotuner (conv_kernel._choose) times it against cuDNN.

Why: cuDNN's fused conv kernels are far from the memory floor on these streaming shapes. On the
H200 (b128 bf16, bench/conv1x1_gemm_gpu.py, results/conv1x1_gemm_20261201_2145.txt) ResNet-50's
1x1 convolutions with batchnorm (+ residual) + relu took 0.47-0.70x cuDNN's time as our GEMM plan:
64->256 + residual 0.158 against 0.224 ms (floor 0.096), 256->64 0.063 against 0.100 (floor 0.054).

The per-channel vectors are folded per call exactly as the fused Triton conv folds them
(triton_conv.FusedGroupLaunch: cached while their inputs are unchanged); the operands go to the
inner plan as [M, C] views of the NHWC tensors (as_strided, no copy) and its [M, C_out] result comes
back as the NHWC-strided output. The inner plan never captures a CUDA graph of its own (the outer
plan may capture it whole).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..ir.node import Node
from ..ir.registry import get_op
from ..runtime.kernel import in_strides
from ..settings import settings
from . import triton_conv

DTYPES = ("float16", "bfloat16")
MAX_SHARED_PLANS = 256
_PLANS: dict[tuple[Any, ...], Any] = {}     # inner plans by GEMM shape and epilogue form (ConvAsGemm.prepare)
# how inner plans are built: no CUDA graph (the outer plan may capture), the GEMM candidate set that
# 1x1 convolutions' recorded choices support (codegen/gemm_configs.GEMM_CANDIDATE_SETS)
INNER_OPTIONS: dict[str, Any] = {"cuda_graphs": False, "gemm_candidates": "conv"}


def debug(name: str, why: str) -> None:
    if settings.debug >= 1:
        print(f"[fusegraph] {name}: conv as GEMM not used: {why}")


def nhwc_strides(shape: Sequence[int]) -> tuple[int, int, int, int]:
    """Dense channels-last strides of a logical NCHW shape."""
    _, c, h, w = shape
    return (h * w * c, 1, w * c, c)


def unsupported(node: Node, out_strides: Sequence[int]) -> str | None:
    """Why a conv2d node is not a GEMM this module runs (None when it is)."""
    if node.op != "conv2d":
        return f"op {node.op}"
    stride, padding, dilation, groups = get_op(node.op).extra["params"](node.attrs)
    w = node.inputs[1].spec
    if tuple(w.shape[2:]) != (1, 1) or tuple(stride) != (1, 1) or tuple(padding) != (0, 0) or groups != 1:
        return f"kernel {tuple(w.shape[2:])} stride {tuple(stride)} padding {tuple(padding)} groups {groups}"
    if tuple(dilation) != (1, 1):
        return f"dilation {tuple(dilation)}"
    if node.dtype not in DTYPES:
        return f"dtype {node.dtype} (fp16/bf16 only)"
    x = node.inputs[0].spec
    if tuple(x.memory_strides) != nhwc_strides(x.shape) or tuple(out_strides) != nhwc_strides(node.shape):
        return "input or output not dense channels-last"
    if tuple(w.memory_strides[:2]) != (w.shape[1], 1):
        return f"weight strides {tuple(w.memory_strides)} (rows of C_in contiguous elements needed)"
    return None


def candidate(group: Any, device: str, name: str, compute_dtype: str = "float32") -> dict[str, Any]:
    """{"conv_as_gemm": launch} for a conv group this module serves on a GPU (settings.conv_as_gemm),
    else {} (the reason under FUSEGRAPH_DEBUG)."""
    from . import cudnn_conv_epilogue as cce

    node = group.compute
    if not settings.conv_as_gemm or not device.startswith("cuda"):
        return {}
    if not (len(group.outputs) == 1 and group.outputs[0].id == (group.epilogue_nodes or [node])[-1].id):
        debug(name, "the group stores more than its final value")
        return {}
    out_strides = tuple(group.outputs[0].spec.memory_strides)
    why = unsupported(node, out_strides)
    epi = None
    if why is None and group.epilogue_nodes:
        try:
            epi = cce.classify(node, group.epilogue_nodes, group.inputs)
        except cce.NotServed as err:
            why = f"epilogue: {err}"
    if why is None and epi is not None and epi.residual is not None \
            and tuple(epi.residual.spec.memory_strides) != nhwc_strides(node.shape):
        why = "residual not dense channels-last"
    if why is not None:
        debug(name, why)
        return {}
    positions = {n.id: k for k, n in enumerate(group.inputs)}
    return {"conv_as_gemm": ConvAsGemm(group, epi, positions, out_strides, compute_dtype, device, name)}


class ConvAsGemm:
    """One conv group's launch through an inner GEMM plan (see the module doc); built on first use."""

    def __init__(self, group: Any, epi: Any, positions: dict[int, int], out_strides: tuple[int, ...],
                 compute_dtype: str, device: str, name: str) -> None:
        node = group.compute
        self.node, self.device, self.name, self.compute_dtype = node, device, name, compute_dtype
        self.conv_at = [positions[i.id] for i in node.inputs]
        problem = triton_conv.problem_of(node, out_strides)
        self.out_shape, self.out_strides, self.x_strides = problem.out_shape, out_strides, problem.x_strides
        self.w_strides = problem.w_strides
        n, c_out, h, w = problem.out_shape
        self.m, self.c_in, self.c_out = n * h * w, problem.x_shape[1], c_out
        self.fused: triton_conv.FusedGroupLaunch | None = None
        if epi is not None:   # the fold of the per-channel vectors and the epilogue's form, shared with our conv
            plain = triton_conv.ConvGroupLaunch(problem, self.conv_at, None, [], device, name)
            self.fused = triton_conv.FusedGroupLaunch(epi, plain, positions, out_strides, compute_dtype, device)
        self.plan: Any = None
        self._inner: tuple[Any, list[str]] | None = None
        self.roles: list[str] = []

    def inner_graph(self) -> tuple[Any, list[str]]:
        """The inner graph and the order of its inputs by role (self.roles), made once."""
        if self._inner is None:
            self._inner = self._graph()
            self.roles = self._inner[1]
        return self._inner

    def _graph(self) -> tuple[Any, list[str]]:
        """The inner graph and the order of its inputs by role."""
        import fusegraph as fg

        dtype = self.node.dtype
        g = fg.Graph(name=f"{self.name}_as_gemm", compute_dtype=self.compute_dtype)
        roles = ["x", "w"]
        x = g.tensor((self.m, self.c_in), dtype, name="x")
        w = g.tensor((self.c_out, self.c_in), dtype, name="w")
        y = g.matmul(x, g.transpose(w, 0, 1))
        fused = self.fused
        direct_bias = len(self.conv_at) == 3 and (fused is None or fused.direct_bias)
        if direct_bias:
            roles.append("bias")
            y = g.add(y, g.tensor((self.c_out,), self.node.inputs[2].dtype, name="bias"))
        out_dtype = dtype
        if fused is not None:
            form = fused.form
            if form.scale:
                roles.append("scale")
                y = g.mul(y, g.tensor((self.c_out,), "float32", name="scale"))
            if form.shift:
                roles.append("shift")
                y = g.add(y, g.tensor((self.c_out,), "float32", name="shift"))
            if form.residual_strides is not None:
                roles.append("residual")
                r = g.tensor((self.m, self.c_out), fused.epi.residual.dtype, name="residual")
                if form.rscale:
                    roles.append("rscale")
                    r = g.mul(r, g.tensor((self.c_out,), "float32", name="rscale"))
                y = g.add(y, r)
            if form.activation == "swish":
                y = g.silu(y)
            elif form.activation == "gelu_approx_tanh":
                y = g.gelu(y, approximate="tanh")
            elif form.activation:
                y = getattr(g, form.activation)(y)
            out_dtype = form.out_dtype or dtype
        g.cast(y, out_dtype).set_output()
        return g, roles

    def prepare(self) -> Any:
        """The inner plan, shared by every group of the same GEMM and epilogue form in this process
        (ResNet-50's repeated blocks build each once; a plan without a CUDA graph returns fresh
        outputs, so sharing it is safe)."""
        if self.plan is None:
            g, _ = self.inner_graph()
            key = self.plan_key()
            self.plan = _PLANS.get(key)
            if self.plan is None:
                if len(_PLANS) >= MAX_SHARED_PLANS:
                    _PLANS.clear()
                self.plan = _PLANS[key] = g.build(device=self.device, **INNER_OPTIONS)
        return self.plan

    def plan_key(self) -> tuple[Any, ...]:
        """What the inner plan computes (the GEMM, its epilogue form, dtypes, device): plans are shared by it."""
        return (self.m, self.c_in, self.c_out, self.node.dtype, tuple(self.inner_graph()[1]), self.compute_dtype,
                self.device,
                None if self.fused is None else (self.fused.form, self.fused.epi.residual is not None
                                                  and self.fused.epi.residual.dtype),
                len(self.conv_at) == 3 and self.node.inputs[2].dtype)

    @property
    def leaf_at(self) -> list[int]:
        """Positions of the per-channel inputs (batchnorm statistics) the fold reads."""
        return self.fused.leaf_at if self.fused is not None else []

    def describe(self) -> str:
        plan = self.prepare()
        lines = [f"# conv2d 1x1 as GEMM [{self.m}, {self.c_in}] x [{self.c_in}, {self.c_out}] over the NHWC "
                 f"operands, inner plan {plan.graph.name}: "
                 + ", ".join(f"{k.name} {k.kind}/{k.backend} {k.config}" for k in plan.kernels)]
        lines += [k.source for k in plan.kernels if getattr(k, "source", None)]
        return "\n".join(lines)

    def __call__(self, args: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        plan = self.prepare()
        x = in_strides(args[self.conv_at[0]], self.x_strides)   # the planned layout (a copy only if not)
        w = args[self.conv_at[1]]
        feeds = {"x": x.as_strided((self.m, self.c_in), (self.c_in, 1)),
                 "w": in_strides(w, self.w_strides).as_strided((self.c_out, self.c_in), (self.c_in, 1))}
        fused = self.fused
        if "bias" in self.roles:    # else the conv's bias is folded into the shift
            feeds["bias"] = args[self.conv_at[2]]
        if fused is not None:
            feeds.update(fused.vectors(args) or {})
            if fused.residual_at is not None:
                residual = in_strides(args[fused.residual_at], self.out_strides)
                feeds["residual"] = residual.as_strided((self.m, self.c_out), (self.c_out, 1))
        (y,) = plan.run([feeds[r] for r in self.roles])
        return [y.as_strided(self.out_shape, self.out_strides)]
