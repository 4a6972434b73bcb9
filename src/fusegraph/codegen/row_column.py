"""One pass for a row reduction and a column reduction over the same space (RowColumnGroup).

Each program owns RPP rows and walks them ROWS at a time with the whole row in registers: it runs
the row kernel (e.g. layernorm backward's statistics and dx) and, on the same tiles, accumulates
the column reduction's operands (g * xhat, g) over its rows. The per-program column partials go
to a fp32 workspace [SPLITS, columns]; the finish kernel reduces them in program order
(deterministic) and runs the column epilogue. The data is read once instead of twice."""

from __future__ import annotations

from ..fusion.index_map import domain_dim
from ..fusion.partition import Entry, RowColumnGroup
from ..ir import dtypes
from .column_split import FILL, ColumnSplitWriter, _combine_of
from .triton_gen import (
    GeneratedKernel,
    _full_ancestors,
    _index_vars,
    _one_hot_gathers,
    _shifted_exps,
    jit_head,
    row_mask,
    whole_row_mask,
)

CONSTEXPRS = ["ROWS", "BLOCK_C", "RPP", "SPLITS", "SPLITS_P2", "FROWS", "STAGES"]


class NotEligible(Exception):
    """The pair cannot run as one pass (row too wide for registers, column-major data, ...)."""


