"""Two-stage column reductions (the reduced axis is not the contiguous one and is long, e.g.
layernorm backward's dw/db = sums over 16k rows, batchnorm statistics): a partial kernel where
each program reduces CHUNK rows of a ROWS-wide column block into a fp32 workspace, then a finish
kernel that reduces the SPLITS partials of each column in a fixed order (deterministic) and runs
the epilogue. One kernel per column block would leave most of the GPU idle. Per-element results
that do not wait for the reduction (the pointwise value whose column sums are reduced) are
stored by the partial kernel, for the rows each program walks."""

from __future__ import annotations

from ..fusion.partition import Domain, Entry
from .triton_gen import GeneratedKernel, _full_ancestors, _index_vars, _ReductionWriter, jit_head

FILL = {"sum": "0.0", "max": "float('-inf')", "min": "float('inf')"}
CONSTEXPRS = ["ROWS", "BLOCK_C", "CHUNK", "SPLITS", "SPLITS_P2", "STAGES"]


class ColumnSplitWriter(_ReductionWriter):
    def write_split(self) -> GeneratedKernel:
        dom = self.domain
        rows, cols = dom.kept_numel, dom.reduced_numel
        self.column = True
        reduces = [e for e in self.group.entries if e.kind == "reduce"]
        workspaces = [f"ws{k}" for k in range(len(reduces))]
        args = [self.ptr[n.id] for n in self.inputs] + list(self.out_ptr.values()) + workspaces
        signature = ", ".join(args + [f"{c}: tl.constexpr" for c in CONSTEXPRS])
        combine = {e.key: str(_combine_of(e)) for e in reduces}

        self.zero_index = "rows * 0"
        pid = ".to(tl.int64)" if self.wide else ""
        kept_lines, dimvar = _index_vars(dom.shape, dom.kept, "rows", "k")
        red_lines, red_vars = _index_vars(dom.shape, dom.reduced, "cols", "j")
        dimvar.update(red_vars)
        by_key = {e.key: e for e in self.group.entries}

        # stage 1: partials over a slice of CHUNK rows
        self.lines = [jit_head(self.name, signature)]
        self.emit(f"rows = tl.program_id(0){pid} * ROWS + tl.arange(0, ROWS)[None, :]")
        self.emit(f"rmask = rows < {rows}")
        for line in kept_lines:
            self.emit(line)
        for e in self.group.entries:
            if not e.full and e.kind != "reduce" and e.stage == 0:
                self.value(e, "rmask", dimvar, 1)
        for e in reduces:
            self.emit(f"acc_{e.key} = tl.full([BLOCK_C, ROWS], {FILL[combine[e.key]]}, tl.float32)")
        # STAGES > 1: Triton's pipeliner loads the next tiles while this one computes (a loop of
        # dependent tiles otherwise waits for each tile's loads: a quarter of the bandwidth lost)
        self.emit("for c0 in tl.range(0, CHUNK, BLOCK_C, num_stages=STAGES):")
        wide = ".to(tl.int64)" if self.wide else ""   # reduced index times a large stride
        self.emit(f"cols = (tl.program_id(1) * CHUNK + c0 + tl.arange(0, BLOCK_C)[:, None]){wide}", 2)
        self.emit(f"mask = rmask & (cols < {cols})", 2)
        for line in red_lines:
            self.emit(line, 2)
        full_stores = [e for e in self.group.stores if e.full]   # per-element results of these rows
        needed = _full_ancestors(reduces + full_stores, by_key)
        for e in self.group.entries:
            if e.key in needed:
                self.value(e, "mask", dimvar, 2)
        for e in full_stores:
            self.store(e, "mask", dimvar, 2)
        for e in reduces:
            masked = f"tl.where(mask, {self.expr[e.args[0]]}, {FILL[combine[e.key]]})"
            if combine[e.key] == "sum":
                self.emit(f"acc_{e.key} += {masked}", 2)
            else:
                fn = "tl.maximum" if combine[e.key] == "max" else "tl.minimum"
                self.emit(f"acc_{e.key} = {fn}(acc_{e.key}, {masked})", 2)
        for e, ws in zip(reduces, workspaces, strict=True):
            self.emit(f"tl.store({ws} + tl.program_id(1) * {rows} + rows, "
                      f"tl.{combine[e.key]}(acc_{e.key}, axis=0, keep_dims=True), mask=rmask)")
        partial = self.lines

        finish = self.finish_lines(f"{self.name}_finish", signature, self.domain, self.group.entries,
                                   self.group.stores, reduces, workspaces, "ROWS")
        source = self.module([*partial, "", "", "", *finish])
        return GeneratedKernel(self.name, source, "reduction", self.inputs, self.outputs, extent=rows,
                               reduced_extent=cols, column=True, finish_name=f"{self.name}_finish",
                               workspaces=len(reduces), meta={"full_stores": bool(full_stores)})


    def finish_lines(self, name: str, signature: str, domain: Domain, entries: list[Entry], stores: list[Entry],
                     reduces: list[Entry], workspaces: list[str], tile: str) -> list[str]:
        """The finish kernel: reduce each column's partials ws[split, column] in split order,
        then the per-column epilogue and stores. `tile` names the constexpr of the column tile."""
        rows = domain.kept_numel
        self.lines = [jit_head(name, signature)]
        self.expr = {}
        self.zero_index = "rows * 0"
        pid = ".to(tl.int64)" if self.wide else ""
        self.emit(f"rows = tl.program_id(0){pid} * {tile} + tl.arange(0, {tile})[None, :]")
        self.emit(f"rmask = rows < {rows}")
        kept_lines, dimvar = _index_vars(domain.shape, domain.kept, "rows", "k")
        for line in kept_lines:
            self.emit(line)
        self.emit("split = tl.arange(0, SPLITS_P2)[:, None]")
        self.emit("smask = rmask & (split < SPLITS)")
        for e, ws in zip(reduces, workspaces, strict=True):
            c = _combine_of(e)
            self.emit(f"{e.key} = tl.{c}(tl.load({ws} + split * {rows} + rows, mask=smask, other={FILL[c]}), "
                      "axis=0, keep_dims=True)")
            self.expr[e.key] = e.key
        for e in entries:
            if not e.full and e.kind != "reduce":
                self.value(e, "rmask", dimvar, 1)
        for e in stores:
            if not e.full:   # per-element results were stored by the partial kernel
                self.store(e, "rmask", dimvar, 1)
        return self.lines


def _combine_of(e: object) -> str:
    from ..ir.registry import get_op

    return str(get_op(e.node.op).extra["combine"])  # type: ignore[attr-defined]
