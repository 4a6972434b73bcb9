"""cuDNN Graph API plans through the cuDNN frontend (`import cudnn`, the optional package
nvidia-cudnn-frontend) as autotune candidates:

- conv2d (+ its bias) + relu/gelu/silu (or no activation) in one fused plan, NHWC operands and
  result, next to torch's conv + our generated epilogue (backends/conv_kernel.py); the CNN
  inference epilogues (BatchNorm affine, residual add, activation) are backends/cudnn_conv_epilogue.py;
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
import threading
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
ACTIVATION_OPS = frozenset(op for op, _ in ACTIVATIONS)
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
        self._stream()
        self.graph.execute(bindings, self.workspace, handle=self.handle)

    def run_ordered(self, buffers: tuple[torch.Tensor, ...], uids: tuple[int, ...]) -> None:
        """execute() with buffers in a fixed order of graph-tensor uids (newer frontends' faster
        binding path: the operand metadata is cached, only the pointers are read per call)."""
        self._stream()
        self.graph.execute(buffers, self.workspace, handle=self.handle, tensor_uids=uids)

    def _stream(self) -> None:
        if self.workspace.device.type == "cuda":  # run on torch's current stream (CUDA graph capture too)
            self.cudnn.set_stream(self.handle, torch.cuda.current_stream(self.workspace.device).cuda_stream)


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


# ---- scaled dot-product attention forward and backward ----

def sdpa_unsupported(node: Node, problem: Any) -> str | None:
    """Why an attention node (forward or backward) is not a frontend SDPA candidate, or None."""
    if node.op not in ("scaled_dot_product_attention", "sdpa_backward"):
        return f"{node.op} is not attention"
    if problem.mask_kind:
        return "masked attention (only causal or no mask)"
    dtype = _q(node).dtype
    if dtype not in ("float16", "bfloat16"):
        return f"dtype {dtype} (fp16/bf16 only)"
    d, dv = problem.head_dim, problem.head_dim_v
    if d % 8 or dv % 8 or max(d, dv) > 256:
        return f"head dims {d}/{dv} (multiples of 8 up to 256)"
    return None


def _q(node: Node) -> Node:
    return node.inputs[1] if node.op == "sdpa_backward" else node.inputs[0]


def sdpa_candidate(node: Node, problem: Any, device: str, name: str) -> Launch | None:
    """A launch (args as the node's inputs) running cuDNN SDPA forward (with its softmax statistics as
    the lse output when the node returns one), or the backward: fed the forward's own out and lse
    when the node has them (has_lse), else after a forward that recomputes them; None (with a debug
    reason) when not offered. The cuDNN graph is built, and checked against torch, at the launch's
    first call (so a tuning choice remembered for another candidate builds nothing), once per process
    for every node of the same problem, strides and dtypes (GPT-2: twelve identical layers, one graph
    and one workspace); a build that failed raises again at each node's first call."""
    why = unavailable(device) or sdpa_unsupported(node, problem)
    if why is not None:
        debug(name, why)
        return None
    return LazySdpa(_sdpa_key(node, problem, device), node, problem, device, name)


class LazySdpa:
    """The frontend SDPA candidate: builds (or takes the process's built) graph at its first call.
    `resolve()` is the built launch itself, which the chosen kernel keeps (no indirection per call)."""

    def __init__(self, key: str, node: Node, problem: Any, device: str, name: str) -> None:
        self.key, self.node, self.problem, self.device, self.name = key, node, problem, device, name
        self.built: Launch | None = None

    def resolve(self) -> Launch:
        if self.built is None:
            self.built = _shared_sdpa(self.key, self.node, self.problem, self.device, self.name)
        return self.built

    def __call__(self, args: Sequence[torch.Tensor]) -> list[Any]:
        return self.resolve()(args)


_SDPA_BUILT: dict[str, Launch | str] = {}   # key -> the built, checked launch, or why it is not offered
_SDPA_LOCK = threading.Lock()


def _sdpa_key(node: Node, problem: Any, device: str) -> str:
    specs = [(i.spec.shape, i.spec.memory_strides, i.dtype) for i in node.inputs]
    outs = [(s.shape, s.memory_strides, s.dtype) for s in node.specs]
    return repr((node.op, problem, sorted(node.attrs.items()), specs, outs, str(torch.device(device))))