class RowColumnWriter(ColumnSplitWriter):
    def write_pair(self, max_block: int) -> GeneratedKernel:
        pair = self.group
        assert isinstance(pair, RowColumnGroup) and pair.row is not None and pair.col is not None
        row, col = pair.row, pair.col
        dom = row.domain
        rows, cols = dom.kept_numel, dom.reduced_numel
        if self.group.column or self.wide or 1 << max(cols - 1, 0).bit_length() > max_block:
            raise NotEligible("the row does not fit in registers as a contiguous tile")
        reduces = [e for e in col.entries if e.kind == "reduce"]
        # a full reduction over the rows (of per-row values): [ROWS, 1] accumulators, one partial
        # a program; else column partials [ROWS, BLOCK_C] -> [programs, columns]
        self.over_rows = not col.domain.kept
        col_mask = "rmask" if self.over_rows else "mask"
        acc_shape = "[ROWS, 1]" if self.over_rows else "[ROWS, BLOCK_C]"
        extent = col.domain.kept_numel
        workspaces = [f"ws{k}" for k in range(len(reduces))]
        args = [self.ptr[n.id] for n in self.inputs] + list(self.out_ptr.values()) + workspaces
        signature = ", ".join(args + [f"{c}: tl.constexpr" for c in CONSTEXPRS])
        computed = {(e.node.id, e.emb): e.key for e in row.entries if e.kind != "load"}
        gathers = _one_hot_gathers(row.entries, dom.reduced)
        self.shifted_exps = _shifted_exps(row.entries)
        self.zero_index = "rows * 0"

        self.lines = [jit_head(self.name, signature)]
        kept_lines, dimvar = _index_vars(dom.shape, dom.kept, "rows", "k")
        red_lines, red_vars = _index_vars(dom.shape, dom.reduced, "cols", "j")
        dimvar.update(red_vars)
        self.emit("cols = tl.arange(0, BLOCK_C)[None, :]")
        self.emit(f"cmask = {whole_row_mask(cols)}")
        for line in red_lines:
            self.emit(line)
        for e in reduces:
            self.emit(f"acc_{e.key} = tl.full({acc_shape}, {FILL[_combine_of(e)]}, tl.float32)")
        needed = _full_ancestors(reduces, {e.key: e for e in col.entries})
        col_values = [e for e in col.entries
                      if e.key in needed or (e.kind != "reduce" and e.stage == 0 and not e.full)]
        # loads: each (input, placement) once, all before the first reduction; the ones that do not
        # depend on the row (the weight) once per program, before the loop over its rows
        loaded: dict[tuple[int, tuple[object, ...]], str] = {}
        loads = [e for e in row.entries if e.kind == "load"]
        col_loads = [e for e in col_values if e.kind == "load" and (e.node.id, e.emb) not in computed]
        loads += col_loads
        per_row = {id(e) for e in col_loads} if self.over_rows else set()
        for e in loads:
            if e.full and id(e) not in per_row and _row_independent(e, dom.kept) and (e.node.id, e.emb) not in loaded:
                self.value(e, "cmask", dimvar, 1)
                loaded[(e.node.id, e.emb)] = e.key
        # STAGES > 1: Triton's pipeliner copies the next tiles' rows (cp.async) while this one computes
        self.emit("for r0 in tl.range(0, RPP, ROWS, num_stages=STAGES):")
        self.emit("rows = tl.program_id(0) * RPP + r0 + tl.arange(0, ROWS)[:, None]", 2)
        self.emit(f"rmask = {row_mask(rows, 'RPP')}", 2)   # RPP is a multiple of ROWS
        self.emit("mask = rmask & cmask", 2)
        for line in kept_lines:
            self.emit(line, 2)
        for e in loads:
            if (e.node.id, e.emb) in loaded:
                self.expr[e.key] = self.expr[loaded[(e.node.id, e.emb)]]
            else:
                self.value(e, "mask" if e.full and id(e) not in per_row else "rmask", dimvar, 2)
                loaded[(e.node.id, e.emb)] = e.key
        by_key = {e.key: e for e in row.entries}
        for key, (source, index) in gathers.items():   # loaded indices: gather before any reduction
            if index.kind == "load":
                self._gather(by_key[key], source, index, dimvar, cols)
        self.combiners: dict[tuple[str, ...], str] = {}
        self._rounds(row.entries, gathers, dimvar, cols)
        for e in row.stores:
            if e.key in self.out_ptr:   # stores only the col kernel read stay in registers
                self.store(e, "mask" if e.full else "rmask", dimvar, 2)
        for e in col_values:
            if e.kind != "reduce" and (e.node.id, e.emb) in computed:
                # in registers already: a row result the column reads, or a value both compute
                # (layernorm backward's x-hat, for dx and for dw)
                self.expr[e.key] = self.expr[computed[(e.node.id, e.emb)]]
            elif e.kind != "load":
                self.value(e, col_mask, dimvar, 2)
        for e in reduces:
            self._accumulate(e, col_mask)
        for e, ws in zip(reduces, workspaces, strict=True):
            total = f"tl.{_combine_of(e)}(acc_{e.key}, axis=0, keep_dims=True)"
            if self.over_rows:
                self.emit(f"tl.store({ws} + tl.program_id(0) + tl.zeros([1, 1], tl.int32), {total})")
            else:
                self.emit(f"tl.store({ws} + tl.program_id(0) * {cols} + cols, {total}, mask=cmask)")
        partial = self.lines
        finish = self.finish_lines(f"{self.name}_finish", signature, col.domain, col.entries, col.stores,
                                   reduces, workspaces, "FROWS")
        # the tuple reductions' combine functions go last: the partial kernel stays the module's first
        helpers = [line for fn in self.combiners.values() for line in ("", "", fn)]
        return GeneratedKernel(self.name, self.module([*partial, "", "", "", *finish, *helpers]), "reduction",
                               self.inputs, self.outputs, extent=extent, reduced_extent=rows,
                               finish_name=f"{self.name}_finish", workspaces=len(reduces),
                               meta={"row_column": True, "rows": rows, "cols": cols})

    def _rounds(self, entries: list[Entry], gathers: dict[str, tuple[Entry, Entry]], dimvar: dict[int, str],
                cols: int) -> None:
        """The row kernel in rounds of reductions: every reduction of a round at once (one
        multi-operand tl.reduce: the operands share the shared-memory exchange and its barriers;
        layernorm backward's sum(x) and sum(g * w) go together), each other value in the last round
        before its first use (a tile computed early stays live in registers across the barriers)."""
        self.by_key = {e.key: e for e in entries}
        level = _reduction_rounds(entries, gathers)
        last = max(level.values(), default=0)
        when = _emit_rounds(entries, level, last + 1)
        for p in range(last + 2):
            for e in entries:
                if (e.kind in ("load", "reduce") and e.key not in gathers) or when[e.key] != p:
                    continue
                if e.key in gathers:
                    if e.key not in self.expr:
                        self._gather(e, *gathers[e.key], dimvar, cols)
                else:
                    self.value(e, "mask" if e.full else "rmask", dimvar, 2)
            batch = [e for e in entries if e.kind == "reduce" and e.key not in gathers and level[e.key] == p]
            merged = [e for e in batch if self._mergeable(e)]
            for e in batch:
                if len(merged) < 2 or e not in merged:
                    self._reduce_single(e, 1)
            if len(merged) >= 2:
                self._reduce_together(merged)

    def _mergeable(self, e: Entry) -> bool:
        """Float reductions only: tl.sum widens small integers, a tuple tl.reduce does not."""
        arg = self.by_key.get(e.args[0])
        return arg is not None and dtypes.is_float(arg.node.dtype) and _combine_of(e) in ("sum", "max", "min")

    def _reduce_together(self, batch: list[Entry]) -> None:
        combines = tuple(_combine_of(e) for e in batch)
        fn = f"_combine_{'_'.join(combines)}"
        if combines not in self.combiners:
            n = len(combines)
            params = ", ".join([f"a{k}" for k in range(n)] + [f"b{k}" for k in range(n)])
            ops = {"sum": "a{k} + b{k}", "max": "tl.maximum(a{k}, b{k})", "min": "tl.minimum(a{k}, b{k})"}
            body = ", ".join(ops[c].format(k=k) for k, c in enumerate(combines))
            self.combiners[combines] = f"@triton.jit\ndef {fn}({params}):\n    return {body}"
        masked = ", ".join(f"tl.where(mask, {self.expr[e.args[0]]}, {FILL[c]})" for e, c in zip(batch, combines,
                                                                                                  strict=True))
        targets = ", ".join(e.key for e in batch)
        self.emit(f"{targets} = tl.reduce(({masked},), 1, {fn}, keep_dims=True)", 2)
        for e in batch:
            self.expr[e.key] = e.key

    def _accumulate(self, e: Entry, mask: str) -> None:
        combine = _combine_of(e)
        masked = f"tl.where({mask}, {self.expr[e.args[0]]}, {FILL[combine]})"
        if combine == "sum":
            self.emit(f"acc_{e.key} += {masked}", 2)
        else:
            fn = "tl.maximum" if combine == "max" else "tl.minimum"
            self.emit(f"acc_{e.key} = {fn}(acc_{e.key}, {masked})", 2)


