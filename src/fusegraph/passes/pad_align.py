"""pad_align: GEMM operands and results with aligned row strides (a memory layout choice only).

A row-major [M, N] value whose row is not a multiple of 16 bytes (N % 8 != 0 in bf16/fp16,
N % 4 != 0 in fp32; a vocabulary of 50257) makes every GEMM that reads or writes it slow:
cuBLAS falls back to its `align1` kernels (GPT-2's LM-head weight gradient g^T @ h on an H200:
4.3-4.5 ms, 1.25 ms with g padded) and our Triton GEMM loses its TMA path (descriptors need 16-byte
aligned strides). Inductor avoids this by padding strides; so does this pass:

- a value produced inside the plan by a kernel that writes its output through its spec's strides
  (a generated Triton kernel or a GEMM) that a GEMM reads (directly or through views that stay
  strided views) gets a padded row stride: [8192, 50257] bf16 is stored with strides (50304, 1).
  The write costs nothing more; every consumer reads it as a strided view (generated kernels bake
  the spec's strides into their indexing, GEMMs take them as literals or leading dimensions, torch
  takes any strides). On the H200 (bench/results/pad_align_20261130_2250.txt) this took the LM
  head's dh = g @ W from 3.12 to 0.86 ms and dW = g^T @ h from 2.55 to 0.86 ms (our Triton GEMM,
  now with TMA); bare cuBLAS dW 4.28 -> 1.25 ms;
- a GEMM result that no GEMM reads is padded only with settings.pad_results (off): the same run measured
  the forward logits GEMM with a padded output at 2.19 ms against 1.07 ms dense (another config
  won), and bare cuBLAS h @ W^T took 6.67 ms into a dense and 6.66 ms into a padded output;
- a graph input (or a value a library kernel computes) that a GEMM reads misaligned is copied once
  per call into a padded buffer (a `to_layout` node, a generated copy kernel) when the copy costs
  no more than COPY_BUDGET times the floor of the GEMMs that read it (device cost model) and is
  at least MIN_COPY_BYTES: a weight [50257, 768] needs none (768 % 8 == 0), a [*, 50257] input does.

Graph outputs are not padded (callers, AOTAutograd among them, get the strides they traced) unless
the caller says it takes them so (`pad_outputs`, build option pad_outputs: the torch backend's saved
activations, which only its own backward reads, with settings.pad_saved), nor
values read by attention or convolution kernels (their backends pick their own layouts), nor
values that already carry a layout. Rows of at least WIDE_MIN_ROW_BYTES are aligned to 128 bytes
(a cache line, as Inductor does), shorter ones to 16; rows that padding would grow by more than
MAX_GROWTH are left alone.

Setting pad_align (FUSEGRAPH_PAD_ALIGN=0, or `pad_align_disabled()`) builds without it (bench/pad_align_gpu.py).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from ..ir.graph import Graph
from ..ir.node import Attrs, Node
from ..ir.registry import COMPOSITE, MATMUL, POINTWISE, SOURCE, VIEW, get_op
from ..ir.spec import TensorSpec
from ..settings import override, settings
from .base import graph_pass

ALIGN_BYTES = 16            # cuBLAS's aligned (align8 bf16) kernels and TMA descriptors need this
WIDE_ALIGN_BYTES = 128      # a cache line, for rows long enough that padding to it costs <= 1/16
WIDE_MIN_ROW_BYTES = 2048
MAX_GROWTH = 1.25           # do not pad a row by more than a quarter of its length
COPY_BUDGET = 1.0           # an input copy may cost up to this fraction of the reading GEMMs' floor
MIN_COPY_BYTES = 1 << 20    # smaller inputs are not worth a launch
MIN_OUTPUT_BYTES = 1 << 20  # pad_outputs: smaller outputs are left dense
EPILOGUE_DEPTH = 4          # with settings.pad_results: same-shape pointwise steps after a GEMM padded too
GEMM_DTYPES = ("float16", "bfloat16", "float32")
RATE_KEYS = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}


@contextmanager
def pad_align_disabled() -> Iterator[None]:
    """Build without the pass inside this block (benchmarks compare both): settings.pad_align off."""
    with override(pad_align=False):
        yield


def padded_row(length: int, itemsize: int) -> int | None:
    """The padded row length (elements) of a row of `length` elements, or None when the row is
    aligned already or padding would grow it by more than MAX_GROWTH."""
    row_bytes = length * itemsize
    if length <= 1 or row_bytes % ALIGN_BYTES == 0:
        return None
    align = WIDE_ALIGN_BYTES if row_bytes >= WIDE_MIN_ROW_BYTES else ALIGN_BYTES
    padded_bytes = -(-row_bytes // align) * align
    if padded_bytes % itemsize or padded_bytes > MAX_GROWTH * row_bytes:
        return None
    return padded_bytes // itemsize


def padded_strides(spec: TensorSpec) -> tuple[int, ...] | None:
    """Row-major strides of `spec` with the last dim's rows padded (padded_row), or None when the
    value has a layout of its own, one row, or an aligned (or too short) row."""
    if spec.rank < 2 or spec.dtype not in GEMM_DTYPES or not _row_major(spec):
        return None
    if math.prod(spec.shape[:-1]) <= 1 or spec.numel == 0:
        return None
    row = padded_row(spec.shape[-1], spec.itemsize)
    if row is None:
        return None
    strides = [1, row]
    for size in reversed(spec.shape[1:-1]):
        strides.append(strides[-1] * max(size, 1))
    return tuple(reversed(strides))


def _row_major(spec: TensorSpec) -> bool:
    """Plain row-major: no layout, or the "strided" tag pointwise shape rules copy from an input
    without its strides (which then are the contiguous ones)."""
    return spec.strides is None and spec.layout in (None, "strided")


def is_gemm(node: Node) -> bool:
    opdef = get_op(node.op)
    return (opdef.has(MATMUL) and opdef.extra.get("kernel_kind") == "matmul" and not node.multi_output
            and node.dtype in GEMM_DTYPES and all(i.dtype in GEMM_DTYPES for i in node.inputs))


def _view(node: Node) -> bool:
    opdef = get_op(node.op)
    return opdef.has(VIEW) and "fold" in opdef.extra and len(node.inputs) == 1 and not node.multi_output \
        and not node.inputs[0].multi_output


def view_base(operand: Node) -> tuple[Node, list[Node]]:
    """The value `operand` is a chain of views of, and that chain (nearest the operand first)."""
    chain: list[Node] = []
    while _view(operand):
        chain.append(operand)
        operand = operand.inputs[0]
    return operand, chain


def chain_folds(chain: list[Node], strides: tuple[int, ...]) -> bool:
    """Whether every view of `chain` (nearest the operand first) stays a strided view of a base laid
    out with `strides` (a view that regroups the padded row would be a copy: nothing gained)."""
    current, offset = strides, 0
    for view in reversed(chain):
        result = get_op(view.op).extra["fold"](view.inputs[0].spec, view.attrs, current, offset)
        if result is None:
            return False
        current, offset = tuple(result[0]), int(result[1])
    return True


def _writes_own_layout(node: Node) -> bool:
    """Produced by a kernel that stores through the spec's strides: generated code or a GEMM."""
    from ..fusion.partition import fusable

    if node.multi_output or get_op(node.op).has(SOURCE) or node.op == "getitem":
        return False
    return is_gemm(node) or (fusable(node) and not get_op(node.op).has(VIEW))


