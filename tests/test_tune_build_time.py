"""Build-time rules of tuning: GEMM candidate pruning by shape class, the launch-bound shortcut,
tuning time recorded per kernel, the parallel precompile path, and the short timing budget."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

import fusegraph as fg
from fusegraph.codegen.matmul import GemmGeometry, gemm_configs, small_problem, tile_cost
from fusegraph.settings import override
from fusegraph.tune import Config, clear_memo, keys, timing, tune
from fusegraph.tune.autotuner import floor_ms_of, launch_bound
from fusegraph.tune.precompile import compile_in_parallel

GPU = {"name": "Fake GPU H200", "capability": "9.0"}
CANDIDATES = [Config.of(BLOCK=1), Config.of(BLOCK=2), Config.of(BLOCK=3)]


@pytest.fixture
def gpu(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(keys, "gpu_identity", lambda: dict(GPU))
    clear_memo()
    with override(cache_dir=str(tmp_path), autotune=True):
        yield
    clear_memo()


def geometry(m: int, n: int, k: int, batch: tuple[int, ...] = ()) -> GemmGeometry:
    return GemmGeometry(batch, m, n, k, (k, 1), (n, 1), (0,) * len(batch), (0,) * len(batch))


def tiles(configs: list[dict]) -> list[tuple[int, int, int, bool]]:
    return [(c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"], bool(c.get("USE_TMA"))) for c in configs]


# ---- pruning --------------------------------------------------------------------------------

@pytest.mark.parametrize("shape, small", [((512, 1024, 1024, ()), True), ((16, 64, 64, ()), True),
                                          ((1024, 1024, 1024, (4,)), False), ((8192, 16384, 4096, ()), False)])
def test_candidate_counts_by_shape_class(shape, small):
    m, n, k, batch = shape
    geo = geometry(m, n, k, batch)
    assert small_problem(geo) is small
    plain, with_tma = gemm_configs(geo), gemm_configs(geo, tma=True)
    if small:  # at most 4 candidates with cuBLAS
        assert len(plain) <= 3 and len(with_tma) <= 3 and sum(c.get("USE_TMA", False) for c in with_tma) <= 1
    else:
        assert len(plain) == 3 and len(with_tma) == 4 and sum(c.get("USE_TMA", False) for c in with_tma) == 1
    assert len(set(tiles(with_tma))) == len(with_tma)          # no duplicate after clipping
    for c in with_tma:                                          # no tile beyond the padded problem
        assert c["BLOCK_M"] <= max(16, 1 << (m - 1).bit_length()) and c["BLOCK_N"] <= max(16, 1 << (n - 1).bit_length())
    unlimited = gemm_configs(geo, limit=False)
    assert len(unlimited) >= len(plain)


def test_candidates_ordered_by_cost_model():
    geo = geometry(512, 1024, 1024)   # 8x4 tiles of 64x256 already leave SMs idle: small tiles win
    configs = gemm_configs(geo, limit=False)
    costs = [tile_cost(geo, c) for c in configs]
    assert costs == sorted(costs)
    assert configs[0]["BLOCK_M"] * configs[0]["BLOCK_N"] <= 64 * 64 * 2
    big = gemm_configs(geometry(1024, 1024, 1024, (4,)))   # 128 tiles of 128x256 fill one wave
    assert (big[0]["BLOCK_M"], big[0]["BLOCK_N"]) == (128, 256)


def test_pipeline_stages_fit_shared_memory():
    for c in gemm_configs(geometry(4096, 4096, 4096), itemsize=4, limit=False):
        assert c["num_stages"] * (c["BLOCK_M"] + c["BLOCK_N"]) * c["BLOCK_K"] * 4 <= 232448


@pytest.mark.parametrize("store_itemsize", [2, 4, 6])
def test_tma_store_tiles_fit_beside_the_pipeline(store_itemsize):
    """A TMA store stages a BLOCK_M x BLOCK_N tile in shared memory: with it, GPT-2's 128x256 persistent
    tile at 4 stages (bf16 store: 263200 bytes on the H200) or 3 stages (fp32 store: 278552) failed to
    load after compiling. Now every TMA candidate fits with its stores, keeps >= 3 stages, and a tile
    that cannot is not a candidate; the pointer-path configs keep their stages."""
    from fusegraph.codegen.gemm_configs import SMEM_BYTES, gemm_candidates

    geo = geometry(8192, 3072, 768)
    configs = gemm_candidates(geo, tma=True, store_itemsize=store_itemsize)
    tma = [c for c in configs if c.get("USE_TMA")]
    assert tma and len({tuple(sorted(c.items())) for c in configs}) == len(configs)
    for c in tma:
        pipeline = c["num_stages"] * (c["BLOCK_M"] + c["BLOCK_N"]) * c["BLOCK_K"] * 2
        assert pipeline + c["BLOCK_M"] * c["BLOCK_N"] * store_itemsize + 1056 <= SMEM_BYTES, c
        assert c["num_stages"] >= 3
    big = [c for c in tma if c.get("VARIANT") == "persistent" and (c["BLOCK_M"], c["BLOCK_N"]) == (128, 256)]
    assert [c["num_stages"] for c in big] == ([3] if store_itemsize == 2 else [])
    plain = [c for c in configs if not c.get("USE_TMA")]
    assert plain == [c for c in gemm_candidates(geo, tma=True) if not c.get("USE_TMA")]


@pytest.mark.parametrize("mnk", [(50176, 256, 64), (12544, 2048, 512), (8192, 3072, 768)])
def test_the_conv_candidate_set_drops_tiled_tma_and_keeps_one_persistent_config(mnk):
    """A 1x1 convolution's inner GEMM (build option gemm_candidates="conv") compiles the pointer-path
    tiles and the first persistent config only: in recorded cold compiles of ResNet-50, MobileNetV3 and
    ConvNeXt a tiled TMA config never won there. The full set (linear layers) is unchanged."""
    from fusegraph.codegen.gemm_configs import CONV_PERSISTENT_CANDIDATES, gemm_candidates

    geo = geometry(*mnk)
    full = gemm_candidates(geo, tma=True, store_itemsize=2)
    conv = gemm_candidates(geo, tma=True, store_itemsize=2, candidates="conv")
    tiled_tma = [c for c in full if c.get("USE_TMA") and c.get("VARIANT", "tiled") == "tiled"]
    persistent = [c for c in full if c.get("VARIANT") == "persistent"]
    assert tiled_tma and len(persistent) > CONV_PERSISTENT_CANDIDATES    # what the full set offers here
    assert conv == [c for c in full if c not in tiled_tma and c not in persistent[CONV_PERSISTENT_CANDIDATES:]]
    assert [c for c in conv if c.get("VARIANT") == "persistent"] == persistent[:CONV_PERSISTENT_CANDIDATES]


def test_an_unknown_gemm_candidate_set_is_a_clear_error():
    from fusegraph.codegen.gemm_configs import candidate_set
    from fusegraph.errors import InvalidValueError

    assert candidate_set({}) == "full" and candidate_set({"gemm_candidates": "conv"}) == "conv"
    g = fg.Graph("mm")
    g.matmul(g.tensor((8, 16), "float32", "a"), g.tensor((16, 4), "float32", "b")).set_output()
    with pytest.raises(InvalidValueError, match="gemm_candidates='wide'"):
        g.build(device="cpu", gemm_candidates="wide")


def test_tiny_problem_keeps_one_tile():
    configs = gemm_configs(geometry(8, 32, 16, (4,)))
    assert tiles(configs) == [(16, 32, 16, False)]


# ---- launch-bound shortcut ------------------------------------------------------------------

def test_launch_bound_kernel_is_not_timed(gpu):
    calls = []
    with override(tune_min_floor_us=10):
        result = tune("tiny", {"k": 1}, CANDIDATES, lambda c: calls.append(c) or 1.0, floor_ms=0.004)
    assert result.config == CANDIDATES[0] and result.source == "launch-bound" and calls == []
    assert launch_bound(0.009) and not launch_bound(0.011) and not launch_bound(None)


def test_floor_above_threshold_or_rule_off_tunes(gpu):
    times = {1: 0.3, 2: 0.1, 3: 0.2}
    result = tune("big", {"k": 2}, CANDIDATES, lambda c: times[c["BLOCK"]], floor_ms=0.05)
    assert result.source == "tuned" and result.config == CANDIDATES[1]
    clear_memo()
    with override(tune_min_floor_us=0):
        result = tune("tiny_forced", {"k": 3}, CANDIDATES, lambda c: times[c["BLOCK"]], floor_ms=0.001)
    assert result.source == "tuned"


@pytest.mark.parametrize("ratio", [1.5, 0.0])
def test_a_clear_loser_stops_after_its_first_timed_calls(gpu, ratio):
    """tune_early_stop: once a candidate has a time, a later one whose first EARLY_STOP_REPS timed calls
    have a median above best x ratio is not timed further (tune/timing.losing_above); 0 times it in full.
    The choice is the same either way, and a close candidate is always timed in full."""
    # seconds per call: 2 loses by 6x; 3 ties with 1, so only sleeps overshooting by half under a loaded
    # host could make it look like a loser: at 0.5 ms a call that happened twice (a CI run beside other
    # work stopped 3 at 0.6 ms), so the calls sleep 2 ms (a 1 ms overshoot of the median is needed)
    sleeps = {1: 0.002, 2: 0.012, 3: 0.002}
    calls = {1: 0, 2: 0, 3: 0}

    def run(block: int) -> None:
        calls[block] += 1
        time.sleep(sleeps[block])

    def bench(c: Config) -> float:
        return timing.bench_ms(lambda: run(c["BLOCK"]))

    with override(tune_early_stop=ratio, tune_min_floor_us=0):
        result = tune(f"early_stop_{ratio}", {"k": 9}, CANDIDATES, bench, floor_ms=0.1)
    assert result.config in (CANDIDATES[0], CANDIDATES[2])
    overhead = 1 + timing._SHORT_ESTIMATE_CALLS + timing.WARMUP_CALLS    # first call, estimate, warm-up
    full = overhead + timing.MIN_REPS                                    # 3 ms a call: the fewest timed calls
    assert calls[2] == (overhead + timing.EARLY_STOP_REPS if ratio else full), calls
    assert calls[3] > overhead + timing.EARLY_STOP_REPS, calls
    slow = next(t for t in result.timings if t.config == CANDIDATES[1])
    assert slow.ms is not None and slow.ms > 8.0


def test_floor_of_a_demo_sized_gemm_kernel():
    g = fg.Graph(name="floor")
    a = g.tensor((4, 1024, 1024), dtype="bfloat16", name="a")
    w = g.tensor((1024, 1024), dtype="bfloat16", name="w")
    g.matmul(a, w).set_output()
    plan = g.build(device="cpu")
    (kernel,) = plan.kernels
    floor = floor_ms_of(kernel)   # 8.6 GFLOP at 989 TFLOP/s (datasheet bf16): ~8.7 us
    assert floor is not None and 0.007 < floor < 0.010


# ---- tuning time recorded -------------------------------------------------------------------

def test_tune_reports_seconds_and_precompiles_before_timing(gpu):
    order: list[str] = []

    def bench(c: Config) -> float:
        order.append(f"time {c['BLOCK']}")
        time.sleep(0.01)
        return float(c["BLOCK"])

    def precompile(kept):
        order.append(f"compile {len(kept)}")

    result = tune("timed", {"k": 4}, CANDIDATES, bench, precompile=precompile)
    assert order == ["compile 3", "time 1", "time 2", "time 3"]
    assert result.source == "tuned" and result.seconds >= 0.03
    again = tune("timed", {"k": 4}, CANDIDATES, bench, precompile=precompile)
    assert again.source == "memo" and len(order) == 4 and again.seconds < result.seconds


def test_precompile_failure_does_not_stop_tuning(gpu):
    def precompile(kept):
        raise RuntimeError("compiler crashed")

    result = tune("robust", {"k": 5}, CANDIDATES, lambda c: float(c["BLOCK"]), precompile=precompile)
    assert result.source == "tuned" and result.config == CANDIDATES[0]


def test_plan_kernels_record_their_tuning():
    g = fg.Graph(name="rec", compute_dtype="float32")
    x = g.tensor((32, 16), dtype="float16", name="x")
    w = g.tensor((16, 24), dtype="float16", name="w")
    g.relu(g.matmul(x, w)).set_output()
    plan = g.build(device="cpu")
    (kernel,) = plan.kernels
    assert kernel.tuning["source"] == "default" and kernel.tuning["build_s"] >= 0
    assert set(kernel.tuning) >= {"source", "seconds", "candidates", "build_s"}


# ---- parallel precompile --------------------------------------------------------------------

def test_compile_in_parallel_overlaps_jobs_and_reports_errors():
    running, peak, lock = [0], [0], threading.Lock()

    def fake_compile(k: int):
        def job():
            with lock:
                running[0] += 1
                peak[0] = max(peak[0], running[0])
            time.sleep(0.2)
            with lock:
                running[0] -= 1
            if k == 2:
                raise RuntimeError("out of resources: shared memory")
        return job

    t0 = time.perf_counter()
    errors = compile_in_parallel([fake_compile(k) for k in range(4)], threads=4, triton_jobs=False)
    elapsed = time.perf_counter() - t0
    assert peak[0] >= 2 and elapsed < 0.6          # serial would take 0.8 s
    assert errors[:2] == [None, None] and errors[3] is None and "out of resources" in (errors[2] or "")


def test_compile_in_parallel_through_triton_async_compile_mode():
    """Jobs that submit like JITFunction.warmup does under AsyncCompileMode: the compile runs in
    the pool, and every result is finished when compile_in_parallel returns."""
    from triton.runtime import _async_compile

    finished: list[int] = []

    def warmup_like(k: int):
        def job():
            mode = _async_compile.active_mode.get()
            assert mode is not None

            def compile_fn():
                time.sleep(0.2)
                if k == 1:
                    raise ValueError("bad config")
                return k

            return mode.submit(("key", k), compile_fn, lambda kernel: finished.append(kernel))
        return job

    t0 = time.perf_counter()
    errors = compile_in_parallel([warmup_like(k) for k in range(4)], threads=4)
    assert time.perf_counter() - t0 < 0.6
    assert sorted(finished) == [0, 2, 3] and errors[1] is not None and "bad config" in errors[1]
    assert errors[0] is None and errors[2] is None


def _warmup_like(k: int, release: threading.Event, finished: list[int], fail: int = -1):
    """A job submitting like JITFunction.warmup under AsyncCompileMode; its compile waits for `release`."""
    from triton.runtime import _async_compile

    def job():
        mode = _async_compile.active_mode.get()
        assert mode is not None

        def compile_fn():
            assert release.wait(5)
            if k == fail:
                raise ValueError("bad config")
            return k

        return mode.submit(("key", k), compile_fn, lambda kernel: finished.append(kernel))
    return job


def test_compile_stream_returns_before_the_compiles_and_finishes_them_on_leaving():
    """CompileStream: entering binds the jobs and returns while they compile; a launch inside finds
    its pending compile through the active AsyncCompileMode and waits for that one only; leaving
    finishes the rest (a failing compile is ignored: the kernel's own build reports it); a nested
    stream adds its jobs to the same pool instead of waiting."""
    from triton.runtime import _async_compile

    from fusegraph.tune.precompile import CompileStream, streaming

    release, finished = threading.Event(), []
    with override(stream_compiles=True), \
            CompileStream([_warmup_like(k, release, finished, fail=2) for k in range(4)], threads=4) as stream:
        assert finished == [] and streaming()                       # nothing compiled yet, and we are here
        mode = _async_compile.active_mode.get()
        pending = mode.submit(("key", 0), None, None)               # what a launch of kernel 0 finds
        release.set()
        assert pending.result() == 0 and finished == [0]            # waits for its own compile only
        nested = CompileStream([_warmup_like(9, release, finished)])
        with nested:                                                # inside: no new mode, no wait
            assert _async_compile.active_mode.get() is mode
    assert sorted(finished) == [0, 1, 3, 9] and not streaming()
    assert _async_compile.active_mode.get() is None and stream.pool is not None


def test_compile_stream_off_compiles_everything_first():
    from fusegraph.tune.precompile import CompileStream

    release, finished = threading.Event(), []
    release.set()
    with override(stream_compiles=False), CompileStream([_warmup_like(k, release, finished) for k in range(3)],
                                                        threads=3):
        assert sorted(finished) == [0, 1, 2]


@pytest.mark.parametrize("cpu_max, cap", [("max 100000\n", None), ("400000 100000\n", 4), ("150000 100000", 2),
                                          ("garbage", None), (None, None)])
def test_usable_cpus_follow_the_affinity_mask_and_the_cgroup_quota(tmp_path, cpu_max, cap):
    import os

    from fusegraph.tune.precompile import usable_cpus

    path = tmp_path / "cpu.max"
    if cpu_max is not None:
        path.write_text(cpu_max)
    mask = len(os.sched_getaffinity(0))
    assert usable_cpus(str(path)) == (mask if cap is None else min(mask, cap))


def test_the_triton_warmup_computes_tritons_cache_key():
    """Triton's key of its own files (hashing its library) is computed by the warmup thread, not by
    the first compiles (without a GPU the driver start fails quietly; the key is still computed)."""
    from triton.runtime.cache import triton_key

    from fusegraph.tune.precompile import _warm_triton

    triton_key.cache_clear()
    _warm_triton()
    assert triton_key.cache_info().currsize == 1


def test_one_thread_runs_jobs_in_order():
    seen: list[int] = []
    errors = compile_in_parallel([lambda k=k: seen.append(k) for k in range(3)], threads=1)
    assert seen == [0, 1, 2] and errors == [None, None, None]


# ---- short timing budget --------------------------------------------------------------------

def test_short_budget_scales_with_duration():
    assert timing.short_budget(0.018)[1] == timing.MAX_REPS          # 18 us kernel: 50 calls
    assert timing.short_budget(2.0)[1] == timing.MIN_REPS            # 2 ms kernel: 10 calls
    assert timing.MIN_REPS <= timing.short_budget(0.5)[1] <= timing.MAX_REPS


def test_bench_ms_default_is_short(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    calls = [0]

    def fn():
        calls[0] += 1

    timing.bench_ms(fn)
    assert calls[0] <= 1 + 3 + timing.WARMUP_CALLS + timing.MAX_REPS


class _FakeCuda:
    """Records what the CUDA timing path enqueues: spins (cycles), L2 flushes, events and calls."""

    def __init__(self, monkeypatch, host_s: float) -> None:
        self.log: list[tuple[str, float]] = []
        self.host_s = host_s
        log = self.log

        class Event:
            def __init__(self, enable_timing: bool = False) -> None:
                self.at = 0

            def record(self) -> None:
                self.at = len(log)
                log.append(("record", 0))

            def elapsed_time(self, other: Event) -> float:
                return 0.05

        class Flush:
            def zero_(self) -> None:
                log.append(("flush", 0))

        class Props:
            clock_rate = 1_000_000   # kHz: 1000 cycles per microsecond

        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
        monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: log.append(("sleep", cycles)))
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Props())
        monkeypatch.setattr(torch, "empty", lambda *a, **k: Flush())

    def fn(self) -> None:
        time.sleep(self.host_s)   # the host's launch time
        self.log.append(("call", 0))


def test_cuda_timing_keeps_the_gpu_queue_ahead_of_slow_launches(monkeypatch):
    """Each timed call is preceded by a flush and a spin longer than the host takes to launch it,
    so the start event never waits on the GPU for the launch (which inflated short kernels' times)."""
    fake = _FakeCuda(monkeypatch, host_s=0.002)
    assert timing.bench_ms(fake.fn) == pytest.approx(0.05)
    log = [k for k, _ in fake.log]
    timed = [i for i in range(len(log) - 1) if log[i] == "record" and log[i + 1] == "call"
             and i >= 2 and log[i - 2] == "flush"]
    assert len(timed) >= timing.MIN_REPS
    for i in timed:
        kind, cycles = fake.log[i - 1]
        assert kind == "sleep" and cycles >= 2000 * 1000   # >= the 2 ms host launch, at 1000 cycles/us
        assert log[i + 2] == "record"


def test_launch_bound_attention_takes_first_candidate_that_runs_and_agrees():
    from fusegraph.backends.attention_kernel import _first_that_runs

    good = torch.ones(4, 4)
    calls: list[str] = []

    def cand(label: str, value: torch.Tensor | None):
        def launch(args):
            calls.append(label)
            if value is None:
                raise RuntimeError("out of resources")
            return [value]
        return launch

    candidates = {"triton:a": cand("triton:a", None), "triton:b": cand("triton:b", good * 5),
                  "triton:c": cand("triton:c", good.clone()), "triton:d": cand("triton:d", good),
                  "torch:flash": cand("torch:flash", good)}
    assert _first_that_runs("attn", list(candidates), candidates, []) == "triton:c"
    assert "triton:d" not in calls                      # nothing after the choice is compiled or run
    only_torch = {"torch:cudnn": cand("torch:cudnn", good)}
    assert _first_that_runs("attn", list(only_torch), only_torch, []) == "torch:cudnn"


def test_build_time_note_summarizes_kernel_tuning():
    from types import SimpleNamespace

    from fusegraph.tune.autotuner import build_time_note

    assert build_time_note([SimpleNamespace(name="k0", tuning={"source": "default", "seconds": 0.0})]) is None
    kernels = [SimpleNamespace(name="k0", tuning={"source": "tuned", "seconds": 2.0, "build_s": 3.0}),
               SimpleNamespace(name="k1", tuning={"source": "launch-bound", "seconds": 0.0, "build_s": 1.0}),
               SimpleNamespace(name="k2", tuning={})]
    note = build_time_note(kernels)
    assert note is not None and "4.0 s" in note and "2.0 s of it tuning" in note
    assert "1 launch-bound" in note and "1 tuned" in note and "slowest k0 3.0 s" in note


def _two_gemm_items():
    from fusegraph.fusion.epilogue import claim_epilogues
    from fusegraph.fusion.partition import partition_graph

    g = fg.Graph(name="two_gemms", compute_dtype="float32")
    x = g.tensor((4, 1024, 1024), dtype="bfloat16", name="x")
    w1 = g.tensor((1024, 1024), dtype="bfloat16", name="w1")     # 8.6 GFLOP: launch-bound (floor ~8.7 us)
    w2 = g.tensor((1024, 4096), dtype="bfloat16", name="w2")     # 34 GFLOP: tuned
    g.matmul(g.relu(g.matmul(x, w1)), w2).set_output()
    plan = g.build(device="cpu")
    return claim_epilogues(partition_graph(plan.graph).items, plan.graph)


def test_plan_precompiles_first_config_of_launch_bound_kernels_and_all_of_the_others(gpu, monkeypatch):
    from fusegraph import lower
    from fusegraph.backends import matmul_kernel, plan_precompile
    from fusegraph.tune import autotuner

    items = _two_gemm_items()   # GEMM (launch-bound) + relu epilogue, GEMM (tuned)
    submitted: list[list] = []
    cpu_inputs = lambda nodes, device: [torch.zeros(n.shape, dtype=torch.bfloat16) for n in nodes]  # noqa: E731
    monkeypatch.setattr(plan_precompile, "interpreting", lambda: False)
    monkeypatch.setattr(matmul_kernel, "_tma_available", lambda device: False)
    monkeypatch.setattr(matmul_kernel, "_example_inputs", cpu_inputs)
    monkeypatch.setattr(lower, "_example_inputs", cpu_inputs)
    monkeypatch.setattr("fusegraph.tune.precompile.compile_in_parallel",
                        lambda jobs, threads=None: submitted.append(jobs))
    # launch-bound: its first config, timed against cuBLAS (paired: its floor is over 2 us), whose
    # second launch is the relu epilogue kernel; tuned: 3 tiled + 2 persistent configs (512 tiles > 132 SMs)
    stream = plan_precompile.precompile_plan(items, "cuda", {})
    assert len(stream.jobs) == 1 + 1 + 3 + 2
    with override(stream_compiles=False), stream:
        pass
    assert len(submitted) == 1 and len(submitted[0]) == 7           # one parallel batch for the whole plan
    monkeypatch.setattr(autotuner, "cached_choice", lambda name, key, candidates: candidates[1])
    assert len(plan_precompile.precompile_plan(items, "cuda", {}).jobs) == 1 + 1 + 1   # known choice: only it compiles
    assert len(plan_precompile.precompile_plan(items, "cpu", {}).jobs) == 0


def test_plan_precompiles_fused_kernels(gpu, monkeypatch):
    from fusegraph import lower
    from fusegraph.backends import plan_precompile
    from fusegraph.fusion.partition import partition_graph

    g = fg.Graph(name="norm", compute_dtype="float32")
    x = g.tensor((4096, 1024), dtype="bfloat16", name="x")          # 16 MiB through a layernorm: launch-bound
    g.layernorm(x, eps=1e-5).set_output()
    big = fg.Graph(name="big_norm", compute_dtype="float32")
    y = big.tensor((65536, 1024), dtype="bfloat16", name="y")       # 256 MiB: tuned, every candidate
    big.layernorm(y, eps=1e-5).set_output()
    submitted: list[list] = []
    monkeypatch.setattr(plan_precompile, "interpreting", lambda: False)
    monkeypatch.setattr(lower, "_example_inputs",
                        lambda nodes, device: [torch.zeros(n.shape, dtype=torch.bfloat16) for n in nodes])
    monkeypatch.setattr("fusegraph.tune.precompile.compile_in_parallel",
                        lambda jobs, threads=None: submitted.append(jobs))
    counts = []
    for graph in (g, big):
        plan = graph.build(device="cpu")
        counts.append(len(plan_precompile.precompile_plan(partition_graph(plan.graph).items, "cuda", {}).jobs))
    assert counts[0] == 1 and counts[1] > 1


def test_compile_in_parallel_inside_an_outer_async_compile_mode():
    from concurrent.futures import ThreadPoolExecutor

    from triton import AsyncCompileMode
    from triton.runtime import _async_compile

    def job():
        return _async_compile.active_mode.get().submit("k", lambda: 1, lambda kernel: None)

    with ThreadPoolExecutor(2) as pool, AsyncCompileMode(pool) as outer:
        assert compile_in_parallel([job, job], threads=2) == [None, None]
        assert len(outer.raw_futures) == 1      # submitted to the caller's mode (deduplicated by key)


def test_untimed_gemm_choice_is_checked_against_the_reference_launch():
    """What matmul_group_kernel runs on the GPU for a launch-bound choice, here under the interpreter."""
    from fusegraph.backends.matmul_kernel import GemmLaunch, _reference_group_launch, check_same
    from fusegraph.codegen.compile import load_triton_function
    from fusegraph.codegen.matmul import generate_gemm
    from fusegraph.fusion.epilogue import MatmulGroup, claim_epilogues
    from fusegraph.fusion.partition import partition_graph
    from fusegraph.lower import reference_launch

    g = fg.Graph(name="checked", compute_dtype="float32")
    a = g.tensor((2, 32, 48), dtype="float16", name="a")
    b = g.tensor((48, 40), dtype="float16", name="b")
    bias = g.tensor((40,), dtype="float16", name="bias")
    g.relu(g.add(g.matmul(a, b), bias)).set_output()
    plan = g.build(device="cpu")
    (group,) = claim_epilogues(partition_graph(plan.graph).items, plan.graph)
    assert isinstance(group, MatmulGroup)
    gen = generate_gemm(group, "checked_gemm")
    config = gemm_configs(gen.geometry)[0]
    launch = GemmLaunch(load_triton_function(gen.source, gen.name), gen, config, "cpu")
    example = [torch.randn(n.shape).to(torch.float16) for n in gen.inputs]
    reference = _reference_group_launch(group, "float32", reference_launch)
    got = launch(example)
    check_same(got, reference(example), "checked")
    with pytest.raises(ValueError):
        check_same([t * 2 + 1 for t in got], reference(example), "broken")


def test_plan_precompiles_a_repeated_block_once(gpu, monkeypatch):
    """Two identical GEMM + relu blocks: the second block's kernels are the first's (same source up to
    the kernel positions), so the plan submits each kernel's compile jobs once."""
    from fusegraph import lower
    from fusegraph.backends import matmul_kernel, plan_precompile
    from fusegraph.fusion.epilogue import claim_epilogues
    from fusegraph.fusion.partition import partition_graph

    def items(blocks: int) -> list:
        g = fg.Graph(name="blocks", compute_dtype="float32")
        h = g.tensor((4, 1024, 1024), dtype="bfloat16", name="x")
        for i in range(blocks):
            w = g.tensor((1024, 1024), dtype="bfloat16", name=f"w{i}")
            h = g.relu(g.matmul(h, w))
        h.set_output()
        plan = g.build(device="cpu")
        return claim_epilogues(partition_graph(plan.graph).items, plan.graph)

    cpu_inputs = lambda nodes, device: [torch.zeros(n.shape, dtype=torch.bfloat16) for n in nodes]  # noqa: E731
    monkeypatch.setattr(plan_precompile, "interpreting", lambda: False)
    monkeypatch.setattr(matmul_kernel, "_tma_available", lambda device: False)
    monkeypatch.setattr(matmul_kernel, "_example_inputs", cpu_inputs)
    monkeypatch.setattr(lower, "_example_inputs", cpu_inputs)
    monkeypatch.setattr("fusegraph.tune.precompile.compile_in_parallel", lambda jobs, threads=None: None)
    one = len(plan_precompile.precompile_plan(items(1), "cuda", {}).jobs)
    assert one > 0 and len(plan_precompile.precompile_plan(items(3), "cuda", {}).jobs) == one


def test_plan_precompiles_convolution_epilogues_once(gpu, monkeypatch):
    """conv + batchnorm + relu blocks: the conv itself is a library call, but its generated epilogue
    (the candidate the fused library plans are checked against) compiles with the plan's other kernels,
    under the name the conv kernel gives it, once for identical blocks."""
    from fusegraph import lower
    from fusegraph.backends import plan_precompile
    from fusegraph.fusion.epilogue import ConvGroup, claim_epilogues
    from fusegraph.fusion.partition import partition_graph

    def items(blocks: int) -> list:
        g = fg.Graph(name="convs", compute_dtype="float32")
        h = g.tensor((2, 8, 8, 8), dtype="float16", name="x")
        for i in range(blocks):
            w = g.tensor((8, 8, 3, 3), dtype="float16", name=f"w{i}")
            b = g.tensor((8,), dtype="float16", name=f"b{i}")
            h = g.relu(g.add(g.conv2d(h, w, padding=1), g.reshape(b, (1, 8, 1, 1))))
        h.set_output()
        plan = g.build(device="cpu")
        return claim_epilogues(partition_graph(plan.graph).items, plan.graph)

    names: list[str] = []
    real = plan_precompile.fused_warmup_jobs

    def recording(group, k, device, options, generated=None, seen=None, name=None):
        names.append(name or "")
        return real(group, k, device, options, generated, seen, name)

    monkeypatch.setattr(plan_precompile, "interpreting", lambda: False)
    monkeypatch.setattr(plan_precompile, "fused_warmup_jobs", recording)
    monkeypatch.setattr(lower, "_example_inputs",
                        lambda nodes, device: [torch.zeros(n.shape, dtype=torch.float16) for n in nodes])
    monkeypatch.setattr("fusegraph.tune.precompile.compile_in_parallel", lambda jobs, threads=None: None)
    two = items(2)   # the last block's epilogue also converts back to NCHW: a kernel of its own
    assert any(isinstance(item, ConvGroup) and item.epilogue_nodes for item in two)
    first = len(plan_precompile.precompile_plan(two, "cuda", {}).jobs)
    assert first > 0 and any(n.endswith("_conv_epilogue") for n in names)
    assert len(plan_precompile.precompile_plan(items(4), "cuda", {}).jobs) == first   # the middle blocks add nothing
