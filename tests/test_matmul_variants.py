"""GEMM variants: the persistent kernel (one program per SM looping over tiles, pointer and TMA
paths) and split-K for skinny problems (partials reduced in a fixed order by a second kernel, the
epilogue after the reduction), under the interpreter against the reference; which candidates the
autotuner is offered by shape; every variant keeps the group's cost (bytes, FLOPs)."""

from __future__ import annotations

import pytest
import torch

import fusegraph as fg
from conftest import assert_close
from fusegraph.backends.matmul_kernel import GemmLaunch, matmul_group_cost
from fusegraph.codegen.compile import load_triton_function
from fusegraph.codegen.matmul import (
    GemmGeometry,
    gemm_candidates,
    gemm_launch_parameters,
    generate_gemm,
    persistent_configs,
    split_k_configs,
    streamk_configs,
)
from fusegraph.fusion.epilogue import MatmulGroup, claim_epilogues
from fusegraph.fusion.partition import partition_graph
from fusegraph.settings import override


def _mlp_graph(m: int, n: int, k: int, batch: tuple[int, ...] = (), dtype: str = "float16"):
    g = fg.Graph(name=f"mlp_{m}_{n}_{k}_{len(batch)}", compute_dtype="float32")
    x = g.tensor((*batch, m, k), dtype=dtype, name="x")
    w = g.tensor((k, n), dtype=dtype, name="w")
    b = g.tensor((n,), dtype=dtype, name="b")
    y = g.gelu(g.add(g.matmul(x, w), b), approximate="tanh")
    y.set_output()
    td = getattr(torch, dtype)
    feeds = {x: torch.randn(*batch, m, k, dtype=td), w: (torch.randn(k, n) / k ** 0.5).to(td),
             b: torch.randn(n, dtype=td)}
    return g, y, feeds


def _group(g: fg.Graph) -> MatmulGroup:
    plan = g.build(device="cpu")
    (group,) = claim_epilogues(partition_graph(plan.graph).items, plan.graph)
    assert isinstance(group, MatmulGroup)
    return group


def _launch(g: fg.Graph, feeds: dict, config: dict, name: str) -> torch.Tensor:
    gen = generate_gemm(_group(g), name)
    by_name = {h.name: t for h, t in feeds.items()}
    launch = GemmLaunch(load_triton_function(gen.source, gen.name), gen, config, "cpu")
    (got,) = launch([by_name[n.name] for n in gen.inputs])
    return got


def _geometry(m: int, n: int, k: int, batch: tuple[int, ...] = ()) -> GemmGeometry:
    return GemmGeometry(batch, m, n, k, (k, 1), (n, 1), tuple(m * k for _ in batch), tuple(0 for _ in batch))


# ---- persistent ---------------------------------------------------------------------------------

@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_persistent_gemm_with_epilogue_matches_reference(tma: bool, dtype: str) -> None:
    g, y, feeds = _mlp_graph(40, 72, 48, batch=(2,), dtype=dtype)
    # 3 x 5 tiles of 16x16 a batch entry over 4 programs: each loops over 3-4 tiles, edges in M and N
    config = {"VARIANT": "persistent", "BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32, "GROUP_M": 2,
              "NUM_PROGRAMS": 4, "FLATTEN": True, "USE_TMA": tma, "num_warps": 4, "num_stages": 3}
    got = _launch(g, feeds, config, f"persistent_{int(tma)}_{dtype}")
    assert_close(got, fg.reference(g).execute(feeds)[y], what=f"persistent tma={tma} {dtype}")


def _variant_source(variant: str, name: str) -> str:
    """The `variant` kernel's source of a 40x64x48 GEMM + bias + gelu, checked to be named name_variant."""
    g, _, _ = _mlp_graph(40, 64, 48)
    with override(gemm_streamk=True):
        names, source = generate_gemm(_group(g), name).variants[variant]
    assert names == (f"{name}_{variant}",)
    return source


def test_persistent_source_loops_over_tiles_with_the_epilogue_inside() -> None:
    source = _variant_source("persistent", "persistent_source")
    assert "tl.range(start, num_tiles, NUM_PROGRAMS, flatten=FLATTEN, warp_specialize=WARP_SPECIALIZE)" in source
    loops = source.split("for tile in tl.range")[1:]
    assert len(loops) == 2                                              # TMA and pointer paths
    for loop in loops:                                                  # gelu and the only store, per tile
        assert "tl.dot" in loop and "tl.sigmoid" in loop and loop.count("tl.store(") + loop.count("_desc.store(") == 1
    assert "out0_desc.store(" in loops[0]                                # the TMA path stores through TMA too


