"""build(): the whole compiler, one readable sequence. Graph -> passes -> lowering -> Plan."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from .codegen.gemm_configs import candidate_set
from .errors import ExecutionError, FusegraphError, InvalidValueError, where
from .ir.graph import Graph
from .ir.node import Node
from .ir.registry import SOURCE, VIEW, get_op
from .ir.spec import TensorSpec
from .ir.verify import verify
from .lower import lower_fused, lower_reference
from .passes import optimize
from .passes.base import Pass
from .passes.decompose import decompose_keeping
from .passes.layout import layout_pass
from .passes.pad_align import pad_outputs, padded_strides
from .passes.pad_dims import pad_gemm_dims
from .runtime.cuda_graph import check_graph_outputs
from .runtime.plan import Plan
from .settings import settings
from .tune.build_profile import mark, profiled_build
from .tune.precompile import start_triton_warmup


def default_device(hint: str | None = None) -> str:
    if hint:
        return str(hint)
    return "cuda" if torch.cuda.is_available() else "cpu"


@profiled_build
def compile_graph(graph: Graph, device: str | None = None, input_handles: Sequence[Any] = (),
                  output_handles: Sequence[Any] = (), **options: Any) -> Plan:
    """Optimize, decompose, partition and generate kernels for `device`; returns a runnable Plan.

    Options: static (a call with another input signature raises instead of rebuilding),
    fuse (False: one reference kernel per op), max_row_block (widest row held whole in registers),
    keep_composites (composite ops not to decompose), fast_launch (direct launches on CUDA),
    cuda_graphs (True: capture the plan as one CUDA graph when possible, False: never, None/absent:
    automatically when launch-bound; runtime/cuda_graph.py), graph_outputs ("copy": outputs the caller
    owns each call, the default (large ones are the captured buffers while the caller drops them
    before the next call); "alias": the captured output buffers, valid until the next call; "reuse": the
    captured buffers while the caller holds none of the previous call's, captured at the second call,
    reading other reuse plans' outputs in place: training graphs of the torch backend), static_inputs
    (positions of inputs a CUDA graph reads in place instead of copying: weights that stay the same
    tensor from call to call; Graph.build also takes handles), conv_layout ("auto": NHWC around
    tensor-core convolutions, "NHWC", "NCHW"; passes/layout.py), allow_tf32 (fp32 convolutions may
    use TF32 tensor cores, which also makes them candidates for NHWC), output_strides (per graph output,
    the strides to return a view output in, a dense permutation; None = row-major; fusion/views.py),
    held_outputs (graph_outputs="reuse": positions of the outputs a caller may keep past the next call,
    whose small buffers are then cloned; absent = all; the torch backend leaves out saved activations),
    pad_outputs (positions of outputs the caller takes with padded rows, reading the returned strides:
    misaligned large ones get them, passes/pad_align.py; the torch backend's saved activations),
    layout_outputs (positions of 4-D outputs the caller takes in the layout the layout pass chose for
    them, reading the returned strides: channels-last ones are not copied back to row-major; the
    torch backend's saved activations, which the backward's plan then reads channels-last),
    gemm_variant ("tiled", "persistent", "streamk", "splitk", "gemv" or "pingpong": only that kind of generated GEMM
    candidate beside cuBLAS), gemm_candidates ("full", the default; "conv": the smaller set that 1x1
    convolutions' inner GEMM plans use, codegen/gemm_configs.GEMM_CANDIDATE_SETS).
    """
    device = default_device(device)
    start_triton_warmup(device)   # Triton's import and CUDA driver start overlap the passes (tune/precompile.py)
    check_graph_outputs(options.get("graph_outputs", "copy"))
    candidate_set(options)   # raises on an unknown gemm_candidates
    if options.get("cuda_graphs") not in (None, True, False):
        raise InvalidValueError(f"build option cuda_graphs={options['cuda_graphs']!r}: use True, False or None "
                                f"(automatic)")
    static_inputs = check_static_inputs(options.get("static_inputs", ()), len(graph.inputs))
    held_outputs = check_held_outputs(options.get("held_outputs"), len(graph.outputs))
    primitive = front_end(graph, options)
    kernels = lower_fused(primitive, device, options) if options.get("fuse", True) else lower_reference(primitive)
    mark("lower (rest)")

    def rebuild(specs: Sequence[TensorSpec]) -> Plan:
        return compile_graph(respecialize(graph, specs), device, input_handles, output_handles, **options)

    plan = Plan(primitive, kernels, device, input_handles, output_handles,
                static=bool(options.get("static", False)), rebuild=rebuild,
                cuda_graphs=options.get("cuda_graphs"), graph_outputs=options.get("graph_outputs", "copy"),
                static_inputs=static_inputs, held_outputs=held_outputs)
    mark("plan (memory plan, guards)")
    _dump(plan)
    return plan


def front_end(graph: Graph, options: dict[str, Any], marks: bool = True) -> Graph:
    """The graph as lowering takes it: verified, optimized, decomposed, laid out (and with fuse on,
    views prepared as strided aliases). `marks`: record each stage in the build profile (off for a
    look at another graph in the middle of a build: plan_precompile's inner plans)."""
    stage = mark if marks else (lambda name: None)
    verify(graph)
    stage("verify")
    optimized = optimize(graph)
    stage("passes")
    # decompose runs as a Pass: recorded in provenance and verified like the others
    primitive = optimize(decompose_keeping(frozenset(options.get("keep_composites", ())))(optimized))
    stage("decompose + passes")
    # channels-last for tensor-core convolutions and the chains around them (passes/layout.py)
    free_layout = check_positions("layout_outputs", options.get("layout_outputs", ()), len(graph.outputs))
    primitive = layout_pass(options.get("conv_layout", "auto"), bool(options.get("allow_tf32", False)),
                            free_layout)(primitive)
    pad_at = check_positions("pad_outputs", options.get("pad_outputs", ()), len(graph.outputs))
    # misaligned GEMM dims zero-padded, results sliced (passes/pad_dims.py); sliced outputs only at pad_at
    primitive = Pass("pad_gemm_dims", lambda g: pad_gemm_dims(g, pad_at))(primitive)
    output_strides = options.get("output_strides")
    if pad_at:   # outputs the caller takes with padded rows (passes/pad_align.py)
        primitive = Pass("pad_outputs", lambda g: pad_outputs(g, pad_at))(primitive)
        output_strides = padded_view_outputs(primitive, pad_at, output_strides)
    if options.get("fuse", True):
        from .fusion.views import prepare as prepare_views  # views as strided aliases (fusion/views.py)

        primitive = prepare_views(primitive, output_strides)
    return primitive


def padded_view_outputs(graph: Graph, positions: Sequence[int], output_strides: Sequence[Any] | None
                        ) -> Sequence[Any] | None:
    """`output_strides` with padded rows asked for the view outputs at `positions` whose rows are
    misaligned (a slice of a zero-padded GEMM result: returned as that alias, not copied dense)."""
    asked = list(output_strides) if output_strides is not None else [None] * len(graph.outputs)
    changed = False
    for k in positions:
        node = graph.outputs[k]
        strides = padded_strides(node.spec) if get_op(node.op).has(VIEW) and not node.multi_output else None
        if strides is not None and k < len(asked):
            asked[k], changed = strides, True
    return asked if changed else output_strides


def check_static_inputs(value: Any, n_inputs: int) -> tuple[int, ...]:
    """The build option static_inputs as sorted input positions, or InvalidValueError."""
    items = list(value) if isinstance(value, list | tuple | set | frozenset) else None
    if items is None or not all(type(i) is int and 0 <= i < n_inputs for i in items):
        raise InvalidValueError(f"build option static_inputs={value!r}: use a list of input positions "
                                f"0..{n_inputs - 1} (Graph.build also takes input handles)")
    return tuple(sorted(set(items)))


def check_held_outputs(value: Any, n_outputs: int) -> tuple[int, ...] | None:
    """The build option held_outputs as sorted output positions (None: every output), or InvalidValueError."""
    return None if value is None else check_positions("held_outputs", value, n_outputs, ", or None for all")


def check_positions(option: str, value: Any, n_outputs: int, hint: str = "") -> tuple[int, ...]:
    """A build option naming graph outputs by position, sorted, or InvalidValueError."""
    items = list(value) if isinstance(value, list | tuple | set | frozenset) else None
    if items is None or not all(type(i) is int and 0 <= i < n_outputs for i in items):
        raise InvalidValueError(f"build option {option}={value!r}: use a list of output positions "
                                f"0..{n_outputs - 1}{hint}")
    return tuple(sorted(set(items)))


def respecialize(graph: Graph, specs: Sequence[TensorSpec]) -> Graph:
    """The same graph for other input specs (shapes, dtypes, strides), every node re-inferred."""
    mapping: dict[int, Node] = {}
    new_inputs = []
    for node, spec in zip(graph.inputs, specs, strict=True):
        mapping[node.id] = node.replace(specs=(spec,))
        new_inputs.append(mapping[node.id])
    for node in graph.nodes:
        if node.id in mapping:
            continue
        inputs = tuple(mapping[i.id] for i in node.inputs)
        opdef = get_op(node.op)
        if opdef.has(SOURCE):
            mapping[node.id] = node
            continue
        try:
            if node.op == "getitem":
                out_specs: tuple[TensorSpec, ...] = (inputs[0].specs[node.attrs["index"]],)
            else:
                out = opdef.infer([i.spec for i in inputs], node.attrs)
                out_specs = out if isinstance(out, tuple) else (out,)
        except FusegraphError as err:
            raise ExecutionError(f"{where(node.op, node.name, node.source)}: the graph cannot be rebuilt "
                                 f"for inputs {', '.join(str(s) for s in specs)}: {err}") from None
        mapping[node.id] = node.replace(inputs=inputs, specs=out_specs)
    return Graph(graph.name, tuple(new_inputs), tuple(mapping[n.id] for n in graph.outputs), graph.compute_dtype)


_DUMPED: dict[tuple[str, str], int] = {}   # (dump dir, graph name) -> plans dumped under that name


def _dump_stem(folder: str, name: str) -> str:
    """The file stem for this build's dump: the graph's name, then name.2, name.3, ... for later builds
    of a graph with the same name in this process (two torch.compile frames each have a forward_fused_0;
    a recompile rebuilds one), so no dump overwrites another."""
    count = _DUMPED.get((folder, name), 0) + 1
    _DUMPED[(folder, name)] = count
    return name if count == 1 else f"{name}.{count}"


def _dump(plan: Plan) -> None:
    if settings.debug >= 1:
        print(plan.graph)
    if settings.debug >= 2:
        print(plan)
    if settings.debug >= 3:
        for k in plan.kernels:
            print(f"# ---- {k.name} ----\n{k.source}")
    if settings.dump_dir:
        os.makedirs(settings.dump_dir, exist_ok=True)
        base = os.path.join(settings.dump_dir, _dump_stem(settings.dump_dir, plan.graph.name))
        with open(base + ".graph.txt", "w") as f:
            f.write(str(plan.graph) + "\n")
        with open(base + ".plan.txt", "w") as f:
            f.write(str(plan) + "\n")
        for k in plan.kernels:
            if k.backend == "triton":
                with open(f"{base}.{k.name}.py", "w") as f:
                    f.write(k.source)
