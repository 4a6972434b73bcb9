"""The partitioner: group a primitive graph's nodes into kernels by iteration space.

Every kernel has a Domain: the full index space F it iterates and the dims D it reduces
(D = () for a pointwise kernel). Pointwise nodes are inlined as expressions into every kernel that
needs them, unless rebuilding one in each of them reads more bytes than storing it once
(fusion/recompute.py: then it is materialized). What touches memory is only what crosses a kernel
boundary: graph outputs, reductions used by another kernel, materialized pointwise values, and the
inputs of ops without code generation ("library" nodes, run by their torch reference).

Grouping starts from "anchors" (graph outputs, reductions, library inputs, materialized values),
each its own group, and merges an anchor into the group that produces what it reads when the
domains agree (same F; a pointwise store of shape F or of a row shape joins a reduction over F)
and the kernel graph stays acyclic. Inside a kernel each value is placed by an Embedding: for each of its dims, the
dim of F it indexes (None where it is broadcast), so broadcasting is index arithmetic.

An embedding lookup or index_select of a graph input (a weight, a rotary table) is a "gather" entry:
the kernel computes or loads the index, then loads the table at that row (is_gather), so the rows
never go through a buffer of their own and the lookup is no launch of its own.
"""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Collection
from dataclasses import dataclass, field

from ..ir import dtypes
from ..ir.graph import Graph
from ..ir.node import Node
from ..ir.registry import POINTWISE, REDUCTION, SOURCE, VIEW, get_op
from ..settings import settings
from .index_map import (
    Affine,
    concat_fusable,
    concat_input_embedding,
    concat_parts,
    domain_dim,
    pad_fusable,
    pad_input_embedding,
    slice_input_embedding,
)

Embedding = tuple["int | Affine | None", ...]   # Affine: a slice or concat input (index_map)
COMBINES = ("sum", "max", "min")
# A pointwise store joins a reduction kernel only when that keeps enough programs busy (or the
# tensor is small enough that parallelism does not matter).
MIN_KEPT_FOR_FUSION = 128
SMALL_NUMEL = 1 << 16
# Groupings tried while choosing values to materialize (fusion/recompute.py): the first decides
# nearly everything (values along a chain are judged in one pass); later rounds catch values whose
# cost changed with the new kernels.
MATERIALIZE_ROUNDS = 3
# Column reductions at least this long are split across programs (codegen/column_split.py). Long
# reductions with fewer kept values than these and at least SPLIT_MIN_WORK elements in all are never
# fused in a way that stops the split (KernelGroup.needs_split). Column: the unsplit kernel runs one
# program per 64-column block, fewer than codegen/configs.py's TARGET_PROGRAMS (528). Row: one
# program per row, fewer than half an H100/H200's 132 SMs (a looped row kernel with more rows
# keeps its one pass over the data: online softmax's max and sum, GPT-2's loss over 127 rows).
SPLIT_MIN_EXTENT = 512
SPLIT_MAX_KEPT_COLUMN = 64 * 528
SPLIT_MAX_KEPT_ROW = 132 // 2
SPLIT_MIN_WORK = 1 << 16


@dataclass(frozen=True)
class Domain:
    shape: tuple[int, ...]            # F: the full iteration space
    reduced: tuple[int, ...] = ()     # D: reduced dims of F, sorted; () = pointwise

    @property
    def kept(self) -> tuple[int, ...]:
        return tuple(d for d in range(len(self.shape)) if d not in self.reduced)

    @property
    def kept_numel(self) -> int:
        return math.prod(self.shape[d] for d in self.kept)

    @property
    def reduced_numel(self) -> int:
        return math.prod(self.shape[d] for d in self.reduced)

    @property
    def is_reduction(self) -> bool:
        return bool(self.reduced)

    def __str__(self) -> str:
        return f"{'x'.join(map(str, self.shape)) or 'scalar'}" + (f" reduce{self.reduced}" if self.reduced else "")


@dataclass
class Entry:
    """One value computed inside a kernel: node `node` placed in the domain by `emb`."""

    key: str
    node: Node
    emb: Embedding
    kind: str                     # load | literal | op | gen (index generator) | view | reduce | gather
    args: tuple[str, ...] = ()
    full: bool = True             # depends on a reduced index (else: one value per kept index)
    stage: int = 0                # how many sequential reductions it waits for


