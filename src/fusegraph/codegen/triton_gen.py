"""Triton source for a KernelGroup: pointwise kernels over the flattened domain (for rows of
>= ROW_TILE_MIN_COLS with a row-padded store or a per-row operand, also a body over BLOCK-column
tiles of one row each, chosen by the ROW_TILED knob the autotuner times: per-row values load once
as scalars and padded rows store as vectors, but an odd row stride makes its loads scalar), and reduction
kernels over a [kept, reduced] tile (row reductions reduce the tile's contiguous axis, column
reductions the other), with the whole reduced extent in registers when it fits (SINGLE) and a
loop over chunks, one pass per sequential reduction, when it does not.

Every value is an fp32 tile (ints and bools keep their own types); loads upcast, stores cast to
the output's dtype. Broadcasting and strides are index arithmetic on per-dim index variables.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ..fusion.index_map import Affine, concat_expr, domain_dim, index_expr, pad_before, pad_expr, range_mask
from ..fusion.partition import Entry, KernelGroup, gather_index_embedding, gather_source
from ..ir import dtypes
from ..ir.node import Node
from ..ir.registry import get_op
from ..ir.spec import contiguous_strides, strides_for_order
from ..settings import settings

TL_DTYPE = {"float32": "tl.float32", "float16": "tl.float16", "bfloat16": "tl.bfloat16",
            "int64": "tl.int64", "int32": "tl.int32", "int16": "tl.int16", "int8": "tl.int8",
            "uint8": "tl.uint8", "bool": "tl.int1"}
HEADER = ("import triton\nimport triton.language as tl\n"
          "from triton.language.extra import libdevice  # noqa: F401\n\n\n")
# Programmatic dependent launch (Hopper and newer; runtime/launch.py pdl_enabled decides): a kernel
# launched with it may be scheduled while the kernel before it in the stream is finishing. Its first act
# is to wait for that kernel's writes (griddepcontrol.wait: nothing of ours touches memory before), then
# to let the kernel after it be scheduled early in turn. With USE_PDL false (the default, and every
# launch that does not ask for it) the lines compile away.
PDL_PROLOGUE = ("    if USE_PDL:\n"
                "        tl.extra.cuda.gdc_wait()\n"
                "        tl.extra.cuda.gdc_launch_dependents()")


def jit_head(name: str, params: str) -> str:
    """`@triton.jit def name(params, USE_PDL=False):` and the PDL prologue: the head of every
    generated kernel (pointwise, reductions, GEMMs)."""
    return f"@triton.jit\ndef {name}({params}, USE_PDL: tl.constexpr = False):\n{PDL_PROLOGUE}"


INT32_LIMIT = 2**31 - 1
LOG2E = 1.4426950408889634


@dataclass
class GeneratedKernel:
    name: str
    source: str                       # a whole module: imports + one @triton.jit function
    kind: str
    inputs: list[Node]                # pointer arguments, in order, then outputs
    outputs: list[Node]
    extent: int                       # pointwise: numel; reduction: kept numel (rows)
    reduced_extent: int = 1           # reduction: elements reduced per row
    column: bool = False              # reduction over a non-contiguous axis
    finish_name: str = ""             # two-stage column reduction: the kernel reducing the partials
    workspaces: int = 0               # two-stage: fp32 [splits, rows] partials, one per reduction
    meta: dict[str, Any] = field(default_factory=dict)


def generate(group: KernelGroup, name: str) -> GeneratedKernel:
    from ..fusion.horizontal import ComboGroup

    if isinstance(group, ComboGroup):
        from .combo import write_combo

        return write_combo(group, name)
    if group.domain.is_reduction:
        if group.splittable:
            from .column_split import ColumnSplitWriter

            return ColumnSplitWriter(group, name).write_split()
        return _ReductionWriter(group, name).write()
    return _PointwiseWriter(group, name).write()


class _Writer:
    def __init__(self, group: KernelGroup, name: str) -> None:
        self.group = group
        self.name = name
        self.domain = group.domain
        self.bounds = group.domain.shape   # the extent range conditions assume (a row-tiled body's fast half: less)
        self.inputs = group.inputs
        self.outputs = [e.node for e in group.stores]
        self.ptr = {n.id: f"in{k}" for k, n in enumerate(self.inputs)}
        self.out_ptr = {e.key: f"out{k}" for k, e in enumerate(group.stores)}
        self.expr: dict[str, str] = {}
        self.lines: list[str] = []
        self.zero_index = "0"  # an index expression of the tile's shape that is always 0
        self.wide = max([_max_offset(n) for n in self.inputs + self.outputs] + [0]) > INT32_LIMIT
        self.shifted_exps: dict[str, tuple[str, str]] = {}   # exp(a - max(a)) entries: key -> (a, max)
        self.read_keys = {a for e in group.entries for a in e.args}   # entries some entry of the group reads

    def emit(self, line: str, indent: int = 1) -> None:
        self.lines.append("    " * indent + line)

    def signature(self, constexprs: list[str]) -> str:
        args = [self.ptr[n.id] for n in self.inputs] + list(self.out_ptr.values())
        return ", ".join(args + [f"{c}: tl.constexpr" for c in constexprs])

    def offset(self, node: Node, emb: tuple[int | Affine | None, ...], dimvar: dict[int, str]) -> str:
        strides = node.spec.memory_strides
        terms = []
        for k, d in enumerate(emb):
            if d is None or node.shape[k] == 1:
                continue
            index = index_expr(d, dimvar)   # dimvar[d], or an affine index of a slice / concat input
            terms.append(index if strides[k] == 1 else f"{index} * {strides[k]}")
        if terms and all(domain_dim(d) is None for d in emb):   # constant indices only
            terms.append(self.zero_index)
        return " + ".join(terms) or self.zero_index

    def value(self, entry: Entry, mask: str, dimvar: dict[int, str], indent: int) -> None:
        """Emit the line computing `entry` (not for reductions)."""
        if entry.kind == "literal":
            opdef = get_op(entry.node.op)
            assert opdef.triton is not None
            text = str(opdef.triton([], entry.node.attrs))
            value = entry.node.attrs.get("value")
            if (entry.node.op == "scalar" and (dtypes.is_int(entry.node.dtype) or entry.node.dtype == "bool")
                    and isinstance(value, (int, float))
                    and not isinstance(value, bool) and float(value).is_integer()):
                # an integer literal meeting an int tensor (a cross-entropy's ignore_index -100, a
                # where(..., 0)): spelled as a float it promoted the int64 operand to fp32 per element
                # (a slow conversion, and inexact above 2**24)
                text = str(int(value))
            self.expr[entry.key] = f"float('{text}')" if text in ("inf", "-inf", "nan") else text
            return
        # a widening float cast computed here is its input's fp32 value; one loaded (a cast that
        # another kernel stored: a boundary value) is read like any load
        if entry.kind == "view" or (entry.kind == "op" and _is_free_cast(entry.node) and not _narrows(entry.node)):
            self.expr[entry.key] = self.expr[entry.args[0]]
            return
        if entry.kind == "gen":
            self.emit(f"{entry.key} = {self._generator(entry, dimvar)}", indent)
            self.expr[entry.key] = entry.key
            return
        if entry.kind == "gather":
            self.emit(f"{entry.key} = {self._table_load(entry, mask, dimvar)}", indent)
            self.expr[entry.key] = entry.key
            return
        if entry.kind == "load":
            inside = range_mask(entry.node, entry.emb, self.bounds, dimvar)   # concat, pad inputs
            load = self._raw_load(entry, f"({mask}) & {inside}" if inside else mask, dimvar)
            if dtypes.is_float(entry.node.dtype):
                load += ".to(tl.float32)"
            self.emit(f"{entry.key} = {load}", indent)
        elif entry.key in self.shifted_exps:
            # exp(a - m) with m = max(a): one FFMA and ex2.approx.ftz (tl.exp's non-ftz ex2 costs
            # three more instructions an element to handle denormal results, which are < 1e-38
            # here next to the row's largest term, 1)
            a, m = (self.expr[k] for k in self.shifted_exps[entry.key])
            self.emit(f"{entry.key} = tl.math.exp2({a} * {LOG2E} - {m} * {LOG2E})", indent)
        elif entry.node.op == "concat":   # the segment's input, by the output index (index_map)
            expr = concat_expr(entry.node, entry.emb, [self.expr[a] for a in entry.args], dimvar)
            self.emit(f"{entry.key} = {expr}", indent)
        elif entry.node.op == "pad":      # the pad value outside the input (index_map)
            expr = pad_expr(entry.node, entry.emb, self.expr[entry.args[0]], self.bounds, dimvar)
            self.emit(f"{entry.key} = {expr}", indent)
        else:
            args = [self.expr[a] for a in entry.args]
            expr = _op_expr(entry.node, args)
            # a 16-bit result is rounded as eager rounds it op by op (settings.round_intermediates, on by
            # default); off, it stays fp32 in registers (Inductor's way) unless it is an explicit cast or a
            # stored value that later ops here read too (they see what the tensor holds); stores always round
            low = entry.node.dtype in ("float16", "bfloat16") and (
                entry.node.op == "cast" or settings.round_intermediates
                or (entry.key in self.out_ptr and entry.key in self.read_keys))
            if low:
                expr = f"({expr}).to({TL_DTYPE[entry.node.dtype]}).to(tl.float32)"
            self.emit(f"{entry.key} = {expr}", indent)
        self.expr[entry.key] = entry.key

    def _raw_load(self, entry: Entry, mask: str, dimvar: dict[int, str]) -> str:
        """A load of `entry` in its stored dtype (no upcast), where `dimvar` indexes it."""
        ptr = f"{self.ptr[entry.node.id]} + {self.offset(entry.node, entry.emb, dimvar)}"
        return f"tl.load({ptr}, mask={mask}, other=0)"

    def _table_load(self, entry: Entry, mask: str, dimvar: dict[int, str]) -> str:
        """The table element a gather entry reads: the index value (an entry computed before it) picks
        the row of the selected dim, the entry's embedding places the other dims. An index outside the
        table reads 0 (masked) instead of memory past it; torch raises for one."""
        node = entry.node
        table = gather_source(node)
        _, _, dim = gather_index_embedding(node, entry.emb)
        strides = table.spec.memory_strides
        if node.op == "embedding":   # weight[indices[...], j]: the output's last dim is the weight's
            other = {1: entry.emb[-1]}
        else:                        # x[..., index[i_d], ...]: every other dim as the output's
            other = {k: entry.emb[k] for k in range(table.spec.rank) if k != dim}
        row = f"{self.expr[entry.args[0]]}.to(tl.int64)" if self.wide else self.expr[entry.args[0]]
        terms = [row if strides[dim] == 1 else f"{row} * {strides[dim]}"]
        for k, d in other.items():
            if d is not None and table.shape[k] != 1:
                index = index_expr(d, dimvar)
                terms.append(index if strides[k] == 1 else f"{index} * {strides[k]}")
        if len(terms) == 1:   # the row may be one scalar per program: the address takes the tile's shape
            terms.append(self.zero_index)
        inside = f"({row} >= 0) & ({row} < {table.shape[dim]})"
        load = f"tl.load({self.ptr[table.id]} + {' + '.join(terms)}, mask=({mask}) & {inside}, other=0)"
        return load + ".to(tl.float32)" if dtypes.is_float(table.dtype) else load

    def _generator(self, entry: Entry, dimvar: dict[int, str]) -> str:
        node = entry.node
        opdef = get_op(node.op)
        assert opdef.triton is not None
        zero = "tl.zeros([1], tl.int32)"
        if "index_dim_attr" in opdef.extra:
            dim = int(node.attrs[opdef.extra["index_dim_attr"]]) % len(node.shape)
            d = entry.emb[dim]
            index = index_expr(d, dimvar) if d is not None and node.shape[dim] != 1 else zero
        else:  # the row-major linear index over the generator's own shape
            strides = contiguous_strides(node.shape)
            terms = [index_expr(d, dimvar) if strides[k] == 1 else f"{index_expr(d, dimvar)} * {strides[k]}"
                     for k, d in enumerate(entry.emb) if d is not None and node.shape[k] != 1]
            index = " + ".join(terms) or zero
        return str(opdef.triton([index], node.attrs))

    def store(self, entry: Entry, mask: str, dimvar: dict[int, str], indent: int) -> None:
        out = self.out_ptr[entry.key]
        off = self.offset(entry.node, entry.emb, dimvar)
        value = self.expr[entry.key]
        self.emit(f"tl.store({out} + {off}, ({value}).to({out}.dtype.element_ty), mask={mask})", indent)

    def module(self, body: list[str]) -> str:
        return HEADER + "\n".join(body) + "\n"


def row_mask(rows: int, per_program: str) -> str:
    """`rows < {rows}`, or'ed with a constexpr that is True when every program's rows are in range:
    Triton folds the mask to a constant, dropping the selects and predicates on every element."""
    return f"(rows < {rows}) | ({rows} % {per_program} == 0)"


def whole_row_mask(cols: int) -> str:
    """The column mask of a tile holding the whole row, `cols = tl.arange(0, BLOCK_C)`: constant
    True when the row is exactly BLOCK_C wide (a power of two)."""
    return f"((cols < {cols}) | (BLOCK_C == {cols}))"


def _op_expr(node: Node, args: list[str]) -> str:
    if node.op == "cast":
        src, dst = node.inputs[0].dtype, node.dtype
        if dtypes.is_float(dst):
            return args[0] if dtypes.is_float(src) else f"{args[0]}.to(tl.float32)"
        if dst == "bool":
            return f"({args[0]} != 0)"
        return f"{args[0]}.to({TL_DTYPE[dst]})"
    opdef = get_op(node.op)
    assert opdef.triton is not None
    return str(opdef.triton(args, node.attrs))


def _is_free_cast(node: Node) -> bool:
    """float -> float casts cost nothing inside a kernel: values stay fp32, stores round."""
    return node.op == "cast" and dtypes.is_float(node.dtype) and dtypes.is_float(node.inputs[0].dtype)


def _narrows(node: Node) -> bool:
    return dtypes.itemsize(node.dtype) < dtypes.itemsize(node.inputs[0].dtype)


def _max_offset(node: Node) -> int:
    return sum((s - 1) * abs(st) for s, st in zip(node.shape, node.spec.memory_strides, strict=True))


def _index_vars(shape: tuple[int, ...], dims: tuple[int, ...], linear: str,
                prefix: str) -> tuple[list[str], dict[int, str]]:
    """Per-dim indices of `linear`, a row-major index over `shape[d] for d in dims`."""
    lines, names = [], {}
    inner = 1
    for pos in range(len(dims) - 1, -1, -1):
        d = dims[pos]
        size = shape[d]
        if size == 1:
            continue
        expr = linear if inner == 1 else f"({linear} // {inner})"
        outermost = all(shape[e] == 1 for e in dims[:pos])
        if not outermost:
            expr = f"{expr} % {size}"
        if expr == linear:
            names[d] = linear
        else:
            names[d] = f"{prefix}{d}"
            lines.append(f"{prefix}{d} = {expr}")
        inner *= size
    return list(reversed(lines)), names


ROW_TILE_MIN_COLS = 2048   # row-tiled pointwise kernels: rows at least this wide (the tail block's waste)
SEGMENT_MIN_COLS = 4096    # segmented pointwise bodies: rows at least the widest BLOCK


class _PointwiseWriter(_Writer):
    def write(self) -> GeneratedKernel:
        order = self._iteration_order()
        if self._row_tiled(order):
            return self._write_both(order)
        self._write_flat(order)
        head = [jit_head(self.name, self.signature(['BLOCK']))]
        return GeneratedKernel(self.name, self.module(head + self.lines), "pointwise", self.inputs,
                               self.outputs, extent=math.prod(self.domain.shape))

    def _write_both(self, order: tuple[int, ...]) -> GeneratedKernel:
        """A kernel with two or three bodies, chosen by the constexpr ROW_TILED (a tuning knob: the
        autotuner times them; which wins depends on the operands' alignment and the row width): the
        row-tiled one (ROW_TILED true), the segmented one (2, see _write_segmented) where it applies,
        and the flat one (false)."""
        self._write_row_tiled(order)
        row_lines, self.lines, self.expr = self.lines, [], {}
        segmented = self._segmentable(order)
        seg_lines: list[str] = []
        if segmented:
            self._write_segmented(order)
            seg_lines, self.lines, self.expr = self.lines, [], {}
        self._write_flat(order)
        flat_lines = self.lines
        shape = self.domain.shape
        numel, cols_n = math.prod(shape), shape[order[-1]]
        head = [jit_head(self.name, self.signature(['BLOCK', 'ROW_TILED'])),
                f"    # ROW_TILED: program p covers BLOCK columns of row p // cdiv({cols_n}, BLOCK); "
                "else BLOCK elements of the flat domain"
                + (" (2: per-row values of its <= 2 rows)" if segmented else "")]
        body = []
        if segmented:
            body += ["    if ROW_TILED == 2:"] + ["    " + line for line in seg_lines]
        body += [f"    {'elif' if segmented else 'if'} ROW_TILED:"] + ["    " + line for line in row_lines]
        body += ["    else:"] + ["    " + line for line in flat_lines]
        meta: dict[str, Any] = {"row_tiled": (numel // cols_n, cols_n)}
        if segmented:
            meta["segmented"] = True
        return GeneratedKernel(self.name, self.module(head + body), "pointwise", self.inputs, self.outputs,
                               extent=numel, meta=meta)

    def _segmentable(self, order: tuple[int, ...]) -> bool:
        """The segmented body applies: rows at least SEGMENT_MIN_COLS wide (a block of up to that many
        elements crosses at most one row end), every store dense or walking its row contiguously (a
        padded row layout), and operands read once per row."""
        shape = self.domain.shape
        inner = order[-1]
        contiguous = strides_for_order(shape, order)
        return (shape[inner] >= SEGMENT_MIN_COLS
                and all(self._linear(e, contiguous) or self._inner_contiguous(e, inner) for e in self.group.stores)
                and any(self._per_row(e, inner) for e in self.group.entries))

    def _per_row(self, e: Entry, inner: int) -> bool:
        return e.kind == "load" and not self._scalar(e) and not any(domain_dim(d) == inner for d in e.emb)

    def _write_segmented(self, order: tuple[int, ...]) -> None:
        """Flat blocks of BLOCK <= C elements (C the innermost dim), so dense loads and stores stay
        aligned 16-byte vectors even when C is odd (a 50257-wide vocab), and a block holds the end of
        at most one row: each per-row operand loads as two scalars (this block's first row and the
        next) and is selected per element, instead of a gather per element, and no element pays a
        division for its row. A store into padded rows (a logits gradient padded for the GEMM after
        it) goes to row * stride + col, element by element. Emits the body only (see _write_both)."""
        shape = self.domain.shape
        inner = order[-1]
        cols_n = shape[inner]
        numel = math.prod(shape)
        rows_n = numel // cols_n
        pid = "tl.program_id(0).to(tl.int64)" if self.wide else "tl.program_id(0)"
        self.emit(f"start = {pid} * BLOCK")
        self.emit("offs = start + tl.arange(0, BLOCK)")
        self.emit(f"mask = offs < {numel}")
        self.emit(f"row0 = start // {cols_n}")
        self.emit(f"row1 = tl.minimum(row0 + 1, {rows_n - 1})")
        self.emit(f"second = offs >= (row0 + 1) * {cols_n}")   # the elements of the next row
        self.emit("row = tl.where(second, row1, row0)")
        self.emit(f"cols = offs - row * {cols_n}")
        self.zero_index = "offs * 0"
        contiguous = strides_for_order(shape, order)
        index_lines, dimvar = _index_vars(shape, order[:-1], "row", "i")
        dimvar[inner] = "cols"
        if any(e.kind in ("gen", "gather") or (e.kind == "load" and not self._per_row(e, inner) and not self._scalar(e)
                                               and not self._linear(e, contiguous)) for e in self.group.entries) \
                or not all(self._linear(e, contiguous) for e in self.group.stores):
            for line in index_lines:   # a generator, a strided operand or a padded store needs the row's indices
                self.emit(line)
        ends = []
        for name in ("row0", "row1"):
            lines, dims = _index_vars(shape, order[:-1], name, f"{name}_i")
            for line in lines:
                self.emit(line)
            dims[inner] = "0"   # unused: per-row operands do not walk the row
            ends.append(dims)
        for e in self.group.entries:
            if e.kind == "load" and self._scalar(e):
                self._plain_load(e, "")
            elif self._per_row(e, inner):
                ptr = self.ptr[e.node.id]
                up = ".to(tl.float32)" if dtypes.is_float(e.node.dtype) else ""
                of_row0, of_row1 = (f"tl.load({ptr} + {self.offset(e.node, e.emb, d)}){up}" for d in ends)
                self.emit(f"{e.key} = tl.where(second, {of_row1}, {of_row0})")
                self.expr[e.key] = e.key
            else:
                self._dense_load_or_value(e, contiguous, dimvar)
        self._store_rows(contiguous, dimvar)

    def _dense_load_or_value(self, e: Entry, contiguous: tuple[int, ...], dimvar: dict[int, str]) -> None:
        """A dense operand loads at the flat index `offs`; anything else is computed per element."""
        if e.kind == "load" and self._linear(e, contiguous):
            self._plain_load(e, " + offs, mask=mask, other=0")
        else:
            self.value(e, "mask", dimvar, 1)

    def _store_rows(self, contiguous: tuple[int, ...], dimvar: dict[int, str]) -> None:
        """The stores of a row-wise body: dense ones at `offs`, padded rows at their own offsets (a
        per-row value broadcasts to the row's columns)."""
        for e in self.group.stores:
            out = self.out_ptr[e.key]
            off = "offs" if self._linear(e, contiguous) else self.offset(e.node, e.emb, dimvar)
            self.emit(f"tl.store({out} + {off}, ({self.expr[e.key]}).to({out}.dtype.element_ty), mask=mask)")

    def _write_flat(self, order: tuple[int, ...], pid: str = "") -> None:
        """The flat body: program `pid` (default: this launch's program id) covers BLOCK elements of
        the domain walked in `order` (a combo kernel passes its member's block number: codegen/combo.py)."""
        shape = self.domain.shape
        numel = math.prod(shape)
        pid = pid or ("tl.program_id(0).to(tl.int64)" if self.wide else "tl.program_id(0)")
        self.emit(f"offs = {pid} * BLOCK + tl.arange(0, BLOCK)")
        self.emit(f"mask = offs < {numel}")
        self.zero_index = "offs * 0"
        # Walk the domain in the memory order of the output, so stores (and loads laid out like it,
        # e.g. NHWC) stay coalesced; for row-major outputs this is the plain flat index.
        index_lines, dimvar = _index_vars(shape, order, "offs", "i")
        contiguous = strides_for_order(shape, order)
        needs_index = any(e.kind in ("gen", "gather") or e.node.op in ("concat", "pad") for e in self.group.entries)
        for e in self.group.entries:
            if e.kind == "load" and not self._linear(e, contiguous):
                needs_index = True
        for e in self.group.stores:
            if not self._linear(e, contiguous):
                needs_index = True
        if needs_index:
            for line in index_lines:
                self.emit(line)
        for e in self.group.entries:
            linear = e.kind == "load" and self._linear(e, contiguous)
            if linear or (e.kind == "load" and self._scalar(e)):
                # a scalar operand (a loss scale, a count) loads once per program as a scalar, so the
                # math on it (e.g. a division) is not repeated per element; it broadcasts where used
                self._plain_load(e, " + offs, mask=mask, other=0" if linear else "")
            else:
                self.value(e, "mask", dimvar, 1)
        for e in self.group.stores:
            if self._linear(e, contiguous):
                out = self.out_ptr[e.key]
                self.emit(f"tl.store({out} + offs, ({self.expr[e.key]}).to({out}.dtype.element_ty), mask=mask)")
            else:
                self.store(e, "mask", dimvar, 1)

    def _iteration_order(self) -> tuple[int, ...]:
        """Dims outermost-first by the first full-size store's memory strides (row-major on ties)."""
        shape = self.domain.shape
        for e in self.group.stores:
            if e.node.shape == shape and e.emb == tuple(range(len(shape))):
                strides = e.node.spec.memory_strides
                return tuple(sorted(range(len(shape)), key=lambda d: (-strides[d], d)))
        return tuple(range(len(shape)))

    def _row_tiled(self, order: tuple[int, ...]) -> bool:
        """Whether to tile the domain by rows: the innermost dim (in iteration order) is at least
        ROW_TILE_MIN_COLS wide and a store or load is not the flat index (a row-padded layout, such
        as a vocab-wide gradient padded to a multiple of 8 for the GEMM after it: flat, its stores
        break at every row into scalar ones and every element pays a div/mod) or reads one value
        per row (a per-row gather per element, flat). A program then covers BLOCK columns of one
        row: per-row operands load once as scalars, stores into padded rows stay vectors."""
        shape = self.domain.shape
        if len(order) < 2 or shape[order[-1]] < ROW_TILE_MIN_COLS or math.prod(shape) == shape[order[-1]]:
            return False
        inner = order[-1]
        if any((e.kind == "gen" and "index_dim_attr" not in get_op(e.node.op).extra) or e.node.op == "concat"
               or (e.node.op == "pad" and not self._pads_only(e, inner)) for e in self.group.entries):
            return False
        contiguous = strides_for_order(shape, order)
        if not all(self._inner_contiguous(e, inner) or self._linear(e, contiguous) for e in self.group.stores):
            return False   # every store walks the row (a per-row output is a reduction's job)
        padded = [e for e in self.group.stores if not self._linear(e, contiguous)]
        per_row = [e for e in self.group.entries if e.kind == "load" and not self._scalar(e)
                   and not any(domain_dim(d) == inner for d in e.emb)]
        return bool(padded or per_row)

    def _pads_only(self, e: Entry, inner: int) -> bool:
        """A pad entry that pads only along domain dim `inner` (a zero-padded vocabulary row,
        passes/pad_dims.py): per-row values stay in range, so the row-tiled body covers it."""
        return all(domain_dim(e.emb[d]) == inner for d in pad_before(e.node))

    def _inner_contiguous(self, e: Entry, inner: int) -> bool:
        """The entry walks the inner domain dim with stride 1."""
        strides = e.node.spec.memory_strides
        return any(domain_dim(d) == inner and isinstance(d, int) and strides[k] == 1 for k, d in enumerate(e.emb))

    def _write_row_tiled(self, order: tuple[int, ...]) -> None:
        """The domain as R rows of C elements (C the innermost dim in iteration order); program p
        covers BLOCK columns of row p // cdiv(C, BLOCK). Launch grid: R * cdiv(C, BLOCK). Emits the
        body only (see _write_both)."""
        shape = self.domain.shape
        inner = order[-1]
        cols_n = shape[inner]
        pid = "tl.program_id(0).to(tl.int64)" if self.wide else "tl.program_id(0)"
        self.emit(f"pid = {pid}")
        self.emit(f"row = pid // (({cols_n} + BLOCK - 1) // BLOCK)")
        self.emit(f"c0 = (pid % (({cols_n} + BLOCK - 1) // BLOCK)) * BLOCK")
        self.emit("cols = c0 + tl.arange(0, BLOCK)")
        self.emit(f"offs = row * {cols_n} + cols")
        self.zero_index = "cols * 0"
        index_lines, dimvar = _index_vars(shape, order[:-1], "row", "i")
        dimvar[inner] = "cols"
        for line in index_lines:
            self.emit(line)
        contiguous = strides_for_order(shape, order)
        start = len(self.lines)
        saved_expr = dict(self.expr)

        def emit_body() -> None:
            for e in self.group.entries:
                if e.kind == "load" and (self._scalar(e) or self._per_row(e, inner)):
                    # one value per row (or per kernel): a scalar load, in range for every program
                    self._plain_load(e, "" if self._scalar(e) else f" + {self.offset(e.node, e.emb, dimvar)}")
                else:
                    self._dense_load_or_value(e, contiguous, dimvar)
            self._store_rows(contiguous, dimvar)

        emit_body()
        # zero padding along the row (passes/pad_dims.py) is in range up to the shortest padded input
        inside = min([cols_n] + [e.node.inputs[0].shape[d] for e in self.group.entries if e.node.op == "pad"
                                 for d in pad_before(e.node) if domain_dim(e.emb[d]) == inner])
        if cols_n % 16 == 0 and inside == cols_n:
            self.lines.insert(start, f"    mask = cols < {cols_n}")
            return
        # an odd row (a 50257-wide vocab): `cols < C` varies element by element, which makes Triton
        # load and store the whole block in scalars; blocks that end inside the row take no mask (their
        # accesses to 16-byte-aligned rows, e.g. padded ones, become vectors), the row's last block does.
        # Likewise for a row padded past `inside`: blocks before it are emitted without the range
        # conditions of the padding (self.bounds: the domain cut there), the rest with them
        body = ["    " + line for line in self.lines[start:]]
        del self.lines[start:]
        if inside < cols_n:
            self.expr = dict(saved_expr)
            self.bounds = tuple(inside if d == inner else n for d, n in enumerate(shape))
            try:
                emit_body()
            finally:
                self.bounds = shape
            fast = ["    " + line for line in self.lines[start:]]
            del self.lines[start:]
        else:
            fast = body
        self.emit(f"if c0 + BLOCK <= {inside}:")
        self.emit("mask = tl.full([BLOCK], 1, tl.int1)", 2)
        self.lines += fast
        self.emit("else:")
        self.emit(f"mask = cols < {cols_n}", 2)
        self.lines += body

    def _plain_load(self, e: Entry, rest: str) -> None:
        """`e = tl.load(ptr{rest})`, upcast to fp32 for floats."""
        load = f"tl.load({self.ptr[e.node.id]}{rest})"
        if dtypes.is_float(e.node.dtype):
            load += ".to(tl.float32)"
        self.emit(f"{e.key} = {load}")
        self.expr[e.key] = e.key

    def _scalar(self, e: Entry) -> bool:
        """One element read by every program at offset 0 (no index term): a 0-d or all-ones tensor,
        or one broadcast along every domain dim."""
        return all(d is None or e.node.shape[k] == 1 for k, d in enumerate(e.emb))

    def _linear(self, e: Entry, contiguous: tuple[int, ...]) -> bool:
        """Offset equals the flat index: the tensor has the domain's elements, each of its dims of
        size > 1 is one domain dim of that size with the stride the iteration order gives it. Size-1
        dims do not count: a batch-1 [1, T, V] tensor in a [T, V] domain is read at `offs` too (as
        16-byte vectors, where a row / column index per element would defeat them)."""
        shape = self.domain.shape
        if math.prod(e.node.shape) != math.prod(shape):
            return False
        if math.prod(shape) <= 1:
            return True
        strides = e.node.spec.memory_strides
        seen: set[int] = set()
        for k, size in enumerate(e.node.shape):
            if size == 1:
                continue
            d = e.emb[k]
            if type(d) is not int or d in seen or shape[d] != size or strides[k] != contiguous[d]:
                return False
            seen.add(d)
        return True


class _ReductionWriter(_Writer):
    def write(self) -> GeneratedKernel:
        dom = self.domain
        rows, cols = dom.kept_numel, dom.reduced_numel
        self.column = self.group.column
        ax = 0 if self.column else 1
        r_tile = "[None, :]" if self.column else "[:, None]"
        c_tile = "[:, None]" if self.column else "[None, :]"
        self.tile = "[BLOCK_C, ROWS]" if self.column else "[ROWS, BLOCK_C]"
        head = [jit_head(self.name, self.signature(['ROWS', 'BLOCK_C', 'SINGLE', 'STAGES', 'PREFETCH']))]
        pid = "tl.program_id(0).to(tl.int64)" if self.wide else "tl.program_id(0)"
        self.emit(f"rows = {pid} * ROWS + tl.arange(0, ROWS){r_tile}")
        self.emit(f"rmask = {row_mask(rows, 'ROWS')}")
        self.zero_index = "rows * 0"
        kept_lines, dimvar = _index_vars(dom.shape, dom.kept, "rows", "k")
        for line in kept_lines:
            self.emit(line)
        red_lines, red_vars = _index_vars(dom.shape, dom.reduced, "cols", "j")
        dimvar.update(red_vars)
        entries = self.group.entries
        self.emit("if SINGLE:")
        wide = ".to(tl.int64)" if self.wide else ""   # reduced index times a large stride
        self.emit(f"cols = tl.arange(0, BLOCK_C){c_tile}{wide}", 2)
        self.emit(f"mask = rmask & {whole_row_mask(cols)}", 2)
        for line in red_lines:
            self.emit(line, 2)
        gathers = {} if self.column else _one_hot_gathers(entries, dom.reduced)
        self.shifted_exps = _shifted_exps(entries)
        by_key = {e.key: e for e in entries}
        self.hoisted_loads(entries, dimvar, 2)
        for key, (source, index) in gathers.items():   # loaded indices: gather before any reduction
            if index.kind == "load":
                self._gather(by_key[key], source, index, dimvar, cols)
        for e in entries:
            if e.key in gathers and e.key not in self.expr:
                self._gather(e, *gathers[e.key], dimvar, cols)
            elif e.key in gathers:
                continue
            elif e.kind == "reduce":
                self._reduce_single(e, ax)
            elif e.kind != "load":
                self.value(e, "mask" if e.full else "rmask", dimvar, 2)
        for e in self.group.stores:
            self.store(e, "mask" if e.full else "rmask", dimvar, 2)
        self.emit("else:")
        prefetch = self._looped(entries, dimvar, red_lines, c_tile, ax, cols)
        return GeneratedKernel(self.name, self.module(head + self.lines), "reduction", self.inputs,
                               self.outputs, extent=rows, reduced_extent=cols, column=self.column,
                               meta={"prefetch": True} if prefetch else {})

    def _gather(self, e: Entry, source: Entry, index: Entry, dimvar: dict[int, str], cols: int) -> None:
        """sum(where(iota == index, source, 0)) over the row: load source[row, index] (0 where the
        index is outside the row, e.g. an ignore_index) instead of a select and a reduction over
        every element (cross-entropy's target logit)."""
        idx = self.expr[index.key]
        at = dict(dimvar)
        at[self.domain.reduced[0]] = f"{e.key}_at"
        self.emit(f"{e.key}_at = tl.where(({idx} >= 0) & ({idx} < {cols}), {idx}, 0)", 2)
        ptr = f"{self.ptr[source.node.id]} + {self.offset(source.node, source.emb, at)}"
        load = f"tl.load({ptr}, mask=rmask & ({idx} >= 0) & ({idx} < {cols}), other=0)"
        if dtypes.is_float(source.node.dtype):
            load += ".to(tl.float32)"
        self.emit(f"{e.key} = {load}", 2)
        self.expr[e.key] = e.key

    def hoisted_loads(self, entries: list[Entry], dimvar: dict[int, str], indent: int) -> None:
        """Every load of the row tile, issued before the first reduction: a load written after a
        reduction waits for it (its barriers keep the load from moving up), so a program would make
        two round trips to memory instead of one (cross-entropy's target after the max and sum)."""
        for e in entries:
            if e.kind == "load":
                self.value(e, "mask" if e.full else "rmask", dimvar, indent)

    def _reduce_single(self, e: Entry, ax: int) -> None:
        combine = get_op(e.node.op).extra["combine"]
        arg = self.expr[e.args[0]]
        fill = {"sum": "0.0", "max": "float('-inf')", "min": "float('inf')"}[combine]
        masked = f"tl.where(mask, {arg}, {fill})"
        self.emit(f"{e.key} = tl.{combine}({masked}, axis={ax}, keep_dims=True)", 2)
        self.expr[e.key] = e.key

    def _looped(self, entries: list[Entry], dimvar: dict[int, str], red_lines: list[str], c_tile: str,
                ax: int, cols: int) -> bool:
        """One loop over the row per round of sequential reductions (plus one for stores that
        need the last round). A sum of exp(a - max(a)) rides along with its max (online softmax:
        the running sum is rescaled when the running max grows), saving a pass over the row.
        In a row reduction over one dim, with PREFETCH the row's loads of the next chunk are issued
        at the top of each chunk's body, into registers carried to the next iteration, so they are
        in flight during this chunk's math (two chunks of loads a thread instead of one; the loop
        otherwise waits for each chunk's loads). True when that variant was written."""
        self.expr = {}
        wide = ".to(tl.int64)" if self.wide else ""
        by_key = {e.key: e for e in entries}
        online = _online_softmax_pairs(entries, by_key)          # sum key -> its max entry
        with_sum = {m.key: by_key[k] for k, m in online.items()}   # max key -> its sum entry
        stage = _stages(entries, online)
        reduces = [e for e in entries if e.kind == "reduce"]
        passes = max(stage[e.key] for e in reduces)
        stores = self.group.stores
        ninf = "float('-inf')"
        prefetched = False
        for p in range(passes + 2):
            # values with one number per row that became available after pass p-1
            for e in entries:
                if not e.full and e.kind != "reduce" and stage[e.key] == p:
                    self.value(e, "rmask", dimvar, 2)
            for e in stores:
                if not e.full and stage[e.key] == p:
                    self.store(e, "rmask", dimvar, 2)
            targets = [e for e in reduces if stage[e.key] == p + 1]
            targets += [e for e in stores if e.full and stage[e.key] == p]
            if not targets:
                continue
            for e in targets:
                if e.kind == "reduce":
                    fill = {"sum": "0.0", "max": ninf, "min": "float('inf')"}[_combine(e)]
                    self.emit(f"acc_{e.key} = tl.full({self.tile}, {fill}, tl.float32)", 2)
            # a row reduction over an odd row (a 50257-wide vocab): `cols < C` varies element by
            # element, which makes Triton load in scalars; full chunks take only the row mask (loads
            # from 16-byte-aligned rows become vectors), one tail chunk after them the column mask
            tail = not self.column and cols % 16 != 0
            loop_end = f"{cols} - {cols} % BLOCK_C" if tail else str(cols)
            needed = _full_ancestors([t for t in targets if t.key not in online], by_key)
            ahead = [e for e in entries if e.key in needed and e.kind == "load" and e.full
                     and not range_mask(e.node, e.emb, self.domain.shape, dimvar)] \
                if not self.column and len(self.domain.reduced) == 1 and not red_lines else []
            next_vars = {**dimvar, self.domain.reduced[0]: "cols_n"}   # the next chunk's column index
            if ahead:   # the first chunk's loads, before the loop
                prefetched = True
                self.emit("if PREFETCH:", 2)
                self.emit(f"cols_n = tl.arange(0, BLOCK_C){c_tile}{wide}", 3)
                for e in ahead:
                    self.emit(f"pf_{e.key} = {self._raw_load(e, f'rmask & (cols_n < {loop_end})', next_vars)}", 3)
            # STAGES > 1: Triton's pipeliner loads the next chunks while this one computes
            self.emit(f"for c0 in tl.range(0, {loop_end}, BLOCK_C, num_stages=STAGES):", 2)
            start = len(self.lines)
            self.emit(f"cols = (c0 + tl.arange(0, BLOCK_C){c_tile}){wide}", 3)
            self.emit(f"mask = rmask & (cols < {cols})" if not tail else
                      "mask = rmask & tl.full([1, BLOCK_C], 1, tl.int1)", 3)
            for line in red_lines:
                self.emit(line, 3)
            saved = dict(self.expr)
            block: tuple[int, int, int] | None = None   # the PREFETCH block's lines: if, else, end
            if ahead:
                first = len(self.lines)
                self.emit("if PREFETCH:", 3)
                for e in ahead:
                    up = ".to(tl.float32)" if dtypes.is_float(e.node.dtype) else ""
                    self.emit(f"{e.key} = pf_{e.key}{up}", 4)
                self.emit("cols_n = cols + BLOCK_C", 4)
                for e in ahead:   # the mask stays constant over 16-element runs (loop_end: whole chunks)
                    self.emit(f"pf_{e.key} = {self._raw_load(e, f'rmask & (cols_n < {loop_end})', next_vars)}", 4)
                other = len(self.lines)
                self.emit("else:", 3)
                for e in ahead:
                    self.value(e, "mask", dimvar, 4)
                block = (first, other, len(self.lines))
            ahead_keys = {e.key for e in ahead}
            for e in entries:
                if e.key in needed and e.key not in ahead_keys:
                    self.value(e, "mask", dimvar, 3)
            for e in targets:
                if e.key in online:
                    continue
                if e.kind != "reduce":
                    self.store(e, "mask", dimvar, 3)
                    continue
                arg = self.expr[e.args[0]]
                combine = _combine(e)
                fill = {"sum": "0.0", "max": ninf, "min": "float('inf')"}[combine]
                masked = f"tl.where(mask, {arg}, {fill})"
                if e.key in with_sum:
                    # one exp an element: of x and the running max, the smaller one's term is
                    # exp(-|x - max|) relative to the larger; when x is larger the sum is rescaled
                    # by that same factor and x counts 1. A lane's terms while its max is -inf are
                    # zeroed by the final rescale (exp(-inf - row max)); NaN propagates through d.
                    acc_s, acc_m = f"acc_{with_sum[e.key].key}", f"acc_{e.key}"
                    self.emit(f"x_on = {masked}", 3)
                    self.emit(f"d_on = tl.where(x_on == {acc_m}, 0.0, x_on - {acc_m})", 3)
                    self.emit("e_on = tl.exp(-tl.abs(d_on))", 3)
                    self.emit(f"{acc_s} = tl.where(d_on > 0.0, {acc_s} * e_on + 1.0, {acc_s} + e_on)", 3)
                    self.emit(f"{acc_m} = tl.maximum({acc_m}, x_on)", 3)
                elif combine == "sum":
                    self.emit(f"acc_{e.key} += {masked}", 3)
                else:
                    fn = "tl.maximum" if combine == "max" else "tl.minimum"
                    self.emit(f"acc_{e.key} = {fn}(acc_{e.key}, {masked})", 3)
            if tail:   # the same body once more, on the last partial chunk (its loads direct)
                body = self.lines[start + 2:]
                if block is not None:
                    first, other, end = (k - start - 2 for k in block)
                    body = body[:first] + [line[4:] for line in body[other + 1:end]] + body[end:]
                self.emit(f"if {cols} % BLOCK_C != 0:", 2)
                self.emit(f"c0 = {cols} - {cols} % BLOCK_C", 3)
                self.emit(f"cols = (c0 + tl.arange(0, BLOCK_C){c_tile}){wide}", 3)
                self.emit(f"mask = rmask & (cols < {cols})", 3)
                self.lines += body
            self.expr = saved  # values of the loop body are not visible after it
            for e in targets:
                if e.kind == "reduce" and e.key not in online:
                    self.emit(f"{e.key} = tl.{_combine(e)}(acc_{e.key}, axis={ax}, keep_dims=True)", 2)
                    self.expr[e.key] = e.key
            for e in targets:
                if e.key in online:
                    m = online[e.key].key
                    self.emit(f"{m}_safe = tl.where({m} == {ninf}, 0.0, {m})", 2)
                    self.emit(f"{e.key} = tl.sum(acc_{e.key} * tl.exp(acc_{m} - {m}_safe), axis={ax}, "
                              "keep_dims=True)", 2)
                    self.expr[e.key] = e.key
        return prefetched


def _one_hot_gathers(entries: list[Entry], reduced: tuple[int, ...]) -> dict[str, tuple[Entry, Entry]]:
    """Row sums of where(iota == index, x, 0), x a loaded input and index one integer per row (the
    one-hot pick of cross-entropy): reduce key -> (x's load, the index entry)."""
    if len(reduced) != 1:
        return {}
    by_key = {e.key: e for e in entries}

    def under(key: str) -> Entry:   # through views and float casts that do not narrow
        e = by_key[key]
        while e.kind == "view" or (e.kind == "op" and _is_free_cast(e.node) and not _narrows(e.node)):
            e = by_key[e.args[0]]
        return e

    out = {}
    for e in entries:
        if e.kind != "reduce" or _combine(e) != "sum" or e.node.dtype != "float32":
            continue
        where = under(e.args[0])
        if where.kind != "op" or where.node.op != "where" or len(where.args) != 3:
            continue
        eq, source, zero = (under(a) for a in where.args)
        literal = get_op(zero.node.op).triton if zero.kind == "literal" else None
        if literal is None or str(literal([], zero.node.attrs)) not in ("0", "0.0"):
            continue
        if source.kind != "load" or not source.full or not dtypes.is_float(source.node.dtype):
            continue
        if eq.kind != "op" or eq.node.op != "eq" or len(eq.args) != 2:
            continue
        a, b = (under(k) for k in eq.args)
        iota, index = (a, b) if a.kind == "gen" else (b, a)
        if iota.kind != "gen" or iota.node.op != "iota" or index.full or index.kind == "gen":
            continue
        dim = int(iota.node.attrs["dim"]) % len(iota.node.shape)
        if iota.emb[dim] != reduced[0] or not dtypes.is_int(iota.node.dtype) or not dtypes.is_int(index.node.dtype):
            continue
        out[e.key] = (source, index)
    return out


def _shifted_exps(entries: list[Entry]) -> dict[str, tuple[str, str]]:
    """fp32 exp(a - max(a)) entries (values in (0, 1]): key -> (a's key, the max's key)."""
    by_key = {e.key: e for e in entries}
    out = {}
    for e in entries:
        if e.kind != "op" or e.node.op != "exp" or e.node.dtype != "float32":
            continue
        sub = by_key[e.args[0]]
        if sub.kind != "op" or sub.node.op != "sub" or sub.node.dtype != "float32" or len(sub.args) != 2:
            continue
        m = by_key[sub.args[1]]
        if m.kind == "reduce" and _combine(m) == "max" and m.args[0] == sub.args[0]:
            out[e.key] = (sub.args[0], m.key)
    return out


def _online_softmax_pairs(entries: list[Entry], by_key: dict[str, Entry]) -> dict[str, Entry]:
    """sum(exp(a - max(a))) reductions, by key, with their max entry (all in fp32)."""
    pairs = {}
    for e in entries:
        if e.kind != "reduce" or _combine(e) != "sum":
            continue
        ex = by_key[e.args[0]]
        if ex.kind != "op" or ex.node.op != "exp" or ex.node.dtype != "float32":
            continue
        sub = by_key[ex.args[0]]
        if sub.kind != "op" or sub.node.op != "sub" or sub.node.dtype != "float32" or len(sub.args) != 2:
            continue
        m = by_key[sub.args[1]]
        if m.kind == "reduce" and _combine(m) == "max" and m.args[0] == sub.args[0]:
            pairs[e.key] = m
    return pairs


def _stages(entries: list[Entry], online: dict[str, Entry]) -> dict[str, int]:
    """Rounds of reductions each value waits for, with online sums computed beside their max."""
    stage: dict[str, int] = {}
    for e in entries:
        if e.key in online:
            stage[e.key] = stage[online[e.key].key]
        elif e.kind == "reduce":
            stage[e.key] = stage[e.args[0]] + 1
        else:
            stage[e.key] = max((stage[a] for a in e.args), default=0)
    return stage


def _combine(e: Entry) -> str:
    return str(get_op(e.node.op).extra["combine"])


def _full_ancestors(targets: list[Entry], by_key: dict[str, Entry]) -> set[str]:
    """Keys of the per-element values the targets need, stopping at per-row values."""
    out: set[str] = set()
    stack = [a for t in targets for a in t.args] + [t.key for t in targets if t.kind != "reduce"]
    while stack:
        key = stack.pop()
        e = by_key[key]
        if key in out or e.kind == "reduce" or (not e.full and e.kind != "literal"):
            continue
        out.add(key)
        stack.extend(e.args)
    return out
