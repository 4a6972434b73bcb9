"""Kernels of attention nodes: the flash-style Triton kernels (codegen/attention.py), torch's
cuDNN and FlashAttention SDPA backends as autotuned candidates, and the reference for what none
covers (fp32, odd head dims: FUSEGRAPH_DEBUG says why). Never an error: a shape or dtype no
generated kernel covers goes to a library or the reference."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..codegen.attention import (
    AttentionProblem,
    attention_backward,
    attention_configs,
    attention_forward,
    attention_supported,
    backward_calls,
    decode_config,
    default_scale,
    forward_calls,
)
from ..codegen.compile import interpreting
from ..ir import dtypes
from ..ir.node import Node
from ..ir.registry import get_op
from ..reference import run_node
from ..runtime.kernel import Kernel, in_strides
from ..settings import settings
from . import cudnn, cudnn_frontend
from .matmul_kernel import sm_count

log = logging.getLogger("fusegraph.backends")


def attention_problem(node: Node) -> AttentionProblem:
    """The problem of a scaled_dot_product_attention or sdpa_backward node."""
    attrs = node.attrs
    backward = node.op == "sdpa_backward"
    q, k, v = node.inputs[1:4] if backward else node.inputs[:3]
    has_mask = bool(attrs.get("has_mask", False))
    mask = node.inputs[(5 if backward else 3)] if has_mask else None
    b, h, hk, sq, sk, d, dv = get_op(node.op).extra["dims"](q.spec, k.spec, v.spec,
                                                           None if mask is None else mask.spec, attrs)
    kind = 0 if mask is None else (2 if mask.dtype == "bool" else 1)
    return AttentionProblem(b, h, hk, sq, sk, d, dv, bool(attrs.get("is_causal", False)), kind,
                            default_scale(d, attrs.get("scale")), dtypes.to_torch(q.dtype))


def attention_kernel(node: Node, name: str, compute_dtype: str, device: str) -> Kernel:
    problem = attention_problem(node)
    backward = node.op == "sdpa_backward"
    cost = get_op(node.op).cost([i.spec for i in node.inputs], list(node.specs), node.attrs)

    def reference(args: Sequence[torch.Tensor]) -> list[Any]:
        return [run_node(node, list(args), compute_dtype, args[0].device)]

    kernel = Kernel(name=name, kind="attention", backend="reference", nodes=(node,), inputs=tuple(node.inputs),
                    outputs=(node,), cost=cost, launch=in_spec_strides(node, reference),
                    source=f"# {node.op} via torch reference")
    why = attention_supported(problem)
    candidates: dict[str, Any] = {}
    if why is None:
        decode = None if backward or not settings.decode_attention else decode_config(problem, sm_count(device))
        if decode is not None:   # few query rows per kv head (a decode step): the split-KV kernels
            candidates["triton:decode"] = _triton_forward(node, problem, decode)
        for config in distinct_configs(node, problem):
            label = "triton:" + ",".join(f"{k}={v}" for k, v in sorted(config.items()))
            candidates[label] = (_triton_backward if backward else _triton_forward)(node, problem, config)
    # torch's kernels give NaN where a boolean mask hides every key of a query (we give 0): the
    # forward fixes those rows up, the backward (NaN would reach dk/dv) does not use torch then
    torch_ok = not node.attrs.get("return_lse", False) and not (backward and problem.mask_kind == 2)
    if device.startswith("cuda") and torch_ok:
        for backend in cudnn.SDPA_BACKENDS:
            candidates[f"torch:{backend}"] = (_torch_backward if backward else _torch_forward)(node, problem, backend)
        if backward and node.attrs.get("has_lse", False) and problem.mask_kind == 0:
            candidates.update(_direct_backward_candidates(node, problem, device, name))
    if device.startswith("cuda"):   # also for a training forward (return_lse: cuDNN's statistics are the lse)
        frontend = cudnn_frontend.sdpa_candidate(node, problem, device, name)  # None when not offered
        if frontend is not None:
            candidates["frontend:cudnn"] = frontend
    runnable = device.startswith("cuda") or (interpreting() and settings.use_triton)
    if not candidates or not runnable:
        kernel.note = why or "planned as Triton attention; runs through the reference on this device"
        if why is not None:
            _debug(name, f"reference attention: {why}")
        if why is None and candidates:
            kernel.backend, kernel.source = "triton", _triton_source(backward, next(iter(candidates)))
        return kernel
    start = time.perf_counter()
    chosen = _choose(kernel, node, problem, candidates, device)
    kernel.tuning = dict(kernel.tuning or {"source": "default", "seconds": 0.0, "candidates": len(candidates)},
                         build_s=round(time.perf_counter() - start, 4))
    if chosen is None:
        kernel.note = "no attention candidate ran on the example inputs: torch reference"
        _debug(name, kernel.note)
        return kernel
    launch = candidates[chosen]
    if isinstance(launch, cudnn_frontend.LazySdpa):   # the built graph's launch, not the lazy wrapper
        launch = launch.resolve()
    kernel.launch = in_spec_strides(node, launch)
    kernel.config = {"candidate": chosen}
    if chosen.startswith("triton"):
        kernel.backend, kernel.source = "triton", _triton_source(backward, chosen)
    else:
        kernel.backend = "cudnn" if "cudnn" in chosen else "torch"
        kernel.source = f"# torch.nn.functional.scaled_dot_product_attention, {chosen.split(':')[1]} backend"
        if chosen.startswith("frontend:"):
            kernel.source = "# cuDNN frontend SDPA graph (Graph API), built at build time"
        if why is not None:
            kernel.note = f"no Triton kernel: {why}"
    return kernel


def attention_warmup_jobs(node: Node, device: str) -> list[Callable[[], Any]]:
    """Compile-ahead jobs (backends/plan_precompile.py) for the Triton kernels an attention node's build
    compiles one after another while it tunes: each distinct launch of its candidate configs (the
    backward's recompute of the forward too, without the forward's lse). [] when the kernels do not
    cover the problem, off the GPU, or when the node is launch-bound (its build then tries torch's
    backends first and compiles nothing). Inputs: random, in the strides the plan passes."""
    problem = attention_problem(node)
    if not device.startswith("cuda") or attention_supported(problem) is not None or not settings.autotune:
        return []
    if launch_bound_node(node):
        return []
    backward = node.op == "sdpa_backward"
    has_lse = backward and bool(node.attrs.get("has_lse", False))

    def calls(config: dict[str, Any]) -> list[Any]:
        args = _random_inputs(node, device)
        if not backward:
            mask = args[3] if problem.mask_kind else None
            return forward_calls(args[0], args[1], args[2], mask, problem, config, node.specs[0].memory_strides)[2]
        grad_out, q, k, v = args[:4]
        mask = args[5] if problem.mask_kind else None
        lse = torch.zeros((problem.batch, problem.heads, problem.sq), dtype=torch.float32, device=q.device)
        recompute = [] if has_lse else forward_calls(q, k, v, mask, problem, config)[2]
        return recompute + backward_calls(grad_out, q, k, v, lse, torch.zeros_like(lse), mask, problem, config)[3]

    launches = 1 if not backward else 2 if has_lse else 3   # the recomputed forward, dk/dv, dq
    configs = distinct_configs(node, problem)

    @functools.cache
    def calls_of(k: int) -> list[Any]:   # one set of random inputs per config, shared by its launches
        return calls(configs[k])

    def job(k: int, index: int) -> Any:
        fn, grid, args, consts = calls_of(k)[index]
        return fn.warmup(*args, grid=grid, **consts)   # a handle, as tune/precompile expects of a job

    return [functools.partial(job, k, index) for k in range(len(configs)) for index in range(launches)]


def launch_bound_node(node: Node) -> bool:
    """Is the attention node launch-bound by the cost model (tune/autotuner.launch_bound)? Its build
    then takes the first candidate that runs, torch's backends first, and compiles nothing."""
    from ..tune.autotuner import floor_ms_of, launch_bound

    cost = get_op(node.op).cost([i.spec for i in node.inputs], list(node.specs), node.attrs)
    shape = Kernel(name=node.name, kind="attention", backend="triton", nodes=(node,), inputs=tuple(node.inputs),
                   outputs=(node,), cost=cost, launch=lambda args: [])
    return launch_bound(floor_ms_of(shape))


