"""Epilogue claiming: a matmul or convolution and the pointwise kernel that consumes only it
become one kernel.

Runs on the partitioner's output without changing it. The partitioner leaves every matmul as a
library node whose output is a load of the pointwise kernel after it (bias add, activation,
residual add, scale, cast). When that pointwise kernel iterates exactly the matmul's output space,
reads the matmul's result element for element (no transpose, no broadcast) and is the only reader
of it, the two merge: the GEMM kernel computes the accumulator tile and then evaluates the
pointwise kernel's expressions on it, so the product never goes to memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..ir import dtypes
from ..ir.graph import Graph
from ..ir.node import Node
from ..ir.registry import get_op
from .partition import Domain, Entry, KernelGroup, squeeze_map


@dataclass
class EpilogueGroup:
    """One kernel: the compute-bound node `compute`, then `epilogue` on its result.

    `epilogue` is a pointwise KernelGroup over the compute node's output space; its load of that
    output (`product`) is the accumulator. A node without a claimed epilogue gets the identity one
    (store the product)."""

    compute: Node
    epilogue: KernelGroup
    product: Entry                   # the epilogue's load of the compute node's result
    # full max reductions over the product's space (e.g. the amax of a quantize epilogue), each a
    # reduction KernelGroup reading only the product: the GEMM folds every tile in with an atomic max
    reductions: list[KernelGroup] = field(default_factory=list)

    @property
    def stores(self) -> list[Entry]:
        return self.epilogue.stores

    @property
    def outputs(self) -> list[Node]:
        return [e.node for e in self.epilogue.stores] + [e.node for r in self.reductions for e in r.stores]

    @property
    def inputs(self) -> list[Node]:
        """Distinct values read: the compute node's operands, then what the epilogue reads besides."""
        seen: dict[int, Node] = {}
        for n in (*self.compute.inputs, *self.epilogue.inputs, *(i for r in self.reductions for i in r.inputs)):
            if n.id != self.compute.id:
                seen.setdefault(n.id, n)
        return list(seen.values())

    @property
    def nodes(self) -> list[Node]:
        return [self.compute, *self.epilogue_nodes]

    @property
    def epilogue_nodes(self) -> list[Node]:
        return [*self.epilogue.nodes, *(n for r in self.reductions for n in r.nodes)]


class MatmulGroup(EpilogueGroup):
    """A GEMM with its epilogue (one generated Triton kernel, or cuBLAS + the epilogue)."""

    kind = "matmul"

    @property
    def matmul(self) -> Node:
        return self.compute


class ConvGroup(EpilogueGroup):
    """A convolution with its epilogue (cuDNN, then the epilogue as our generated kernel)."""

    kind = "convolution"


GROUP_OF_KIND: dict[str, type[MatmulGroup] | type[ConvGroup]] = {"matmul": MatmulGroup, "conv": ConvGroup}


def compute_kind(node: Node) -> str | None:
    """The kernel kind ("matmul" or "conv") of a node that takes an epilogue, else None."""
    kind = get_op(node.op).extra.get("kernel_kind")
    return kind if kind in GROUP_OF_KIND and not node.multi_output else None


def identity_epilogue(node: Node) -> tuple[KernelGroup, Entry]:
    """The epilogue that only stores the product."""
    emb = tuple(squeeze_map(node.shape))
    load = Entry(f"v0_{_ident(node.name)}", node, emb, "load")
    group = KernelGroup(Domain(tuple(s for s in node.shape if s != 1)), [node], [load], [load], [load])
    return group, load


def claim_epilogues(items: list[KernelGroup | Node],
                    graph: Graph) -> list[KernelGroup | MatmulGroup | ConvGroup | Node]:
    """Replace each matmul/conv library node (and the pointwise kernel that is its only reader,
    when it fits) by a MatmulGroup/ConvGroup, placed where that reader was scheduled."""
    readers: dict[int, list[KernelGroup | Node]] = {}
    for item in items:
        reads = {e.node.id for e in item.loads} if isinstance(item, KernelGroup) else {i.id for i in item.inputs}
        for rid in reads:
            readers.setdefault(rid, []).append(item)
    outputs = {n.id for n in graph.outputs}
    claimed: dict[int, MatmulGroup | ConvGroup] = {}  # id(epilogue group) -> merged kernel
    merged_away: set[int] = set()              # ids of compute nodes moved into a later kernel
    absorbed: set[int] = set()                 # ids of reduction groups folded into a GEMM
    for item in items:
        if not isinstance(item, Node) or compute_kind(item) is None:
            continue
        users = readers.get(item.id, [])
        if item.id in outputs:
            continue
        amax = _amax_claim(item, users, items, readers)
        if amax is not None:
            group, reduction = amax
            product = _product_load(group, item)
            if product is not None and id(group) not in claimed:
                claimed[id(group)] = MatmulGroup(item, group, product, [reduction])
                merged_away.add(item.id)
                absorbed.add(id(reduction))
            continue
        if len(users) != 1 or not isinstance(users[0], KernelGroup):
            continue
        product = _product_load(users[0], item)
        if product is None or id(users[0]) in claimed:
            continue
        claimed[id(users[0])] = GROUP_OF_KIND[str(compute_kind(item))](item, users[0], product)
        merged_away.add(item.id)
    for merged in claimed.values():
        if isinstance(merged, MatmulGroup):
            merged.epilogue, casts = _with_fp8_casts(merged.epilogue, readers, outputs)
            merged_away.update(casts)
    out: list[KernelGroup | MatmulGroup | ConvGroup | Node] = []
    for item in items:
        if isinstance(item, Node) and item.id in merged_away:
            continue
        if isinstance(item, KernelGroup) and id(item) in absorbed:
            continue
        if isinstance(item, KernelGroup) and id(item) in claimed:
            out.append(claimed[id(item)])
        elif isinstance(item, Node) and compute_kind(item) is not None:
            group, load = identity_epilogue(item)
            out.append(GROUP_OF_KIND[str(compute_kind(item))](item, group, load))
        else:
            out.append(item)
    return out