@dataclass
class KernelGroup:
    domain: Domain
    anchors: list[Node]
    entries: list[Entry] = field(default_factory=list)     # topological order
    stores: list[Entry] = field(default_factory=list)      # anchors written to memory
    loads: list[Entry] = field(default_factory=list)

    @property
    def kind(self) -> str:
        return "reduction" if self.domain.is_reduction else "pointwise"

    @property
    def inputs(self) -> list[Node]:
        """Distinct materialized values read: the loads in first-use order, then the tables of gathers."""
        seen: dict[int, Node] = {}
        for e in self.loads:
            seen.setdefault(e.node.id, e.node)
        for e in self.entries:
            if e.kind == "gather":
                source = gather_source(e.node)
                seen.setdefault(source.id, source)
        return list(seen.values())

    @property
    def nodes(self) -> list[Node]:
        seen: dict[int, Node] = {}
        for e in self.entries:
            if e.kind in ("op", "gen", "view", "reduce", "gather"):
                seen.setdefault(e.node.id, e.node)
        return list(seen.values())

    @property
    def column(self) -> bool:
        """A reduction along the tile's first axis: the contiguous dim of the main operand is kept."""
        full = [e for e in self.loads if e.full]
        if not full or not self.domain.kept:
            return False
        node, emb = full[0].node, full[0].emb
        big = [k for k in range(len(node.shape)) if node.shape[k] > 1 and emb[k] is not None]
        if not big:
            return False
        inner = min(big, key=lambda k: abs(node.spec.memory_strides[k]))
        return domain_dim(emb[inner]) in self.domain.kept

    @property
    def long_reduction(self) -> bool:
        """A reduction of at least SPLIT_MIN_EXTENT elements per kept value."""
        return self.domain.is_reduction and self.domain.reduced_numel >= SPLIT_MIN_EXTENT

    @property
    def splittable(self) -> bool:
        """A long column reduction (or a full one: one column, or a row reduction that needs_split)
        with one round of reductions, whose per-element results (if any) do not wait for it: its
        reduced elements can be split across programs (partials, and the per-element stores of
        their slice, e.g. an activation's gradient whose column sums are the bias gradient), then
        the partials reduced (codegen/column_split.py)."""
        return (self.long_reduction and (self.column or not self.domain.kept or self.needs_split)
                and all(e.stage <= 1 for e in self.entries) and all(not e.full or e.stage == 0 for e in self.stores))

    @property
    def needs_split(self) -> bool:
        """A long reduction over too few kept values for the unsplit kernel to fill the GPU: one
        program per 64-column block of a column reduction, one per row of a looped row reduction
        (batchnorm's statistics: 64-2048 channels, each summed over N*H*W, in NHWC or NCHW). It must
        stay splittable: fused with a second round of reductions or with stores that wait for the
        sums it would run on a handful of programs, and gain little, since the loops over a long
        reduction re-read their data anyway. Small ones (under SPLIT_MIN_WORK elements) are left
        alone: a second launch would cost more than it saves."""
        dom = self.domain
        few = SPLIT_MAX_KEPT_COLUMN if self.column else SPLIT_MAX_KEPT_ROW
        return self.long_reduction and dom.kept_numel < few and dom.kept_numel * dom.reduced_numel >= SPLIT_MIN_WORK


@dataclass
class RowColumnGroup(KernelGroup):
    """A row reduction and a column reduction over the same space in one pass: each program owns
    a block of rows, runs the row kernel on them and accumulates the column reduction's partials
    over its rows (layernorm backward's dx with dw/db); a finish kernel reduces the partials.
    The column reduction may also be a full reduction over the row kernel's kept (leading) dims,
    of per-row values (the mean of cross-entropy's per-row losses): one partial per program.
    `col` has its entries renamed apart from `row`'s; `separate` is the unpaired column group."""

    row: KernelGroup | None = None
    col: KernelGroup | None = None
    separate: KernelGroup | None = None


@dataclass
class Partition:
    """The kernels of a graph in launch order; `library` groups hold one unfusable node each."""

    items: list[KernelGroup | Node]


class TraceError(Exception):
    """A set of anchors cannot share one kernel (embedding conflict, wrong domain)."""


# fusable() per node: nodes are immutable and a partition asks about each one thousands of times
# (every trial trace of a merge); weak, so that a graph's nodes go with it
_FUSABLE: weakref.WeakKeyDictionary[Node, bool] = weakref.WeakKeyDictionary()


def fusable(node: Node) -> bool:
    """Has code generation: a pointwise op with a Triton expression, or a sum/max/min reduction."""
    known = _FUSABLE.get(node)
    if known is None:
        known = _FUSABLE[node] = _fusable(node)
    return known


def _fusable(node: Node) -> bool:
    opdef = get_op(node.op)
    if node.multi_output or any(i.multi_output for i in node.inputs):
        return False
    if any(not _supported_dtype(s.dtype) for s in (node.spec, *(i.spec for i in node.inputs))):
        return False
    if node.op in GATHERS:
        return is_gather(node)
    if node.op == "concat":   # selects of shifted loads (index_map)
        return concat_fusable(node)
    if node.op == "pad":      # a select of a shifted, range-masked load (index_map)
        return pad_fusable(node)
    if opdef.has(REDUCTION):
        return opdef.extra.get("combine") in COMBINES and (dtypes.is_float(node.dtype) or is_unit_reduction(node))
    if node.op == "cast":
        return True
    if opdef.has(VIEW):
        try:
            view_input_embedding(node, tuple(range(len(node.shape))))
        except TraceError:
            return False
        return True
    return opdef.has(POINTWISE) and opdef.triton is not None


# ops that read a table at rows chosen by an integer index: (table input position, index input position)
GATHERS = {"embedding": (1, 0), "index_select": (0, 1)}


