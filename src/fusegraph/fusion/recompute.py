"""Recompute or materialize: which inlined pointwise values become kernel results.

The partitioner inlines a pointwise value into every kernel that needs it. That is free when the
value is cheap to rebuild from what those kernels read anyway (a scale, a cast, x * w), and
quadratic when the value is a chain through earlier kernels: in a backward graph the residual
gradient g_l = g_{l+1} + layernorm_backward_l(...) is rebuilt, with all of g_{l+1}'s own
recomputation, by every kernel that reads it, so the kernels of layer l re-read the inputs of
every later layer (O(L^2) bytes, kernels of hundreds of ops).

The rule is a byte count on a partition already made. For a pointwise value v inlined into k >= 2
kernels, let only_i be the bytes kernel i reads solely to rebuild v (its loads reachable only
through v; loads the kernel needs for other values cost nothing extra) and S the bytes of v:

    recompute:    sum_i only_i
    materialize:  min_i only_i + S (the kernel that already reads most of what v needs, usually
                  the one that produces those inputs, stores it) + (k - 1) * S (the others read it)

and v is materialized when that is strictly cheaper. Values are decided in graph order, so a value
chosen earlier counts as one read of S bytes (not its whole rebuild) in the values after it: along
a chain every link is judged with the links before it already materialized. Only divergence points
are candidates (values with two or more users, looking through views): a value with a single user
is duplicated because its user is, and materializing the user covers both.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..ir.graph import Graph
from ..ir.node import Node
from ..ir.registry import VIEW, get_op

if TYPE_CHECKING:
    from .partition import Entry, KernelGroup


def worth_materializing(groups: list[KernelGroup], graph: Graph) -> set[int]:
    """Ids of inlined pointwise nodes that are cheaper stored once than rebuilt in every kernel
    that reads them (see the module docstring)."""
    anchored = {a.id for g in groups for a in g.anchors}
    sites: dict[int, list[KernelGroup]] = {}
    for g in groups:
        seen: set[int] = set()
        for e in g.entries:
            if e.kind == "op" and e.node.id not in anchored and e.node.id not in seen:
                seen.add(e.node.id)
                sites.setdefault(e.node.id, []).append(g)
    users = graph.users()
    node_of = {n.id: n for n in graph.nodes}
    epilogues = epilogue_values(groups, users, node_of, frozenset(n.id for n in graph.outputs))
    if not any(len(s) > 1 for s in sites.values()):
        return epilogues
    position = {n.id: k for k, n in enumerate(graph.nodes)}
    candidates = sorted((nid for nid, s in sites.items() if len(s) > 1 and _value_users(nid, users, node_of) > 1),
                        key=position.__getitem__)
    chosen: set[int] = set()
    for nid in candidates:
        size = node_of[nid].spec.nbytes
        only = [_bytes_only_for(g, nid, chosen) for g in sites[nid]]
        if sum(only) - min(only) > len(only) * size:
            chosen.add(nid)
    return chosen | epilogues


def epilogue_values(groups: list[KernelGroup], users: dict[int, list[Node]], node_of: dict[int, Node],
                    outputs: frozenset[int] = frozenset()) -> set[int]:
    """Ids of pointwise values computed element for element from a GEMM's or convolution's result
    that a kernel rebuilds at several index maps: a max-pool's window taps over conv -> batchnorm ->
    relu (ResNet's stem: the batchnorm's rsqrt and four more ops evaluated at each of 9 taps, 0.128
    ms for batchnorm + relu + pool against 0.067 for relu + pool, b128 64x112x112 bf16 on the
    H200). Stored once, such a value is the compute kernel's epilogue (claim_epilogues), written by
    the store the product needed anyway: no extra bytes, and the chain runs once per element.
    Only the last value of each chain, and only when the product and every link before that value
    have no other reader and are no graph outputs (else the product is stored anyway, the epilogue
    cannot be claimed, and storing the value would add its bytes)."""
    anchored = {a.id for g in groups for a in g.anchors}
    found: set[int] = set()
    for g in groups:
        maps: dict[int, set[str]] = {}
        for e in g.entries:
            if e.kind == "op" and e.node.id not in anchored:
                maps.setdefault(e.node.id, set()).add(e.key)
        found |= {nid for nid, keys in maps.items() if len(keys) > 1 and _on_product(node_of[nid], users, outputs)}
    # the chain's last value: its readers are no values of the chain (a link's one reader is the next)
    return {nid for nid in found if not any(u.id in found for u in users.get(nid, ()))}


def _on_product(value: Node, users: dict[int, list[Node]], outputs: frozenset[int] = frozenset()) -> bool:
    """Is `value` a pointwise chain (each link with one full-size operand, the others smaller:
    per-channel vectors) from the result of a matmul/conv, with no reader off the chain below it?"""
    from ..ir.registry import POINTWISE
    from .epilogue import compute_kind

    node = value
    while True:
        if node is not value and compute_kind(node) is not None:
            return True
        if not get_op(node.op).has(POINTWISE) or node.multi_output:
            return False
        full = [i for i in node.inputs if i.shape == value.shape]
        if len(full) != 1 or any(i.spec.numel >= value.spec.numel for i in node.inputs if i is not full[0]):
            return False
        node = full[0]
        if len(users.get(node.id, ())) != 1 or node.id in outputs:
            return False


def _value_users(nid: int, users: dict[int, list[Node]], node_of: dict[int, Node]) -> int:
    """How many distinct nodes consume the value of node `nid`, a view's users standing for it."""
    found: set[int] = set()
    stack = [nid]
    while stack:
        for u in users.get(stack.pop(), ()):
            if get_op(u.op).has(VIEW):
                stack.append(u.id)
            else:
                found.add(u.id)
    return len(found)