def _with_fp8_casts(group: KernelGroup, readers: dict[int, list[KernelGroup | Node]],
                    outputs: set[int]) -> tuple[KernelGroup, set[int]]:
    """The epilogue extended by the fp8 casts that are the only readers of its stores (the
    partitioner leaves fp8 casts as library nodes; in a GEMM epilogue the store does the cast:
    fp32 -> e4m3/e5m2 rounds to nearest even on the GPU), and the ids of the casts taken."""
    stores, entries, taken = [], list(group.entries), set()
    for e in group.stores:
        users = readers.get(e.node.id, [])
        cast = users[0] if len(users) == 1 else None
        if (e.node.id in outputs or not isinstance(cast, Node) or cast.op != "cast" or cast.dtype not in dtypes.FP8
                or cast.shape != e.node.shape):
            stores.append(e)
            continue
        stored = Entry(f"{e.key}_fp8", cast, e.emb, "op", (e.key,), e.full, e.stage)
        entries.append(stored)
        stores.append(stored)
        taken.add(cast.id)
    if not taken:
        return group, taken
    anchors = [*group.anchors, *(u for e in stores if e.node.id in taken for u in [e.node])]
    return KernelGroup(group.domain, anchors, entries, stores, list(group.loads)), taken


def _amax_claim(node: Node, users: list[KernelGroup | Node], items: list[KernelGroup | Node],
                readers: dict[int, list[KernelGroup | Node]]) -> tuple[KernelGroup, KernelGroup] | None:
    """(pointwise epilogue, full max reduction) when a matmul's product has exactly these two readers
    (quantize with a given scale + the amax of the same product, as in delayed fp8 scaling). The
    merged kernel takes the pointwise kernel's place: the reduction reads only the product, so it
    may move later, but only if nothing scheduled between the two reads the reduction's result.
    None otherwise."""
    if compute_kind(node) != "matmul" or len(users) != 2 or not all(isinstance(u, KernelGroup) for u in users):
        return None
    pointwise = [u for u in users if isinstance(u, KernelGroup) and not u.domain.is_reduction]
    reduction = [u for u in users if isinstance(u, KernelGroup) and _is_full_max_of(u, node)]
    if len(pointwise) != 1 or len(reduction) != 1:
        return None
    at_p, at_r = items.index(pointwise[0]), items.index(reduction[0])
    written = {e.node.id for e in reduction[0].stores}
    for between in items[at_r + 1:at_p]:
        reads = {e.node.id for e in between.loads} if isinstance(between, KernelGroup) else {
            i.id for i in between.inputs}
        if reads & written:
            return None
    return pointwise[0], reduction[0]


def _is_full_max_of(group: KernelGroup, node: Node) -> bool:
    """A reduction over every dim of `node`'s space whose only store is one `max` of pointwise
    values of `node` read element for element."""
    shape = tuple(s for s in node.shape if s != 1)
    if group.domain.shape != shape or group.domain.reduced != tuple(range(len(shape))):
        return False
    reduces = [e for e in group.entries if e.kind == "reduce"]
    if len(reduces) != 1 or reduces[0].node.op != "max" or group.stores != reduces:
        return False
    if any(e.kind not in ("load", "literal", "op", "reduce") for e in group.entries):
        return False
    return all(e.node.id == node.id and e.emb == tuple(squeeze_map(node.shape)) for e in group.loads)


def _product_load(group: KernelGroup, node: Node) -> Entry | None:
    """The group's single element-for-element load of `node`, if it can be an epilogue of it."""
    if group.domain.is_reduction or group.domain.shape != tuple(s for s in node.shape if s != 1):
        return None
    if any(e.kind not in ("load", "literal", "op", "view", "gen") for e in group.entries):
        return None
    loads = [e for e in group.loads if e.node.id == node.id]
    if len(loads) != 1 or loads[0].emb != tuple(squeeze_map(node.shape)):
        return None
    return loads[0]


def _ident(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name)[:24]