def distinct_configs(node: Node, problem: AttentionProblem) -> list[dict[str, Any]]:
    """The Triton candidate configs that launch different kernels: a backward fed the forward's lse
    reads only the BWD_* options, so configs differing in forward tiles alone are one candidate (the
    tuner would time the same kernels again); without the lse the forward it recomputes differs."""
    configs = attention_configs(problem)
    if node.op != "sdpa_backward" or not node.attrs.get("has_lse", False):
        return configs
    seen: dict[tuple[Any, ...], dict[str, Any]] = {}
    for config in configs:
        seen.setdefault(tuple(config.get(k) for k in ("BWD_BLOCK_M", "BWD_BLOCK_N", "bwd_warps")), config)
    return list(seen.values())


def in_spec_strides(node: Node, launch: Any) -> Any:
    """`launch` with every output tensor in the memory strides of its spec. Generated kernels read
    their inputs with the strides of the spec (compile-time constants), but torch's SDPA backends
    return e.g. out [B, H, S, D] laid out as [B, S, H, D] (memory-efficient, flash, cuDNN), and
    their backward may return dq/dk/dv like that too: read as dense, those are scrambled values."""
    dense = [s.memory_strides for s in node.specs]

    def fix(t: Any, strides: tuple[int, ...]) -> Any:
        return in_strides(t, strides) if isinstance(t, torch.Tensor) and t.numel() > 1 else t

    def launch_dense(args: Sequence[torch.Tensor]) -> list[Any]:
        results = launch(args)
        if len(dense) == 1:
            return [fix(results[0], dense[0])]
        return [tuple(fix(t, st) for t, st in zip(results[0], dense, strict=True))]

    return launch_dense