def _reader_accepts(reader: Node, users: dict[int, list[Node]], outputs: set[int], depth: int = 0) -> bool:
    """Does `reader` read a padded value as well as a dense one? Generated kernels and GEMMs index
    through the spec, library ops run by torch take any tensor; attention and convolution backends
    are left alone, and so is a view that is a graph output (a free alias of a dense value, a copy
    of a padded one: the forward's logits, returned reshaped)."""
    from ..fusion.partition import fusable

    if is_gemm(reader) or (fusable(reader) and not get_op(reader.op).has(VIEW)):
        return True
    if get_op(reader.op).has(VIEW):   # an alias (its readers decide) or a generated copy
        return depth < 8 and reader.id not in outputs and \
            all(_reader_accepts(u, users, outputs, depth + 1) for u in users.get(reader.id, []))
    return get_op(reader.op).extra.get("kernel_kind") is None


def _copyable(value: Node) -> bool:
    """A graph input or a library kernel's result. Not a constant (`fold` would undo the copy), nor a
    composite op (the first pipeline run sees the graph before decomposition: its primitives are
    padded, where they feed a GEMM, by the run after it)."""
    if value.op == "input":
        return True
    opdef = get_op(value.op)
    return not (opdef.has(SOURCE) or opdef.has(COMPOSITE) or value.multi_output or value.op == "getitem")


def _readers_accept(value: Node, users: dict[int, list[Node]], outputs: set[int]) -> bool:
    return all(_reader_accepts(u, users, outputs) for u in users.get(value.id, []))


def _epilogue_values(gemm: Node, users: dict[int, list[Node]]) -> list[Node]:
    """The GEMM's result and the same-shape pointwise values after it (what its epilogue stores)."""
    from ..fusion.partition import fusable

    found, frontier = [gemm], [gemm]
    for _ in range(EPILOGUE_DEPTH):
        nxt = [u for n in frontier for u in users.get(n.id, [])
               if get_op(u.op).has(POINTWISE) and fusable(u) and u.shape == gemm.shape and not u.multi_output
               and all(u.id != f.id for f in found)]
        nxt = list({u.id: u for u in nxt}.values())
        found += nxt
        frontier = nxt
    return found


@dataclass
class _CopyCandidate:
    value: Node
    strides: tuple[int, ...]
    readers: set[int] = field(default_factory=set)   # ids of the nodes reading `value` on a GEMM path
    floor_s: float = 0.0                             # summed floors of the GEMMs it feeds


def _gemm_floor_s(gemm: Node, device: Any) -> float:
    cost = get_op(gemm.op).cost([i.spec for i in gemm.inputs], list(gemm.specs), gemm.attrs)
    key = RATE_KEYS[gemm.inputs[0].dtype]
    rate = device.rate(key) if device.has_rate(key) else device.rate("fp32")
    return max(cost.flops / rate, cost.bytes / device.bandwidth)


