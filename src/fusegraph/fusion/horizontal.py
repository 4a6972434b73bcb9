"""Horizontal fusion: independent elementwise kernels that read only graph inputs become one launch.

A training step under autocast casts every weight to the 16-bit dtype at its start, one small kernel
per weight (GPT-2-124M: 48 casts of 0.6-2.4 M elements, a few microseconds each, mostly launch
and ramp). Nothing orders them but their readers, so they can all run first, in one kernel whose
programs are split between them: a combo kernel (codegen/combo.py), program p running member i's
flat pointwise body for the p - start(i)'th block of its elements.

Which kernels join (`combinable`): a plain pointwise KernelGroup whose every load is a whole graph
input read element for element in row-major order (no broadcast, gather, view or index generator)
and whose every store is a row-major full-size output; no 64-bit offsets. Running them first makes
their outputs live from the start of the plan: only outputs the plan returns anyway (a cast weight
saved for the backward) move for free, so kernels with outputs the plan does not return join only
while those add up to at most COMBO_TEMP_BYTES. At most COMBO_MAX_MEMBERS kernels a combo (the
kernel's source grows with each; more make another combo).

A GEMM epilogue's cast of a graph input (an fp32 bias added to a 16-bit product) is first made a group
of its own (_split_input_casts), so it joins too: cuBLAS's bias epilogue wants the product's dtype, and
its launcher cast the bias with one more torch kernel a GEMM a call (GPT-2's step: 48 of them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ..ir.graph import Graph
from ..ir.node import Node
from ..ir.spec import contiguous_strides
from ..settings import settings
from .partition import Domain, Entry, KernelGroup

# GPT-2-124M: 96 casts in 6 combos, compiled in parallel (64 a combo: cold compile 32 s, else 26-29)
COMBO_MAX_MEMBERS = 16
COMBO_TEMP_BYTES = 32 << 20      # outputs the plan does not return, brought forward: at most this many bytes
INT32_LIMIT = 2**31 - 1


@dataclass
class ComboGroup:
    """One kernel running several independent pointwise KernelGroups side by side (see the module doc)."""

    members: list[KernelGroup] = field(default_factory=list)

    @property
    def kind(self) -> str:
        return "pointwise"

    @property
    def inputs(self) -> list[Node]:
        seen: dict[int, Node] = {}
        for m in self.members:
            for n in m.inputs:
                seen.setdefault(n.id, n)
        return list(seen.values())

    def _joined(self, attr: str) -> list[Any]:
        """The members' `attr` lists, one after another."""
        return [x for m in self.members for x in getattr(m, attr)]

    entries = property(lambda self: self._joined("entries"))
    loads = property(lambda self: self._joined("loads"))
    stores = property(lambda self: self._joined("stores"))
    nodes = property(lambda self: self._joined("nodes"))


def _row_major(node: Node) -> bool:
    return tuple(node.spec.memory_strides) == tuple(contiguous_strides(node.shape))


def combinable(group: object) -> bool:
    """A pointwise group reading only whole graph inputs element for element (see the module doc)."""
    if type(group) is not KernelGroup or group.kind != "pointwise" or not group.stores:
        return False
    shape = tuple(group.domain.shape)
    numel = math.prod(shape)
    if numel == 0 or numel > INT32_LIMIT:
        return False
    identity = tuple(range(len(shape)))
    for e in group.entries:
        if e.kind not in ("load", "op", "literal"):
            return False
        if e.kind == "load" and (e.node.op != "input" or tuple(e.node.shape) != shape or tuple(e.emb) != identity
                                 or not _row_major(e.node) or e.node.multi_output):
            return False
    return all(tuple(e.node.shape) == shape and tuple(e.emb) == identity and _row_major(e.node)
               for e in group.stores)