def is_gather(node: Node) -> bool:
    """An embedding lookup or index_select a kernel reads in place (settings.fuse_gathers): its table
    is a graph input (a weight, a rotary table: there before any kernel runs, never written by the
    plan) and its index at most 1-D for index_select. The row is data: the kernel loads the index,
    then the table at that row."""
    if node.op not in GATHERS or not settings.fuse_gathers:
        return False
    table, index = (node.inputs[k] for k in GATHERS[node.op])
    if table.op != "input" or not dtypes.is_int(index.dtype) or table.spec.rank == 0:
        return False
    return node.op == "embedding" or index.spec.rank <= 1


def gather_source(node: Node) -> Node:
    """The table a gather node reads."""
    return node.inputs[GATHERS[node.op][0]]


def gather_index_embedding(node: Node, emb: Embedding) -> tuple[Node, Embedding, int]:
    """(index node, its embedding, the table dim it selects) of a gather node placed at `emb`:
    embedding(indices, weight)[i..., j] = weight[indices[i...], j]; index_select(x, d, index)[..., i_d, ...]
    = x[..., index[i_d], ...]."""
    if node.op == "embedding":
        index = node.inputs[0]
        return index, tuple(None if s == 1 else emb[k] for k, s in enumerate(index.shape)), 0
    index, dim = node.inputs[1], int(node.attrs["dim"]) % node.spec.rank
    return index, ((None if index.shape[0] == 1 else emb[dim],) if index.spec.rank == 1 else ()), dim


def is_unit_reduction(node: Node) -> bool:
    """A reduction over dims of size 1 only: the value itself, reshaped (a view)."""
    return get_op(node.op).has(REDUCTION) and all(node.inputs[0].shape[d] == 1 for d in _reduced_dims(node))


def is_generator(node: Node) -> bool:
    """iota / rand_uniform: values computed from the index, reading no memory."""
    return bool(get_op(node.op).extra.get("generator")) and not node.inputs


def view_input_embedding(node: Node, emb: Embedding) -> Embedding:
    """A view's embedding carried to its input: expand broadcasts, permute reorders, a reshape
    that only adds or drops unit dims keeps the other dims in order. Others raise TraceError."""
    opdef = get_op(node.op)
    src = node.inputs[0]
    kind = opdef.extra.get("view")
    if node.op == "expand" or kind == "broadcast":
        return input_embedding(node.shape, emb, src.shape)
    if kind == "permute":
        perm = opdef.extra["view_params"](src.spec, node.attrs)["perm"]
        out: list[int | Affine | None] = [None] * len(src.shape)
        for i, p in enumerate(perm):
            out[p] = None if src.shape[p] == 1 else emb[i]
        return tuple(out)
    if node.op == "reshape" or is_unit_reduction(node):
        out_dims = [d for d, s in enumerate(node.shape) if s != 1]
        in_dims = [d for d, s in enumerate(src.shape) if s != 1]
        if [node.shape[d] for d in out_dims] != [src.shape[d] for d in in_dims]:
            raise TraceError(f"{node.name}: reshape {src.shape} -> {node.shape} regroups dims")
        result: list[int | Affine | None] = [None] * len(src.shape)
        for o, i in zip(out_dims, in_dims, strict=True):
            result[i] = emb[o]
        return tuple(result)
    if kind == "slice":   # in[dim] = start + step * out[dim] (index_map.Affine)
        return slice_input_embedding(node, emb)
    raise TraceError(f"{node.name}: view {node.op} is not folded into indexing")


def is_literal(node: Node) -> bool:
    """A scalar known at build time: inlined as a literal in generated code."""
    opdef = get_op(node.op)
    return opdef.has(SOURCE) and opdef.triton is not None and node.spec.rank == 0


def _supported_dtype(dtype: str) -> bool:
    return dtype not in dtypes.FP8 and dtype != "float64"


def squeeze_map(shape: tuple[int, ...]) -> list[int | None]:
    """For each dim of `shape`, its index among the dims of size > 1 (None for size-1 dims).
    Domains are kept squeezed, so [B, 1, N] and [B, N] iterate the same space."""
    out: list[int | None] = []
    k = 0
    for size in shape:
        out.append(None if size == 1 else k)
        k += size != 1
    return out


def _reduced_dims(node: Node) -> tuple[int, ...]:
    rank = len(node.inputs[0].shape)
    dims = node.attrs.get("dims")
    return tuple(range(rank)) if dims is None else tuple(sorted({d % max(rank, 1) for d in dims}))


def natural_embedding(node: Node, domain: Domain) -> Embedding:
    """Where a reduction's result lives in its own domain."""
    src = node.inputs[0].shape
    where = squeeze_map(src)
    dims = _reduced_dims(node)
    if node.attrs.get("keepdim", False):
        return tuple(None if d in dims else where[d] for d in range(len(src)))
    return tuple(where[d] for d in range(len(src)) if d not in dims)


def reduction_domain(node: Node) -> Domain:
    src = node.inputs[0].shape
    where = squeeze_map(src)
    reduced = tuple(w for d in _reduced_dims(node) if (w := where[d]) is not None)
    return Domain(tuple(s for s in src if s != 1), reduced)


