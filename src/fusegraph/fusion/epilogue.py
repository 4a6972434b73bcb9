"""Epilogue claiming: a matmul and the pointwise kernel that consumes only it become one kernel.

Runs on the partitioner's output without changing it. The partitioner leaves every matmul as a
library node whose output is a load of the pointwise kernel after it (bias add, activation,
residual add, scale, cast). When that pointwise kernel iterates exactly the matmul's output space,
reads the matmul's result element for element (no transpose, no broadcast) and is the only reader
of it, the two merge: the GEMM kernel computes the accumulator tile and then evaluates the
pointwise kernel's expressions on it, so the product never goes to memory.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..ir.graph import Graph
from ..ir.node import Node
from ..ir.registry import get_op
from .partition import Domain, Entry, KernelGroup, squeeze_map

Item = "KernelGroup | MatmulGroup | Node"


@dataclass
class MatmulGroup:
    """One GEMM kernel: `matmul` computed into an accumulator, then `epilogue` on it.

    `epilogue` is a pointwise KernelGroup over the matmul's output space; its load of the matmul
    (`product`) is the accumulator. A matmul without a claimed epilogue gets the identity one
    (store the product)."""

    matmul: Node
    epilogue: KernelGroup
    product: Entry                   # the epilogue's load of the matmul's result

    @property
    def kind(self) -> str:
        return "matmul"

    @property
    def stores(self) -> list[Entry]:
        return self.epilogue.stores

    @property
    def outputs(self) -> list[Node]:
        return [e.node for e in self.epilogue.stores]

    @property
    def inputs(self) -> list[Node]:
        """Distinct values read: the two operands, then what the epilogue reads besides the product."""
        seen: dict[int, Node] = {}
        for n in (*self.matmul.inputs, *self.epilogue.inputs):
            if n.id != self.matmul.id:
                seen.setdefault(n.id, n)
        return list(seen.values())

    @property
    def nodes(self) -> list[Node]:
        return [self.matmul, *self.epilogue.nodes]

    @property
    def epilogue_nodes(self) -> list[Node]:
        return self.epilogue.nodes


def is_matmul(node: Node) -> bool:
    return get_op(node.op).extra.get("kernel_kind") == "matmul"


def identity_epilogue(matmul: Node) -> tuple[KernelGroup, Entry]:
    """The epilogue that only stores the product."""
    emb = tuple(squeeze_map(matmul.shape))
    load = Entry(f"v0_{_ident(matmul.name)}", matmul, emb, "load")
    group = KernelGroup(Domain(tuple(s for s in matmul.shape if s != 1)), [matmul], [load], [load], [load])
    return group, load


def claim_epilogues(items: list[KernelGroup | Node], graph: Graph) -> list[KernelGroup | MatmulGroup | Node]:
    """Replace each matmul library node (and the pointwise kernel that is its only reader, when
    it fits) by a MatmulGroup, placed where that reader was scheduled."""
    readers: dict[int, list[KernelGroup | Node]] = {}
    for item in items:
        reads = {e.node.id for e in item.loads} if isinstance(item, KernelGroup) else {i.id for i in item.inputs}
        for rid in reads:
            readers.setdefault(rid, []).append(item)
    outputs = {n.id for n in graph.outputs}
    claimed: dict[int, MatmulGroup] = {}       # id(epilogue group) -> merged kernel
    merged_away: set[int] = set()              # ids of matmul nodes moved into a later kernel
    for item in items:
        if not isinstance(item, Node) or not is_matmul(item):
            continue
        users = readers.get(item.id, [])
        if item.id in outputs or len(users) != 1 or not isinstance(users[0], KernelGroup):
            continue
        product = _product_load(users[0], item)
        if product is None or id(users[0]) in claimed:
            continue
        claimed[id(users[0])] = MatmulGroup(item, users[0], product)
        merged_away.add(item.id)
    out: list[KernelGroup | MatmulGroup | Node] = []
    for item in items:
        if isinstance(item, Node) and item.id in merged_away:
            continue
        if isinstance(item, KernelGroup) and id(item) in claimed:
            out.append(claimed[id(item)])
        elif isinstance(item, Node) and is_matmul(item):
            group, load = identity_epilogue(item)
            out.append(MatmulGroup(item, group, load))
        else:
            out.append(item)
    return out


def _product_load(group: KernelGroup, matmul: Node) -> Entry | None:
    """The group's single element-for-element load of `matmul`, if it can be an epilogue of it."""
    if group.domain.is_reduction or group.domain.shape != tuple(s for s in matmul.shape if s != 1):
        return None
    if any(e.kind not in ("load", "literal", "op", "view", "gen") for e in group.entries):
        return None
    loads = [e for e in group.loads if e.node.id == matmul.id]
    if len(loads) != 1 or loads[0].emb != tuple(squeeze_map(matmul.shape)):
        return None
    return loads[0]


def _ident(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name)[:24]