def _triton_source(backward: bool, label: str = "") -> str:
    from ..codegen.attention import BACKWARD_SOURCE, DECODE_SOURCE, FORWARD_SOURCE

    return BACKWARD_SOURCE if backward else DECODE_SOURCE if label == "triton:decode" else FORWARD_SOURCE


def _triton_forward(node: Node, p: AttentionProblem, config: dict[str, Any]) -> Any:
    with_lse = bool(node.attrs.get("return_lse", False))
    out_strides = node.specs[0].memory_strides   # e.g. [B, T, H, D] in memory (fusion/views.py)

    def launch(args: Sequence[torch.Tensor]) -> list[Any]:
        mask = args[3] if p.mask_kind else None
        out, lse = attention_forward(args[0], args[1], args[2], mask, p, config, out_strides)
        return [(out, lse)] if with_lse else [out]

    return launch


def _triton_backward(node: Node, p: AttentionProblem, config: dict[str, Any]) -> Any:
    has_lse = bool(node.attrs.get("has_lse", False))

    def launch(args: Sequence[torch.Tensor]) -> list[Any]:
        grad_out, q, k, v, out = args[:5]
        mask = args[5] if p.mask_kind else None
        if has_lse:
            lse = args[5 + (p.mask_kind != 0)]
        else:  # recompute the statistics the backward needs
            out, lse = attention_forward(q, k, v, mask, p, config)
        return [attention_backward(grad_out, q, k, v, out, lse, mask, p, config)]

    return launch


def _torch_forward(node: Node, p: AttentionProblem, backend: str) -> Any:
    def launch(args: Sequence[torch.Tensor]) -> list[Any]:
        mask = args[3] if p.mask_kind else None
        out = cudnn.torch_sdpa(args[0], args[1], args[2], mask, p.causal, p.scale, backend)
        if mask is not None and mask.dtype == torch.bool:  # rows that see no key: 0, as our semantics
            out = out.masked_fill(~mask.any(dim=-1, keepdim=True), 0.0)
        return [out]

    return launch