def anchor_embedding(node: Node, domain: Domain) -> Embedding | None:
    """How a value written by a kernel of `domain` is placed in it, or None if it does not fit:
    its dims of size > 1 are, in order, all dims of F (a full value) or, in a reduction, the kept
    dims of F (one value per row)."""
    if get_op(node.op).has(REDUCTION) and fusable(node) and not is_unit_reduction(node):
        return natural_embedding(node, domain) if reduction_domain(node) == domain else None
    big = [d for d, s in enumerate(node.shape) if s != 1]
    sizes = [node.shape[d] for d in big]
    for target in (tuple(range(len(domain.shape))), domain.kept if domain.is_reduction else None):
        if target is not None and sizes == [domain.shape[t] for t in target]:
            emb: list[int | None] = [None] * len(node.shape)
            for d, t in zip(big, target, strict=True):
                emb[d] = t
            return tuple(emb)
    return None


def input_embedding(consumer_shape: tuple[int, ...], emb: Embedding, shape: tuple[int, ...]) -> Embedding:
    """A pointwise consumer's embedding, carried to one of its inputs (numpy broadcasting)."""
    lead = len(consumer_shape) - len(shape)
    return tuple(None if size == 1 else emb[lead + d] for d, size in enumerate(shape))


def trace_group(group: KernelGroup, boundary: set[int]) -> None:
    """Fill `group.entries/loads/stores`: the expression DAG from its anchors down to values that
    cross a kernel boundary (loads). Raises TraceError when the anchors cannot share the kernel."""
    domain = group.domain
    own = {n.id for n in group.anchors}
    entries: dict[tuple[int, Embedding], Entry] = {}
    order: list[Entry] = []

    def visit(node: Node, emb: Embedding) -> Entry:
        key = (node.id, emb)
        if key in entries:
            return entries[key]
        kind = _trace_kind(node)
        if kind == "literal":
            entry = Entry("", node, emb, "literal", full=False)
        elif kind == "load" or (node.id in boundary and node.id not in own):
            entry = Entry("", node, emb, "load", full=_is_full(emb, domain))
        elif kind == "gen":
            entry = Entry("", node, emb, "gen", full=_is_full(emb, domain))
        elif kind == "gather":   # the table at the row the index names (codegen: two dependent loads)
            index, index_emb, _ = gather_index_embedding(node, emb)
            arg = visit(index, index_emb)
            entry = Entry("", node, emb, "gather", (arg.key,), full=arg.full or _is_full(emb, domain),
                          stage=arg.stage)
        elif kind == "view":
            arg = visit(node.inputs[0], view_input_embedding(node, emb))
            entry = Entry("", node, emb, "view", (arg.key,), full=arg.full, stage=arg.stage)
        elif kind == "reduce":
            if reduction_domain(node) != domain or emb != natural_embedding(node, domain):
                raise TraceError(f"{node.name}: reduction does not fit domain {domain}")
            arg = visit(node.inputs[0], tuple(squeeze_map(node.inputs[0].shape)))
            entry = Entry("", node, emb, "reduce", (arg.key,), full=False, stage=arg.stage + 1)
        elif kind == "concat":   # one argument per non-empty input, read at shifted indices
            args = [visit(x, concat_input_embedding(node, emb, k)) for k, x, _ in concat_parts(node)]
            entry = Entry("", node, emb, "op", tuple(a.key for a in args), stage=max(a.stage for a in args),
                          full=any(a.full for a in args) or _is_full(emb, domain))
        elif kind == "pad":      # the input read at i - before, the padding selected (index_map)
            arg = visit(node.inputs[0], pad_input_embedding(node, emb))
            entry = Entry("", node, emb, "op", (arg.key,), stage=arg.stage, full=arg.full or _is_full(emb, domain))
        else:
            args = [visit(i, input_embedding(node.shape, emb, i.shape)) for i in node.inputs]
            stage = max((a.stage for a in args), default=0)
            entry = Entry("", node, emb, "op", tuple(a.key for a in args),
                          full=any(a.full for a in args), stage=stage)
        # numbered when made (unique); named by the op, not the node, so that the same kernel in every
        # layer has the same source (compiled and tuned once: codegen/compile.shared_kernel_text)
        entry.key = f"v{len(order)}_{_ident(node.op)}"
        entries[key] = entry
        order.append(entry)
        return entry

    stores = []
    for anchor in group.anchors:
        emb = anchor_embedding(anchor, domain)
        if emb is None:
            raise TraceError(f"{anchor.name}: shape {anchor.shape} does not fit domain {domain}")
        stores.append(visit(anchor, emb))
    if domain.is_reduction and not any(e.kind == "reduce" for e in order):
        raise TraceError("a reduction kernel without a reduction")
    group.entries = order
    group.loads = [e for e in order if e.kind == "load"]
    group.stores = stores


_TRACE_KIND: weakref.WeakKeyDictionary[Node, str] = weakref.WeakKeyDictionary()


