"""Memory plan of a Plan: liveness of every value over the launch schedule, an offset assignment of
the intermediate buffers into one arena, and the in-place choices for generated pointwise kernels.

The schedule is a list of steps (what each launch reads and writes, as slot numbers). A value that is
a view of another (reshape, getitem, an in-place output) has no bytes of its own: it extends its
base buffer's interval. A buffer lives from the step that writes it to the last step that reads any
value sharing it; graph outputs live to the end of the call. Graph inputs and build-time constants
are resident before and after the call and are never planned.

Offsets follow the usual buffer assignment (XLA, TVM): buffers sorted by size (largest first), each
placed in the smallest gap left by the buffers already placed whose intervals overlap its own
(best fit), or above them all. Two buffers share bytes of the arena only when their intervals are
disjoint. The arena is what one allocation of intermediates would need; the plan reports it next to
the sum without reuse and the peak of live bytes (intermediates + outputs) over the schedule, which
is what the torch caching allocator can at best reach when each value is dropped at its last use.

What the runtime does with it: kernels still allocate their outputs through torch's caching
allocator and the Plan drops each value right after its last reader (outputs nothing reads, at
once), so reuse follows the plan's liveness; a CUDA-graph capture records the same drops, and its
private pool reuses the freed blocks inside the graph. The offsets are a report (how small one arena
could be), not an allocation: outputs are made by several launchers (generated Triton, GEMM, cuBLAS,
cuDNN, torch references), and a persistent arena would stay allocated between calls. What the plan
changes is in-place writes: a generated one-stage elementwise kernel writes an output into an input
of the same shape, dtype and strides that dies at that kernel, and a scatter (index_put, index_copy,
scatter_add, slice_scatter) writes into its destination when that dies there, instead of into a copy
of it (choose_inplace has the rules).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..ir.registry import POINTWISE, VIEW, WRITES_INPUT, get_op
from .launch import TritonLaunch

ALIGN = 256   # bytes: every planned buffer starts at a multiple (CUDA allocations are 512-aligned)


@dataclass(frozen=True)
class Step:
    """One launch as the planner sees it: the slots it reads and the slots it writes."""

    reads: tuple[int, ...]
    writes: tuple[int, ...]


@dataclass(frozen=True)
class Buffer:
    """Storage of one base value (and of the values that alias it), live over [start, end]."""

    slot: int                   # the base value
    nbytes: int
    start: int                  # step that writes it
    end: int                    # last step that reads it or a value aliasing it (n_steps: an output)
    members: tuple[int, ...]    # the base and every value sharing its storage
    output: bool = False        # holds a graph output: handed to the caller, not an arena slice

    def overlaps(self, other: Buffer) -> bool:
        return self.start <= other.end and other.start <= self.end


@dataclass
class MemoryPlan:
    """plan.memory: what the schedule needs. Bytes are per call; inputs and constants are resident."""

    arena_bytes: int            # one arena holding every intermediate buffer at its offset
    peak_live_bytes: int        # max over steps of live intermediates + outputs written so far
    no_reuse_bytes: int         # sum of the intermediate buffers (every one its own allocation)
    num_buffers: int            # intermediate buffers (views and in-place outputs are not buffers)
    reused: int                 # intermediate buffers placed over bytes of an earlier, dead buffer
    inplace: int                # kernels' outputs written into an input buffer that dies there
    input_bytes: int
    output_bytes: int
    constant_bytes: int = 0
    buffers: list[Buffer] = field(default_factory=list)
    offsets: dict[int, int] = field(default_factory=dict)    # base slot -> arena offset

    def summary(self) -> str:
        return (f"memory: {self.num_buffers} intermediate buffer(s) in an arena of {fmt_bytes(self.arena_bytes)} "
                f"(no reuse: {fmt_bytes(self.no_reuse_bytes)}; {self.reused} reused, {self.inplace} in place); "
                f"planned peak {fmt_bytes(self.peak_live_bytes)} (intermediates + outputs); "
                f"inputs {fmt_bytes(self.input_bytes)}, outputs {fmt_bytes(self.output_bytes)}"
                + (f", constants {fmt_bytes(self.constant_bytes)}" if self.constant_bytes else ""))

    def as_dict(self) -> dict[str, int]:
        return {"arena_bytes": self.arena_bytes, "peak_live_bytes": self.peak_live_bytes,
                "no_reuse_bytes": self.no_reuse_bytes, "num_buffers": self.num_buffers, "reused": self.reused,
                "inplace": self.inplace, "input_bytes": self.input_bytes, "output_bytes": self.output_bytes,
                "constant_bytes": self.constant_bytes}


def fmt_bytes(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class _Sets:
    """Union-find over slots: which values may share storage."""

    def __init__(self) -> None:
        self.parent: dict[int, int] = {}

    def find(self, x: int) -> int:
        parent = self.parent
        root = x
        while parent.get(root, root) != root:
            root = parent[root]
        while parent.get(x, x) != root:
            parent[x], x = root, parent[x]
        return root

    def union(self, a: int, b: int) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[max(ra, rb)] = min(ra, rb)   # the earliest slot stays the root (the base)


def base_of(slot: int, view_of: Mapping[int, int]) -> int:
    seen = set()
    while slot in view_of and slot not in seen:
        seen.add(slot)
        slot = view_of[slot]
    return slot


def buffers_of(steps: Sequence[Step], nbytes: Mapping[int, int], outputs: Sequence[int],
               view_of: Mapping[int, int], resident: set[int]) -> list[Buffer]:
    """The planned buffers: one per base value written by a step and not resident (input, constant).
    view_of maps a value to the value whose storage it shares."""
    n = len(steps)
    written: dict[int, int] = {}
    last: dict[int, int] = {}
    for s, step in enumerate(steps):
        for v in step.writes:
            written.setdefault(v, s)
            last.setdefault(v, s)        # a value never read dies where it is written
        for v in step.reads:
            last[v] = s
    for v in outputs:
        last[v] = n
    members: dict[int, list[int]] = {}
    for v in written:
        members.setdefault(base_of(v, view_of), []).append(v)
    out_set = set(outputs)
    result = []
    for base, group in members.items():
        if base in resident or base not in written:
            continue
        end = max(last.get(v, written[v]) for v in group)
        result.append(Buffer(base, int(nbytes.get(base, 0)), written[base], end, tuple(sorted(group)),
                             output=any(v in out_set for v in group)))
    return sorted(result, key=lambda b: b.slot)


def assign_offsets(buffers: Sequence[Buffer]) -> tuple[dict[int, int], int]:
    """Best-fit offsets, largest buffer first; two buffers share bytes only when their intervals
    are disjoint. Returns (base slot -> offset, arena size)."""
    placed: list[tuple[int, int, Buffer]] = []     # (offset, size, buffer)
    offsets: dict[int, int] = {}
    arena = 0
    for buf in sorted(buffers, key=lambda b: (-b.nbytes, b.start, b.slot)):
        size = aligned(buf.nbytes)
        busy = sorted((o, o + sz) for o, sz, other in placed if other.overlaps(buf))
        best: int | None = None
        best_gap = 0
        cursor = 0
        for lo, hi in busy:
            gap = lo - cursor
            if gap >= size and (best is None or gap < best_gap):
                best, best_gap = cursor, gap
            cursor = max(cursor, hi)
        offset = best if best is not None else cursor
        offsets[buf.slot] = offset
        placed.append((offset, size, buf))
        arena = max(arena, offset + size)
    return offsets, arena


def peak_live(buffers: Sequence[Buffer], n_steps: int) -> int:
    """Max over steps of the bytes of buffers live at that step (a launch's inputs and outputs
    are live together)."""
    delta = [0] * (n_steps + 2)
    for b in buffers:
        delta[b.start] += b.nbytes
        delta[min(b.end, n_steps) + 1] -= b.nbytes
    peak = live = 0
    for d in delta:
        live += d
        peak = max(peak, live)
    return peak


def plan_memory(steps: Sequence[Step], nbytes: Mapping[int, int], inputs: Sequence[int], outputs: Sequence[int],
                view_of: Mapping[int, int] | None = None, constants: Sequence[int] = (),
                inplace: int = 0) -> MemoryPlan:
    """The memory plan of a schedule. nbytes: bytes of every slot; inputs: the graph inputs' slots;
    outputs: the graph outputs' slots (may repeat or be inputs); view_of: value -> the value whose
    storage it shares; constants: slots made once at build time; inplace: how many outputs were
    placed into an input buffer (already part of view_of)."""
    view_of = dict(view_of or {})
    resident = set(inputs) | set(constants)
    buffers = buffers_of(steps, nbytes, outputs, view_of, resident)
    arena_buffers = [b for b in buffers if not b.output]
    offsets, arena = assign_offsets(arena_buffers)
    reused = 0
    for b in arena_buffers:
        lo, hi = offsets[b.slot], offsets[b.slot] + aligned(b.nbytes)
        if any(o.start < b.start and not o.overlaps(b) and offsets[o.slot] < hi
               and lo < offsets[o.slot] + aligned(o.nbytes) for o in arena_buffers):
            reused += 1
    out_bases = {base_of(v, view_of) for v in outputs}
    return MemoryPlan(
        arena_bytes=arena, peak_live_bytes=peak_live(buffers, len(steps)),
        no_reuse_bytes=sum(b.nbytes for b in arena_buffers), num_buffers=len(arena_buffers), reused=reused,
        inplace=inplace, input_bytes=sum(int(nbytes.get(v, 0)) for v in set(inputs)),
        output_bytes=sum(int(nbytes.get(v, 0)) for v in out_bases),
        constant_bytes=sum(int(nbytes.get(v, 0)) for v in set(constants)), buffers=buffers, offsets=offsets)


def choose_inplace(steps: Sequence[Step], outputs: Sequence[int], may_share: Mapping[int, Sequence[int]],
                   pinned: set[int], eligible: Mapping[int, Sequence[tuple[int, int]]]) -> dict[int, dict[int, int]]:
    """Which outputs write into one of their kernel's inputs. eligible[step] lists (output position,
    input position) pairs the kernel allows (same shape, dtype and strides, pure elementwise access);
    may_share[v] lists values v may share storage with (views, reference kernels that can return their
    input); pinned: values that must never be written (graph inputs, static inputs, constants).
    A pair is taken only when every value that may share the input's storage is dead after this step
    (no later reader, not a graph output, not pinned) and no other input of the step shares it.
    Returns step -> {output position: input position}."""
    sets = _Sets()
    for v, others in may_share.items():
        for o in others:
            sets.union(v, o)
    last: dict[int, int] = {}
    for s, step in enumerate(steps):
        for v in (*step.writes, *step.reads):
            last[v] = s
    n = len(steps)
    for v in outputs:
        last[v] = n
    group_last: dict[int, int] = {}
    group_pinned: set[int] = set()
    for v, s in last.items():
        root = sets.find(v)
        group_last[root] = max(group_last.get(root, -1), s)
        if v in pinned:
            group_pinned.add(root)
    for v in pinned:
        group_pinned.add(sets.find(v))
    chosen: dict[int, dict[int, int]] = {}
    for s, step in enumerate(steps):
        taken: set[int] = set()
        for out_pos, in_pos in eligible.get(s, ()):
            if out_pos in chosen.get(s, {}) or in_pos in taken:
                continue
            v = step.reads[in_pos]
            root = sets.find(v)
            if root in group_pinned or group_last.get(root, n) > s:
                continue
            if any(sets.find(r) == root for k, r in enumerate(step.reads) if k != in_pos):
                continue
            out = step.writes[out_pos]
            chosen.setdefault(s, {})[out_pos] = in_pos
            taken.add(in_pos)
            # the output now owns the input's storage: the merged group lives as long as either
            out_root = sets.find(out)
            sets.union(root, out)
            merged = sets.find(out)
            group_last[merged] = max(group_last.get(root, s), group_last.get(out_root, s))
            if root in group_pinned or out_root in group_pinned:
                group_pinned.add(merged)
    return chosen


# ---- a Plan's schedule (Kernels over slots) as the planner sees it ----

def _value_bytes(node: Any) -> int:
    return sum(spec.nbytes for spec in node.specs)


def _aliasing(kernel: Any) -> bool:
    """True when the kernel's output is its first input or a view of it (no bytes of its own): view
    kernels, and reference kernels of one VIEW op, a getitem or an in-place write."""
    if kernel.kind == "view":
        return True
    if kernel.backend in ("reference", "eager") and len(kernel.nodes) == 1 and kernel.inputs:
        node = kernel.nodes[0]
        return node.op == "getitem" or get_op(node.op).has(VIEW) or get_op(node.op).has(WRITES_INPUT)
    return False


def _elementwise_pairs(kernel: Any) -> list[tuple[int, int]]:
    """(output position, input position) pairs a generated kernel can write in place: a one-stage
    pointwise Triton kernel of elementwise ops only (no views, gathers or reductions), every output
    of one shape, and an input of that shape, dtype and strides (loaded at the index it is stored)."""
    launch = kernel.launch
    if not isinstance(launch, TritonLaunch) or kernel.kind != "pointwise" or kernel.backend != "triton":
        return []
    if len(launch.stages) != 1 or launch.workspaces or launch.into:
        return []
    if not all(get_op(n.op).has(POINTWISE) or not n.inputs for n in kernel.nodes):
        return []
    outs = kernel.outputs
    if any(o.multi_output for o in outs) or len({o.shape for o in outs}) != 1:
        return []
    pairs = []
    for k, o in enumerate(outs):
        for j, i in enumerate(kernel.inputs):
            if (not i.multi_output and i.shape == o.shape and i.dtype == o.dtype
                    and i.spec.memory_strides == o.spec.memory_strides and o.spec.numel > 0):
                pairs.append((k, j))
    return pairs


def _scatter_pairs(kernel: Any) -> list[tuple[int, int]]:
    """[(0, 0)] for a scatter run by its torch reference (ops/scatter.py INPLACE_FORMS: index_put,
    index_copy, scatter_add, slice_scatter) whose destination, input 0, has the output's shape, dtype
    and strides: its in-place form can write into the destination instead of a copy of it."""
    from ..ops.scatter import INPLACE_FORMS
    from ..settings import settings

    if not settings.inplace_scatter or kernel.backend != "reference" or kernel.kind != "library" \
            or len(kernel.nodes) != 1:
        return []
    node = kernel.nodes[0]
    if node.op not in INPLACE_FORMS or node.multi_output or not kernel.inputs or kernel.inputs[0] is not node.inputs[0]:
        return []
    x = node.inputs[0]
    if (x.multi_output or x.shape != node.shape or x.dtype != node.dtype or node.spec.numel == 0
            or x.spec.memory_strides != node.spec.memory_strides):
        return []
    return [(0, 0)]


def _scatter_in_place(kernel: Any) -> Any:
    """The launcher of a scatter kernel that writes into its destination (input 0) and returns it."""
    from ..ops.scatter import INPLACE_FORMS

    node = kernel.nodes[0]
    form, attrs = INPLACE_FORMS[node.op], node.attrs

    def launch(args: Sequence[Any]) -> list[Any]:
        return [form(list(args), attrs)]

    return launch


def plan_schedule(schedule: Sequence[tuple[Any, tuple[int, ...], tuple[int, ...]]], inputs: Sequence[Any],
                  outputs: Sequence[int], launches: dict[int, Any] | None) -> MemoryPlan:
    """The memory plan of a Plan's schedule [(kernel, input slots, output slots)]; graph input k
    (a Node) is slot k. When `launches` is a dict, in-place choices are made and their launchers
    stored there (step -> launcher)."""
    steps = [Step(tuple(ins), tuple(outs)) for _, ins, outs in schedule]
    n_inputs = len(inputs)
    nbytes: dict[int, int] = {k: _value_bytes(node) for k, node in enumerate(inputs)}
    view_of: dict[int, int] = {}
    may_share: dict[int, list[int]] = {}
    constants: list[int] = []
    eligible: dict[int, list[tuple[int, int]]] = {}
    for s, (kernel, ins, outs) in enumerate(schedule):
        for node, slot in zip(kernel.inputs, ins, strict=True):
            nbytes.setdefault(slot, _value_bytes(node))
        for node, slot in zip(kernel.outputs, outs, strict=True):
            nbytes[slot] = _value_bytes(node)
        scatter = _scatter_pairs(kernel)
        if kernel.kind == "constant" or not ins:
            constants.extend(outs)           # made once (or a source): never written in place
        elif _aliasing(kernel):
            for slot in outs:
                view_of[slot] = ins[0]
                may_share[slot] = list(ins)
        elif scatter:                        # a new tensor (in place: the destination, merged when chosen)
            pass
        elif kernel.backend in ("reference", "eager"):
            for slot in outs:                # a torch reference may hand back (a view of) its input
                may_share[slot] = list(ins)
        pairs = _elementwise_pairs(kernel) or scatter
        if pairs:
            eligible[s] = pairs
    inplace = 0
    if launches is not None and eligible:
        pinned = set(range(n_inputs)) | set(constants)
        chosen = choose_inplace(steps, outputs, may_share, pinned, eligible)
        for s, mapping in chosen.items():
            kernel, ins, outs = schedule[s]
            launches[s] = (kernel.launch.reusing([mapping.get(k) for k in range(len(outs))])
                           if isinstance(kernel.launch, TritonLaunch) else _scatter_in_place(kernel))
            for k, j in mapping.items():
                view_of[outs[k]] = ins[j]
                inplace += 1
    return plan_memory(steps, nbytes, range(n_inputs), outputs, view_of, constants, inplace)