def _torch_backward(node: Node, p: AttentionProblem, backend: str) -> Any:
    def launch(args: Sequence[torch.Tensor]) -> list[Any]:
        mask = args[5] if p.mask_kind else None
        return [cudnn.torch_sdpa_backward(args[0], args[1], args[2], args[3], mask, p.causal, p.scale, backend)]

    return launch


def _direct_backward_candidates(node: Node, p: AttentionProblem, device: str, name: str) -> dict[str, Any]:
    """torch's cuDNN / flash backward kernels fed our forward's out and lse (no forward recompute,
    which the plain torch candidates pay); a backend that does not take the problem is left out."""
    q, k, v = (torch.randn(i.shape, device=device).to(dtypes.to_torch(i.dtype)) for i in node.inputs[1:4])
    found: dict[str, Any] = {}
    for backend in ("cudnn", "flash"):
        try:
            direct = cudnn.SdpaBackwardWithLse(backend, q, k, v, p.causal, p.scale)
        except (RuntimeError, TypeError, IndexError) as err:
            _debug(name, f"direct {backend} backward not offered: {type(err).__name__}: {str(err)[:200]}")
            continue

        def launch(args: Sequence[torch.Tensor], direct: Any = direct) -> list[Any]:
            return [direct(args[0], args[1], args[2], args[3], args[4], args[5])]

        found[f"lse:{backend}"] = launch
    return found


def _choose(kernel: Kernel, node: Node, p: AttentionProblem, candidates: dict[str, Any],
            device: str) -> str | None:
    """The fastest candidate that runs (and agrees with a torch backend) on example data; the first
    without a GPU; None when none runs. Each candidate is checked on its first call, inside its
    timing, so a choice the autotuner remembers (this process's memo: another layer of the same
    problem) runs no candidate at all, and one from the disk cache runs only itself (and the torch
    baseline it is checked against): a warm compile builds no losing cuDNN graph. A launch-bound
    problem (tune/autotuner.py) takes the first candidate that runs and agrees, torch's SDPA
    backends first (nothing to compile), without compiling or timing the others. Recorded in
    kernel.tuning."""
    from ..tune import Config, bench_ms, keys, tune
    from ..tune.autotuner import floor_ms_of, launch_bound, summary

    name = kernel.name
    labels = list(candidates)
    if not device.startswith("cuda"):
        return labels[0]
    floor = floor_ms_of(kernel)
    if settings.autotune and launch_bound(floor) and keys.gpu_identity() is not None:
        # library kernels first: nothing to compile. (The split-KV decode kernels are not put first here:
        # in the Llama decode step, KV 2048, they were no faster than cuDNN's one kernel, the merge's
        # launch eating their gain: bench/ab_gpu.py --workload llama_decode, results/ab_decode_*.txt)
        start = time.perf_counter()
        ordered = sorted(labels, key=lambda label: not label.startswith("torch:"))  # stable
        chosen = _first_that_runs(name, ordered, candidates, _example_inputs(node, device))
        kernel.tuning = {"source": "launch-bound", "seconds": round(time.perf_counter() - start, 4),
                         "candidates": len(labels)}
        return chosen
    from ..errors import UnsupportedError
    from .matmul_kernel import check_same

    made: list[list[torch.Tensor]] = []
    wanted: list[list[torch.Tensor]] = []

    def example() -> list[torch.Tensor]:
        if not made:
            made.append(_example_inputs(node, device))
        return made[0]

    def want() -> list[torch.Tensor]:
        """A torch backend's result on the example inputs, [] when none runs (with return_lse or
        has_lse there is none to compare with)."""
        if not wanted:
            wanted.append(_torch_baseline(labels, candidates, example()))
        return wanted[0]

    def bench(config: Config) -> float:
        label = str(config["candidate"])
        launch, inputs = candidates[label], example()
        try:
            got = _flat(launch(inputs))
            if not label.startswith("torch:") and want():   # ours, direct-lse and frontend candidates
                check_same(got, want(), f"{name} {label} vs a torch backend")
        except Exception as err:  # a backend that does not take this problem, or different results
            _debug(name, f"{label} not used: {type(err).__name__}: {str(err)[:200]}")
            raise
        return bench_ms(lambda: launch(inputs))

    key = {"problem": repr(p), "op": node.op, "attrs": repr(sorted(node.attrs.items())), "torch": torch.__version__}
    try:
        result = tune(name, key, [Config(candidate=label) for label in labels], bench, floor_ms=floor)
    except UnsupportedError:   # none ran
        return None
    kernel.tuning = summary(result, len(labels))
    chosen = str(result.config["candidate"])
    if result.source in ("tuned", "memo"):   # timed and checked in this process
        return chosen
    # from the disk cache (another process) or untimed: the first that runs and agrees, from it on
    return _first_that_runs(name, [chosen] + [label for label in labels if label != chosen], candidates,
                            example())