def _default_device() -> Any:
    from ..perf.devices import detect_device, get_device

    return detect_device() or get_device("H100")


def pad_align_graph(graph: Graph, device: Any = None, min_copy_bytes: int | None = None) -> Graph:
    """The graph with padded row strides for misaligned GEMM operands and results (module docstring);
    `device` (a perf.devices.DeviceSpec; default the present GPU, else H100) prices input copies,
    `min_copy_bytes` (default MIN_COPY_BYTES) is the smallest input worth one."""
    min_copy_bytes = MIN_COPY_BYTES if min_copy_bytes is None else min_copy_bytes
    users = graph.users()
    outputs = {n.id for n in graph.outputs}
    pads: dict[int, tuple[int, ...]] = {}
    copies: dict[int, _CopyCandidate] = {}
    from .pad_dims import zero_padded

    for gemm in graph.nodes:
        if not is_gemm(gemm) or zero_padded(gemm):   # pad_dims gives it aligned dims instead
            continue
        for operand in dict.fromkeys(gemm.inputs):
            base, chain = view_base(operand)
            strides = padded_strides(base.spec)
            if strides is None or base.id in outputs or not chain_folds(chain, strides):
                continue
            if _writes_own_layout(base):
                if _readers_accept(base, users, outputs):
                    pads[base.id] = strides
            elif _copyable(base) and (not chain or _reader_accepts(chain[-1], users, outputs)):
                cand = copies.setdefault(base.id, _CopyCandidate(base, strides))
                cand.readers.add((chain[-1] if chain else gemm).id)
                device = device or _default_device()
                cand.floor_s += _gemm_floor_s(gemm, device)
        for value in _epilogue_values(gemm, users) if settings.pad_results else ():
            strides = padded_strides(value.spec)
            if strides is not None and value.id not in outputs and _readers_accept(value, users, outputs):
                pads[value.id] = strides
    if copies:
        bandwidth = (device or _default_device()).bandwidth
        copies = {k: c for k, c in copies.items() if c.value.spec.nbytes >= min_copy_bytes
                  and 2 * c.value.spec.nbytes / bandwidth <= COPY_BUDGET * c.floor_s}
    if not pads and not copies:
        return graph
    return _rewrite(graph, pads, copies)


def _padded_copy(value: Node, strides: tuple[int, ...]) -> Node:
    spec = value.spec.with_(layout="strided", strides=strides)
    return Node(op="to_layout", inputs=(value,), attrs=Attrs(layout="contiguous"), specs=(spec,),
                name=f"{value.name}.padded", source=value.source)


def _rewrite(graph: Graph, pads: dict[int, tuple[int, ...]], copies: dict[int, _CopyCandidate]) -> Graph:
    mapping: dict[int, Node] = {}
    made: dict[int, Node] = {}        # input id -> its padded copy
    for node in graph.nodes:
        if node.op == "input":
            mapping[node.id] = node
            continue
        inputs = []
        for i in node.inputs:
            new = mapping[i.id]
            cand = copies.get(i.id)
            if cand is not None and node.id in cand.readers:
                if i.id not in made:
                    made[i.id] = _padded_copy(new, cand.strides)
                new = made[i.id]
            inputs.append(new)
        specs = node.specs
        if node.id in pads:
            specs = (node.spec.with_(layout="strided", strides=pads[node.id]), *specs[1:])
        changed = specs is not node.specs or any(a is not b for a, b in zip(inputs, node.inputs, strict=True))
        mapping[node.id] = node.replace(inputs=tuple(inputs), specs=specs) if changed else node
    return graph.with_(outputs=tuple(mapping[n.id] for n in graph.outputs))


def pad_outputs(graph: Graph, positions: Collection[int]) -> Graph:
    """Padded row strides for the graph outputs at `positions` (a caller that takes any row stride
    there and reads the returned tensor's strides), where the row is misaligned, the value is at
    least MIN_OUTPUT_BYTES, written by a kernel that stores through its spec and read only by nodes
    that take a padded value. Not for a value also returned at a position outside `positions`."""
    if not settings.pad_align or not positions:
        return graph
    users = graph.users()
    outputs = {n.id for n in graph.outputs}
    fixed = {n.id for k, n in enumerate(graph.outputs) if k not in positions}
    pads: dict[int, tuple[int, ...]] = {}
    for k in sorted(set(positions)):
        node = graph.outputs[k]
        strides = padded_strides(node.spec)
        if strides is None or node.id in fixed or node.spec.nbytes < MIN_OUTPUT_BYTES:
            continue
        if _writes_own_layout(node) and _readers_accept(node, users, outputs):
            pads[node.id] = strides
    return _rewrite(graph, pads, {}) if pads else graph


@graph_pass("pad_align")
def pad_align(graph: Graph) -> Graph:
    """Aligned (padded) row strides for misaligned GEMM operands and results; input copies by cost."""
    if not settings.pad_align:
        return graph
    return pad_align_graph(graph)