def _reduction_rounds(entries: list[Entry], gathers: dict[str, tuple[Entry, Entry]]) -> dict[str, int]:
    """Round of each row value: how many rounds of reductions it waits for (a reduction belongs to
    the round of its operand; a gathered value to the round of its index)."""
    level: dict[str, int] = {}
    reduce_keys = {e.key for e in entries if e.kind == "reduce"}
    for e in entries:
        if e.key in gathers:
            index = gathers[e.key][1]
            level[e.key] = 0 if index.kind == "load" else level.get(index.key, 0)
        elif e.kind == "reduce":
            level[e.key] = level.get(e.args[0], 0)
        else:
            level[e.key] = max((level.get(a, 0) + (a in reduce_keys) for a in e.args), default=0)
    return level


def _emit_rounds(entries: list[Entry], level: dict[str, int], end: int) -> dict[str, int]:
    """The round each value is computed in: the latest that is still before its first use (a
    reduction uses its operand in its own round; stores and the column values come after the
    last round, `end`)."""
    when: dict[str, int] = {}
    for e in reversed(entries):
        when.setdefault(e.key, end)
        need = level[e.key] if e.kind == "reduce" else when[e.key]
        for a in e.args:
            when[a] = min(when.get(a, end), need)
    return {k: max(v, level[k]) for k, v in when.items()}


def _row_independent(e: Entry, kept: tuple[int, ...]) -> bool:
    """A load whose address does not depend on the row (a weight along the reduced axis)."""
    return all(domain_dim(d) is None or domain_dim(d) not in kept or e.node.shape[k] == 1
               for k, d in enumerate(e.emb))