def _trace_kind(node: Node) -> str:
    """What trace_group does with a node, boundaries aside (remembered per node): "literal",
    "load" (a graph input or not fusable), "gen", "gather", "view", "reduce", "concat", "pad" or "op"."""
    known = _TRACE_KIND.get(node)
    if known is None:
        opdef = get_op(node.op)
        if is_literal(node):
            known = "literal"
        elif node.op == "input" or not fusable(node):
            known = "load"
        elif is_generator(node):
            known = "gen"
        elif node.op in GATHERS:
            known = "gather"
        elif opdef.has(VIEW) or is_unit_reduction(node):
            known = "view"
        elif opdef.has(REDUCTION):
            known = "reduce"
        else:
            known = node.op if node.op in ("concat", "pad") else "op"
        _TRACE_KIND[node] = known
    return known


def _is_full(emb: Embedding, domain: Domain) -> bool:
    if not domain.is_reduction:
        return True
    return any(d in domain.reduced and domain.shape[d] != 1 for d in map(domain_dim, emb) if d is not None)


@functools.cache
def _ident(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name)[:24]


def partition_graph(graph: Graph, aliases: Collection[int] = ()) -> Partition:
    """Group `graph` (primitives only) into kernels, in an order where each reads only what
    earlier kernels wrote. `aliases`: ids of view nodes computed as torch views of their input
    (fusion/views.py): like library nodes, they read a materialized input and are read as loads.
    Pointwise values that several kernels would each rebuild at a higher cost in bytes than
    storing them once become kernel results (fusion/recompute.py), and the graph is grouped again."""
    from .recompute import kernels_on_cycles, worth_materializing

    materialized: set[int] = set()
    for round_ in range(MATERIALIZE_ROUNDS):
        groups, library, ancestors = _group(graph, set(aliases), materialized)
        while cyclic := {a.id for g in kernels_on_cycles(groups, library) for a in g.anchors} & materialized:
            materialized -= cyclic   # a materialized value whose kernel landed on a cycle stays inlined
            groups, library, ancestors = _group(graph, set(aliases), materialized)
        more = worth_materializing(groups, graph) if round_ + 1 < MATERIALIZE_ROUNDS else set()
        if not more - materialized:
            break
        materialized |= more
    external = {n.id for n in graph.outputs} | {i.id for n in library for i in n.inputs}
    boundary = {e.node.id for g in groups for e in g.stores} | {n.id for n in library}
    groups = _pair_rows_with_columns(groups, ancestors, external, boundary)
    return Partition(_schedule(groups, library, graph))


def _group(graph: Graph, aliases: set[int],
           materialized: set[int]) -> tuple[list[KernelGroup], list[Node], dict[int, int]]:
    """The kernel groups (before row/column pairing), the library nodes and the ancestor masks.
    `materialized`: pointwise nodes made anchors; one that cannot be traced alone is left inlined
    (removed from the set) rather than run by reference."""
    library_ids = {n.id for n in graph.nodes if n.op != "input" and not is_literal(n) and not fusable(n)}
    library_ids |= aliases
    while True:  # an anchor that cannot be traced alone runs by reference; its inputs then become anchors
        anchors, literal_library = _anchors(graph, library_ids, materialized)
        boundary = {n.id for n in anchors} | library_ids | literal_library
        failed = set()
        for anchor in anchors:
            try:
                trace_group(KernelGroup(_own_domain(anchor), [anchor]), boundary)
            except TraceError:
                failed.add(anchor.id)
        if not failed:
            break
        if failed & materialized:
            materialized -= failed
        else:
            library_ids |= failed
    library_ids |= literal_library
    library = [n for n in graph.nodes if n.id in library_ids]
    ancestors = _ancestor_masks(graph)
    bits = _bits(ancestors)
    library_by_id = {n.id: n for n in library}
    groups: list[KernelGroup] = []
    group_of: dict[int, KernelGroup] = {}
    for anchor in anchors:
        alone = KernelGroup(_own_domain(anchor), [anchor])
        trace_group(alone, boundary)
        target = _merge_target(alone, groups, group_of, boundary, ancestors, bits, library_by_id)
        if target is None:
            groups.append(alone)
            group_of[anchor.id] = alone
        else:
            group_of[anchor.id] = target
    alias_root: dict[int, int] = {}   # an aliased view -> the value whose memory it views
    for n in graph.nodes:
        if n.id in aliases:
            alias_root[n.id] = alias_root.get(n.inputs[0].id, n.inputs[0].id)
    _merge_same_domain(groups, group_of, boundary, ancestors, alias_root, library_by_id)
    for group in groups:
        _drop_internal_stores(group, groups, graph, library, boundary)
    return groups, library, ancestors


def _anchors(graph: Graph, library_ids: set[int],
             materialized: Collection[int] = ()) -> tuple[list[Node], set[int]]:
    """Values that must be kernel results: graph outputs, library-op arguments, reductions, and
    the pointwise values chosen to be `materialized`. Also the literals that must exist as tensors
    (outputs, library arguments)."""
    users = graph.users()
    outputs = {n.id for n in graph.outputs}
    anchors: list[Node] = []
    literals: set[int] = set()
    for node in graph.nodes:
        if node.op == "input" or node.id in library_ids:
            continue
        needed_raw = node.id in outputs or any(u.id in library_ids for u in users.get(node.id, ()))
        if is_literal(node):
            if needed_raw:  # a scalar output / library argument: made by its reference
                literals.add(node.id)
        elif needed_raw or node.id in materialized or (get_op(node.op).has(REDUCTION) and not is_unit_reduction(node)):
            anchors.append(node)
    return anchors, literals