def _split_input_casts(items: list[Any]) -> list[Any]:
    """A GEMM epilogue that casts a graph input (a linear layer's fp32 bias under autocast) reads the
    cast value instead, made by a pointwise group of its own placed before the GEMM: a candidate for the
    combo. cuBLAS then gets the bias in the product's dtype (its launcher cast it, one torch kernel a
    GEMM a call); our GEMM kernels load the 16-bit vector in place of the fp32 one."""
    from .epilogue import MatmulGroup

    stored = {e.node.id for item in items if isinstance(item, (KernelGroup, MatmulGroup)) for e in item.stores}
    made: set[int] = set()   # casts detached already (one cast node in two epilogues: made once, first)
    out: list[object] = []
    for item in items:
        if isinstance(item, MatmulGroup) and not item.reductions:
            out.extend(_input_casts(item.epilogue, stored, made))
        out.append(item)
    return out


def _input_casts(epilogue: KernelGroup, stored: set[int], made: set[int]) -> list[KernelGroup]:
    """Detach each `cast(graph input)` of `epilogue` (read as a broadcast vector) into its own group;
    not a cast another kernel stores, and one detached from an earlier epilogue is only loaded."""
    by_key = {e.key: e for e in epilogue.entries}
    readers: dict[str, int] = {}
    for e in epilogue.entries:
        for a in e.args:
            readers[a] = readers.get(a, 0) + 1
    groups: list[KernelGroup] = []
    for e in list(epilogue.entries):
        if e.kind != "op" or e.node.op != "cast" or len(e.args) != 1 or e.node.multi_output:
            continue
        src = by_key.get(e.args[0])
        if src is None or src.kind != "load" or src.node.op != "input" or not _row_major(src.node) \
                or tuple(src.node.shape) != tuple(e.node.shape) or math.prod(e.node.shape) > (1 << 20) \
                or e.node.id in stored:
            continue
        if e.node.id not in made:
            made.add(e.node.id)
            identity = tuple(range(len(e.node.shape)))
            load = Entry(src.key, src.node, identity, "load")
            cast = Entry(e.key, e.node, identity, "op", (load.key,))
            groups.append(KernelGroup(Domain(tuple(e.node.shape)), [e.node], entries=[load, cast], stores=[cast],
                                      loads=[load]))
        loaded = Entry(e.key, e.node, e.emb, "load", (), e.full, e.stage)
        epilogue.entries[epilogue.entries.index(e)] = loaded   # (an earlier removal may have shifted it)
        epilogue.loads.append(loaded)
        readers[src.key] -= 1
        if readers[src.key] == 0 and not any(st.key == src.key for st in epilogue.stores):
            epilogue.entries.remove(src)
            epilogue.loads.remove(src)
    return groups


def combine_sources(items: list[Any], graph: Graph) -> list[Any]:
    """`items` with the combinable pointwise groups merged into ComboGroups, each at its first
    member's place (their inputs are graph inputs: nothing before it computes them)."""
    if not settings.horizontal_fusion:
        return items
    if sum(combinable(item) for item in items) >= 2:
        items = _split_input_casts(items)
    returned = {n.id for n in graph.outputs}
    picked: list[int] = []
    temp_bytes = 0
    for k, item in enumerate(items):
        if not combinable(item):
            continue
        assert isinstance(item, KernelGroup)
        temp = sum(e.node.spec.nbytes for e in item.stores if e.node.id not in returned)
        if temp and temp_bytes + temp > COMBO_TEMP_BYTES:
            continue
        temp_bytes += temp
        picked.append(k)
    if len(picked) < 2:
        return items
    chunks = [picked[i:i + COMBO_MAX_MEMBERS] for i in range(0, len(picked), COMBO_MAX_MEMBERS)]
    place: dict[int, ComboGroup] = {}
    dropped: set[int] = set()
    for chunk in chunks:
        if len(chunk) < 2:
            continue
        place[chunk[0]] = ComboGroup([items[k] for k in chunk])   # type: ignore[misc]
        dropped.update(chunk[1:])
    return [place.get(k, item) for k, item in enumerate(items) if k not in dropped]