def _bytes_only_for(group: KernelGroup, nid: int, chosen: set[int]) -> int:
    """Bytes `group` reads only to rebuild node `nid`: the materialized values (loads, and nodes
    already chosen for materializing) reachable from its entries of `nid` and from nowhere else."""
    by_key = {e.key: e for e in group.entries}
    used = {a for e in group.entries for a in e.args}
    roots = [e for e in group.entries if e.key not in used] + list(group.stores)
    via = _reads([e for e in group.entries if e.node.id == nid], by_key, nid, chosen, through=True)
    other = _reads(roots, by_key, nid, chosen, through=False)
    return sum(node.spec.nbytes for i, node in via.items() if i not in other)


def _reads(starts: list[Entry], by_key: dict[str, Entry], nid: int, chosen: set[int],
           through: bool) -> dict[int, Node]:
    """The materialized values reached from `starts` down the entries' arguments; a node in
    `chosen` is a read of that node (its rebuild stops there); a gather stands for the table rows it
    reads (its own size); entries of `nid` are entered only when `through`."""
    out: dict[int, Node] = {}
    seen: set[str] = set()
    stack = list(starts)
    while stack:
        e = stack.pop()
        if e.key in seen:
            continue
        seen.add(e.key)
        if e.node.id == nid and not through:
            continue
        if e.kind == "load" or (e.node.id in chosen and e.node.id != nid):
            out[e.node.id] = e.node
            continue
        if e.kind == "gather":   # the table rows it reads: as many bytes as the gathered value holds
            out[e.node.id] = e.node
        stack.extend(by_key[a] for a in e.args)
    return out


def kernels_on_cycles(groups: list[KernelGroup], library: list[Node]) -> list[KernelGroup]:
    """Groups that (through other kernels) read what they write. The merges' ancestry check
    (_cyclic) does not see a kernel that writes v and reads a value of another kernel that reads
    v without depending on it; this catches that, for the kernels of materialized values."""
    producer: dict[int, KernelGroup | Node] = {n.id: n for n in library}
    for g in groups:
        for a in g.anchors:
            producer[a.id] = g
    deps: dict[int, set[int]] = {}
    for g in groups:
        deps[id(g)] = {id(producer[e.node.id]) for e in g.loads if e.node.id in producer} - {id(g)}
    for n in library:
        deps[id(n)] = {id(producer[i.id]) for i in n.inputs if i.id in producer} - {id(n)}
    on_cycle = []
    for g in groups:
        seen: set[int] = set()
        stack = list(deps[id(g)])
        while stack:
            k = stack.pop()
            if k == id(g):
                on_cycle.append(g)
                break
            if k not in seen:
                seen.add(k)
                stack.extend(deps[k])
    return on_cycle


def reads_through_kernels(trial: KernelGroup, group_of: dict[int, KernelGroup], library: dict[int, Node]) -> bool:
    """Would the merged kernel `trial` read a value computed (through other kernels and library ops)
    from one it writes? The node ancestry check (_cyclic) misses a kernel that joins a value upstream
    of a library op with one downstream of a kernel that reads that op's result (cross-entropy: the
    target's validity feeding a gather, and the label-smoothing sum after the logsumexp kernel that
    reads the gather)."""
    written = {a.id for a in trial.anchors}
    stack = [e.node for e in trial.loads]
    seen_nodes: set[int] = set()
    seen_groups: set[int] = set()
    while stack:
        node = stack.pop()
        if node.id in written:
            return True
        if node.id in seen_nodes:
            continue
        seen_nodes.add(node.id)
        group = group_of.get(node.id)
        if group is not None and id(group) not in seen_groups:
            seen_groups.add(id(group))
            stack.extend(e.node for e in group.loads)
        elif group is None and node.id in library:
            stack.extend(library[node.id].inputs)
    return False