def _own_domain(anchor: Node) -> Domain:
    if get_op(anchor.op).has(REDUCTION) and not is_unit_reduction(anchor):
        return reduction_domain(anchor)
    return Domain(tuple(s for s in anchor.shape if s != 1))


def _ancestor_masks(graph: Graph) -> dict[int, int]:
    """node id -> bitmask (by position in graph.nodes) of every node it depends on."""
    bit = {n.id: 1 << k for k, n in enumerate(graph.nodes)}
    masks: dict[int, int] = {}
    for n in graph.nodes:
        m = 0
        for i in n.inputs:
            m |= masks.get(i.id, 0) | bit.get(i.id, 0)
        masks[n.id] = m
    return masks


def _merge_would_cycle(first: KernelGroup, second: KernelGroup, ancestors: dict[int, int],
                       graph_bits: dict[int, int]) -> bool:
    """_cyclic of the two groups merged, without tracing the merge: the merged kernel loads what either
    loads except the other's anchors (its own values now), so this is exact whenever the trace would
    succeed. Half of GPT-2's same-domain merge trials failed this way after a full trace."""
    anchors = first.anchors + second.anchors
    written = 0
    for a in anchors:
        written |= graph_bits[a.id]
    own = {a.id for a in anchors}
    return any(ancestors.get(e.node.id, 0) & written
               for e in (*first.loads, *second.loads) if e.node.id not in own)


def _cyclic(group: KernelGroup, ancestors: dict[int, int], graph_bits: dict[int, int]) -> bool:
    """Does a value this kernel reads depend on one it writes (through other kernels), or is it one
    (a row + column pair whose row part reads the column part's result)?"""
    written = 0
    for a in group.anchors:
        written |= graph_bits[a.id]
    own = {a.id for a in group.anchors}
    return any(ancestors.get(e.node.id, 0) & written or e.node.id in own for e in group.loads)


def _merge_target(alone: KernelGroup, groups: list[KernelGroup], group_of: dict[int, KernelGroup],
                  boundary: set[int], ancestors: dict[int, int], bits: dict[int, int],
                  library: dict[int, Node] | None = None) -> KernelGroup | None:
    """The producer group this anchor can join (latest first), merging in place; None if none."""
    from .recompute import reads_through_kernels

    producers = [group_of[e.node.id] for e in alone.loads if e.node.id in group_of]
    reads = {e.node.id for e in alone.loads}
    siblings = [g for g in groups if g.domain == alone.domain and any(e.node.id in reads for e in g.loads)]
    ordered = sorted({id(g): g for g in producers}.values(), key=groups.index, reverse=True)
    ordered += [g for g in reversed(siblings) if g not in ordered]  # same space, same data read
    for group in ordered:
        domain = _merged_domain(group.domain, alone.domain, alone.anchors[0])
        if domain is None or _merge_would_cycle(group, alone, ancestors, bits):
            continue
        trial = KernelGroup(domain, group.anchors + alone.anchors)
        try:
            trace_group(trial, boundary)
        except TraceError:
            continue
        if _cyclic(trial, ancestors, bits) or reads_through_kernels(trial, group_of, library or {}) \
                or _stops_split(trial, group, alone):
            continue
        group.domain, group.anchors = trial.domain, trial.anchors
        group.entries, group.loads, group.stores = trial.entries, trial.loads, trial.stores
        return group
    return None


def _stops_split(merged: KernelGroup, *parts: KernelGroup) -> bool:
    """Would this merge make a kernel that needs a split but cannot have it (KernelGroup.needs_split:
    a second round of reductions, or stores waiting for the sums)? Not when a part was such a
    kernel already: the merge then costs no split."""
    def stuck(g: KernelGroup) -> bool:
        return g.needs_split and not g.splittable
    return stuck(merged) and not any(stuck(p) for p in parts)