def _first_that_runs(name: str, labels: list[str], candidates: dict[str, Any], args: list[torch.Tensor]) -> str | None:
    """The first candidate that runs and, when it is a Triton one and a torch backend runs too,
    agrees with it (the torch backend is run once, for the comparison)."""
    from .matmul_kernel import check_same

    want: list[torch.Tensor] | None = None
    for label in labels:
        try:
            got = _flat(candidates[label](args))
        except Exception as err:
            _debug(name, f"{label} does not run: {type(err).__name__}: {str(err)[:200]}")
            continue
        if not label.startswith("triton"):
            return label
        if want is None:
            want = _torch_baseline(labels, candidates, args)
        try:
            if want:
                check_same(got, want, f"{name} {label}")
            return label
        except ValueError as err:
            _debug(name, str(err))
    return None


def _torch_baseline(labels: list[str], candidates: dict[str, Any], args: list[torch.Tensor]) -> list[torch.Tensor]:
    for label in labels:
        if label.startswith("torch:"):
            try:
                return _flat(candidates[label](args))
            except Exception:
                continue
    return []


def _flat(results: list[Any]) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for r in results:
        out.extend(r if isinstance(r, tuple | list) else [r])
    return out


def _example_inputs(node: Node, device: str) -> list[torch.Tensor]:
    """Random inputs; for a backward with the forward's lse, `out` and `lse` are the forward's own
    (fp32 math) on the example q, k, v, so candidates that read them and candidates that recompute
    the forward agree."""
    out = _random_inputs(node, device)
    if node.op == "sdpa_backward" and node.attrs.get("has_lse", False):
        has_mask = node.attrs.get("has_mask", False)
        fwd_inputs = out[1:4] + ([out[5]] if has_mask else [])
        attrs = {k: v for k, v in node.attrs.items() if k != "has_lse"}
        with torch.no_grad():
            o, lse = get_op("scaled_dot_product_attention").reference(
                fwd_inputs, {**attrs, "return_lse": True})
        out[4] = o.to(out[4].dtype)
        out[-1] = lse.to(out[-1].dtype).reshape(out[-1].shape)
    return out


def _random_inputs(node: Node, device: str) -> list[torch.Tensor]:
    out = []
    for n in node.inputs:
        dt = dtypes.to_torch(n.dtype)
        if dt == torch.bool:
            t = torch.ones(n.shape, dtype=torch.bool, device=device)
        elif n.dtype == "float32" and len(n.shape) == 3:  # lse
            t = torch.zeros(n.shape, dtype=dt, device=device)
        else:
            t = torch.randn(n.shape, device=device).to(dt)
        strides = n.spec.memory_strides
        if t.dim() and tuple(t.stride()) != tuple(strides):   # laid out as the plan passes it (e.g. q as a
            t = torch.empty_strided(n.shape, strides, dtype=dt, device=device).copy_(t)   # view of qkv)
        out.append(t)
    return out


def _debug(name: str, why: str) -> None:
    if settings.debug >= 1:
        print(f"[fusegraph] {name}: {why}")
    log.debug("%s: %s", name, why)
