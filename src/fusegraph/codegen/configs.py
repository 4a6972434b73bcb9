"""Launch configurations of generated kernels, as data, best guess first (the cost model's pick:
whole rows in registers when they fit, enough elements per thread for 16-byte loads)."""

from __future__ import annotations

from typing import Any

from .triton_gen import GeneratedKernel

MAX_ROW_BLOCK = 16384      # widest row held whole in registers; wider rows loop over chunks
LOOP_BLOCK = 4096          # chunk width of the looped path
COLUMN_BLOCK = 64          # tile side of column reductions


def next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def candidate_configs(gen: GeneratedKernel, options: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    options = options or {}
    if gen.meta.get("combo"):   # a combo kernel's source is written for one BLOCK (codegen/combo.py)
        return [dict(gen.meta["config"])]
    if gen.kind == "pointwise":
        cap = max(next_pow2(gen.extent), 16)
        out = [pointwise_heuristic(gen.extent)]
        # timed beside the heuristic pick: of 12 timed pointwise kernels in ResNet-50's and GPT-2's cold
        # compiles, 1024/4, 2048/4 and 2048/8 won every one; 4096/8 and 512/4 never did (bench/results/
        # choices_resnet50_20261202_0155.txt, choices_gpt2_train_20261202_0155.txt), so they cost compiles only
        for block, warps in ((1024, 4), (2048, 8), (2048, 4)):
            cfg = {"BLOCK": min(block, cap), "num_warps": warps if block <= cap else 4}
            if cfg not in out:
                out.append(cfg)
        if gen.meta.get("row_tiled"):   # the bodies (triton_gen._write_both): row-tiled first, segmented, flat
            cols = gen.meta["row_tiled"][1]
            tiled: list[dict[str, Any]] = [{"BLOCK": b, "num_warps": w, "ROW_TILED": True}
                                           for b, w in ((4096, 8), (2048, 8), (2048, 4), (1024, 4))
                                           if b <= next_pow2(cols)]
            segmented: list[dict[str, Any]] = [{"BLOCK": b, "num_warps": w, "ROW_TILED": 2}
                                               for b, w in ((4096, 8), (2048, 8), (1024, 4))
                                               if gen.meta.get("segmented") and b <= cols]
            return tiled + segmented + [dict(cfg, ROW_TILED=False) for cfg in out]
        return out
    max_block = int(options.get("max_row_block", MAX_ROW_BLOCK))
    rows, cols = gen.extent, gen.reduced_extent
    if gen.meta.get("row_column"):
        return _row_column_configs(gen.meta["rows"], gen.meta["cols"], gen.extent)
    if gen.finish_name and gen.meta.get("full_stores"):
        # it also stores every element it reads (an activation's gradient beside its column sums):
        # a pointwise kernel's worth of traffic and math, so as many programs as one, each a few tiles
        # deep, and timed (heuristic_config_ok): GPT-2's gelu backward + bias gradient ran at half
        # the bandwidth of the pointwise kernel alone in its first, untimed config
        return [_split_config(rows, cols, kept, red, warps, steps=steps, stages=stages)
                for kept, red, warps, steps, stages in SPLIT_STORE_TILES]
    if gen.finish_name:
        return [_split_config(rows, cols, kept, red, warps, stages=stages) for kept, red, warps, stages in SPLIT_TILES]
    if gen.column:
        side = min(COLUMN_BLOCK, max_block)
        kept = min(next_pow2(rows), side)
        red = min(next_pow2(cols), side)
        wide = min(next_pow2(cols), 2 * side)
        return [{"ROWS": kept, "BLOCK_C": red, "num_warps": 4}, {"ROWS": kept, "BLOCK_C": wide, "num_warps": 8},
                {"ROWS": kept, "BLOCK_C": red, "num_warps": 4, "STAGES": 3},
                {"ROWS": kept, "BLOCK_C": wide, "num_warps": 8, "STAGES": 3}]
    whole = next_pow2(cols)
    if whole <= max_block:
        rows_per_program = max(1, min(next_pow2(rows), 2048 // whole, 64))
        warps = max(1, min(16, whole * rows_per_program // 512))
        out = [{"ROWS": rows_per_program, "BLOCK_C": whole, "num_warps": warps}]
        for w in (warps // 2, warps * 2):
            if 1 <= w <= 16:
                out.append({"ROWS": rows_per_program, "BLOCK_C": whole, "num_warps": w})
        if rows_per_program > 1:
            out.append({"ROWS": max(1, rows_per_program // 2), "BLOCK_C": whole, "num_warps": max(1, warps // 2)})
        # more rows per program: more loads in flight per SM (a program's loads all issue before
        # its first reduction, then it waits on them)
        for more, w in ((2, min(16, warps * 2)), (2, warps), (4, 16)):
            cfg = {"ROWS": rows_per_program * more, "BLOCK_C": whole, "num_warps": w}
            if rows_per_program * more <= min(next_pow2(rows), 64) and whole * more <= MAX_ROW_BLOCK \
                    and cfg not in out:
                out.append(cfg)
        return out
    chunk = min(LOOP_BLOCK, next_pow2(max_block) if next_pow2(max_block) <= max_block else next_pow2(max_block) // 2)
    # the loop over a row's chunks is not pipelined (STAGES 1): a vocabulary-wide log-sum-exp timed the
    # same with STAGES 2 or 3 (bench/results/split_column_20261202_0405.txt), so no compiles are spent on it
    out = [{"ROWS": 1, "BLOCK_C": chunk, "num_warps": 8}, {"ROWS": 1, "BLOCK_C": chunk // 2 or 1, "num_warps": 4}]
    if gen.meta.get("prefetch"):   # the next chunk's loads in flight during this one's math (triton_gen._looped)
        out += [dict(c, PREFETCH=True) for c in out]
    return out


def heuristic_config_ok(gen: GeneratedKernel) -> bool:
    """May tune "fast" give this kernel its first config untimed when its floor is small? Not a split
    column reduction that also stores its elements, nor a row + column pass: their tile shapes decide
    their speed (a row kernel carrying column partials holds more per program than the heuristic
    row kernel it was sized for)."""
    return not ((gen.finish_name and gen.meta.get("full_stores")) or gen.meta.get("row_column"))


# Tiles of a split column reduction that also stores its elements: (kept, reduced, warps, tiles a
# program, pipeline stages of its loop). Few rows a tile, a few tiles a program, the loop pipelined:
# GPT-2's GELU backward + bias gradient ([8192, 3072] bf16) took 0.062 ms in (64, 8, 2, 8, 3)
# (bench/results/split_column_20261202_0349.txt), 0.078 in the best tile of the unpipelined list before
# (split_column_20261202_0345.txt).
SPLIT_STORE_TILES = ((64, 8, 2, 8, 3), (64, 16, 4, 4, 3), (32, 32, 4, 2, 1), (64, 32, 4, 1, 1), (64, 16, 4, 4, 2),
                     (32, 32, 2, 4, 3))
# Tiles of a split column reduction (partials only): (kept, reduced, warps, pipeline stages). Pipelined,
# a column sum of [8192, 3072] bf16 took 0.023 ms against 0.039 (same file).
SPLIT_TILES = ((64, 64, 4, 3), (64, 64, 8, 3), (64, 32, 4, 3), (32, 128, 4, 3))
TARGET_PROGRAMS = 528   # ~4 per SM on an H100/H200: enough to hide memory latency
MAX_SPLITS = 256        # partials per column of a split reduction (the finish kernel reads them in one tile)


def pointwise_heuristic(extent: int) -> dict[str, Any]:
    """The untimed pick for a pointwise kernel of `extent` elements: BLOCK 1024 and 4 warps (Inductor's
    default too), narrower blocks while that would launch fewer than TARGET_PROGRAMS programs. On the
    H200 a 4096x4096 bf16 epilogue ran 4096/8 in 28.6 us, 2048/4 28.8, 1024/4 29.3
    (bench/results/compile_time_20261130_1610.txt), but GPT-2's tanh-GELU backward, [8192, 3072] bf16,
    ran 1024/4 in 0.0408 ms and 4096/8 in 0.0440 (split_column_20261202_0354.txt): a kernel with more
    math a element keeps more of its loads in flight in narrow programs."""
    block = 1024
    while block > 512 and _cdiv(extent, block) < TARGET_PROGRAMS:
        block //= 2
    block = min(block, max(next_pow2(extent), 16))
    return {"BLOCK": block, "num_warps": 4}


def _split_config(rows: int, cols: int, kept: int, red: int, warps: int, steps: int = 0,
                  stages: int = 1) -> dict[str, Any]:
    """A split column reduction: kept x red tiles, CHUNK reduced elements (`steps` tiles when given,
    else enough splits for TARGET_PROGRAMS programs) per program, its loop pipelined over `stages`."""
    kept = min(next_pow2(rows), kept)
    blocks = _cdiv(rows, kept)
    if steps:
        splits = max(1, min(_cdiv(cols, red * steps), MAX_SPLITS))
    else:
        splits = max(1, min(_cdiv(TARGET_PROGRAMS, blocks), _cdiv(cols, red)))
    chunk = _cdiv(_cdiv(cols, splits), red) * red
    splits = _cdiv(cols, chunk)
    return {"ROWS": kept, "BLOCK_C": red, "CHUNK": chunk, "SPLITS": splits, "SPLITS_P2": next_pow2(splits),
            "STAGES": stages if chunk > red else 1, "num_warps": warps}


def _row_column_configs(rows: int, cols: int, extent: int | None = None) -> list[dict[str, Any]]:
    """Row + column pass. Each program walks its RPP rows one ROWS-row tile at a time, so the rows
    in flight per SM are (programs resident per SM) x ROWS, plus the next tile when STAGES > 1
    (Triton's pipeliner copies it with cp.async while this one computes). At 4096 columns a
    program needs ~128 registers a thread at 8 warps (two resident per SM), so RPP is chosen for
    one balanced wave of ~2 programs per SM; 16 warps with the prefetch fit one per SM. `extent`:
    the column results (= cols; 1 for a full reduction over the rows), FROWS of them a finish program
    (32: 128 finish programs for 4096 columns, each reading 128-byte segments of the partials)."""
    extent = cols if extent is None else extent
    whole = next_pow2(cols)
    step = max(1, min(next_pow2(rows), 2048 // whole, 64))
    warps = max(1, min(16, whole * step // 512))
    wide = min(16, warps * 2)
    half, quarter = TARGET_PROGRAMS // 2, TARGET_PROGRAMS // 4
    if extent == 1:
        # one partial a program (a mean over rows): light kernels (cross-entropy: ~32-48 registers,
        # 6-16 programs an SM) and partials of one number, so many short programs: the last wave
        # stays short; given as rows per program
        plan = [(rows // 8, step, warps, 2), (rows // 16, step, max(1, warps // 2), 2), (rows // 4, step, warps, 1),
                (rows // 8, step, wide, 2), (rows // 32, step, warps, 2), (rows // 8, 2 * step, warps, 2),
                (rows // 4, step, max(1, warps // 2), 1)]
    else:
        plan = [(half, step, warps, 2), (half, step, warps, 3), (half, step, wide, 1), (half, step, warps, 1),
                (quarter, step, wide, 2), (quarter, 2 * step, wide, 1), (TARGET_PROGRAMS, step, warps, 2),
                (half, step, max(1, warps // 2), 2)]   # fewest instructions a row, 8 warps an SM
    out: list[dict[str, Any]] = []
    for programs, tile_rows, w, stages in plan:
        programs = max(1, programs)
        tile_rows = min(tile_rows, next_pow2(rows))
        per_program = max(tile_rows, next_pow2(_cdiv(rows, programs)))
        splits = _cdiv(rows, per_program)
        cfg = {"ROWS": tile_rows, "BLOCK_C": whole, "RPP": per_program, "SPLITS": splits,
               "SPLITS_P2": next_pow2(splits), "FROWS": min(next_pow2(extent), 32), "STAGES": stages, "num_warps": w}
        if cfg not in out:
            out.append(cfg)
    return out


def launch_parameters(gen: GeneratedKernel,
                      config: dict[str, Any]) -> tuple[list[tuple[int, ...]], dict[str, Any], int]:
    """(grid of each launch, constexprs in signature order, num_warps) for one config."""
    warps = int(config.get("num_warps", 4))
    if gen.meta.get("combo"):   # programs handed out member after member (codegen/combo.py)
        return [(int(gen.meta["combo"]),)], {"BLOCK": int(config["BLOCK"])}, warps
    if gen.kind == "pointwise":
        block = int(config["BLOCK"])
        if gen.meta.get("row_tiled"):
            rows, cols = gen.meta["row_tiled"]
            if config.get("ROW_TILED") == 2:   # segmented: flat blocks
                return [(max(1, _cdiv(gen.extent, block)),)], {"BLOCK": block, "ROW_TILED": 2}, warps
            if bool(config.get("ROW_TILED", True)):
                return [(rows * _cdiv(cols, block),)], {"BLOCK": block, "ROW_TILED": True}, warps
            return [(max(1, _cdiv(gen.extent, block)),)], {"BLOCK": block, "ROW_TILED": False}, warps
        return [(max(1, _cdiv(gen.extent, block)),)], {"BLOCK": block}, warps
    if gen.meta.get("row_column"):
        consts = {k: int(config[k]) for k in ("ROWS", "BLOCK_C", "RPP", "SPLITS", "SPLITS_P2", "FROWS")}
        consts["STAGES"] = int(config.get("STAGES", 1))
        return [(consts["SPLITS"],), (_cdiv(gen.extent, consts["FROWS"]),)], consts, warps
    rows, block_c = int(config["ROWS"]), int(config["BLOCK_C"])
    blocks = max(1, _cdiv(gen.extent, rows))
    if gen.finish_name:
        consts = {k: int(config[k]) for k in ("ROWS", "BLOCK_C", "CHUNK", "SPLITS", "SPLITS_P2")}
        consts["STAGES"] = int(config.get("STAGES", 1))
        return [(blocks, int(config["SPLITS"])), (blocks,)], consts, warps
    consts = {"ROWS": rows, "BLOCK_C": block_c, "SINGLE": block_c >= gen.reduced_extent,
              "STAGES": int(config.get("STAGES", 1)), "PREFETCH": bool(config.get("PREFETCH", False))}
    return [(blocks,)], consts, warps