def _pair_rows_with_columns(groups: list[KernelGroup], ancestors: dict[int, int], external: set[int],
                            boundary: set[int]) -> list[KernelGroup]:
    """Pair column reductions with the row reduction over the same space whose data they read
    (see RowColumnGroup): the column kernels' second pass over the data disappears.

    A column reduction goes with the row kernel it shares the most bytes with: values the row
    computes (a bias gradient summing the rows of layernorm backward's dx) or tensors both load
    (layernorm backward's dw and db read the dx kernel's inputs). The column reductions one row
    kernel gets are traced as one column group (their loads once), as many as fit: a column that
    would make the pair read its own results is left apart. `boundary`: the values every kernel
    reads from memory (stored results, library nodes)."""
    bits = _bits(ancestors)
    rows = [g for g in groups if g.domain.is_reduction]
    claimed: dict[int, list[tuple[int, KernelGroup]]] = {}
    taken: set[int] = set()
    for col in groups:
        if not col.domain.is_reduction or any(e.stage > 1 for e in col.entries) or any(e.full for e in col.stores):
            continue
        best, score = None, 0
        for row in rows:
            if row is col or id(row) in taken or not (_transposed(row.domain, col.domain)
                                                      or _over_rows(row.domain, col.domain)):
                continue
            shared = _shared_bytes(row, col)
            if shared > score:
                best, score = row, shared
        if best is not None:
            claimed.setdefault(id(best), []).append((score, col))
            taken.add(id(col))
    out = list(groups)
    for row in rows:
        if id(row) in taken or id(row) not in claimed:
            continue
        cols = [c for _, c in sorted(claimed[id(row)], key=lambda sc: -sc[0])]
        pair: RowColumnGroup | None = None
        members: list[KernelGroup] = []
        for col in cols if settings.share_row_pass else cols[:1]:
            more = [*members, col]
            merged = _columns_as_one(more, boundary)
            trial = None if merged is None else _pair_of(row, merged, out, more, external)
            if trial is None or _cyclic(trial, ancestors, bits):
                continue
            pair, members = trial, more
        if pair is None:
            continue
        out[out.index(row)] = pair
        for col in members:
            out.remove(col)
    return out


def _shared_bytes(row: KernelGroup, col: KernelGroup) -> int:
    """Bytes the column kernel reads per pass that the row kernel has in registers too: values it
    computes, or full-size tensors it loads (0 when the column reads a row value the row holds in
    another placement: that pair cannot share registers)."""
    computed = {(e.node.id, e.emb) for e in row.entries if e.kind != "load"}
    row_nodes = {e.node.id for e in row.entries if e.kind != "load"}
    row_loads = {(e.node.id, e.emb) for e in row.loads} if settings.share_row_pass else set()
    total = 0
    for e in col.loads:
        if e.node.id in row_nodes and (e.node.id, e.emb) not in computed:
            return 0
        if (e.node.id, e.emb) in computed or ((e.node.id, e.emb) in row_loads and e.full):
            total += e.node.spec.numel * dtypes.itemsize(e.node.dtype)
    return total


def _columns_as_one(cols: list[KernelGroup], boundary: set[int]) -> KernelGroup | None:
    """The column reductions traced as one group (stores: what each stored), or None when they do
    not fit one (other domains, a trace conflict, a second round of reductions)."""
    if len(cols) == 1:
        return cols[0]
    if any(c.domain != cols[0].domain for c in cols):
        return None
    group = KernelGroup(cols[0].domain, [a for c in cols for a in c.anchors])
    try:
        trace_group(group, boundary)
    except TraceError:
        return None
    stored = {e.node.id for c in cols for e in c.stores}
    group.stores = [e for e in group.stores if e.node.id in stored]
    if any(e.stage > 1 for e in group.entries) or any(e.full for e in group.stores):
        return None
    return group


def _pair_of(row: KernelGroup, col: KernelGroup, groups: list[KernelGroup], members: list[KernelGroup],
             external: set[int]) -> RowColumnGroup:
    """`row` and the column group `col` (made of the groups `members`) as one RowColumnGroup: col's
    entries renamed apart, row results only col reads kept in registers."""
    import dataclasses

    row_nodes = {e.node.id for e in row.entries if e.kind != "load"}
    rename = {e.key: "c" + e.key for e in col.entries}
    entries = [dataclasses.replace(e, key=rename[e.key], args=tuple(rename[a] for a in e.args))
               for e in col.entries]
    by_key = {e.key: e for e in entries}
    stores = [by_key[rename[e.key]] for e in col.stores]
    loads = [e for e in entries if e.kind == "load"]
    renamed = KernelGroup(col.domain, col.anchors, entries, stores, loads)
    skip = {id(row), *(id(m) for m in members)}
    others = external | {e.node.id for g in groups if id(g) not in skip for e in g.loads}
    row_stores = [e for e in row.stores if e.node.id in others]   # the rest stays in registers
    return RowColumnGroup(row.domain, row.anchors + col.anchors, row.entries + entries, row_stores + stores,
                          row.loads + [e for e in loads if e.node.id not in row_nodes],
                          row=row, col=renamed, separate=col)


def _transposed(row: Domain, col: Domain) -> bool:
    """Same space; the column reduction reduces the dims the row reduction keeps, and keeps the rest."""
    return row.shape == col.shape and set(row.reduced) == set(col.kept) and set(row.kept) == set(col.reduced)


def _over_rows(row: Domain, col: Domain) -> bool:
    """A full reduction over the row kernel's kept space (leading dims, same numbering): the mean
    over rows of a per-row value such as cross-entropy's loss."""
    k = len(col.shape)
    return not col.kept and row.kept == tuple(range(k)) and col.shape == row.shape[:k]


def _bits(ancestors: dict[int, int]) -> dict[int, int]:
    return {nid: 1 << k for k, nid in enumerate(ancestors)}


