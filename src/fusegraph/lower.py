"""Lowering: turn an optimized, decomposed Graph into Kernels.

Fused groups from the partitioner get generated Triton kernels; ops without code generation run
by their torch reference inside the same plan. Whatever fails to generate or compile falls back
to the reference for that kernel, with a warning, never an error. On CPU without the Triton
interpreter the planned kernels run through the reference, while `plan.kernels` still describes
the Triton kernels that were planned.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from .codegen.compile import interpreting, load_triton_function
from .codegen.configs import MAX_ROW_BLOCK, candidate_configs, heuristic_config_ok, launch_parameters
from .codegen.triton_gen import generate
from .fusion.partition import KernelGroup, RowColumnGroup, gather_source, is_literal, partition_graph
from .ir import dtypes
from .ir.graph import Graph
from .ir.node import Node
from .ir.registry import RANDOM, Cost, get_op
from .reference import run_node
from .runtime.kernel import Kernel, in_strides
from .runtime.launch import TritonLaunch
from .settings import settings
from .tune.build_profile import kernels_built, mark, timed_stage


class FusionFallbackWarning(UserWarning):
    """A fused kernel could not be generated or compiled; it runs through the reference."""


def node_kernel(node: Node, compute_dtype: str, backend: str = "reference", note: str = "",
                device: str | None = None, kind: str | None = None) -> Kernel:
    """A kernel that runs one node with its reference implementation (also the eager fallback).
    Sources (constants, scalars) are made once, on `device`, at build time."""
    inputs = tuple(i for i in node.inputs)
    opdef = get_op(node.op)
    if not node.inputs and device is not None and not node.multi_output and not opdef.has(RANDOM):
        value = run_node(node, [], compute_dtype, torch.device(device))
        value = value.to(device) if isinstance(value, torch.Tensor) else value
        return Kernel(name=f"constant_{node.name}", kind="constant", backend="reference", nodes=(node,),
                      inputs=(), outputs=(node,), cost=Cost(0, 0), launch=lambda args: [value],
                      source=f"# {node.op}: made once at build time", note=note)
    dense = None if node.multi_output else node.spec.memory_strides

    def launch(args: Sequence[torch.Tensor]) -> list[Any]:
        device = args[0].device if args and isinstance(args[0], torch.Tensor) else None  # getitem: a tuple
        out = run_node(node, list(args), compute_dtype, device)
        if dense is not None and isinstance(out, torch.Tensor) and out.stride() != dense and out.numel() > 1:
            out = torch.empty_strided(out.shape, dense, dtype=out.dtype, device=out.device).copy_(out)
        return [out]

    # getitem picks one value of a multi-output node: it moves nothing
    cost = Cost(0, 0) if node.op == "getitem" else opdef.cost([i.spec for i in node.inputs], list(node.specs),
                                                               node.attrs)
    kind = kind or ("eager" if backend == "eager" else "library")
    return Kernel(name=f"{backend}_{node.name}", kind=kind,
                  backend=backend, nodes=(node,), inputs=inputs, outputs=(node,), cost=cost,
                  launch=launch, source=f"# {node.op} via torch reference", note=note)


def view_kernel(node: Node, strides: tuple[int, ...], offset: int) -> Kernel:
    """A view node run as a torch strided view of its input (kind "view": no launch, no copy; the
    output aliases input 0). The input is expected in its spec's strides (every kernel writes its
    outputs so); one that is not is first copied into them, so the view's strides stay exact."""
    src = node.inputs[0]
    shape = tuple(node.shape)
    in_shape, in_strides = tuple(src.shape), tuple(src.spec.memory_strides)
    checked = tuple(k for k, size in enumerate(in_shape) if size > 1)
    out_strides = tuple(strides)

    def launch(args: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        x = args[0]
        got = x.stride()
        if any(got[k] != in_strides[k] for k in checked):
            x = torch.empty_strided(in_shape, in_strides, dtype=x.dtype, device=x.device).copy_(x)
        return [x.as_strided(shape, out_strides, x.storage_offset() + offset)]

    return Kernel(name=f"view_{node.name}", kind="view", backend="torch", nodes=(node,), inputs=(src,),
                  outputs=(node,), cost=Cost(0, 0), launch=launch,
                  source=f"# {node.op}: as_strided({shape}, {out_strides}, +{offset}) of its input, no copy",
                  note="strided view of the input (no copy)")


def common_refinement(src: Sequence[int], dst: Sequence[int]) -> tuple[int, ...] | None:
    """The coarsest shape both `src` and `dst` (a reshape of it) are regroupings of, each of their dims
    a run of its dims: [B, H*D] and [B*H, D] -> [B, H, D]; None where there is none ([2, 3] and
    [3, 2]) or the tensor is empty. Cut points are the suffix products of both shapes; they must
    divide one another."""
    total = math.prod(src)
    if total != math.prod(dst) or total == 0:
        return None
    cuts: set[int] = set()
    for shape in (src, dst):
        product = 1
        for size in reversed(shape):
            product *= size
            cuts.add(product)
    fine: list[int] = []
    previous = 1
    for cut in sorted(cuts):
        if cut % previous:
            return None
        if cut != previous:
            fine.append(cut // previous)
        previous = cut
    return tuple(reversed(fine))


def refined_strides(shape: Sequence[int], strides: Sequence[int], fine: Sequence[int]) -> tuple[int, ...]:
    """Strides of a tensor of `shape`/`strides` read as `fine` (common_refinement of shape): each dim
    split into its run of fine dims (a split is always a strided view)."""
    out = [0] * len(fine)
    j = len(fine) - 1
    for size, stride in zip(reversed(shape), reversed(strides), strict=True):
        if size == 1:
            continue
        covered, step = 1, stride
        while covered < size:
            out[j] = step
            covered *= fine[j]
            step *= fine[j]
            j -= 1
    return tuple(out)


def reshape_copy_kernel(node: Node, name: str, compute_dtype: str, device: str) -> Kernel | None:
    """A reshape that is no view of its input's layout (it regroups dims that are not contiguous in
    memory: q.view(T, B*H, D) of a permuted projection), as our generated copy kernel instead of
    torch's strided copy: the input read as the two shapes' common refinement (a strided view), written
    row-major (to_layout "contiguous"), which is the reshape's own row-major layout. None where the
    shapes have no common refinement or the result is not row-major (the reference copies it)."""
    from .api import Graph as UserGraph
    from .ir.spec import contiguous_strides

    src = node.inputs[0]
    fine = common_refinement(tuple(src.shape), tuple(node.shape))
    if fine is None or len(fine) < 2 or node.multi_output or \
            tuple(node.spec.memory_strides) != tuple(contiguous_strides(tuple(node.shape))):
        return None
    in_shape, in_strides = tuple(src.shape), tuple(src.spec.memory_strides)
    fine_strides = refined_strides(in_shape, in_strides, fine)
    try:
        g = UserGraph(name, compute_dtype=compute_dtype)
        g.to_layout(g.tensor(fine, node.dtype, "x", strides=fine_strides), "contiguous").set_output()
        (copy,) = g.build(device=device, cuda_graphs=False).kernels
    except Exception as err:  # codegen must never take the plan down: the reference copies it
        warnings.warn(f"{name}: copy kernel not built ({type(err).__name__}: {err}); torch copies the reshape",
                      FusionFallbackWarning, stacklevel=2)
        return None
    shape = tuple(node.shape)

    # the input has its spec's strides: kernels write their outputs so, view kernels restride theirs, and
    # Plan.__call__ brings graph inputs of other strides into them (tests/test_views_reshape_copy.py)
    def launch(args: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        x = args[0]
        (out,) = copy.launch([x.as_strided(fine, fine_strides, x.storage_offset())])
        return [out.view(shape)]

    return Kernel(name=name, kind="pointwise", backend=copy.backend, nodes=(node,), inputs=(src,), outputs=(node,),
                  cost=Cost(src.spec.nbytes + node.spec.nbytes, 0), launch=launch,
                  source=f"# reshape {in_shape} -> {shape}: its input read as {fine} (strides {fine_strides}), "
                         f"copied row-major by:\n{copy.source}", config=copy.config,
                  note="reshape that is no view of its input: our copy kernel over the shapes' common refinement")


def lower_reference(graph: Graph) -> list[Kernel]:
    return [node_kernel(node, graph.compute_dtype) for node in graph.nodes if node.op != "input"]


def plan_items(graph: Graph) -> tuple[list[Any], dict[int, Any]]:
    """The partition lower_fused turns into kernels, in order (fusion groups, matmul and conv groups
    with their claimed epilogues, single nodes), and the nodes computed as strided views of their input."""
    from .fusion.epilogue import claim_epilogues
    from .fusion.horizontal import combine_sources
    from .fusion.views import alias_kernel_specs

    aliases = alias_kernel_specs(graph)   # views computed by torch as strided views: no copy
    return combine_sources(claim_epilogues(partition_graph(graph, aliases).items, graph), graph), aliases


def lower_fused(graph: Graph, device: str, options: dict[str, Any] | None = None) -> list[Kernel]:
    """Partition `graph` and turn each group into a kernel."""
    options = options or {}
    from .backends.conv_kernel import conv_group_kernel  # compute-bound kernels (issue 4)
    from .backends.lowering import compute_node_kernel
    from .backends.matmul_kernel import matmul_group_kernel
    from .backends.plan_precompile import precompile_plan
    from .fusion.epilogue import ConvGroup, MatmulGroup

    mark("layout + views")
    kernels: list[Kernel] = []
    items, aliases = plan_items(graph)
    mark("partition")
    with precompile_plan(items, device, options, graph.compute_dtype):  # Triton candidates compile at once, in
        mark("precompile (parallel)")                                   # parallel (streamed: as the kernels build)
        for k, item in enumerate(items):
            built = len(kernels)
            if isinstance(item, MatmulGroup):
                kernels.append(matmul_group_kernel(item, f"fg_k{k}_matmul", graph.compute_dtype, device, options))
            elif isinstance(item, ConvGroup):
                kernels.append(conv_group_kernel(item, f"fg_k{k}_conv", graph.compute_dtype, device, options))
            elif isinstance(item, Node) and item.id in aliases:
                kernels.append(view_kernel(item, *aliases[item.id]))
            elif isinstance(item, Node) and item.op == "getitem":
                kernels.append(node_kernel(item, graph.compute_dtype, note="picks one output", device=device,
                                           kind="view"))
            elif isinstance(item, Node):
                kernels.append(compute_node_kernel(item, f"fg_k{k}_{item.op}", graph.compute_dtype, device)
                               or (reshape_copy_kernel(item, f"fg_k{k}_reshape_copy", graph.compute_dtype, device)
                                   if item.op == "reshape" and settings.reshape_copy_kernel else None)
                               or node_kernel(item, graph.compute_dtype, note="no code generation for this op",
                                              device=device))
            elif isinstance(item, RowColumnGroup):
                kernels.extend(row_column_kernels(item, f"fg_k{k}_{_summary(item)}", graph.compute_dtype, device,
                                                  options))
            else:
                kernels.append(fused_kernel(item, f"fg_k{k}_{_summary(item)}", graph.compute_dtype, device, options))
            kernels_built(kernels, built)
    return kernels


def group_cost(group: KernelGroup) -> Cost:
    """What the kernel must move (each value read once, each output written once) and its FLOPs. A
    table read only through gathers counts the rows gathered (at most the table), not the table."""
    gathered: dict[int, int] = {}
    for e in group.entries:
        if e.kind == "gather":
            table = gather_source(e.node)
            gathered[table.id] = gathered.get(table.id, 0) + e.node.spec.numel * table.spec.itemsize
    loaded = {e.node.id for e in group.loads}
    nbytes = sum(min(n.spec.nbytes, gathered[n.id]) if n.id in gathered and n.id not in loaded else n.spec.nbytes
                 for n in group.inputs) + sum(e.node.spec.nbytes for e in group.stores)
    flops = 0
    for node in group.nodes:
        flops += get_op(node.op).cost([i.spec for i in node.inputs], list(node.specs), node.attrs).flops
    return Cost(nbytes, flops)


def reference_launch(group: KernelGroup, compute_dtype: str) -> Any:
    """Run a group's nodes one by one with torch (CPU path and fallback)."""
    inputs = group.inputs
    literals = list({e.node.id: e.node for e in group.entries if e.kind == "literal"}.values())
    nodes = group.nodes
    outputs = [e.node for e in group.stores]

    def launch(args: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        device = args[0].device if args else None
        env = {n.id: a for n, a in zip(inputs, args, strict=True)}
        for n in literals:
            env[n.id] = run_node(n, [], compute_dtype, device)
        for n in nodes:
            value = run_node(n, [env[i.id] for i in n.inputs], compute_dtype, device)
            if not n.inputs and device is not None:   # generators (iota) are made on the CPU
                value = value.to(device)
            env[n.id] = value
        return [in_spec_strides(env[o.id], o) for o in outputs]

    return launch


def in_spec_strides(value: torch.Tensor, node: Node) -> torch.Tensor:
    """`value` in the memory strides of `node`'s spec (what the generated kernels reading it assume:
    NHWC, a padded row of passes/pad_align.py, row-major otherwise); copied only when they differ."""
    if tuple(value.shape) != tuple(node.shape):
        return value.contiguous()
    return in_strides(value, node.spec.memory_strides)


def row_column_kernels(pair: RowColumnGroup, name: str, compute_dtype: str, device: str,
                       options: dict[str, Any]) -> list[Kernel]:
    """The paired row + column reductions as one pass, or as two kernels when not eligible."""
    from .codegen.row_column import NotEligible, RowColumnWriter

    max_block = int(options.get("max_row_block", MAX_ROW_BLOCK))
    try:
        gen = RowColumnWriter(pair, name).write_pair(max_block)
    except NotEligible:
        assert pair.row is not None and pair.separate is not None
        row = fused_kernel(pair.row, name, compute_dtype, device, options)
        cols = fused_kernel(pair.separate, name + "_cols", compute_dtype, device, options)
        # apart, each kernel runs after what it reads: a row kernel may read the column kernel's result
        # (a reduction over the other axis of a value the pair computes)
        written = {e.node.id for e in pair.separate.stores}
        return [cols, row] if any(n.id in written for n in pair.row.inputs) else [row, cols]
    return [fused_kernel(pair, name, compute_dtype, device, options, generated=gen)]


def fused_kernel(group: KernelGroup, name: str, compute_dtype: str, device: str,
                 options: dict[str, Any], generated: Any = None) -> Kernel:
    cost = group_cost(group)
    kernel = Kernel(name=name, kind=group.kind, backend="triton", nodes=tuple(group.nodes),
                    inputs=tuple(group.inputs), outputs=tuple(e.node for e in group.stores), cost=cost,
                    launch=reference_launch(group, compute_dtype))
    try:
        gen = generated if generated is not None else generate(group, name)
    except Exception as err:  # codegen must never take the plan down
        return _fallback(kernel, f"code generation failed: {type(err).__name__}: {err}")
    kernel.source = gen.source
    candidates = candidate_configs(gen, options)
    kernel.config = dict(candidates[0])
    run_triton = settings.use_triton and (device.startswith("cuda") or interpreting())
    if not run_triton:
        kernel.note = "planned as Triton; runs through the reference on this device"
        return kernel
    try:
        fns = [load_triton_function(gen.source, fn_name) for fn_name in (name, gen.finish_name) if fn_name]
        config = _choose_config(fns, gen, candidates, device, options, kernel)
        launcher = _launcher(fns, gen, config, device, fast=options.get("fast_launch", True))
        if options.get("check_compile", True) and not interpreting():
            _compile_and_check(launcher, _example_inputs(gen.inputs, device))
    except Exception as err:
        return _fallback(kernel, f"Triton compilation failed: {type(err).__name__}: {err}")
    kernel.config = dict(config)
    kernel.launch = launcher
    return kernel


@timed_stage("first launch + check")
def _compile_and_check(launcher: TritonLaunch, example: list[torch.Tensor]) -> None:
    """Compile now (failures fall back to the reference), then check the direct launch path
    against the JIT's on the same inputs; any difference turns the direct path off."""
    first = launcher(example)
    if launcher._compiled is None:
        return
    try:
        second = launcher(example)
        same = all(bool(((a == b) | (a != a)).all()) for a, b in zip(first, second, strict=True))
    except Exception:
        same = False
    if not same:
        warnings.warn(f"{launcher.fn}: direct launch disagrees with Triton's JIT; using the JIT",
                      FusionFallbackWarning, stacklevel=2)
        launcher._compiled = None
        launcher.fast = False


def _fallback(kernel: Kernel, why: str) -> Kernel:
    warnings.warn(f"{kernel.name}: {why}; running it through the torch reference", FusionFallbackWarning,
                  stacklevel=3)
    kernel.backend = "reference"
    kernel.note = why
    return kernel


def _launcher(fns: list[Any], gen: Any, config: dict[str, Any], device: str, fast: bool) -> TritonLaunch:
    grids, constexprs, num_warps = launch_parameters(gen, config)
    workspaces = [(int(config["SPLITS"]), gen.extent)] * gen.workspaces if gen.workspaces else []
    # (row-column pairs: extent = columns, so the partials are [programs, columns])
    return TritonLaunch(list(zip(fns, grids, strict=True)), constexprs, num_warps, gen.outputs, device,
                        fast=fast, workspaces=workspaces)


def _choose_config(fns: list[Any], gen: Any, candidates: list[dict[str, Any]], device: str,
                   options: dict[str, Any], kernel: Kernel) -> dict[str, Any]:
    try:
        from .tune import Config, tune
        from .tune.autotuner import floor_ms_of, summary
    except ImportError:
        return candidates[0]
    if not device.startswith("cuda") or not settings.autotune or len(candidates) == 1:
        return candidates[0]

    def bench(config: Any) -> float:
        from .tune import bench_ms

        launcher = _launcher(fns, gen, dict(config.values), device, fast=False)
        args = _example_inputs(gen.inputs, device)
        return bench_ms(lambda: launcher(args))

    key = {"source": gen.source, "device": device}
    # pointwise and reductions: a heuristic config when small (tune "fast"), unless the tile shape matters
    result = tune(gen.name, key, [Config(c) for c in candidates], bench, floor_ms=floor_ms_of(kernel),
                  memory_bound=heuristic_config_ok(gen))
    kernel.tuning = summary(result, len(candidates))  # where the choice (and the build time) came from
    return dict(result.config.values)


def _example_inputs(nodes: Sequence[Node], device: str) -> list[torch.Tensor]:
    out = []
    for n in nodes:
        dt = dtypes.to_torch(n.dtype)
        size = 1 + sum((s - 1) * st for s, st in zip(n.shape, n.spec.memory_strides, strict=True)) if n.shape else 1
        base = torch.randn(max(size, 1), device=device).to(dt) if dt.is_floating_point else \
            torch.zeros(max(size, 1), dtype=dt, device=device)
        out.append(base.as_strided(n.shape, n.spec.memory_strides) if n.shape else base.reshape(()))
    return out


def _summary(group: KernelGroup) -> str:
    if not isinstance(group, KernelGroup):   # a ComboGroup of several groups (fusion/horizontal.py)
        members = group.members  # type: ignore[attr-defined]
        return f"combo{len(members)}_" + _summary(members[0])
    ops = [n.op for n in group.nodes if n.op not in ("cast",)]
    picked: list[str] = []
    for op in ops:
        if op not in picked:
            picked.append(op)
    return "_".join(picked[:4]) or "copy"


_ = (math, is_literal)