def test_persistent_epilogue_over_an_odd_n_has_a_masked_body_for_flatten() -> None:
    """N = 72 is not a multiple of 16: on the pointer path the epilogue is written for FLATTEN (masked:
    Triton cannot flatten a loop holding a branch), for tiles inside the output (constant masks) and for
    edge tiles; the TMA path stores through a descriptor (no masks) in one body."""
    g, _, _ = _mlp_graph(40, 72, 48)
    source = generate_gemm(_group(g), "odd_n").variants["persistent"][1]
    tma, pointers = source.split("for tile in tl.range")[1:]
    assert tma.count("out0_desc.store(") == 1 and "tl.store(" not in tma and "if FLATTEN:" not in tma
    assert pointers.count("tl.store(") == 3 and pointers.count("tl.sigmoid") == 3
    assert "if FLATTEN:" in pointers and "elif (pid_n_c * BLOCK_N + BLOCK_N <= N) & (pid_m_c * BLOCK_M" in pointers


def test_persistent_launch_grid_is_capped_at_the_programs() -> None:
    geo = _geometry(8192, 16384, 4096)
    (config, *_) = persistent_configs(geo, tma=True, sms=132)
    grid, consts, warps, _ = gemm_launch_parameters(geo, config)
    assert warps == config["num_warps"]
    assert grid == (132, 1) and consts["NUM_PROGRAMS"] == 132 and consts["USE_TMA"] and consts["FLATTEN"]
    assert [c["FLATTEN"] for c in persistent_configs(geo, sms=132)] == [True, True]
    assert not consts["WARP_SPECIALIZE"]                          # Hopper: Triton 3.6 has no warp specialization


# ---- stream-K -----------------------------------------------------------------------------------

@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_streamk_gemm_with_epilogue_matches_reference(tma: bool, dtype: str) -> None:
    """3 x 5 tiles of 16x16 over 4 programs: 12 tiles persistent, the last 3 stream-K. K = 200 is 7
    blocks of 32 (the last ragged); runs of 6 iterations cut the 21 tail iterations into 4 runs that
    cross tiles (program 1 ends tile 0 and starts tile 1), so every tail tile sums 2 partials."""
    g, y, feeds = _mlp_graph(40, 72, 200, dtype=dtype)
    config = {"VARIANT": "streamk", "BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32, "GROUP_M": 2, "NUM_PROGRAMS": 4,
              "FLATTEN": True, "USE_TMA": tma, "SK_TILES": 3, "SK_ITERS": 6, "num_warps": 4, "num_stages": 3}
    with override(gemm_streamk=True):
        gen = generate_gemm(_group(g), f"streamk_{int(tma)}_{dtype}")
    by_name = {h.name: t for h, t in feeds.items()}
    launch = GemmLaunch(load_triton_function(gen.source, gen.name), gen, config, "cpu")
    args = [by_name[n.name] for n in gen.inputs]
    (got,) = launch(args)
    assert_close(got, fg.reference(g).execute(feeds)[y], what=f"stream-K tma={tma} {dtype}")
    assert launch.sk_count is not None and not launch.sk_count.any()     # counters reset for the next launch
    (again,) = launch(args)
    assert torch.equal(got, again)                                        # partials summed in program order


def test_streamk_source_shares_the_tail_tiles_by_k() -> None:
    source = _variant_source("streamk", "streamk_source")
    assert "ws, sk_count, BLOCK_M: tl.constexpr" in source
    assert "SK_TILES: tl.constexpr, SK_ITERS: tl.constexpr" in source
    assert source.count("while it < it_end:") == 2                       # TMA and pointer paths
    tail = source.split("while it < it_end:")[1]
    assert "tl.atomic_add(sk_count + t, 1" in tail and "tl.atomic_xchg(sk_count + t, 0)" in tail
    assert "tl.sigmoid" in tail                                            # the epilogue runs once per tail tile
    bmm = fg.Graph(name="bmm_streamk", compute_dtype="float32")       # a batched B: no folding into M
    bmm.matmul(bmm.tensor((2, 40, 48), dtype="float16", name="x"),
               bmm.tensor((2, 48, 64), dtype="float16", name="w")).set_output()
    with override(gemm_streamk=True):
        assert "streamk" not in generate_gemm(_group(bmm), "batched").variants
    g, _, _ = _mlp_graph(40, 64, 48)
    assert "streamk" not in generate_gemm(_group(g), "streamk_off").variants   # off: not even generated