def _merge_same_domain(groups: list[KernelGroup], group_of: dict[int, KernelGroup], boundary: set[int],
                       ancestors: dict[int, int], alias_root: dict[int, int] | None = None,
                       library: dict[int, Node] | None = None) -> None:
    """Second round: merge groups of one domain that depend on each other or read the same data
    (also through different views of one tensor: q, k and v sliced out of one qkv projection),
    when no third kernel sits between them (greedy anchor order can leave such pairs apart).

    A pair that fails to merge is not tried again while both groups keep their anchors: its trace
    depends only on the anchors and the (fixed) boundary, and merges elsewhere only coarsen the
    kernel graph, which can add paths through other kernels (reads_through_kernels) but not remove
    them. GPT-2's backward (hundreds of groups) spent most of its build here retrying such pairs."""
    from .recompute import reads_through_kernels

    roots = alias_root or {}

    def read(g: KernelGroup) -> set[int]:
        return {roots.get(e.node.id, e.node.id) for e in g.loads}

    def deps(g: KernelGroup) -> set[int]:
        return {id(group_of[e.node.id]) for e in g.loads if e.node.id in group_of} - {id(g)}

    bits = _bits(ancestors)
    failed: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()
    changed = True
    while changed:
        changed = False
        position = {id(g): k for k, g in enumerate(groups)}   # relative order survives removals
        alive = set(position)
        reads = {id(g): read(g) for g in groups}
        dep = {id(g): deps(g) for g in groups}
        for a in list(groups):
            for b in list(groups):
                if a is b or a.domain != b.domain or id(a) not in alive or id(b) not in alive:
                    continue
                if not (id(a) in dep[id(b)] or id(b) in dep[id(a)] or reads[id(a)] & reads[id(b)]):
                    continue
                first, second = (a, b) if position[id(a)] < position[id(b)] else (b, a)
                key = (tuple(n.id for n in first.anchors), tuple(n.id for n in second.anchors))
                if key in failed:
                    continue
                if _merge_would_cycle(first, second, ancestors, bits):
                    failed.add(key)
                    continue
                trial = KernelGroup(first.domain, first.anchors + second.anchors)
                try:
                    trace_group(trial, boundary)
                except TraceError:
                    failed.add(key)
                    continue
                if _cyclic(trial, ancestors, bits) or reads_through_kernels(trial, group_of, library or {}) \
                        or _stops_split(trial, first, second):
                    failed.add(key)
                    continue
                first.anchors, first.entries, first.loads, first.stores = \
                    trial.anchors, trial.entries, trial.loads, trial.stores
                for n in second.anchors:
                    group_of[n.id] = first
                groups.remove(second)
                alive.discard(id(second))
                reads[id(first)], dep[id(first)] = read(first), deps(first)
                for g in groups:   # who read the second group now reads the first
                    if g is not first and id(second) in dep[id(g)]:
                        dep[id(g)] = (dep[id(g)] - {id(second)}) | {id(first)}
                changed = True


def _merged_domain(have: Domain, new: Domain, anchor: Node) -> Domain | None:
    if have == new:
        return have
    if have.shape != new.shape and not new.is_reduction and have.is_reduction:
        return have if anchor_embedding(anchor, have) is not None else None
    if have.shape != new.shape:
        return None
    if have.is_reduction and new.is_reduction:
        return None
    reduction = have if have.is_reduction else new
    numel = math.prod(reduction.shape)
    if reduction.kept_numel < MIN_KEPT_FOR_FUSION and numel > SMALL_NUMEL:
        return None  # the fused kernel would run on too few programs
    return reduction


def _drop_internal_stores(group: KernelGroup, groups: list[KernelGroup], graph: Graph,
                          library: list[Node], boundary: set[int]) -> None:
    """An anchor used only inside its own kernel (and not an output) stays in registers."""
    read_elsewhere = {e.node.id for g in groups if g is not group for e in g.loads}
    read_elsewhere |= {i.id for n in library for i in n.inputs}
    read_elsewhere |= {n.id for n in graph.outputs}
    group.stores = [e for e in group.stores if e.node.id in read_elsewhere]
    boundary.difference_update(e.node.id for e in group.entries if e.kind != "load" and
                               e.node.id not in read_elsewhere)


def _schedule(groups: list[KernelGroup], library: list[Node], graph: Graph) -> list[KernelGroup | Node]:
    """Launch order: a topological order of kernels by what they read."""
    producer: dict[int, KernelGroup | Node] = {}
    for g in groups:
        for e in g.stores:
            producer[e.node.id] = g
    for n in library:
        producer[n.id] = n
    deps: dict[int, list[KernelGroup | Node]] = {}
    items: list[KernelGroup | Node] = [*groups, *library]
    for item in items:
        reads = [e.node for e in item.loads] if isinstance(item, KernelGroup) else list(item.inputs)
        deps[id(item)] = [producer[n.id] for n in reads if n.id in producer and producer[n.id] is not item]
    position = {n.id: k for k, n in enumerate(graph.nodes)}
    items.sort(key=lambda it: min(position[a.id] for a in it.anchors) if isinstance(it, KernelGroup)
               else position[it.id])
    out: list[KernelGroup | Node] = []
    done: set[int] = set()

    def place(item: KernelGroup | Node) -> None:
        if id(item) in done:
            return
        done.add(id(item))
        for d in deps[id(item)]:
            place(d)
        out.append(item)

    for item in items:
        place(item)
    return out
