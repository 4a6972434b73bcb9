"""Triton source for a MatmulGroup: C = epilogue(A' @ B') with A' = A^T if trans_a, B' = B^T if
trans_b, batch dims broadcast (one program column per output batch), fp32 accumulation, grouped
tile ordering (GROUP_M rows of tiles share B columns in L2), and the epilogue's pointwise
expressions evaluated on the accumulator tile before the only stores.

Three kernels of one group (gemm_configs.py lists their candidates): "tiled" (one output tile a
program), "persistent" (NUM_PROGRAMS programs looping over the tiles, the epilogue inside the loop)
and "splitk" (K split over programs into fp32 partials, then a kernel that sums them in split order
and runs the epilogue). A claimed full max reduction of the product (the amax of a quantize
epilogue) is folded in per tile with tl.atomic_max into an fp32 scratch (max is order-free).

Shapes and strides are literals in the source (a plan is specialized to its input signature);
tile sizes are constexprs, chosen by the autotuner. The epilogue reuses the pointwise writer of
triton_gen: each domain dim is indexed by a batch index, `offs_m` or `offs_n`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ..fusion.epilogue import MatmulGroup
from ..fusion.partition import Entry, squeeze_map
from ..ir import dtypes
from ..ir.node import Node
from ..settings import settings
from .gemm_configs import (  # noqa: F401
    GEMM_TILES,
    SMS,
    GemmGeometry,
    gemm_candidates,
    gemm_configs,
    gemm_launch_parameters,
    gemv_configs,
    gemv_covers,
    persistent_configs,
    small_problem,
    split_k_configs,
    split_k_finish_grid,
    streamk_configs,
    streamk_workspace,
    tile_cost,
)
from .triton_gen import HEADER, TL_DTYPE, _Writer, jit_head

GEMM_DTYPES = ("float16", "bfloat16", "float32")

@dataclass
class GeneratedGemm:
    name: str
    source: str                          # the tiled kernel (one output tile a program)
    inputs: list[Node]
    outputs: list[Node]
    geometry: GemmGeometry
    tma: bool = False                    # the source has a TMA-descriptor path (USE_TMA)
    # VARIANT -> (kernel names, module source): "persistent" (one kernel) and "splitk" (partials, then
    # the reduction + epilogue kernel)
    variants: dict[str, tuple[tuple[str, ...], str]] = field(default_factory=dict)
    # outputs (by position) reduced with tl.atomic_max into an fp32 scratch that starts at -inf
    atomic_max_outputs: tuple[int, ...] = ()
    # bytes per output element written through TMA descriptor stores on the TMA path (summed over those
    # outputs): each stages a BLOCK_M x BLOCK_N tile in shared memory beside the operand pipeline
    tma_store_itemsize: int = 0
    # bytes per element of the output the ping-pong variant stores through TMA (0: none; its two
    # consumers each stage a BLOCK_M x BLOCK_N tile of it)
    pingpong_store_itemsize: int = 0
    # the epilogue computes an activation (a transcendental function): the ping-pong variant is offered
    # from a shorter K (gemm_configs.PINGPONG_MIN_K_ACTIVATION)
    pingpong_activation: bool = False

    def source_of(self, variant: str) -> str:
        return self.source if variant == "tiled" else self.variants[variant][1]

    @property
    def all_sources(self) -> str:
        """Every variant's source (the autotuner's cache key covers all candidates)."""
        return "\n".join([self.source] + [src for _, src in self.variants.values()])


TmaOperand = tuple[str, str, str, str, bool]   # shape, strides, block shape, load offsets, transpose after load


def tma_plan(geo: GemmGeometry, itemsize: int) -> tuple[TmaOperand, TmaOperand] | None:
    """How A' and B' are read through TMA descriptors, or None when a layout does not allow it
    (TMA needs a unit stride in the last dim and 16-byte aligned other strides)."""
    def aligned(*strides: int) -> bool:
        return all((st * itemsize) % 16 == 0 for st in strides)

    sam, sak = geo.a_strides
    sbk, sbn = geo.b_strides
    if not aligned(*geo.a_batch, *geo.b_batch):
        return None
    if sak == 1 and sam != 0 and aligned(sam):
        a: TmaOperand = ("[M, K]", f"[{sam}, 1]", "[BLOCK_M, BLOCK_K]", "[pid_m * BLOCK_M, k0]", False)
    elif sam == 1 and sak != 0 and aligned(sak):
        a = ("[K, M]", f"[{sak}, 1]", "[BLOCK_K, BLOCK_M]", "[k0, pid_m * BLOCK_M]", True)
    else:
        return None
    if sbn == 1 and sbk != 0 and aligned(sbk):
        b: TmaOperand = ("[K, N]", f"[{sbk}, 1]", "[BLOCK_K, BLOCK_N]", "[k0, pid_n * BLOCK_N]", False)
    elif sbk == 1 and sbn != 0 and aligned(sbn):
        b = ("[N, K]", f"[{sbn}, 1]", "[BLOCK_N, BLOCK_K]", "[pid_n * BLOCK_N, k0]", True)
    else:
        return None
    return a, b


def gemm_geometry(matmul: Node) -> GemmGeometry:
    a, b = matmul.inputs
    batch, m, n, k = get_dims(matmul)
    ta, tb = bool(matmul.attrs.get("trans_a", False)), bool(matmul.attrs.get("trans_b", False))
    sa, sb = a.spec.memory_strides, b.spec.memory_strides
    if a.spec.rank == 1:
        a_mk = (0, sa[0])
    else:
        a_mk = (sa[-1], sa[-2]) if ta else (sa[-2], sa[-1])
    if b.spec.rank == 1:
        b_kn = (sb[0], 0)
    else:
        b_kn = (sb[-1], sb[-2]) if tb else (sb[-2], sb[-1])
    return GemmGeometry(batch, m, n, k, a_mk, b_kn, _batch_strides(a, batch), _batch_strides(b, batch))


def fold_batch(geo: GemmGeometry) -> GemmGeometry:
    """Leading batch dims folded into M when B' is shared by every batch entry and A' rows continue
    across entries at the same stride: x[B, S, K] @ W becomes one [B*S, K] @ W tile grid (decode's
    M is then the batch, not B programs of one row each). Else `geo` unchanged."""
    if not geo.batch or any(geo.b_batch) or geo.a_strides[0] == 0 or geo.m == 0:
        return geo
    expect = geo.a_strides[0] * geo.m
    for d in range(len(geo.batch) - 1, -1, -1):
        if geo.batch[d] != 1 and geo.a_batch[d] != expect:
            return geo
        expect *= geo.batch[d]
    return GemmGeometry((), geo.m * geo.batch_numel, geo.n, geo.k, geo.a_strides, geo.b_strides, (), (),
                        folded=geo.batch, rows=geo.m)


def get_dims(matmul: Node) -> tuple[tuple[int, ...], int, int, int]:
    from ..ir.registry import get_op

    a, b = matmul.inputs
    return get_op(matmul.op).extra["dims"](a.spec, b.spec, matmul.attrs)  # type: ignore[no-any-return]


def _batch_strides(operand: Node, batch: tuple[int, ...]) -> tuple[int, ...]:
    own = operand.shape[:-2] if operand.spec.rank > 2 else ()
    strides = operand.spec.memory_strides[:len(own)]
    lead = len(batch) - len(own)
    out = []
    for d in range(len(batch)):
        k = d - lead
        out.append(0 if k < 0 or own[k] == 1 else strides[k])
    return tuple(out)


def gemm_supported(group: MatmulGroup) -> str | None:
    """None when the Triton GEMM covers the group, else why not."""
    mm = group.matmul
    if mm.inputs[0].dtype not in GEMM_DTYPES:
        return f"dtype {mm.inputs[0].dtype} has no Triton GEMM"
    if min(mm.shape or (1,)) == 0 or get_dims(mm)[3] == 0:
        return "empty matmul"
    return None


def generate_gemm(group: MatmulGroup, name: str) -> GeneratedGemm:
    """The tiled kernel and its persistent and split-K variants (one writer each: a writer's value
    names are per kernel)."""
    tiled = _GemmWriter(group, name)
    source = HEADER + tiled.write_tiled()
    persistent = f"{name}_persistent"
    partial, finish = f"{name}_splitk", f"{name}_splitk_finish"
    variants = {
        "persistent": ((persistent,), HEADER + _GemmWriter(group, persistent).write_persistent()),
        "splitk": ((partial, finish), HEADER + _GemmWriter(group, partial).write_split_partial() + "\n\n"
                   + _GemmWriter(group, finish).write_split_finish()),
    }
    if settings.gemm_streamk and not tiled.geo.batch:   # the last wave shared out over one batch entry's programs
        variants["streamk"] = ((f"{name}_streamk",),
                               HEADER + _GemmWriter(group, f"{name}_streamk").write_persistent(streamk=True))
    pingpong = None
    if settings.gemm_pingpong:   # the warp-specialized Hopper kernel in Gluon, where it covers the group
        from .matmul_pingpong import epilogue_activation, generate_pingpong

        pingpong = generate_pingpong(group, f"{name}_pingpong")
        if pingpong is not None:
            variants["pingpong"] = ((f"{name}_pingpong",), pingpong[0])
    if gemv_covers(tiled.geo):
        variants["gemv"] = ((f"{name}_gemv",), HEADER + _GemmWriter(group, f"{name}_gemv").write_gemv())
    atomic = tuple(range(len(group.epilogue.stores), len(tiled.outputs)))
    by_key = {e.key: e.node for e in group.epilogue.stores}
    store_itemsize = sum(dtypes.itemsize(by_key[key].dtype) for key in tiled.tma_stores)
    return GeneratedGemm(name, source, tiled.kernel_inputs, tiled.outputs, tiled.geo, tma=tiled.tma is not None,
                         variants=variants, atomic_max_outputs=atomic, tma_store_itemsize=store_itemsize,
                         pingpong_store_itemsize=pingpong[1] if pingpong is not None else 0,
                         pingpong_activation=pingpong is not None and epilogue_activation(group))


_TILE_VAR = re.compile(r"\boffs_([mn])\b")
TILE_CONSTS = ["BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "EVEN_K", "USE_TMA"]


class _GemmWriter(_Writer):
    def __init__(self, group: MatmulGroup, name: str) -> None:
        super().__init__(group.epilogue, name)
        self.gemm = group
        self.geo = fold_batch(gemm_geometry(group.matmul))
        self.pid_m, self.pid_n = "pid_m", "pid_n"   # the epilogue tile's block indices (_tile_index)
        self.kernel_inputs = group.inputs
        self.ptr = {n.id: f"in{k}" for k, n in enumerate(self.kernel_inputs)}
        self.zero_index = "zero_m"
        a = group.matmul.inputs[0]
        self.tma = tma_plan(self.geo, dtypes.itemsize(a.dtype))
        self.tma_stores = self._tma_stores()
        self.tma_mode = ""   # how stores in tma_stores are written now: "" plain, "static" under USE_TMA, "direct"
        # fp32 operands: exact (CUDA cores) at torch's 'highest' float32 matmul precision, TF32 otherwise
        exact = a.dtype == "float32" and torch.get_float32_matmul_precision() == "highest"
        self.precision = ', input_precision="ieee"' if exact else ', input_precision="tf32"' \
            if a.dtype == "float32" else ""
        # claimed full max reductions (amax): their value names get a prefix (each group numbers its
        # own), their results go to fp32 scratch outputs after the epilogue's
        self.reductions = [[replace(e, key=f"r{i}_{e.key}", args=tuple(f"r{i}_{x}" for x in e.args))
                            for e in r.entries] for i, r in enumerate(group.reductions)]
        for entries in self.reductions:
            for e in entries:
                if e.kind == "reduce":
                    self.out_ptr[e.key] = f"out{len(self.out_ptr)}"
        self.outputs = self.outputs + [e.node for r in group.reductions for e in r.stores]

    def offset(self, node: Node, emb: tuple[Any, ...], dimvar: dict[int, str]) -> str:
        off = super().offset(node, emb, dimvar)
        if not _TILE_VAR.search(off):
            off = f"{off} + zero_m" if off != self.zero_index else off
        return off

    def _mask(self, off: str, store: bool) -> str:
        used = set(_TILE_VAR.findall(off))
        if used == {"m", "n"} or store:
            return "mask"
        return "mask_n" if used == {"n"} else "mask_m"

    def value(self, entry: Entry, mask: str, dimvar: dict[int, str], indent: int) -> None:
        if entry is self.gemm.product or (entry.kind == "load" and entry.node.id == self.gemm.matmul.id):
            self.expr[entry.key] = "acc_out"
            return
        if entry.kind == "load":
            mask = self._mask(self.offset(entry.node, entry.emb, dimvar), store=False)
        super().value(entry, mask, dimvar, indent)

    def store(self, entry: Entry, mask: str, dimvar: dict[int, str], indent: int) -> None:
        off = self.offset(entry.node, entry.emb, dimvar)
        if set(_TILE_VAR.findall(off)) != {"m", "n"}:
            off = f"{off} + zero_mn"
        out = self.out_ptr[entry.key]
        value = f"({self.expr[entry.key]}).to({out}.dtype.element_ty)"
        plain = f"tl.store({out} + {off}, {value}, mask=mask)"
        if entry.key not in self.tma_stores or not self.tma_mode:
            self.emit(plain, indent)
            return
        # a TMA store: the tile goes out through shared memory asynchronously, and the copy engine
        # clips it at the output's edges (no masks, whatever N is)
        tma = f"{out}_desc.store([{self.pid_m} * BLOCK_M, {self.pid_n} * BLOCK_N], {value})"
        if self.tma_mode == "direct":
            self.emit(tma, indent)
            return
        self.emit("if USE_TMA:", indent)
        self.emit(tma, indent + 1)
        self.emit("else:", indent)
        self.emit(plain, indent + 1)

    def _tma_stores(self) -> dict[str, int]:
        """Stores of the whole [M, N] tile into rows of 16-byte-aligned stride (e.g. padded logits),
        by key, with that stride: written through a TMA descriptor on the TMA path."""
        geo, mm = self.geo, self.gemm.matmul
        if not settings.gemm_tma_store or self.tma is None or geo.batch or geo.folded or len(mm.shape) != 2:
            return {}
        out = {}
        for e in self.group.stores:
            strides = e.node.spec.memory_strides
            if (e.node.shape == mm.shape and tuple(e.emb) == (0, 1) and strides[1] == 1 and strides[0] >= geo.n
                    and (strides[0] * dtypes.itemsize(e.node.dtype)) % 16 == 0):
                out[e.key] = strides[0]
        return out

    # ---- pieces --------------------------------------------------------------------------------

    def _head(self, pointers: list[str], consts: list[str]) -> str:
        return jit_head(self.name, ", ".join(pointers + [f"{c}: tl.constexpr" for c in consts]))

    def _pointers(self, outputs: bool = True, workspace: bool = False) -> list[str]:
        out = [self.ptr[n.id] for n in self.kernel_inputs]
        return out + (list(self.out_ptr.values()) if outputs else []) + (["ws"] if workspace else [])

    def _grid_shape(self) -> None:
        geo = self.geo
        self.emit(f"M, N, K = {geo.m}, {geo.n}, {geo.k}")
        self.emit("num_pid_m = tl.cdiv(M, BLOCK_M)")
        self.emit("num_pid_n = tl.cdiv(N, BLOCK_N)")
        self.emit("group_size = GROUP_M * num_pid_n")

    def _tile_of(self, tile: str, indent: int, suffix: str = "") -> None:
        """pid_m, pid_n of the tile numbered `tile` in grouped order (GROUP_M rows of tiles share B
        columns in L2)."""
        e, s = self.emit, suffix
        e(f"first_m{s} = ({tile} // group_size) * GROUP_M", indent)
        e(f"rows_in_group{s} = min(num_pid_m - first_m{s}, GROUP_M)", indent)
        e(f"pid_m{s} = first_m{s} + (({tile} % group_size) % rows_in_group{s})", indent)
        e(f"pid_n{s} = ({tile} % group_size) // rows_in_group{s}", indent)

    def _tile_index(self, indent: int, suffix: str = "") -> None:
        """The output tile's row/column indices and masks, as the epilogue reads them."""
        e = self.emit
        self.pid_m, self.pid_n = f"pid_m{suffix}", f"pid_n{suffix}"
        e(f"offs_m = (pid_m{suffix} * BLOCK_M + tl.arange(0, BLOCK_M))[:, None]", indent)
        e(f"offs_n = (pid_n{suffix} * BLOCK_N + tl.arange(0, BLOCK_N))[None, :]", indent)
        e("mask_m = offs_m < M", indent)
        e("mask_n = offs_n < N", indent)
        e("mask = mask_m & mask_n", indent)
        e("zero_m = offs_m * 0", indent)
        e("zero_mn = zero_m + offs_n * 0", indent)

    def _descriptors(self, indent: int) -> None:
        assert self.tma is not None
        (a_shape, a_strides, a_block, _, _), (b_shape, b_strides, b_block, _, _) = self.tma
        pa, pb = (self.ptr[x.id] for x in self.gemm.matmul.inputs)
        self.emit(f"a_desc = tl.make_tensor_descriptor({pa} + {self.a_base}, shape={a_shape}, strides={a_strides}, "
                  f"block_shape={a_block})", indent)
        self.emit(f"b_desc = tl.make_tensor_descriptor({pb} + {self.b_base}, shape={b_shape}, strides={b_strides}, "
                  f"block_shape={b_block})", indent)
        for key, stride in self.tma_stores.items():
            out = self.out_ptr[key]
            self.emit(f"{out}_desc = tl.make_tensor_descriptor({out}, shape=[M, N], strides=[{stride}, 1], "
                      "block_shape=[BLOCK_M, BLOCK_N])", indent)

    def _mainloop(self, indent: int, tma: bool, k_lo: str = "0", k_hi: str = "K") -> None:
        """acc = A'[tile rows, k_lo:k_hi] @ B'[k_lo:k_hi, tile cols] in fp32."""
        e = self.emit
        if tma:
            assert self.tma is not None
            (_, _, _, a_at, a_trans), (_, _, _, b_at, b_trans) = self.tma
            e("acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)", indent)
            e(f"for k0 in range({k_lo}, {k_hi}, BLOCK_K):", indent)
            e(f"a = {'tl.trans(' if a_trans else ''}a_desc.load({a_at}){')' if a_trans else ''}", indent + 1)
            e(f"b = {'tl.trans(' if b_trans else ''}b_desc.load({b_at}){')' if b_trans else ''}", indent + 1)
            e(f"acc = tl.dot(a, b, acc{self.precision})", indent + 1)
            return
        pa, pb = (self.ptr[x.id] for x in self.gemm.matmul.inputs)
        sam, sak = self.geo.a_strides
        sbk, sbn = self.geo.b_strides
        # rows/cols past the edge wrap around (in bounds; their results are never stored); a modulo
        # keeps Triton's contiguity analysis (vectorized loads), a tl.where would not
        e("safe_m = ((pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M)[:, None]", indent)
        e("safe_n = ((pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N)[None, :]", indent)
        kk = "rk" if k_lo == "0" else f"({k_lo} + rk)"
        e(f"a_ptrs = {pa} + {self.a_base} + safe_m * {sam} + {kk}[None, :] * {sak}", indent)
        e(f"b_ptrs = {pb} + {self.b_base} + {kk}[:, None] * {sbk} + safe_n * {sbn}", indent)
        e("acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)", indent)
        e(f"for k0 in range({k_lo}, {k_hi}, BLOCK_K):", indent)
        e("if EVEN_K:", indent + 1)
        e("a = tl.load(a_ptrs)", indent + 2)
        e("b = tl.load(b_ptrs)", indent + 2)
        e("else:", indent + 1)
        e("a = tl.load(a_ptrs, mask=rk[None, :] < K - k0, other=0.0)", indent + 2)
        e("b = tl.load(b_ptrs, mask=rk[:, None] < K - k0, other=0.0)", indent + 2)
        e(f"acc = tl.dot(a, b, acc{self.precision})", indent + 1)
        e(f"a_ptrs += BLOCK_K * {sak}", indent + 1)
        e(f"b_ptrs += BLOCK_K * {sbk}", indent + 1)

    def _epilogue(self, indent: int, flatten: bool = False) -> None:
        """The claimed pointwise expressions on the fp32 accumulator tile, then the only stores (each
        value cast once, to its output's dtype). When N is not a multiple of 16 (a 50257-wide vocab),
        `offs_n < N` varies element by element, which makes Triton store (and load) the whole tile in
        scalars; so the epilogue is written twice: tiles wholly inside the output take constant masks
        (their stores into 16-byte-aligned rows, e.g. padded logits, become vectors), edge tiles the real
        ones. A persistent kernel run with FLATTEN keeps only the masked body (see below)."""
        tma_only = self.tma_mode == "direct" and all(e.key in self.tma_stores for e in self.group.stores)
        if self.geo.n % 16 == 0 or tma_only:   # (TMA stores need no masks)
            self._epilogue_body(indent)
            return
        start = len(self.lines)
        self._epilogue_body(indent + 1)
        body = self.lines[start:]
        del self.lines[start:]
        if flatten:   # Triton cannot flatten a persistent loop holding a branch: one masked body there
            self.emit("if FLATTEN:", indent)
            self.lines += body
        full = f"({self.pid_n} * BLOCK_N + BLOCK_N <= N) & ({self.pid_m} * BLOCK_M + BLOCK_M <= M)"
        # a whole tile inside the output: constant masks, which Triton drops (a row mask it keeps would
        # still make it store in scalars when the other branch masks by column)
        self.emit(f"{'elif' if flatten else 'if'} {full}:", indent)
        self.emit("mask_m = tl.full([BLOCK_M, 1], 1, tl.int1)", indent + 1)
        self.emit("mask_n = tl.full([1, BLOCK_N], 1, tl.int1)", indent + 1)
        self.emit("mask = tl.full([BLOCK_M, BLOCK_N], 1, tl.int1)", indent + 1)
        self.lines += body
        self.emit("else:", indent)
        self.lines += body

    def _epilogue_body(self, indent: int) -> None:
        mm = self.gemm.matmul
        if mm.dtype in ("float16", "bfloat16"):  # the product is a 16-bit value, as in the reference
            self.emit(f"acc_out = acc.to({TL_DTYPE[mm.dtype]}).to(tl.float32)", indent)
        else:
            self.emit("acc_out = acc", indent)
        dimvar = self._domain_vars(self.batch_vars)
        # each output stored as soon as its value is computed: a value stored and also read later (a
        # linear layer's result saved for the backward, then its activation) is then not held beside
        # the later values (with both 16-bit results of GPT-2's fc layer held to the end, ptxas
        # serialized the ping-pong kernel's wgmma)
        pending = list(self.group.stores)
        for entry in self.group.entries:
            self.value(entry, "mask", dimvar, indent)
            for store in [s for s in pending if s.key == entry.key]:
                self.store(store, "mask", dimvar, indent)
                pending.remove(store)
        for entry in pending:
            self.store(entry, "mask", dimvar, indent)
        for entries in self.reductions:  # amax: this tile's max (masked edges count as -inf), one atomic
            for entry in entries:
                if entry.kind != "reduce":
                    self.value(entry, "mask", dimvar, indent)
                    continue
                self.emit(f"{entry.key} = tl.max(tl.where(mask, {self.expr[entry.args[0]]}, float('-inf')))", indent)
                self.emit(f"tl.atomic_max({self.out_ptr[entry.key]}, {entry.key})", indent)

    def _batch_setup(self, axis: int) -> None:
        self.batch_vars = self._batch_indices(axis)
        self.a_base = _batch_offset(self.batch_vars, self.geo.a_batch)
        self.b_base = _batch_offset(self.batch_vars, self.geo.b_batch)

    def _source(self, head: str) -> str:
        return "\n".join([head, *self.lines]) + "\n"

    # ---- kernels -------------------------------------------------------------------------------

    def write_tiled(self) -> str:
        """One output tile a program: grid (tiles, batch)."""
        e = self.emit
        self._grid_shape()
        e("pid = tl.program_id(0)")
        self._tile_of("pid", 1)
        self._tile_index(1)
        self._batch_setup(1)
        e("rk = tl.arange(0, BLOCK_K)")
        if self.tma is not None:  # TMA descriptors (Hopper): tiles land in shared memory, edges zero-filled
            e("if USE_TMA:")
            self._descriptors(2)
            self._mainloop(2, tma=True)
            e("else:")
            self._mainloop(2, tma=False)
        else:
            self._mainloop(1, tma=False)
        self.tma_mode = "static"
        self._epilogue(1)
        self.tma_mode = ""
        return self._source(self._head(self._pointers(), TILE_CONSTS))

    def write_persistent(self, streamk: bool = False) -> str:
        """NUM_PROGRAMS programs a batch entry, each looping over tiles start, start + NUM_PROGRAMS,
        ... in grouped order: no tail of short-lived programs, and the next tile's loads can overlap
        this tile's epilogue (FLATTEN lets Triton pipeline across the tile loop). The epilogue's tile
        indices come from a second counter (`tile_c`), as Triton's persistent tutorial does to keep
        the pipeliner from carrying one value across both ends of the loop.

        `streamk` (VARIANT "streamk", no batch): the last SK_TILES tiles (the partial last wave, which
        would leave most SMs idle) are shared out by K instead (stream-K): their K iterations, laid
        end to end, are cut into runs of SK_ITERS, one run a program, so every program ends at about
        the same time. A run covering part of a tile stores its fp32 partial product in a workspace
        slot (the slot of program p's part of tail tile t is p + t: runs are ordered in both), then
        counts itself on the tile's counter; the program that arrives last sums the tile's partials in
        program order (the same result every run), runs the epilogue and resets the counter to zero
        for the next launch. (Measured on the H200 with the run before the whole tiles, its pieces
        unrolled, and one unflattened loop over whole tiles and pieces: none was faster; bench/RESULTS.md,
        twenty-fifth session.)"""
        e = self.emit
        self._grid_shape()
        e("start = tl.program_id(0)")
        e("num_tiles = num_pid_m * num_pid_n")
        if streamk:
            e("num_tiles = num_tiles - SK_TILES")
        self._batch_setup(1)
        e("rk = tl.arange(0, BLOCK_K)")
        paths = [True, False] if self.tma is not None else [False]
        for tma in paths:
            indent = 1
            if len(paths) > 1:
                e("if USE_TMA:" if tma else "else:")
                indent = 2
            if tma:
                self._descriptors(indent)
            e("tile_c = start - NUM_PROGRAMS", indent)
            e("for tile in tl.range(start, num_tiles, NUM_PROGRAMS, flatten=FLATTEN, "
              "warp_specialize=WARP_SPECIALIZE):", indent)
            self._tile_of("tile", indent + 1)
            self._mainloop(indent + 1, tma=tma)
            e("tile_c += NUM_PROGRAMS", indent + 1)
            self._tile_of("tile_c", indent + 1, suffix="_c")
            self._tile_index(indent + 1, suffix="_c")
            self.tma_mode = "direct" if tma else ""
            self._epilogue(indent + 1, flatten=True)
            self.tma_mode = ""
            if streamk:
                self._streamk_tail(indent, tma)
        consts = [*TILE_CONSTS, "NUM_PROGRAMS", "FLATTEN", "WARP_SPECIALIZE"]
        if streamk:
            return self._source(self._head([*self._pointers(workspace=True), "sk_count"],
                                           [*consts, "SK_TILES", "SK_ITERS"]))
        return self._source(self._head(self._pointers(), consts))

    def _streamk_piece(self, i: int, tma: bool) -> None:
        """A piece's partial `acc` of tail tile t into its slot, its arrival counted; the last arrival
        sums the tile's partials in program order, resets the counter and runs the epilogue."""
        e = self.emit
        e("slot_offs = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]", i)
        e("tl.store(ws + (start + t) * (BLOCK_M * BLOCK_N) + slot_offs, acc)", i)
        e("tl.debug_barrier()   # every thread's partial is stored before the count says so", i)
        e("arrived = tl.atomic_add(sk_count + t, 1, sem=\"acq_rel\", scope=\"gpu\")", i)
        e("p_lo = (t * k_iters) // SK_ITERS", i)
        e("p_hi = ((t + 1) * k_iters - 1) // SK_ITERS", i)
        e("if arrived == p_hi - p_lo:   # the last of the tile's runs: sum them in program order", i)
        j = i + 1
        e("acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)", j)
        e("for p in range(p_lo, p_hi + 1):", j)
        e("acc += tl.load(ws + (p + t) * (BLOCK_M * BLOCK_N) + slot_offs, cache_modifier=\".cg\")", j + 1)
        e("tl.atomic_xchg(sk_count + t, 0)", j)
        self._tile_index(j)
        self.tma_mode = "direct" if tma else ""
        self._epilogue(j)
        self.tma_mode = ""

    def _streamk_tail(self, indent: int, tma: bool) -> None:
        """The stream-K part of write_persistent: this program's run of SK_ITERS K iterations over the
        tail tiles (at most two tiles: a run is no longer than one tile's K loop)."""
        e = self.emit
        e("k_iters = tl.cdiv(K, BLOCK_K)", indent)
        e("it = start * SK_ITERS", indent)
        e("it_end = min(it + SK_ITERS, SK_TILES * k_iters)", indent)
        e("while it < it_end:", indent)
        i = indent + 1
        e("t = it // k_iters", i)
        e("k_first = it - t * k_iters", i)
        e("k_last = min(k_iters, k_first + (it_end - it))", i)
        self._tile_of("(num_tiles + t)", i)
        self._mainloop(i, tma=tma, k_lo="k_first * BLOCK_K", k_hi="k_last * BLOCK_K")
        self._streamk_piece(i, tma)
        e("it += k_last - k_first", i)

    def write_gemv(self) -> str:
        """A weight-streaming GEMV (gemm_configs.gemv_covers: at most GEMV_MAX_M rows of A', B' read
        along K): grid (cdiv(N, BLOCK_N),); a program streams BLOCK_N rows of the weight once, BLOCK_K
        at a time, into one fp32 partial-product tile per row of A' (M is a literal, so the rows are
        unrolled), and sums each over K at the end. No tl.dot: one decode row would use 1/16 of a
        16-row MMA and add the operand staging. Rows past N wrap around (in bounds, never stored) so
        the loads need no mask along N and stay vectorized."""
        e, geo = self.emit, self.geo
        pa, pb = (self.ptr[x.id] for x in self.gemm.matmul.inputs)
        sam, sak = geo.a_strides
        sbn = geo.b_strides[1]
        e(f"M, N, K = {geo.m}, {geo.n}, {geo.k}")
        e("pid_m = 0")
        e("pid_n = tl.program_id(0)")
        self._tile_index(1)
        self._batch_setup(1)
        e("rk = tl.arange(0, BLOCK_K)")
        e("rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N")
        e(f"b_ptrs = {pb} + {self.b_base} + rn[:, None] * {sbn} + rk[None, :]")
        for i in range(geo.m):
            e(f"a{i}_ptrs = {pa} + {self.a_base} + {i * sam} + rk * {sak}")
            e(f"acc{i} = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)")
        e("for k0 in range(0, K, BLOCK_K):")
        e("if EVEN_K:", 2)
        e("b = tl.load(b_ptrs, eviction_policy=\"evict_first\")", 3)
        for i in range(geo.m):
            e(f"a{i} = tl.load(a{i}_ptrs)", 3)
        e("else:", 2)
        e("b = tl.load(b_ptrs, mask=rk[None, :] < K - k0, other=0.0, eviction_policy=\"evict_first\")", 3)
        for i in range(geo.m):
            e(f"a{i} = tl.load(a{i}_ptrs, mask=rk < K - k0, other=0.0)", 3)
        e("b = b.to(tl.float32)", 2)
        for i in range(geo.m):
            e(f"acc{i} += b * a{i}.to(tl.float32)[None, :]", 2)
            e(f"a{i}_ptrs += BLOCK_K * {sak}", 2)
        e("b_ptrs += BLOCK_K", 2)
        if geo.m == 1:
            e("acc = tl.sum(acc0, axis=1)[None, :]")
        else:  # the output tile, row by row (rows past M stay zero and are masked at the store)
            e("rows = tl.arange(0, BLOCK_M)[:, None]")
            e("acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)")
            for i in range(geo.m):
                e(f"acc = tl.where(rows == {i}, tl.sum(acc{i}, axis=1)[None, :], acc)")
        self._epilogue(1)
        return self._source(self._head(self._pointers(), ["BLOCK_M", "BLOCK_N", "BLOCK_K", "EVEN_K"]))

    def write_split_partial(self) -> str:
        """Split-K, first kernel: grid (tiles, SPLITS, batch); program (t, s) multiplies the K chunk
        [s * CHUNK_K, (s + 1) * CHUNK_K) of tile t and stores the fp32 partial to ws[s, batch, M, N]."""
        e, geo = self.emit, self.geo
        self._grid_shape()
        e("pid = tl.program_id(0)")
        e("pid_k = tl.program_id(1)")
        self._tile_of("pid", 1)
        self._tile_index(1)
        self._batch_setup(2)
        e("rk = tl.arange(0, BLOCK_K)")
        e("k_lo = pid_k * CHUNK_K")
        e("k_hi = min(k_lo + CHUNK_K, K)")
        self._mainloop(1, tma=False, k_lo="k_lo", k_hi="k_hi")
        e(f"ws_off = pid_k * {geo.m * geo.n * max(1, geo.batch_numel)}{self._ws_batch()} + offs_m * N + offs_n")
        e("tl.store(ws + ws_off, acc, mask=mask)")
        consts = ["BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "EVEN_K", "CHUNK_K"]
        return self._source(self._head(self._pointers(outputs=False, workspace=True), consts))

    def write_split_finish(self) -> str:
        """Split-K, second kernel: grid (tiles, batch); sums the SPLITS partials of its tile in split
        order (the same result every run), then the epilogue."""
        e, geo = self.emit, self.geo
        self._grid_shape()
        e("pid = tl.program_id(0)")
        self._tile_of("pid", 1)
        self._tile_index(1)
        self._batch_setup(1)
        e(f"ws_off = offs_m * N + offs_n{self._ws_batch()}")
        e("acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)")
        e("for s in range(SPLITS):")
        e(f"acc += tl.load(ws + s * {geo.m * geo.n * max(1, geo.batch_numel)} + ws_off, mask=mask, other=0.0)", 2)
        self._epilogue(1)
        return self._source(self._head(self._pointers(workspace=True), ["BLOCK_M", "BLOCK_N", "GROUP_M", "SPLITS"]))

    def _ws_batch(self) -> str:
        return f" + pid_b * {self.geo.m * self.geo.n}" if self.geo.batch else ""

    def _batch_indices(self, axis: int) -> list[str]:
        """Scalar index per output batch dim, from program_id(axis) (row-major over the batch)."""
        batch = self.geo.batch
        if not batch:
            return []
        self.emit(f"pid_b = tl.program_id({axis}).to(tl.int64)")
        names, inner = [], 1
        for d in range(len(batch) - 1, -1, -1):
            expr = "pid_b" if inner == 1 else f"(pid_b // {inner})"
            if d > 0:
                expr = f"{expr} % {batch[d]}"
            self.emit(f"bi{d} = {expr}")
            names.append(f"bi{d}")
            inner *= batch[d]
        return list(reversed(names))

    def _domain_vars(self, batch_vars: list[str]) -> dict[int, str]:
        """Index variable of each (squeezed) domain dim of the matmul's output."""
        mm = self.gemm.matmul
        a, b = mm.inputs
        row = "offs_m"
        if self.geo.folded:  # batch and row indices of the folded M index
            batch_vars, inner = [], self.geo.rows
            for axis in range(len(self.geo.folded) - 1, -1, -1):
                index = f"(offs_m // {inner})" if inner > 1 else "offs_m"
                batch_vars.insert(0, f"({index} % {self.geo.folded[axis]})" if axis > 0 else index)
                inner *= self.geo.folded[axis]
            row = f"(offs_m % {self.geo.rows})"
        names = list(batch_vars) + ([row] if a.spec.rank > 1 else []) + (["offs_n"] if b.spec.rank > 1 else [])
        out: dict[int, str] = {}
        for k, d in enumerate(squeeze_map(mm.shape)):
            if d is not None:
                out[d] = names[k]
        return out


def _batch_offset(batch_vars: list[str], strides: tuple[int, ...]) -> str:
    terms = [f"{v} * {s}" for v, s in zip(batch_vars, strides, strict=True) if s != 0]
    return " + ".join(terms) or "0"