def test_streamk_candidates_only_where_the_last_wave_idles() -> None:
    # gelu_mlp: 4096 tiles of 128x256 over 132 SMs leave 4 for a 32nd wave; 1024 leave 100 for the 8th
    (up,) = streamk_configs(_geometry(8192, 16384, 4096), tma=True, sms=132)
    assert (up["BLOCK_M"], up["BLOCK_N"], up["SK_TILES"], up["NUM_PROGRAMS"]) == (128, 256, 4, 132)
    assert up["SK_ITERS"] == 8                                             # sqrt(64 K iterations): 8 partials a tile
    (down,) = streamk_configs(_geometry(8192, 4096, 16384), tma=True, sms=132)
    assert (down["SK_TILES"], down["SK_ITERS"]) == (100, 194)              # 100 x 256 iterations over 132
    grid, consts, _, _ = gemm_launch_parameters(_geometry(8192, 4096, 16384), down)
    assert grid == (132, 1) and consts["SK_TILES"] == 100 and consts["SK_ITERS"] == 194
    assert streamk_configs(_geometry(132 * 128, 256, 4096), sms=132) == []  # whole waves: nothing idles
    assert streamk_configs(_geometry(8192, 16384, 4096, batch=(2,)), sms=132) == []
    assert "streamk" in _variants(gemm_candidates(_geometry(8192, 4096, 16384), tma=True, streamk=True))
    assert "streamk" not in _variants(gemm_candidates(_geometry(8192, 4096, 16384), tma=True))   # off by default


# ---- split-K ------------------------------------------------------------------------------------

@pytest.mark.parametrize("m", [1, 4, 16])
def test_split_k_decode_shapes_match_reference(m: int) -> None:
    g, y, feeds = _mlp_graph(m, 48, 1024)
    plan = g.build(device="cpu", gemm_variant="splitk")
    (kernel,) = plan.kernels
    assert kernel.config["VARIANT"] == "splitk" and kernel.config["SPLITS"] >= 2
    assert kernel.ops == ["matmul", "add", "gelu"]
    assert "_splitk_finish" in kernel.source and "for s in range(SPLITS)" in kernel.source
    got = plan.execute(feeds)[y]
    assert_close(got, fg.reference(g).execute(feeds)[y], what=f"split-K M={m}")
    assert torch.equal(got, plan.execute(feeds)[y])               # fixed reduction order: the same bits


def test_split_k_batched_with_uneven_k_matches_reference() -> None:
    g, y, feeds = _mlp_graph(3, 40, 600, batch=(2,))              # K = 600: the last chunk is ragged
    config = {"VARIANT": "splitk", "BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "GROUP_M": 1, "SPLITS": 5,
              "CHUNK_K": 128, "num_warps": 4, "num_stages": 3}
    got = _launch(g, feeds, config, "splitk_batched")
    assert_close(got, fg.reference(g).execute(feeds)[y], what="batched split-K")


def test_split_k_splits_cover_k_in_whole_blocks() -> None:
    for m, n, k in ((1, 4096, 4096), (8, 11008, 4096), (32, 14336, 4096), (16, 48, 1024)):
        configs = split_k_configs(_geometry(m, n, k))
        assert configs, (m, n, k)
        for c in configs:
            assert c["CHUNK_K"] % c["BLOCK_K"] == 0 and c["SPLITS"] >= 2
            assert (c["SPLITS"] - 1) * c["CHUNK_K"] < k <= c["SPLITS"] * c["CHUNK_K"]
            assert c["BLOCK_M"] == max(16, 1 << (m - 1).bit_length())


# ---- candidates offered to the autotuner ----------------------------------------------------------

def _variants(configs: list[dict]) -> list[str]:
    return [c.get("VARIANT", "tiled") for c in configs]


