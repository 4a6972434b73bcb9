"""Compile a whole plan's Triton kernels at once, in parallel, before any kernel is built or tuned.

lower_fused calls `precompile_plan(items, device, options, compute_dtype)` with its partition items in
lowering order; kernel k is named as lower_fused names it (fg_k{k}_matmul, fg_k{k}_<ops>), so the
generated sources are the same and Triton's in-memory cache already holds every candidate the
kernel's own build then launches. Covered: MatmulGroups (backends/matmul_kernel.gemm_warmup_jobs, and
the epilogue kernel its cuBLAS candidate launches when that candidate runs),
fused groups (pointwise, row reductions, and the two launches of split column reductions), row +
column pairs (both launches, when the pair is eligible for one pass), the generated epilogue of a
convolution (fg_k{k}_conv_epilogue: the plain conv + epilogue candidate every fused library candidate
is checked and timed against), a convolution's own Triton candidates (backends/triton_conv.warmup_jobs),
the inner GEMM plan of a 1x1 convolution (conv_gemm_warmup_jobs) and the Triton attention kernels of
attention nodes (each distinct launch of their candidate configs, backends/attention_kernel.
attention_warmup_jobs); the rest (library plans) is built where its kernel is built.
Before those, the cuDNN graphs of conv groups and attention nodes go to build worker processes
(prefetch_library_plans).
With settings.stream_compiles on (off by default: measured slower on the H200 host), the kernels'
builds start while the batch compiles, each waiting only for the kernels it launches. Never raises: a
failure here shows again, with its message, where the kernel is built.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from ..codegen.compile import interpreting, load_triton_function, shared_kernel_text
from ..runtime.launch import pdl_options
from ..settings import settings

log = logging.getLogger("fusegraph.backends")

ATTENTION_OPS = ("scaled_dot_product_attention", "sdpa_backward")


def precompile_plan(items: Sequence[Any], device: str, options: dict[str, Any],
                    compute_dtype: str = "float32") -> Any:
    """Every compile the plan's build will need, as a context (tune/precompile.CompileStream) to build
    the plan's kernels in: entering compiles them all (streamed: starts them, and each kernel's first
    launch waits for its own compile; leaving finishes the rest). Its `jobs`: the compile jobs (none
    off the GPU and under the interpreter)."""
    from ..tune.precompile import CompileStream

    if device.startswith("cuda"):
        prefetch_library_plans(items, device)
    if not device.startswith("cuda") or not settings.use_triton or interpreting():
        return CompileStream([])
    return CompileStream(precompile_jobs(items, device, options, compute_dtype, set()))


def _second_launch_jobs(item: Any, k: int, name: str, device: str, options: dict[str, Any],
                        seen: set[str]) -> list[Any]:
    """The compile jobs of the cuBLAS candidate's second launch (matmul_kernel.cublas_second_launch:
    the epilogue, or what follows a bias cuBLAS adds), [] when that candidate has none or does not run."""
    from ..codegen.gemm_configs import candidate_set
    from .matmul_kernel import cublas_second_launch

    second = cublas_second_launch(item, name, device, candidate_set(options))
    return [] if second is None else fused_warmup_jobs(second, k, device, options, seen=seen, name=f"{name}_epilogue")


def precompile_jobs(items: Sequence[Any], device: str, options: dict[str, Any], compute_dtype: str,
                    seen: set[str]) -> list[Any]:
    """The compile jobs of a plan's items (kernel k named as lower_fused names it), none for a kernel
    `seen` already holds."""
    from ..codegen.gemm_configs import candidate_set
    from ..fusion.epilogue import ConvGroup, MatmulGroup
    from ..fusion.horizontal import ComboGroup
    from ..fusion.partition import KernelGroup, RowColumnGroup
    from ..ir.node import Node
    from . import triton_conv
    from .attention_kernel import attention_problem, attention_warmup_jobs
    from .matmul_kernel import gemm_warmup_jobs

    jobs: list[Any] = []

    def add(k: int, collect: Any, *args: Any, **kwargs: Any) -> None:
        """jobs += collect(...); a collector that fails costs only its own jobs (the kernel's build reports it)."""
        try:
            jobs.extend(collect(*args, **kwargs))
        except Exception as err:
            log.debug("kernel %d not (wholly) precompiled: %s: %s", k, type(err).__name__, err)

    for k, item in enumerate(items):
        if isinstance(item, MatmulGroup):
            name = f"fg_k{k}_matmul"
            add(k, gemm_warmup_jobs, item, name, device, seen, candidate_set(options))
            add(k, _second_launch_jobs, item, k, name, device, options, seen)   # the cuBLAS candidate's second launch
        elif isinstance(item, RowColumnGroup):
            add(k, row_column_warmup_jobs, item, k, device, options, seen)
        elif isinstance(item, ConvGroup):
            add(k, conv_gemm_warmup_jobs, item, k, device, compute_dtype, seen)
            add(k, triton_conv.warmup_jobs, item.compute, device, bool(options.get("allow_tf32", False)), seen)
            if item.epilogue_nodes:
                add(k, fused_warmup_jobs, item.epilogue, k, device, options, seen=seen, name=f"fg_k{k}_conv_epilogue")
        elif isinstance(item, (KernelGroup, ComboGroup)):
            add(k, fused_warmup_jobs, item, k, device, options, seen=seen)
        elif isinstance(item, Node) and item.op in ATTENTION_OPS:
            add(k, lambda: attention_warmup_jobs(item, device) if first_time(
                f"{item.op} {attention_problem(item)!r} {sorted(item.attrs.items())!r}", seen) else [])
    return jobs


def conv_gemm_warmup_jobs(group: Any, k: int, device: str, compute_dtype: str, seen: set[str]) -> list[Any]:
    """The compile jobs of a conv group's inner GEMM plan (backends/conv_gemm.py: a 1x1 convolution
    as a fusegraph GEMM plan, built when the conv kernel's candidates are checked): its graph through
    the compiler's front end and partition, its items' jobs. Without this each inner plan compiled its
    own candidates when it was built, eight at a time, one plan after another (ResNet-50: 17 plans,
    about half of the cold build). [] when the group has no such candidate or its plan exists."""
    from ..compiler import front_end
    from ..lower import plan_items
    from . import conv_gemm

    try:
        launch = conv_gemm.candidate(group, device, f"fg_k{k}_conv", compute_dtype).get("conv_as_gemm")
        if launch is None or launch.plan_key() in conv_gemm._PLANS or \
                not first_time(f"conv as GEMM {launch.plan_key()!r}", seen):   # built, or another group's twin
            return []
        graph, _ = launch.inner_graph()
        options = dict(conv_gemm.INNER_OPTIONS)
        inner = front_end(graph.to_ir(), options, marks=False)
        items, _ = plan_items(inner)
    except Exception as err:  # the conv kernel's own build reports it
        log.debug("inner GEMM plan of kernel %d not precompiled: %s: %s", k, type(err).__name__, err)
        return []
    return precompile_jobs(items, device, options, inner.compute_dtype, seen)


def prefetch_library_plans(items: Sequence[Any], device: str) -> int:
    """Start the cuDNN graph builds of the conv groups (fused conv + epilogue) and attention nodes
    (SDPA forward and backward) in build workers (backends/build_workers.py), ahead of the kernels'
    own builds, which take the results; returns how many were submitted."""
    from ..fusion.epilogue import ConvGroup
    from ..ir.node import Node
    from .conv_kernel import prefetch_library_plans as prefetch
    from .cudnn_frontend import prefetch_sdpa

    submitted = 0
    for item in items:
        try:
            if isinstance(item, ConvGroup):
                submitted += prefetch(item, device)
            elif isinstance(item, Node) and item.op in ATTENTION_OPS:
                submitted += prefetch_sdpa(item, device)
        except Exception as err:  # the kernel's own build builds it in-process
            log.debug("cuDNN plan of %s not prefetched: %s: %s", getattr(item, "name", item), type(err).__name__, err)
    return submitted


def first_time(source: str, seen: set[str] | None) -> bool:
    """Record `source` (up to kernel positions) in `seen`; False when it was there already."""
    if seen is None:
        return True
    shared = shared_kernel_text(source)
    if shared in seen:
        return False
    seen.add(shared)
    return True


def row_column_warmup_jobs(pair: Any, k: int, device: str, options: dict[str, Any],
                           seen: set[str] | None = None) -> list[Any]:
    """Compile jobs for a row + column pair built as one pass (as lower.row_column_kernels writes
    it); [] when the pair is not eligible (its two kernels then compile where they are built)."""
    from ..codegen.configs import MAX_ROW_BLOCK
    from ..codegen.row_column import NotEligible, RowColumnWriter
    from ..lower import _summary

    name = f"fg_k{k}_{_summary(pair)}"
    try:
        gen = RowColumnWriter(pair, name).write_pair(int(options.get("max_row_block", MAX_ROW_BLOCK)))
    except NotEligible:
        return []
    return fused_warmup_jobs(pair, k, device, options, generated=gen, seen=seen)


def fused_warmup_jobs(group: Any, k: int, device: str, options: dict[str, Any], generated: Any = None,
                      seen: set[str] | None = None, name: str | None = None) -> list[Any]:
    """Compile jobs for a fused group (each launch of each config: two for split reductions): its
    first config when it is not timed (launch-bound, or a heuristic config under tune "fast"), the
    cached choice, else every candidate; [] when `seen` already has its source (another layer's copy)."""
    from ..codegen.configs import candidate_configs, heuristic_config_ok, launch_parameters
    from ..codegen.triton_gen import generate
    from ..lower import _example_inputs, _summary, group_cost
    from ..runtime.kernel import Kernel
    from ..tune import Config
    from ..tune.autotuner import cached_choice, floor_ms_of, untimed_reason

    name = name or f"fg_k{k}_{_summary(group)}"   # as lower names it (a conv's epilogue: its own name)
    gen = generated if generated is not None else generate(group, name)
    if not first_time(gen.source, seen):
        return []
    candidates = candidate_configs(gen, options)
    shape = Kernel(name=name, kind=group.kind, backend="triton", nodes=tuple(group.nodes),
                   inputs=tuple(group.inputs), outputs=tuple(e.node for e in group.stores), cost=group_cost(group),
                   launch=lambda args: [])
    if len(candidates) > 1 and (not settings.autotune or untimed_reason(floor_ms_of(shape),
                                                                       memory_bound=heuristic_config_ok(gen))):
        candidates = candidates[:1]
    elif len(candidates) > 1:
        known = cached_choice(gen.name, {"source": gen.source, "device": device}, [Config(c) for c in candidates])
        candidates = candidates if known is None else [dict(known.values)]
    fns = [load_triton_function(gen.source, fn_name) for fn_name in (name, gen.finish_name) if fn_name]
    args = _example_inputs(gen.inputs, device)
    out_specs = [(n.shape, n.spec.memory_strides, n.dtype) for n in gen.outputs]

    def job_for(fn: Any, grid: tuple[int, ...], constexprs: dict[str, Any], warps: int,
                workspaces: Sequence[tuple[int, ...]]) -> Any:
        def job() -> Any:
            from ..ir import dtypes

            outs = [torch.empty_strided(s, st, dtype=dtypes.to_torch(dt), device=device) for s, st, dt in out_specs]
            spaces = [torch.empty(shape, dtype=torch.float32, device=device) for shape in workspaces]
            return fn.warmup(*args, *outs, *spaces, grid=grid, **constexprs, **pdl_consts, num_warps=warps,
                             **pdl_launch)

        return job

    pdl_consts, pdl_launch = pdl_options(device)   # as runtime/launch.TritonLaunch adds them
    jobs = []
    for config in candidates:   # the launches as lower._launcher makes them: outputs, then workspaces
        grids, constexprs, warps = launch_parameters(gen, config)
        workspaces = [(int(config["SPLITS"]), gen.extent)] * gen.workspaces if gen.workspaces else []
        jobs += [job_for(fn, grid, constexprs, warps, workspaces) for fn, grid in zip(fns, grids, strict=True)]
    return jobs
