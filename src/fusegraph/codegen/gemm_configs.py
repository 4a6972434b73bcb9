"""GEMM launch candidates as data: tile configs of the one-tile-per-program kernel ("tiled"), of
the persistent kernel (one program per SM looping over tiles in grouped order) and of split-K
(K divided over programs for skinny problems, partials reduced in a fixed order by a second
kernel). The autotuner times what these functions keep, next to cuBLAS."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidValueError
from .configs import next_pow2

# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages): Hopper-friendly tiles, best guess first.
# 128x256x64 / 8 warps and 256x128x64 / 8 warps (two consumer warpgroups of 128 rows each on wgmma)
# are the strong large-bf16 tiles on H100/H200; 128x128x64 with 4 stages the safe middle.
GEMM_TILES = (
    (128, 256, 64, 8, 8, 3),
    (128, 128, 64, 8, 4, 4),
    (256, 128, 64, 8, 8, 3),
    (64, 256, 32, 8, 4, 4),
    (128, 64, 64, 8, 4, 4),
    (64, 64, 32, 8, 4, 4),
)
# persistent tiles: the large-GEMM tiles with the stage counts worth trying (4 stages of 128x256x64
# bf16 = 192 KiB of operands: fits 227 KiB; the epilogue's tile goes through registers)
PERSISTENT_TILES = (
    (128, 256, 64, 8, 8, 3),
    (128, 256, 64, 8, 8, 4),
    (128, 128, 64, 8, 4, 4),
    (256, 128, 64, 8, 8, 3),
)
# split-K tiles (BLOCK_N, BLOCK_K, num_warps, num_stages); BLOCK_M is M padded to >= 16
SPLIT_K_TILES = ((64, 128, 4, 4), (128, 128, 4, 3), (64, 256, 4, 3), (32, 256, 4, 4))

SMS = 132                   # streaming multiprocessors of an H100/H200, when no GPU says otherwise
SMEM_BYTES = 232448         # shared memory one program may use on Hopper (227 KiB)
TMA_STORE_SLACK = 2048      # barriers and alignment beside the tiles of a kernel with TMA stores (seen: 1056)
SMALL_PROBLEM_TRITON = 3    # Triton candidates of a problem too small to fill the GPU (+ cuBLAS: 4)
# Candidate counts, pruned by what won: every candidate's time in cold compiles of ResNet-50 and the
# GPT-2 step on an H200 (results/choices_*_20261202_0529.txt, ranked by bench/choices_ranks.py). In
# their 33 GEMMs the second TMA tile and the persistent kernel's unflattened loop never won by more
# than 0.7%; dropping them saves 60 of their 247 GEMM compiles.
LARGE_PROBLEM_TRITON = 3    # pointer-path candidates of a larger one (+ 1 TMA + cuBLAS: 5)
LARGE_PROBLEM_TMA = 1
PERSISTENT_CANDIDATES = 2   # persistent candidates of a problem with more than one wave of tiles
# The candidate set of a 1x1 convolution's inner GEMM (build option gemm_candidates="conv",
# backends/conv_gemm.INNER_OPTIONS): the pointer-path tiles and one persistent config, no tiled TMA
# config. In the cold compiles of ResNet-50 (twice), MobileNetV3-large and ConvNeXt-nano (40 inner
# GEMMs with every candidate timed: results/choices_resnet50_20261202_0529.txt,
# choices_zoo_*_20261202_1410.txt; bench/choices_ranks.py) a tiled TMA config never won, and the
# second persistent config won once (ConvNeXt-nano, 0.8% of its GEMM time); this set compiles 11 to
# 35 fewer candidates a model (MobileNetV3 49 -> 38, ConvNeXt-nano 66 -> 44, ResNet-50 100-107 -> 71-72).
# Linear layers keep the full set: GPT-2's LM head takes a TMA tile.
GEMM_CANDIDATE_SETS = ("full", "conv")
CONV_PERSISTENT_CANDIDATES = 1
STREAMK_MIN_IDLE = 0.02     # stream-K is a candidate when the persistent kernel's last wave idles >= this
                            # share of its SM time (tiles not a multiple of the programs) ...
STREAMK_CANDIDATES = 1      # ... built on this many of the best persistent configs
SPLIT_K_MAX_M = 64          # split-K is a candidate for M <= this ...
SPLIT_K_MIN_K = 512         # ... and K >= this (decode: M = batch, K = hidden)
SPLIT_K_CANDIDATES = 3
SPLIT_K_TARGET_WAVES = 2    # split until (tiles x splits) is about this many programs per SM
GEMV_MAX_M = 4              # the weight-streaming GEMV kernel takes problems of at most this many rows
# The warp-specialized ping-pong kernel (matmul_pingpong.py; Hopper, Gluon): one tile shape, the one
# measured (bench/gluon_gemm_gpu.py: 128x128x64, 4 stages, GROUP_M 8), offered to problems of at least
# PINGPONG_MIN_WAVES tiles a program (each program's two consumers need a tile each to overlap).
PINGPONG_TILE = (128, 128, 64, 8, 4)   # BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES
# GROUP_M candidates: timed in alternation on gelu_mlp's first GEMM (results/gluon_gemm_sweep_20261202_2236.txt)
# 4 stages with GROUP_M 16 ran 1.0% faster than with 8 (1509 / 1524 us medians), 4 stages 4.1% behind
# 8; 3 stages 21-27% behind; 5 stages (beside the store tiles) 0-13% behind
PINGPONG_GROUPS = (8, 16)
PINGPONG_MIN_WAVES = 2
# ... and of at least PINGPONG_MIN_K, A' read along K: it hides an epilogue behind the other consumer's
# main loop, which must be long to pay for the 128x128 tile's lower operand reuse. Every candidate timed
# in a cold GPT-2 step on the H200 (results/choices_gpt2_pingpong_20261202.txt): it lost all nine GEMMs
# it was offered (K = 768-3072: 0.55-0.97x the best; A' transposed, K = 8192: 0.47x); it won gelu_mlp's
# first GEMM (K = 4096, 1.09x our best Triton config and cuBLAS).
PINGPONG_MIN_K = 4096
# ... or of at least PINGPONG_MIN_K_ACTIVATION when the epilogue computes an activation (a transcendental
# function: GELU's tanh or erf, SiLU's sigmoid, ...). Those nine GEMMs had a bias at most; with the bias
# alone GPT-2's fc GEMM (8192 x 3072 x 768) ran 0.97x cuBLAS + bias (73.0 against 71.0 us), and cuBLAS
# then pays the activation as a second launch over the stored product.
PINGPONG_MIN_K_ACTIVATION = 512


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
    folded: tuple[int, ...] = ()         # batch dims folded into M (then m = prod(folded) * rows)
    rows: int = 0                        # M of one batch entry when folded

    @property
    def batch_numel(self) -> int:
        return math.prod(self.batch)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _fit_stages(bm: int, bn: int, bk: int, stages: int, itemsize: int, store_itemsize: int = 0) -> int | None:
    """num_stages lowered until the operand pipeline fits shared memory; None if 2 (3 with TMA stores)
    do not fit.

    `store_itemsize`: bytes per output element that TMA stores stage through shared memory (the sum over
    the stored outputs: each takes a BLOCK_M x BLOCK_N tile next to the pipeline). Triton's allocation
    is these two plus about a KiB of barriers: 263200 bytes for 4 stages of 128x256x64 bf16 and a bf16
    store, 278552 for 3 stages and an fp32 store (OutOfResources in GPT-2's step on the H200). Such a
    config keeps at least 3 stages or is dropped: a 2-stage pipeline of the big tile does not pay its
    compile."""
    def need(n: int) -> int:
        return n * (bm + bn) * bk * itemsize + (bm * bn * store_itemsize + TMA_STORE_SLACK if store_itemsize else 0)

    lowest = 3 if store_itemsize else 2
    while stages > lowest and need(stages) > SMEM_BYTES:
        stages -= 1
    return None if need(stages) > SMEM_BYTES else stages


def gemm_configs(geometry: GemmGeometry, tma: bool = False, *, sms: int = SMS, itemsize: int = 2,
                 limit: bool = True, store_itemsize: int = 0) -> list[dict[str, Any]]:
    """Tile candidates of the tiled kernel, best first by `tile_cost`, pruned to what is worth compiling.

    Rules: tiles are clipped to the problem padded to a power of two (tl.dot needs every side >= 16)
    and a clipped duplicate is dropped; num_stages is lowered until the operand pipeline fits in
    shared memory (a config that cannot fit is dropped); candidates are ordered by `tile_cost`
    (waves over `sms` x the work of one tile / its efficiency). With `limit`: a problem that 128x128
    tiles do not spread over every SM keeps SMALL_PROBLEM_TRITON candidates, larger ones keep
    LARGE_PROBLEM_TRITON; with `tma` the best LARGE_PROBLEM_TMA (small problems: 1) of those also
    read through TMA descriptors (Hopper), within the same count for small problems. A TMA config
    whose stores (`store_itemsize`, see _fit_stages) leave too little shared memory for its pipeline
    gets fewer stages, or is not a candidate: compiled, it would fail to load."""
    out = _clipped_tiles(geometry, GEMM_TILES, itemsize)
    out.sort(key=lambda c: tile_cost(geometry, c, sms))  # stable: ties keep GEMM_TILES' order
    if not limit:
        return out + (_with_tma(out[:3], itemsize, store_itemsize) if tma else [])
    if small_problem(geometry, sms):
        keep = out[:SMALL_PROBLEM_TRITON - 1 if tma and len(out) > 1 else SMALL_PROBLEM_TRITON]
        return keep + (_with_tma(keep[:1], itemsize, store_itemsize) if tma else [])
    keep = out[:LARGE_PROBLEM_TRITON]
    return keep + (_with_tma(keep[:LARGE_PROBLEM_TMA], itemsize, store_itemsize) if tma else [])


def _with_tma(configs: list[dict[str, Any]], itemsize: int, store_itemsize: int) -> list[dict[str, Any]]:
    """These configs reading through TMA descriptors, their stages refitted beside the TMA stores' tiles."""
    out = []
    for c in configs:
        fitted = _fit_stages(c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"], c["num_stages"], itemsize, store_itemsize)
        if fitted is not None:
            out.append(dict(c, USE_TMA=True, num_stages=fitted))
    return out


def _clipped_tiles(geometry: GemmGeometry, table: tuple[tuple[int, ...], ...], itemsize: int,
                   store_itemsize: int = 0) -> list[dict[str, Any]]:
    cap_m, cap_n, cap_k = (max(16, next_pow2(x)) for x in (geometry.m, geometry.n, geometry.k))
    out: list[dict[str, Any]] = []
    seen: set[tuple[int, int, int, int]] = set()
    for bm, bn, bk, gm, warps, stages in table:
        bm, bn, bk = min(bm, cap_m), min(bn, cap_n), min(bk, cap_k)
        fitted = _fit_stages(bm, bn, bk, stages, itemsize, store_itemsize)
        if fitted is None or (bm, bn, bk, fitted) in seen:
            continue
        if table is GEMM_TILES and any(s[:3] == (bm, bn, bk) for s in seen):
            continue
        seen.add((bm, bn, bk, fitted))
        out.append({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": gm,
                    "num_warps": warps if bm * bn >= 128 * 128 else 4, "num_stages": fitted})
    return out


def persistent_configs(geometry: GemmGeometry, tma: bool = False, *, sms: int = SMS, itemsize: int = 2,
                       warp_specialize: bool = False, store_itemsize: int = 0) -> list[dict[str, Any]]:
    """Persistent-kernel candidates (VARIANT "persistent"): only for problems with more tiles than
    programs (one wave gains nothing from persistence). NUM_PROGRAMS = SMs shared over the batch.
    With `tma` the candidates read through TMA descriptors (Hopper), with stages that leave room for
    the TMA stores' tiles (`store_itemsize`, see _fit_stages). `warp_specialize`: the loop is
    warp-specialized (Triton 3.6 supports it on Blackwell only; never asked for on Hopper)."""
    if small_problem(geometry, sms):
        return []
    out = []
    for c in _clipped_tiles(geometry, PERSISTENT_TILES, itemsize, store_itemsize if tma else 0):
        programs = max(1, sms // max(1, geometry.batch_numel))
        tiles = _cdiv(geometry.m, c["BLOCK_M"]) * _cdiv(geometry.n, c["BLOCK_N"])
        if tiles <= programs:
            continue
        c.update(VARIANT="persistent", NUM_PROGRAMS=programs, FLATTEN=True, WARP_SPECIALIZE=warp_specialize)
        if tma:
            c["USE_TMA"] = True
        out.append(c)
    out.sort(key=lambda c: tile_cost(geometry, c, sms))
    # (the kernel still takes FLATTEN=False, an unflattened tile loop: triton-lang/triton#9279 measured
    # flattening slower for some kernels, but as a candidate it never won here; see the counts above)
    return out[:PERSISTENT_CANDIDATES]


def streamk_configs(geometry: GemmGeometry, tma: bool = False, *, sms: int = SMS, itemsize: int = 2,
                    store_itemsize: int = 0) -> list[dict[str, Any]]:
    """Stream-K candidates (VARIANT "streamk"; matmul.py write_persistent): the best persistent
    configs with their partial last wave shared out by K. With T tiles over P programs, the last
    R = T % P tiles would run as a wave that leaves P - R SMs idle; stream-K instead gives each
    program a run of SK_ITERS of those tiles' K iterations. A tile cut into s runs costs s fp32
    partials that its last program reads back, about as long as s K iterations, so a run is at
    least sqrt(K iterations) long (the sum of the two is then smallest), else R x K iterations
    spread evenly. Only when the idle share (P - R) / (P x waves) is at least STREAMK_MIN_IDLE, and
    for one batch entry."""
    if geometry.batch:
        return []
    out = []
    for c in persistent_configs(geometry, tma, sms=sms, itemsize=itemsize, store_itemsize=store_itemsize):
        programs = int(c["NUM_PROGRAMS"])
        tiles = _cdiv(geometry.m, c["BLOCK_M"]) * _cdiv(geometry.n, c["BLOCK_N"])
        tail = tiles % programs
        if not tail or (programs - tail) / (programs * _cdiv(tiles, programs)) < STREAMK_MIN_IDLE:
            continue
        k_iters = _cdiv(geometry.k, c["BLOCK_K"])
        run = max(_cdiv(tail * k_iters, programs), math.isqrt(k_iters - 1) + 1)
        out.append(dict(c, VARIANT="streamk", SK_TILES=tail, SK_ITERS=run))
        if len(out) == STREAMK_CANDIDATES:
            break
    return out


def streamk_workspace(config: dict[str, Any]) -> int:
    """fp32 elements of a stream-K config's partials: one BLOCK_M x BLOCK_N slot per (program, tail
    tile) run, numbered program + tile (at most NUM_PROGRAMS + SK_TILES - 1 of them)."""
    return (int(config["NUM_PROGRAMS"]) + int(config["SK_TILES"])) * int(config["BLOCK_M"]) * int(config["BLOCK_N"])


def split_k_configs(geometry: GemmGeometry, *, sms: int = SMS, itemsize: int = 2) -> list[dict[str, Any]]:
    """Split-K candidates (VARIANT "splitk") for skinny problems (M <= SPLIT_K_MAX_M, K >=
    SPLIT_K_MIN_K): SPLITS chunks of K (each a multiple of BLOCK_K) so that tiles x splits is about
    SPLIT_K_TARGET_WAVES programs per SM; fp32 partials reduced in split order (deterministic)."""
    if geometry.m > SPLIT_K_MAX_M or geometry.k < SPLIT_K_MIN_K:
        return []
    bm = max(16, next_pow2(geometry.m))
    out: list[dict[str, Any]] = []
    for bn, bk, warps, stages in SPLIT_K_TILES:
        bn = min(bn, max(16, next_pow2(geometry.n)))
        fitted = _fit_stages(bm, bn, bk, stages, itemsize)
        if fitted is None:
            continue
        tiles = _cdiv(geometry.m, bm) * _cdiv(geometry.n, bn) * max(1, geometry.batch_numel)
        k_blocks = _cdiv(geometry.k, bk)
        splits = max(1, min(k_blocks, _cdiv(SPLIT_K_TARGET_WAVES * sms, tiles)))
        chunk = _cdiv(k_blocks, splits) * bk
        splits = _cdiv(geometry.k, chunk)
        if splits < 2:
            continue
        c = {"VARIANT": "splitk", "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 1, "SPLITS": splits,
             "CHUNK_K": chunk, "num_warps": warps, "num_stages": fitted}
        if c not in out:
            out.append(c)
    return out[:SPLIT_K_CANDIDATES]


def pingpong_configs(geometry: GemmGeometry, *, sms: int = SMS, itemsize: int = 2,
                     store_itemsize: int = 0, activation: bool = False) -> list[dict[str, Any]]:
    """The ping-pong kernel's configs (VARIANT "pingpong", one per PINGPONG_GROUPS), for 16-bit
    problems of one batch entry with at least PINGPONG_MIN_WAVES x `sms` tiles and K >= PINGPONG_MIN_K
    (PINGPONG_MIN_K_ACTIVATION with `activation`: the epilogue computes a transcendental function),
    A' read along K; stages lowered until its ring and its two consumers' store tiles
    (`store_itemsize`: bytes per element of the TMA-stored output, 0 if none) fit."""
    bm, bn, bk, _, stages = PINGPONG_TILE
    tiles = _cdiv(geometry.m, bm) * _cdiv(geometry.n, bn)
    min_k = PINGPONG_MIN_K_ACTIVATION if activation else PINGPONG_MIN_K
    if (geometry.batch or itemsize != 2 or tiles < PINGPONG_MIN_WAVES * sms or geometry.k < min_k
            or geometry.a_strides[1] != 1):
        return []
    while stages > 2 and stages * (bm + bn) * bk * itemsize + 2 * bm * bn * store_itemsize + TMA_STORE_SLACK \
            > SMEM_BYTES:
        stages -= 1
    return [{"VARIANT": "pingpong", "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group, "STAGES": stages,
             "NUM_PROGRAMS": min(sms, tiles), "num_warps": 4, "num_stages": stages} for group in PINGPONG_GROUPS]


def candidate_set(options: dict[str, Any]) -> str:
    """The build option gemm_candidates ("full" by default; "conv" for a 1x1 convolution's inner GEMM
    plan, backends/conv_gemm.INNER_OPTIONS), checked."""
    return _checked_set(options.get("gemm_candidates", "full"))


def _checked_set(name: Any) -> str:
    """`name` if it is one of GEMM_CANDIDATE_SETS, else InvalidValueError naming it."""
    if name not in GEMM_CANDIDATE_SETS:
        raise InvalidValueError(f"build option gemm_candidates={name!r}: use one of {', '.join(GEMM_CANDIDATE_SETS)}")
    return str(name)


def gemm_candidates(geometry: GemmGeometry, tma: bool = False, *, sms: int = SMS, itemsize: int = 2,
                    warp_specialize: bool = False, store_itemsize: int = 0,
                    streamk: bool = False, candidates: str = "full",
                    pingpong_store_itemsize: int | None = None,
                    pingpong_activation: bool = False) -> list[dict[str, Any]]:
    """Every generated-kernel candidate of a GEMM: tiled, then persistent, stream-K (with `streamk`),
    then split-K, then the ping-pong kernel (when `pingpong_store_itemsize` is given: the group has that
    variant and the GPU runs it; the bytes per element its TMA-stored output takes). `store_itemsize`:
    bytes per element of the outputs the TMA path stores through descriptors; `pingpong_activation`: the
    epilogue computes an activation (the ping-pong kernel is offered from a shorter K). `candidates`
    "conv" (a 1x1 convolution's inner GEMM): no tiled TMA config, CONV_PERSISTENT_CANDIDATES persistent ones and no
    ping-pong kernel (see GEMM_CANDIDATE_SETS)."""
    conv = _checked_set(candidates) == "conv"
    persistent = persistent_configs(geometry, tma, sms=sms, itemsize=itemsize, warp_specialize=warp_specialize,
                                    store_itemsize=store_itemsize)
    return (gemm_configs(geometry, tma and not conv, sms=sms, itemsize=itemsize, store_itemsize=store_itemsize)
            + (persistent[:CONV_PERSISTENT_CANDIDATES] if conv else persistent)
            + (streamk_configs(geometry, tma, sms=sms, itemsize=itemsize, store_itemsize=store_itemsize)
               if streamk else [])
            + split_k_configs(geometry, sms=sms, itemsize=itemsize)
            + (pingpong_configs(geometry, sms=sms, itemsize=itemsize, store_itemsize=pingpong_store_itemsize,
                                activation=pingpong_activation)
               if pingpong_store_itemsize is not None and not conv else []))


def gemv_covers(geometry: GemmGeometry) -> bool:
    """The GEMV kernel (matmul.py write_gemv) covers a problem of one batch entry (after folding),
    at most GEMV_MAX_M rows, whose B' is read along K (stride 1 there: nn.Linear's [N, K] weight).
    A weight stored [K, N] would need split-K to spread over the GPU; it stays with the GEMM
    kernels and cuBLAS."""
    return (not geometry.batch and 1 <= geometry.m <= GEMV_MAX_M and geometry.b_strides[0] == 1
            and geometry.n >= 1 and geometry.k >= 1)


def gemv_configs(geometry: GemmGeometry) -> list[dict[str, Any]]:
    """The GEMV's config (VARIANT "gemv"), by rule. One row of A': one weight row a program
    (BLOCK_N 1) in runs of up to 1024 elements (2 KiB of bf16 per load: many bytes in flight per
    thread); 8 warps when N is small (fewer programs, so more loads in flight each). With more rows
    of A', 8 weight rows a program, so A' is re-read from L2 once per 8 weight rows, not per row.
    From bench/gemv_gpu.py on an H200 (results/gemv_*.txt)."""
    if not gemv_covers(geometry):
        return []
    bk = min(1024, max(16, next_pow2(geometry.k)))
    bn = 1 if geometry.m == 1 else 8
    warps = 8 if geometry.n <= 2048 else 4
    if geometry.m > 1:
        bk = min(bk, 256)
    return [{"VARIANT": "gemv", "BLOCK_M": next_pow2(geometry.m), "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 1,
             "num_warps": warps, "num_stages": 1}]


def small_problem(geometry: GemmGeometry, sms: int = SMS) -> bool:
    """True when 128x128 output tiles would leave some SMs without work."""
    return _cdiv(geometry.m, 128) * _cdiv(geometry.n, 128) * max(1, geometry.batch_numel) < sms


def tile_cost(geometry: GemmGeometry, config: dict[str, Any], sms: int = SMS) -> float:
    """Relative time of a config: programs per SM (rounded up: the last wave counts whole) x the
    multiply-adds of one tile / the tile's efficiency. Efficiency grows with the tile's operand
    reuse BM*BN/(BM+BN) (FLOPs per byte loaded) up to that of a 128x128 tile."""
    bm, bn = int(config["BLOCK_M"]), int(config["BLOCK_N"])
    tiles = _cdiv(geometry.m, bm) * _cdiv(geometry.n, bn) * max(1, geometry.batch_numel)
    efficiency = min(1.0, (bm * bn / (bm + bn)) / 64.0)
    return _cdiv(tiles, sms) * bm * bn / efficiency


def gemm_launch_parameters(geometry: GemmGeometry, config: dict[str, Any]) -> tuple[
        tuple[int, ...], dict[str, Any], int, int]:
    """(grid, constexprs, num_warps, num_stages) of one config's main kernel. Split-K: the grid is
    (tiles, SPLITS, batch) of the partial-product kernel (its finish kernel: `split_k_finish_grid`)."""
    bm, bn, bk = int(config["BLOCK_M"]), int(config["BLOCK_N"]), int(config["BLOCK_K"])
    tiles = _cdiv(geometry.m, bm) * _cdiv(geometry.n, bn)
    batch = max(1, geometry.batch_numel)
    variant = config.get("VARIANT", "tiled")
    consts: dict[str, Any] = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": int(config["GROUP_M"])}
    if variant == "pingpong":
        consts["STAGES"] = int(config["STAGES"])
        return (min(int(config["NUM_PROGRAMS"]), tiles),), consts, 4, int(config["STAGES"])
    consts.update(EVEN_K=geometry.k % bk == 0, USE_TMA=bool(config.get("USE_TMA", False)))
    if variant in ("persistent", "streamk"):
        programs = min(int(config["NUM_PROGRAMS"]), tiles)
        consts.update(NUM_PROGRAMS=programs, FLATTEN=bool(config.get("FLATTEN", True)),
                      WARP_SPECIALIZE=bool(config.get("WARP_SPECIALIZE", False)))
        if variant == "streamk":
            consts.update(SK_TILES=int(config["SK_TILES"]), SK_ITERS=int(config["SK_ITERS"]))
        grid: tuple[int, ...] = (programs, batch)
    elif variant == "gemv":
        for name in ("USE_TMA", "GROUP_M"):
            consts.pop(name)
        grid = (_cdiv(geometry.n, bn),)
    elif variant == "splitk":
        consts.pop("USE_TMA")
        consts.update(CHUNK_K=int(config["CHUNK_K"]))
        grid = (tiles, int(config["SPLITS"]), batch)
    else:
        grid = (tiles, batch)
    return grid, consts, int(config.get("num_warps", 4)), int(config.get("num_stages", 3))


def split_k_finish_grid(geometry: GemmGeometry, config: dict[str, Any]) -> tuple[tuple[int, ...], dict[str, Any]]:
    """(grid, constexprs) of the split-K reduction + epilogue kernel."""
    bm, bn = int(config["BLOCK_M"]), int(config["BLOCK_N"])
    tiles = _cdiv(geometry.m, bm) * _cdiv(geometry.n, bn)
    return (tiles, max(1, geometry.batch_numel)), {"BLOCK_M": bm, "BLOCK_N": bn, "GROUP_M": int(config["GROUP_M"]),
                                                    "SPLITS": int(config["SPLITS"])}