def _shared_sdpa(key: str, node: Node, problem: Any, device: str, name: str) -> Launch:
    """The built and checked SDPA launch of `key` (built by the first node that asks)."""
    with _SDPA_LOCK:
        found = _SDPA_BUILT.get(key)
        if found is None:
            try:
                backward = node.op == "sdpa_backward"
                found, keep = (_sdpa_backward_plan if backward else _sdpa_plan)(node, problem, torch.device(device),
                                                                                name)
                if keep is not None:   # built here: checked against torch, then stored for the next process
                    (_check_sdpa_backward if backward else _check_sdpa)(found, node, problem, device, name)
                    keep()
            except Exception as err:  # build failure, or results that differ from torch's: not offered
                found = f"SDPA plan not offered: {type(err).__name__}: {str(err)[:300]}"
                debug(name, found)
            _SDPA_BUILT[key] = found
    if isinstance(found, str):
        raise RuntimeError(found)
    return found


def _check_sdpa(launch: Launch, node: Node, problem: Any, device: str, name: str) -> None:
    """Run the plan once on example inputs against torch's SDPA (ValueError when they differ): the
    attention autotuner compares only its Triton candidates with torch."""
    import torch.nn.functional as F

    from ..lower import _example_inputs
    from .matmul_kernel import check_same

    q, k, v = _example_inputs(list(node.inputs[:3]), device)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=bool(problem.causal), scale=float(problem.scale),
                                          enable_gqa=problem.heads != problem.kv_heads)
    got = launch([q, k, v])
    if node.attrs.get("return_lse", False):
        (out, lse), = got
        check_same([out, lse], [want, _reference_lse(q, k, v, problem)], f"{name} cuDNN frontend SDPA (out, lse)")
    else:
        check_same(got, [want], f"{name} cuDNN frontend SDPA")


def _reference_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, problem: Any) -> torch.Tensor:
    """The fp32 natural-log log-sum-exp [B, H, Sq] of the scaled (causal-masked) scores: what our
    Triton forward returns as lse and what cuDNN calls the softmax statistics. From torch's flash
    kernel (memory linear in S); fp32 math on the full score matrix where flash does not run."""
    from ..ops.attention import attention_probs

    groups = problem.heads // problem.kv_heads
    kx, vx = (t.repeat_interleave(groups, dim=-3) if groups > 1 else t for t in (k, v))
    with torch.no_grad():
        try:
            return torch.ops.aten._scaled_dot_product_flash_attention(
                q, kx, vx, 0.0, bool(problem.causal), False, scale=float(problem.scale))[1].float()
        except RuntimeError:
            return attention_probs(q, k, None, {"is_causal": bool(problem.causal), "scale": float(problem.scale)})[1]


def _causal_sdpa(graph: Any, cudnn: Any, q: Any, k: Any, v: Any, scale: float, causal: bool,
                 stats: bool = False) -> Any:
    """graph.sdpa, causal top-left aligned (torch's is_causal); newer frontends name the mask a band."""
    kw = {"name": "sdpa", "q": q, "k": k, "v": v, "attn_scale": scale, "generate_stats": stats}
    return _with_causal(graph.sdpa, cudnn, kw, causal)


def _with_causal(op: Any, cudnn: Any, kw: dict[str, Any], causal: bool) -> Any:
    if not causal:
        return op(**kw)
    try:
        return op(**kw, use_causal_mask=True)
    except TypeError:
        return op(**kw, diagonal_band_right_bound=0, diagonal_alignment=cudnn.diagonal_alignment.TOP_LEFT)


def _layout(node: Node) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return tuple(node.spec.shape), tuple(node.spec.memory_strides)


