"""cuDNN Graph API plans through the cuDNN frontend (`import cudnn`, the optional package
nvidia-cudnn-frontend) as autotune candidates:

- conv2d (+ its bias) + relu/gelu/silu (or no activation) in one fused plan, NHWC operands and
  result, next to torch's conv + our generated epilogue (backends/conv_kernel.py);
- causal or unmasked scaled dot-product attention forward (SDPA), next to torch's SDPA backends
  and our Triton kernel (backends/attention_kernel.py).

Each plan is built once at build time: pygraph -> validate -> build_operation_graph ->
create_execution_plans (heuristics A, then fallback) -> check_support -> build_plans, with its
workspace allocated then. Without the package, a GPU, or a loadable cuDNN the candidates are
simply not offered; a graph the frontend rejects is not offered either. Never an error: with
FUSEGRAPH_DEBUG >= 1 the reason is printed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..ir.node import Node
from ..ir.spec import strides_for_order
from ..settings import settings

Launch = Callable[[Sequence[torch.Tensor]], list[torch.Tensor]]

# our pointwise op (+ attrs) -> the frontend's pygraph method
ACTIVATIONS: dict[tuple[str, str], str] = {("relu", ""): "relu", ("gelu", "none"): "gelu",
                                           ("gelu", "tanh"): "gelu_approx_tanh", ("silu", ""): "swish"}
NHWC = (0, 2, 3, 1)


def debug(name: str, why: str) -> None:
    if settings.debug >= 1:
        print(f"[fusegraph] {name}: cuDNN frontend not used: {why}")


@functools.lru_cache(maxsize=1)
def _load() -> tuple[Any, str | None]:
    """(the cudnn module, None) or (None, why it cannot be used)."""
    try:
        import cudnn
    except Exception as err:  # absent, or a build for another Python/CUDA
        return None, f"package nvidia-cudnn-frontend not importable ({type(err).__name__}: {str(err)[:120]})"
    try:
        version = cudnn.backend_version()
    except Exception as err:
        return None, f"the cuDNN library does not load ({type(err).__name__}: {str(err)[:120]})"
    return cudnn, None if version >= 90000 else f"cuDNN {version} is older than 9.0"


def unavailable(device: str) -> str | None:
    """Why the frontend cannot serve kernels on `device` (None when it can)."""
    if not device.startswith("cuda"):
        return f"device {device} is not a GPU"
    if not torch.cuda.is_available():
        return "no GPU visible"
    return _load()[1]


_HANDLES: dict[int, Any] = {}


def _handle(cudnn: Any, device: torch.device) -> Any:
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _HANDLES:
        with torch.cuda.device(index):
            _HANDLES[index] = cudnn.create_handle()
    return _HANDLES[index]


def _data_type(cudnn: Any, dtype: str) -> Any:
    return {"float16": cudnn.data_type.HALF, "bfloat16": cudnn.data_type.BFLOAT16,
            "float32": cudnn.data_type.FLOAT}[dtype]


def _build(graph: Any, cudnn: Any) -> None:
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans()


class FrontendPlan:
    """One built cuDNN graph and its workspace; __call__ binds tensors to its graph tensors and runs."""

    def __init__(self, cudnn: Any, graph: Any, handle: Any, device: torch.device) -> None:
        self.cudnn, self.graph, self.handle = cudnn, graph, handle
        self.workspace = torch.empty(max(int(graph.get_workspace_size()), 1), device=device, dtype=torch.uint8)

    def __call__(self, bindings: dict[Any, torch.Tensor]) -> None:
        if self.workspace.device.type == "cuda":  # run on torch's current stream (CUDA graph capture too)
            self.cudnn.set_stream(self.handle, torch.cuda.current_stream(self.workspace.device).cuda_stream)
        self.graph.execute(bindings, self.workspace, handle=self.handle)


# ---- conv2d + bias + activation ----

def conv_activation(epilogue: Sequence[Node]) -> str | None:
    """The frontend activation for an epilogue of ops (a final layout copy ignored), "" for none,
    or None when the epilogue is something else."""
    ops = list(epilogue)
    if ops and ops[-1].op == "to_layout":
        ops = ops[:-1]
    if not ops:
        return ""
    if len(ops) != 1:
        return None
    node = ops[0]
    approx = str(node.attrs.get("approximate", "none")) if node.op == "gelu" else ""
    return ACTIVATIONS.get((node.op, approx))


def conv_unsupported(node: Node, activation: str | None) -> str | None:
    """Why a conv2d node (with that epilogue) is not a frontend candidate, or None."""
    if node.op != "conv2d":
        return f"{node.op} is not a forward convolution"
    if activation is None:
        return "the epilogue is not a single relu/gelu/silu"
    if node.dtype not in ("float16", "bfloat16"):
        return f"dtype {node.dtype} (tensor-core fp16/bf16 only)"
    if int(node.attrs.get("groups", 1)) != 1:
        return "grouped convolution"
    return None


def conv_candidate(node: Node, epilogue: Sequence[Node], out_strides: tuple[int, ...], device: str,
                   name: str) -> Launch | None:
    """A launch (args = the conv node's operands x, w[, b]) running conv (+ bias) + activation as one
    cuDNN graph in NHWC, its result in `out_strides`; None (with a debug reason) when not offered."""
    activation = conv_activation(epilogue)
    why = unavailable(device) or conv_unsupported(node, activation)
    if why is not None:
        debug(name, why)
        return None
    try:
        return _conv_plan(node, activation or "", out_strides, torch.device(device))
    except Exception as err:  # unsupported by cuDNN here, or any build failure: not offered
        debug(name, f"conv plan build failed: {type(err).__name__}: {str(err)[:300]}")
        return None


def _conv_plan(node: Node, activation: str, out_strides: tuple[int, ...], device: torch.device) -> Launch:
    from ..ops.conv import conv_params

    cudnn = _load()[0]
    stride, padding, dilation, _ = conv_params(node.attrs)
    x_spec, w_spec = node.inputs[0].spec, node.inputs[1].spec
    kf = w_spec.shape[0]
    dt = _data_type(cudnn, node.dtype)
    handle = _handle(cudnn, device)
    graph = cudnn.pygraph(io_data_type=dt, intermediate_data_type=cudnn.data_type.FLOAT,
                          compute_data_type=cudnn.data_type.FLOAT, handle=handle)
    x = graph.tensor(name="x", dim=list(x_spec.shape), stride=list(strides_for_order(x_spec.shape, NHWC)), data_type=dt)
    w = graph.tensor(name="w", dim=list(w_spec.shape), stride=list(strides_for_order(w_spec.shape, NHWC)), data_type=dt)
    y = graph.conv_fprop(image=x, weight=w, padding=list(padding), stride=list(stride), dilation=list(dilation),
                         name="conv")
    b = None
    if len(node.inputs) == 3:
        b = graph.tensor(name="b", dim=[1, kf, 1, 1], stride=[kf, 1, 1, 1], data_type=dt)
        y = graph.bias(name="bias", input=y, bias=b)
    if activation:
        y = getattr(graph, activation)(name=activation, input=y)
    out_shape = node.spec.shape
    nhwc_out = strides_for_order(out_shape, NHWC)
    y.set_output(True).set_data_type(dt).set_dim(list(out_shape)).set_stride(list(nhwc_out))
    _build(graph, cudnn)
    plan = FrontendPlan(cudnn, graph, handle, device)
    cl = torch.channels_last

    def launch(args: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        xt, wt = args[0].contiguous(memory_format=cl), args[1].contiguous(memory_format=cl)
        out = torch.empty_strided(out_shape, nhwc_out, dtype=xt.dtype, device=xt.device)
        bindings = {x: xt, w: wt, y: out}
        if b is not None:
            bindings[b] = args[2].contiguous().view(1, kf, 1, 1)
        plan(bindings)
        if tuple(out.stride()) != tuple(out_strides):
            out = torch.empty_strided(out_shape, out_strides, dtype=out.dtype, device=out.device).copy_(out)
        return [out]

    return launch


# ---- scaled dot-product attention forward ----

def sdpa_unsupported(node: Node, problem: Any) -> str | None:
    """Why an attention node is not a frontend SDPA candidate, or None."""
    if node.op != "scaled_dot_product_attention":
        return f"{node.op}: the frontend candidate covers the forward only"
    if node.attrs.get("return_lse", False):
        return "the log-sum-exp output is not produced by this candidate"
    if problem.mask_kind:
        return "masked attention (only causal or no mask)"
    if node.dtype not in ("float16", "bfloat16"):
        return f"dtype {node.dtype} (fp16/bf16 only)"
    d, dv = problem.head_dim, problem.head_dim_v
    if d % 8 or dv % 8 or max(d, dv) > 256:
        return f"head dims {d}/{dv} (multiples of 8 up to 256)"
    return None


def sdpa_candidate(node: Node, problem: Any, device: str, name: str) -> Launch | None:
    """A launch (args = q, k, v as in the node) running cuDNN SDPA forward; None when not offered."""
    why = unavailable(device) or sdpa_unsupported(node, problem)
    if why is not None:
        debug(name, why)
        return None
    try:
        launch = _sdpa_plan(node, problem, torch.device(device))
        _check_sdpa(launch, node, problem, device, name)
        return launch
    except Exception as err:  # build failure, or results that differ from torch's: not offered
        debug(name, f"SDPA plan not offered: {type(err).__name__}: {str(err)[:300]}")
        return None


def _check_sdpa(launch: Launch, node: Node, problem: Any, device: str, name: str) -> None:
    """Run the plan once on example inputs against torch's SDPA (ValueError when they differ): the
    attention autotuner compares only its Triton candidates with torch."""
    import torch.nn.functional as F

    from ..lower import _example_inputs
    from .matmul_kernel import check_same

    q, k, v = _example_inputs(list(node.inputs[:3]), device)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=bool(problem.causal), scale=float(problem.scale),
                                          enable_gqa=problem.heads != problem.kv_heads)
    check_same(launch([q, k, v]), [want], f"{name} cuDNN frontend SDPA")


def _causal_sdpa(graph: Any, cudnn: Any, q: Any, k: Any, v: Any, scale: float, causal: bool) -> Any:
    """graph.sdpa, causal top-left aligned (torch's is_causal); newer frontends name the mask a band."""
    kw = {"name": "sdpa", "q": q, "k": k, "v": v, "attn_scale": scale, "generate_stats": False}
    if not causal:
        return graph.sdpa(**kw)
    try:
        return graph.sdpa(**kw, use_causal_mask=True)
    except TypeError:
        return graph.sdpa(**kw, diagonal_band_right_bound=0, diagonal_alignment=cudnn.diagonal_alignment.TOP_LEFT)


def _sdpa_plan(node: Node, problem: Any, device: torch.device) -> Launch:
    cudnn = _load()[0]
    dt = _data_type(cudnn, node.dtype)
    handle = _handle(cudnn, device)
    graph = cudnn.pygraph(io_data_type=dt, intermediate_data_type=cudnn.data_type.FLOAT,
                          compute_data_type=cudnn.data_type.FLOAT, handle=handle)
    specs = [i.spec for i in node.inputs[:3]]
    q, k, v = (graph.tensor(name=n, dim=list(s.shape), stride=list(s.memory_strides), data_type=dt)
               for n, s in zip("qkv", specs, strict=True))
    out, _ = _causal_sdpa(graph, cudnn, q, k, v, float(problem.scale), bool(problem.causal))
    out_shape = node.spec.shape
    out_strides = node.spec.memory_strides
    out.set_output(True).set_data_type(dt).set_dim(list(out_shape)).set_stride(list(out_strides))
    _build(graph, cudnn)
    plan = FrontendPlan(cudnn, graph, handle, device)
    in_strides = [s.memory_strides for s in specs]

    def launch(args: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        tensors = [t if tuple(t.stride()) == st else torch.empty_strided(t.shape, st, dtype=t.dtype,
                                                                           device=t.device).copy_(t)
                   for t, st in zip(args[:3], in_strides, strict=True)]
        result = torch.empty_strided(out_shape, out_strides, dtype=tensors[0].dtype, device=tensors[0].device)
        plan({q: tensors[0], k: tensors[1], v: tensors[2], out: result})
        return [result]

    return launch
