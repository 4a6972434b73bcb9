"""Triton source for a MatmulGroup: C = epilogue(A' @ B') with A' = A^T if trans_a, B' = B^T if
trans_b, batch dims broadcast (one program column per output batch), fp32 accumulation, grouped
tile ordering (GROUP_M rows of tiles share B columns in L2), and the epilogue's pointwise
expressions evaluated on the accumulator tile before the only stores.

Shapes and strides are literals in the source (a plan is specialized to its input signature);
tile sizes are constexprs, chosen from `gemm_configs` by the autotuner. The epilogue reuses the
pointwise writer of triton_gen: each domain dim is indexed by a batch index, `offs_m` or `offs_n`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from ..fusion.epilogue import MatmulGroup
from ..fusion.partition import Entry, squeeze_map
from ..ir import dtypes
from ..ir.node import Node
from .configs import next_pow2
from .triton_gen import HEADER, TL_DTYPE, _Writer

GEMM_DTYPES = ("float16", "bfloat16", "float32")

# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages): Hopper-friendly tiles, best guess first
GEMM_TILES = (
    (128, 256, 64, 8, 8, 3),
    (128, 128, 64, 8, 4, 4),
    (256, 128, 64, 8, 8, 3),
    (64, 256, 32, 8, 4, 4),
    (128, 64, 64, 8, 4, 4),
    (64, 64, 32, 8, 4, 4),
)


@dataclass
class GemmGeometry:
    batch: tuple[int, ...]
    m: int
    n: int
    k: int
    a_strides: tuple[int, int]           # (along M, along K) of A'
    b_strides: tuple[int, int]           # (along K, along N) of B'
    a_batch: tuple[int, ...]             # per output batch dim: A's stride (0 where broadcast)
    b_batch: tuple[int, ...]

    @property
    def batch_numel(self) -> int:
        return math.prod(self.batch)


@dataclass
class GeneratedGemm:
    name: str
    source: str
    inputs: list[Node]
    outputs: list[Node]
    geometry: GemmGeometry
    tma: bool = False                    # the source has a TMA-descriptor path (USE_TMA)


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


SMS = 132                   # streaming multiprocessors of an H100/H200, when no GPU says otherwise
SMEM_BYTES = 232448         # shared memory one program may use on Hopper (227 KiB)
SMALL_PROBLEM_TRITON = 3    # Triton candidates of a problem too small to fill the GPU (+ cuBLAS: 4)
LARGE_PROBLEM_TRITON = 3    # pointer-path candidates of a larger one (+ 2 TMA + cuBLAS: 6)
LARGE_PROBLEM_TMA = 2


def gemm_configs(geometry: GemmGeometry, tma: bool = False, *, sms: int = SMS, itemsize: int = 2,
                 limit: bool = True) -> list[dict[str, Any]]:
    """Tile candidates, best first by `tile_cost`, pruned to what is worth compiling.

    Rules: tiles are clipped to the problem padded to a power of two (tl.dot needs every side >= 16)
    and a clipped duplicate is dropped; num_stages is lowered until the operand pipeline fits in
    shared memory (a config that cannot fit is dropped); candidates are ordered by `tile_cost`
    (waves over `sms` x the work of one tile / its efficiency). With `limit`: a problem that 128x128
    tiles do not spread over every SM keeps SMALL_PROBLEM_TRITON candidates, larger ones keep
    LARGE_PROBLEM_TRITON; with `tma` the best LARGE_PROBLEM_TMA (small problems: 1) of those also
    read through TMA descriptors (Hopper), within the same count for small problems."""
    cap_m, cap_n, cap_k = (max(16, next_pow2(x)) for x in (geometry.m, geometry.n, geometry.k))
    out: list[dict[str, Any]] = []
    tiles_seen: set[tuple[int, int, int]] = set()
    for bm, bn, bk, gm, warps, stages in GEMM_TILES:
        bm, bn, bk = min(bm, cap_m), min(bn, cap_n), min(bk, cap_k)
        if (bm, bn, bk) in tiles_seen:
            continue
        while stages > 2 and stages * (bm + bn) * bk * itemsize > SMEM_BYTES:
            stages -= 1
        if stages * (bm + bn) * bk * itemsize > SMEM_BYTES:
            continue
        tiles_seen.add((bm, bn, bk))
        out.append({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": gm,
                    "num_warps": warps if bm * bn >= 128 * 128 else 4, "num_stages": stages})
    out.sort(key=lambda c: tile_cost(geometry, c, sms))  # stable: ties keep GEMM_TILES' order
    if not limit:
        return out + ([dict(c, USE_TMA=True) for c in out[:3]] if tma else [])
    if small_problem(geometry, sms):
        keep = out[:SMALL_PROBLEM_TRITON - 1 if tma and len(out) > 1 else SMALL_PROBLEM_TRITON]
        return keep + ([dict(keep[0], USE_TMA=True)] if tma else [])
    keep = out[:LARGE_PROBLEM_TRITON]
    return keep + ([dict(c, USE_TMA=True) for c in keep[:LARGE_PROBLEM_TMA]] if tma else [])


def small_problem(geometry: GemmGeometry, sms: int = SMS) -> bool:
    """True when 128x128 output tiles would leave some SMs without work."""
    return -(-geometry.m // 128) * -(-geometry.n // 128) * max(1, geometry.batch_numel) < sms


def tile_cost(geometry: GemmGeometry, config: dict[str, Any], sms: int = SMS) -> float:
    """Relative time of a config: programs per SM (rounded up: the last wave counts whole) x the
    multiply-adds of one tile / the tile's efficiency. Efficiency grows with the tile's operand
    reuse BM*BN/(BM+BN) (FLOPs per byte loaded) up to that of a 128x128 tile."""
    bm, bn = int(config["BLOCK_M"]), int(config["BLOCK_N"])
    tiles = -(-geometry.m // bm) * -(-geometry.n // bn) * max(1, geometry.batch_numel)
    efficiency = min(1.0, (bm * bn / (bm + bn)) / 64.0)
    return -(-tiles // sms) * bm * bn / efficiency


def gemm_launch_parameters(geometry: GemmGeometry, config: dict[str, Any]) -> tuple[
        tuple[int, ...], dict[str, Any], int, int]:
    """(grid, constexprs, num_warps, num_stages) of one config."""
    bm, bn, bk = int(config["BLOCK_M"]), int(config["BLOCK_N"]), int(config["BLOCK_K"])
    grid = (-(-geometry.m // bm) * -(-geometry.n // bn), max(1, geometry.batch_numel))
    consts = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": int(config["GROUP_M"]),
              "EVEN_K": geometry.k % bk == 0, "USE_TMA": bool(config.get("USE_TMA", False))}
    return grid, consts, int(config.get("num_warps", 4)), int(config.get("num_stages", 3))


def generate_gemm(group: MatmulGroup, name: str) -> GeneratedGemm:
    return _GemmWriter(group, name).write()


_TILE_VAR = re.compile(r"\boffs_([mn])\b")


class _GemmWriter(_Writer):
    def __init__(self, group: MatmulGroup, name: str) -> None:
        super().__init__(group.epilogue, name)
        self.gemm = group
        self.geo = gemm_geometry(group.matmul)
        self.kernel_inputs = group.inputs
        self.ptr = {n.id: f"in{k}" for k, n in enumerate(self.kernel_inputs)}
        self.zero_index = "zero_m"

    def offset(self, node: Node, emb: tuple[int | None, ...], dimvar: dict[int, str]) -> str:
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
        if entry is self.gemm.product:
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
        value = self.expr[entry.key]
        self.emit(f"tl.store({out} + {off}, ({value}).to({out}.dtype.element_ty), mask=mask)", indent)

    def write(self) -> GeneratedGemm:
        geo, mm = self.geo, self.gemm.matmul
        a, b = mm.inputs
        pa, pb = self.ptr[a.id], self.ptr[b.id]
        args = [self.ptr[n.id] for n in self.kernel_inputs] + list(self.out_ptr.values())
        consts = ["BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "EVEN_K", "USE_TMA"]
        head = [f"@triton.jit\ndef {self.name}({', '.join(args + [f'{c}: tl.constexpr' for c in consts])}):"]
        e = self.emit
        e(f"M, N, K = {geo.m}, {geo.n}, {geo.k}")
        e("pid = tl.program_id(0)")
        e("num_pid_m = tl.cdiv(M, BLOCK_M)")
        e("num_pid_n = tl.cdiv(N, BLOCK_N)")
        e("group_size = GROUP_M * num_pid_n")
        e("first_m = (pid // group_size) * GROUP_M")
        e("rows_in_group = min(num_pid_m - first_m, GROUP_M)")
        e("pid_m = first_m + ((pid % group_size) % rows_in_group)")
        e("pid_n = (pid % group_size) // rows_in_group")
        e("offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M))[:, None]")
        e("offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N))[None, :]")
        e("mask_m = offs_m < M")
        e("mask_n = offs_n < N")
        e("mask = mask_m & mask_n")
        e("zero_m = offs_m * 0")
        e("zero_mn = zero_m + offs_n * 0")
        batch_vars = self._batch_indices()
        a_base = _batch_offset(batch_vars, geo.a_batch)
        b_base = _batch_offset(batch_vars, geo.b_batch)
        sam, sak = geo.a_strides
        sbk, sbn = geo.b_strides
        e("rk = tl.arange(0, BLOCK_K)")
        # rows/cols past the edge wrap around (in bounds; their results are never stored); a modulo
        # keeps Triton's contiguity analysis (vectorized loads), a tl.where would not
        e("safe_m = offs_m % M")
        e("safe_n = offs_n % N")
        e(f"a_ptrs = {pa} + {a_base} + safe_m * {sam} + rk[None, :] * {sak}")
        e(f"b_ptrs = {pb} + {b_base} + rk[:, None] * {sbk} + safe_n * {sbn}")
        e("acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)")
        precision = ', input_precision="ieee"' if a.dtype == "float32" else ""
        tma = tma_plan(geo, dtypes.itemsize(a.dtype))
        inner = 1
        if tma is not None:  # TMA descriptors (Hopper): tiles land in shared memory, edges zero-filled
            inner = 2
            e("if USE_TMA:")
            (a_shape, a_strides, a_block, a_at, a_trans), (b_shape, b_strides, b_block, b_at, b_trans) = tma
            e(f"a_desc = tl.make_tensor_descriptor({pa} + {a_base}, shape={a_shape}, strides={a_strides}, "
              f"block_shape={a_block})", 2)
            e(f"b_desc = tl.make_tensor_descriptor({pb} + {b_base}, shape={b_shape}, strides={b_strides}, "
              f"block_shape={b_block})", 2)
            e("for k0 in range(0, K, BLOCK_K):", 2)
            e(f"a = {'tl.trans(' if a_trans else ''}a_desc.load({a_at}){')' if a_trans else ''}", 3)
            e(f"b = {'tl.trans(' if b_trans else ''}b_desc.load({b_at}){')' if b_trans else ''}", 3)
            e(f"acc = tl.dot(a, b, acc{precision})", 3)
            e("else:")
        e("for k0 in range(0, K, BLOCK_K):", inner)
        e("if EVEN_K:", inner + 1)
        e("a = tl.load(a_ptrs)", inner + 2)
        e("b = tl.load(b_ptrs)", inner + 2)
        e("else:", inner + 1)
        e("a = tl.load(a_ptrs, mask=rk[None, :] < K - k0, other=0.0)", inner + 2)
        e("b = tl.load(b_ptrs, mask=rk[:, None] < K - k0, other=0.0)", inner + 2)
        e(f"acc = tl.dot(a, b, acc{precision})", inner + 1)
        e(f"a_ptrs += BLOCK_K * {sak}", inner + 1)
        e(f"b_ptrs += BLOCK_K * {sbk}", inner + 1)
        if mm.dtype in ("float16", "bfloat16"):  # the product is a 16-bit value, as in the reference
            e(f"acc_out = acc.to({TL_DTYPE[mm.dtype]}).to(tl.float32)")
        else:
            e("acc_out = acc")
        dimvar = self._domain_vars(batch_vars)
        for entry in self.group.entries:
            self.value(entry, "mask", dimvar, 1)
        for entry in self.group.stores:
            self.store(entry, "mask", dimvar, 1)
        source = HEADER + "\n".join(head + self.lines) + "\n"
        return GeneratedGemm(self.name, source, self.kernel_inputs, self.outputs, geo, tma=tma is not None)

    def _batch_indices(self) -> list[str]:
        """Scalar index per output batch dim, from program_id(1) (row-major over the batch)."""
        batch = self.geo.batch
        if not batch:
            return []
        self.emit("pid_b = tl.program_id(1).to(tl.int64)")
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
        names = list(batch_vars) + (["offs_m"] if a.spec.rank > 1 else []) + (["offs_n"] if b.spec.rank > 1 else [])
        out: dict[int, str] = {}
        for k, d in enumerate(squeeze_map(mm.shape)):
            if d is not None:
                out[d] = names[k]
        return out


def _batch_offset(batch_vars: list[str], strides: tuple[int, ...]) -> str:
    terms = [f"{v} * {s}" for v, s in zip(batch_vars, strides, strict=True) if s != 0]
    return " + ".join(terms) or "0"