def _stats_layout(q_shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """cuDNN's softmax statistics [B, H, Sq, 1], dense fp32: the same memory as our lse [B, H, Sq]."""
    shape = (*q_shape[:-1], 1)
    return shape, tuple(strides_for_order(shape, (0, 1, 2, 3)))


def sdpa_recipes(node: Node, problem: Any) -> list[Any]:
    """The cuDNN graphs of an attention node as plain values (backends/cudnn_plans.SdpaRecipe): a
    forward's one graph; a backward's graph, after the forward that recomputes out and the
    statistics when the node does not have them (has_lse)."""
    from .cudnn_plans import SdpaRecipe

    scale, causal = float(problem.scale), bool(problem.causal)
    if node.op != "sdpa_backward":
        q, k, v = (_layout(i) for i in node.inputs[:3])
        stats = _stats_layout(q[0]) if node.attrs.get("return_lse", False) else None
        out = node.specs[0]   # (the lse, with return_lse, is the statistics output)
        o = (tuple(out.shape), tuple(out.memory_strides))
        return [SdpaRecipe(False, q, k, v, o, stats, None, None, node.inputs[0].dtype, scale, causal)]
    dout, q, k, v = (_layout(i) for i in node.inputs[:4])
    has_lse = bool(node.attrs.get("has_lse", False))
    o_shape = (*q[0][:-1], v[0][-1])
    o = _layout(node.inputs[4]) if has_lse else (o_shape, tuple(strides_for_order(o_shape, (0, 1, 2, 3))))
    stats = _stats_layout(q[0])
    dtype = _q(node).dtype
    grads = tuple((tuple(s.shape), tuple(s.memory_strides)) for s in node.specs)
    backward = SdpaRecipe(True, q, k, v, o, stats, dout, grads, dtype, scale, causal)   # type: ignore[arg-type]
    if has_lse:
        return [backward]
    return [SdpaRecipe(False, q, k, v, o, stats, None, None, dtype, scale, causal), backward]


def prefetch_sdpa(node: Node, device: str) -> int:
    """Submit an attention node's cuDNN graphs to the build workers (backends/build_workers.py),
    ahead of its kernel's build; how many were submitted (none when the frontend does not serve the
    node, its graphs are built or stored, or the node is launch-bound: its build then tries torch's
    backends first)."""
    from . import cudnn_plans
    from .attention_kernel import attention_problem, launch_bound_node

    problem = attention_problem(node)
    if unavailable(device) is not None or sdpa_unsupported(node, problem) is not None:
        return 0
    if _sdpa_key(node, problem, device) in _SDPA_BUILT or (settings.autotune and launch_bound_node(node)):
        return 0
    return sum(cudnn_plans.prefetch([recipe], 1, torch.device(device)) for recipe in sdpa_recipes(node, problem))


def _recipe_plan(recipe: Any, device: torch.device, name: str) -> tuple[FrontendPlan, dict[str, Any],
                                                                         Callable[[], None] | None]:
    """(plan, its graph tensors by role, keep): the graph of `recipe` from the plan store (a warm
    compile: deserialized, nothing built; keep None: it was checked before it was stored, for this
    GPU and cuDNN version, as the conv plans are), else built serialized (by a build worker when
    prefetched) and deserialized here; `keep()` stores it once the caller has checked it. Where that
    route fails (a frontend that cannot serialize the engine), the graph is built here directly."""
    from . import cudnn_plans as plans

    cudnn = _load()[0]
    handle = _handle(cudnn, device)
    uids = dict(zip(recipe.roles(), recipe.uids(), strict=True))
    try:
        key = plans.key_for([recipe], cudnn)
        stored = plans.load(key) if key is not None else None
        if stored is not None and key is not None:
            try:
                return FrontendPlan(cudnn, plans.deserialize(cudnn, handle, stored[2]), handle, device), uids, None
            except Exception as err:  # another library build, a truncated blob: build it again
                plans.forget(key, f"not loadable ({type(err).__name__}: {str(err)[:120]})")
        built = plans.fetch([recipe], 1, device, name)
        if built.blobs:
            index = min(built.blobs)
            blob = built.blobs[index]
            plan = FrontendPlan(cudnn, plans.deserialize(cudnn, handle, blob), handle, device)

            def keep() -> None:
                if key is not None:
                    plans.store(key, 0, index, blob)

            return plan, uids, keep
        debug(name, f"no serialized {recipe.describe()} plan: {'; '.join(built.failures)[:300]}")
    except Exception as err:  # anything unexpected in that route: built here below
        debug(name, f"serialized {recipe.describe()} plan not used: {type(err).__name__}: {str(err)[:200]}")
    graph, tensors = plans.graph_from_recipe(cudnn, handle, recipe)
    _build(graph, cudnn)
    return FrontendPlan(cudnn, graph, handle, device), tensors, lambda: None


def _dense_as(args: Sequence[torch.Tensor], strides: Sequence[tuple[int, ...]]) -> list[torch.Tensor]:
    """Each tensor in the strides its graph tensor was declared with (copied when they differ)."""
    return [t if tuple(t.stride()) == tuple(st) else
            torch.empty_strided(t.shape, st, dtype=t.dtype, device=t.device).copy_(t)
            for t, st in zip(args, strides, strict=False)]


def _sdpa_plan(node: Node, problem: Any, device: torch.device,
               name: str = "sdpa") -> tuple[Launch, Callable[[], None] | None]:
    """(launch, keep) of a forward node: args q, k, v; returns out, or (out, lse) with return_lse.
    keep (_recipe_plan): None when the plan came from the store, else what stores it once checked."""
    (recipe,) = sdpa_recipes(node, problem)
    plan, t, keep = _recipe_plan(recipe, device, name)
    layouts = [recipe.q[1], recipe.k[1], recipe.v[1]]
    out_shape, out_strides = recipe.o

    def launch(args: Sequence[torch.Tensor]) -> list[Any]:
        q, k, v = _dense_as(args[:3], layouts)
        result = torch.empty_strided(out_shape, out_strides, dtype=q.dtype, device=q.device)
        bindings = {t["q"]: q, t["k"]: k, t["v"]: v, t["o"]: result}
        if recipe.stats is None:
            plan(bindings)
            return [result]
        lse = torch.empty(out_shape[:-1], dtype=torch.float32, device=result.device)
        plan({**bindings, t["stats"]: lse})
        return [(result, lse)]

    return launch, keep


def _sdpa_backward_plan(node: Node, problem: Any, device: torch.device,
                        name: str = "sdpa_backward") -> tuple[Launch, Callable[[], None] | None]:
    """(launch, keep) of a backward node: args grad_out, q, k, v, out[, lse]. cuDNN's backward reads
    the forward's softmax statistics: with has_lse they are the forward's own lse (natural log,
    [B, H, Sq] fp32, as cuDNN keeps them) and out is the forward's; without, a forward graph
    recomputes both first (as torch's backward does)."""
    recipes = sdpa_recipes(node, problem)
    built = [_recipe_plan(r, device, name) for r in recipes]
    *fwd, (bwd_plan, bt, _) = built
    recipe = recipes[-1]
    has_lse = not fwd
    o_shape, o_strides = recipe.o
    st_shape, st_strides = recipe.stats
    wanted = [recipe.d_o[1], recipe.q[1], recipe.k[1], recipe.v[1]] + ([o_strides] if has_lse else [])
    grad_layouts = recipe.grads
    fwd_plan, ft = (fwd[0][0], fwd[0][1]) if fwd else (None, {})

    def launch(args: Sequence[torch.Tensor]) -> list[Any]:
        grad, q, k, v, *rest = _dense_as(args, wanted)
        if has_lse:
            o, stats = rest[0], args[5].float().contiguous()
        else:
            assert fwd_plan is not None
            o = torch.empty_strided(o_shape, o_strides, dtype=q.dtype, device=q.device)
            stats = torch.empty_strided(st_shape, st_strides, dtype=torch.float32, device=q.device)
            fwd_plan({ft["q"]: q, ft["k"]: k, ft["v"]: v, ft["o"]: o, ft["stats"]: stats})
        outs = [torch.empty_strided(shape, strides, dtype=q.dtype, device=q.device) for shape, strides in grad_layouts]
        bwd_plan({bt["q"]: q, bt["k"]: k, bt["v"]: v, bt["o"]: o, bt["dO"]: grad, bt["stats"]: stats,
                  bt["dq"]: outs[0], bt["dk"]: outs[1], bt["dv"]: outs[2]})
        return [tuple(outs)]

    def keep() -> None:
        for _, _, kept in built:
            if kept is not None:
                kept()

    return launch, None if all(kept is None for _, _, kept in built) else keep


def _check_sdpa_backward(launch: Launch, node: Node, problem: Any, device: str, name: str) -> None:
    """Gradients on example inputs against torch's SDPA autograd (ValueError when they differ)."""
    import torch.nn.functional as F

    from ..lower import _example_inputs
    from .matmul_kernel import check_same

    grad, q, k, v = _example_inputs(list(node.inputs[:4]), device)
    with torch.enable_grad():
        qg, kg, vg = (t.detach().requires_grad_(True) for t in (q, k, v))
        out = F.scaled_dot_product_attention(qg, kg, vg, is_causal=bool(problem.causal), scale=float(problem.scale),
                                             enable_gqa=problem.heads != problem.kv_heads)
        want = torch.autograd.grad(out, (qg, kg, vg), grad)
    if node.attrs.get("has_lse", False):  # the forward's own out and statistics
        (got,) = launch([grad, q, k, v, out.detach(), _reference_lse(q, k, v, problem)])
    else:
        (got,) = launch([grad, q, k, v, *_example_inputs(list(node.inputs[4:5]), device)])
    check_same(list(got), list(want), f"{name} cuDNN frontend SDPA backward")