def test_candidates_by_shape() -> None:
    big = gemm_candidates(_geometry(8192, 16384, 4096), tma=True)        # gelu_mlp's first GEMM
    assert "persistent" in _variants(big) and "splitk" not in _variants(big)
    persistent = [c for c in big if c.get("VARIANT") == "persistent"]
    assert any((c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"], c["num_warps"]) == (128, 256, 64, 8) for c in persistent)
    assert all(c["USE_TMA"] for c in persistent)
    decode = gemm_candidates(_geometry(1, 4096, 4096), tma=True)
    assert "splitk" in _variants(decode) and "persistent" not in _variants(decode)
    assert _variants(decode)[0] == "tiled"                               # the untimed default stays the tiled one
    small = gemm_candidates(_geometry(256, 256, 256))                    # fits one wave, K short: neither
    assert set(_variants(small)) == {"tiled"}
    assert split_k_configs(_geometry(128, 4096, 4096)) == []             # M > 64: no split-K


def test_tiled_candidates_keep_the_large_bf16_tiles() -> None:
    tiles = {(c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"], c["num_warps"], c["num_stages"])
             for c in gemm_candidates(_geometry(8192, 8192, 8192), tma=True)}
    assert (128, 256, 64, 8, 3) in tiles and (128, 128, 64, 4, 4) in tiles and (256, 128, 64, 8, 3) in tiles


def test_every_variant_reports_the_group_cost() -> None:
    g, _, _ = _mlp_graph(4, 48, 1024)
    for variant in ("tiled", "splitk"):
        plan = g.build(device="cpu", gemm_variant=variant)
        (kernel,) = plan.kernels
        group = _group(g)
        cost = matmul_group_cost(group)
        assert (kernel.cost.bytes, kernel.cost.flops) == (cost.bytes, cost.flops)
        assert kernel.cost.flops >= 2 * 4 * 48 * 1024
        assert kernel.cost.bytes == (4 * 1024 + 1024 * 48 + 48 + 4 * 48) * 2


# ---- batch folded into M (shared weight) --------------------------------------------------------------

@pytest.mark.parametrize("variant", ["tiled", "splitk"])
def test_decode_batch_folds_into_m_with_batched_epilogue_operands(variant: str) -> None:
    """x[8, 1, K] @ W^T + residual[8, 1, N], * a per-entry scale [8, 1, 1]: one [8, K] @ W^T tile grid."""
    g = fg.Graph(name=f"fold_{variant}", compute_dtype="float32")
    x = g.tensor((8, 1, 1024), dtype="float16", name="x")
    w = g.tensor((40, 1024), dtype="float16", name="w")
    r = g.tensor((8, 1, 40), dtype="float16", name="r")
    s = g.tensor((8, 1, 1), dtype="float16", name="s")
    y = g.add(g.mul(g.matmul(x, w, transpose_b=True), s), r)
    y.set_output()
    feeds = {x: torch.randn(8, 1, 1024, dtype=torch.float16), w: (torch.randn(40, 1024) / 32).half(),
             r: torch.randn(8, 1, 40, dtype=torch.float16), s: torch.randn(8, 1, 1, dtype=torch.float16)}
    plan = g.build(device="cpu", gemm_variant=variant)
    (kernel,) = plan.kernels
    assert kernel.config.get("VARIANT", "tiled") == variant
    assert "M, N, K = 8, 40, 1024" in kernel.source and "program_id(2)" not in kernel.source
    assert_close(plan.execute(feeds)[y], fg.reference(g).execute(feeds)[y], what=f"folded decode {variant}")


def test_prefill_batch_folds_and_rows_cross_tiles() -> None:
    g, y, feeds = _mlp_graph(20, 24, 32, batch=(3,))     # rows 0..59: 16-row tiles straddle batch entries
    gen = generate_gemm(_group(g), "fold_prefill")
    assert (gen.geometry.batch, gen.geometry.m, gen.geometry.folded, gen.geometry.rows) == ((), 60, (3,), 20)
    config = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 2, "num_warps": 4, "num_stages": 2}
    assert_close(_launch(g, feeds, config, "fold_prefill"), fg.reference(g).execute(feeds)[y], what="folded prefill")


def test_no_fold_when_the_weight_has_batch_dims_or_a_is_transposed() -> None:
    from fusegraph.codegen.matmul import fold_batch

    per_batch_weight = GemmGeometry((3,), 20, 24, 32, (32, 1), (24, 1), (640,), (768,))
    assert fold_batch(per_batch_weight) is per_batch_weight
    transposed_a = GemmGeometry((3,), 20, 24, 32, (1, 20), (24, 1), (640,), (0,))   # A [3, K, M]
    assert fold_batch(transposed_a) is transposed_a
    padded_rows = GemmGeometry((3,), 20, 24, 32, (32, 1), (24, 1), (700,), (0,))   # gaps between entries
    assert fold_batch(padded_rows) is padded_rows


def test_tma_allocator_is_set_per_launching_thread() -> None:
    """Triton's allocator lives in a ContextVar: one set in a worker thread (where a warm build first
    constructs a GEMM launch) is not the launching thread's. _set_tma_allocator sets it per thread."""
    import threading

    from triton.runtime import _allocation

    from fusegraph.backends import matmul_kernel

    def in_worker() -> None:
        matmul_kernel._set_tma_allocator()
        seen.append(_allocation._allocator.get())

    seen: list[object] = []
    worker = threading.Thread(target=in_worker)
    worker.start()
    worker.join()
    assert seen == [matmul_kernel._tma_scratch]
    token = _allocation._allocator.set(_allocation._NULL_ALLOCATOR)   # this thread: none yet
    try:
        matmul_kernel._set_tma_allocator()
        assert _allocation._allocator.get() is matmul_kernel._tma_scratch
    finally:
        _allocation._allocator.reset(token)
