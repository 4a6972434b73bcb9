"""Build-time cuts: memory-bound kernels under tune "fast" take their shape's heuristic config
untimed (only the big ones are compiled and timed), tune "full" times them all, and the parallel
precompile also builds the compiled kernels' C launchers in its pool, once per distinct signature."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import fusegraph as fg
from fusegraph.errors import InvalidValueError
from fusegraph.settings import override
from fusegraph.tune import Config, clear_memo, keys, precompile, tune
from fusegraph.tune.autotuner import untimed_reason
from fusegraph.tune.build_profile import profile_build

GPU = {"name": "Fake GPU H200", "capability": "9.0"}
CANDIDATES = [Config.of(BLOCK=1), Config.of(BLOCK=2), Config.of(BLOCK=3)]


@pytest.fixture
def gpu(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(keys, "gpu_identity", lambda: dict(GPU))
    clear_memo()
    with override(cache_dir=str(tmp_path), autotune=True):
        yield
    clear_memo()


def test_small_memory_bound_kernel_takes_the_heuristic_config_untimed(gpu):
    calls: list[Config] = []
    bench = lambda c: calls.append(c) or float(c["BLOCK"])  # noqa: E731
    result = tune("norm_30us", {"k": 1}, CANDIDATES, bench, floor_ms=0.030, memory_bound=True)
    assert (result.config, result.source, calls) == (CANDIDATES[0], "heuristic", [])
    # the same floor on a compute kernel (a GEMM), a big memory-bound one, or tune=full: timed
    assert tune("gemm_30us", {"k": 2}, CANDIDATES, bench, floor_ms=0.030).source == "tuned"
    assert tune("norm_80us", {"k": 3}, CANDIDATES, bench, floor_ms=0.080, memory_bound=True).source == "tuned"
    with override(tune="full"):
        assert tune("norm_30us_full", {"k": 4}, CANDIDATES, bench, floor_ms=0.030, memory_bound=True).source == "tuned"
    assert len(calls) == 9


def test_untimed_reason_thresholds():
    assert untimed_reason(0.005, memory_bound=True) == "launch-bound" and untimed_reason(0.005) == "launch-bound"
    assert untimed_reason(0.049, memory_bound=True) == "heuristic" and untimed_reason(0.049) is None
    assert untimed_reason(0.051, memory_bound=True) is None and untimed_reason(None, memory_bound=True) is None
    with override(tune_heuristic_floor_us=100):
        assert untimed_reason(0.080, memory_bound=True) == "heuristic"
    with override(tune="full"):
        assert untimed_reason(0.030, memory_bound=True) is None and untimed_reason(0.005) == "launch-bound"
    with override(tune="slow"), pytest.raises(InvalidValueError, match="fast, full"):
        untimed_reason(0.030, memory_bound=True)


def layernorm_items(rows: int) -> list:
    from fusegraph.fusion.partition import partition_graph

    g = fg.Graph(name=f"norm{rows}", compute_dtype="float32")
    x = g.tensor((rows, 1024), dtype="bfloat16", name="x")
    g.layernorm(x, eps=1e-5).set_output()
    return partition_graph(g.build(device="cpu").graph).items


@pytest.mark.parametrize("rows, fast_jobs, full_jobs", [
    (4096, 1, 1),        # 3.5 us floor: launch-bound either way
    (32768, 1, None),    # 28 us: heuristic under fast, every candidate under full
    (65536, None, None),  # 56 us: timed, every candidate
])
def test_plan_precompile_compiles_only_the_heuristic_config_of_small_kernels(gpu, monkeypatch, rows, fast_jobs,
                                                                               full_jobs):
    from fusegraph import lower
    from fusegraph.backends import plan_precompile
    from fusegraph.codegen.configs import candidate_configs
    from fusegraph.codegen.triton_gen import generate

    items = layernorm_items(rows)
    monkeypatch.setattr(plan_precompile, "interpreting", lambda: False)
    monkeypatch.setattr(lower, "_example_inputs",
                        lambda nodes, device: [torch.zeros(n.shape, dtype=torch.bfloat16) for n in nodes])
    monkeypatch.setattr("fusegraph.tune.precompile.compile_in_parallel", lambda jobs, threads=None: None)
    every = len(candidate_configs(generate(items[0], "fg_k0_x")))
    assert every > 1
    assert len(plan_precompile.precompile_plan(items, "cuda", {}).jobs) == (fast_jobs or every)
    with override(tune="full"):
        assert len(plan_precompile.precompile_plan(items, "cuda", {}).jobs) == (full_jobs or every)


def test_fused_kernel_times_only_big_memory_bound_kernels(gpu, monkeypatch):
    """lower._choose_config under a fake GPU: which configs are timed for a small and a big kernel."""
    from fusegraph import lower
    from fusegraph.codegen.configs import candidate_configs
    from fusegraph.codegen.triton_gen import generate
    from fusegraph.runtime.kernel import Kernel

    timed: list[dict] = []
    monkeypatch.setattr(lower, "_launcher", lambda fns, gen, config, device, fast: config)
    monkeypatch.setattr(lower, "_example_inputs", lambda nodes, device: [])
    monkeypatch.setattr("fusegraph.tune.bench_ms", lambda fn: timed.append(fn.__closure__ and 1) or 1.0)
    chosen = {}
    for rows in (32768, 65536):
        group = layernorm_items(rows)[0]
        gen = generate(group, f"fg_k0_norm{rows}")
        candidates = candidate_configs(gen)
        kernel = Kernel(name=gen.name, kind=group.kind, backend="triton", nodes=tuple(group.nodes),
                        inputs=tuple(group.inputs), outputs=tuple(e.node for e in group.stores),
                        cost=lower.group_cost(group), launch=lambda args: [])
        before = len(timed)
        config = lower._choose_config([], gen, candidates, "cuda", {}, kernel)
        chosen[rows] = (kernel.tuning["source"], len(timed) - before, config == candidates[0], len(candidates))
    assert chosen[32768][:3] == ("heuristic", 0, True)
    assert chosen[65536][0] == "tuned" and chosen[65536][1] == chosen[65536][3]


def test_precompile_builds_each_distinct_launcher_once_in_the_pool(monkeypatch):
    built: list[tuple] = []
    lock = threading.Lock()

    def fake_launcher(src, metadata):
        time.sleep(0.05)
        with lock:
            built.append((tuple(src.signature.items()), threading.current_thread().name))

    def compiled(sig: dict) -> SimpleNamespace:
        return SimpleNamespace(src=SimpleNamespace(signature=sig, constants={}), metadata=SimpleNamespace())

    kernels = [compiled({0: "*bf16", 1: "i32"}), compiled({0: "*bf16", 1: "i32"}), compiled({0: "*fp32"}), None]
    monkeypatch.setattr(precompile, "_launcher_class", lambda: fake_launcher)
    with profile_build("g", enabled=True) as profile:
        errors = precompile.compile_in_parallel([lambda k=k: k for k in kernels], threads=2, triton_jobs=False)
    assert errors == [None] * 4
    assert sorted(sig for sig, _ in built) == [((0, "*bf16"), (1, "i32")), ((0, "*fp32"),)]
    assert all(name.startswith("fusegraph-compile") for _, name in built)
    subs = {s.name: s.detail for r in profile.records for s in r.subs}
    assert subs["launcher builds"] == "2 distinct launchers" and subs["parallel compile"] == "4 jobs on 2 threads"
    built.clear()
    with override(prebuild_launchers=False):
        precompile.compile_in_parallel([lambda k=k: k for k in kernels], threads=2, triton_jobs=False)
    assert built == []


def test_launchers_not_built_without_a_gpu_driver():
    assert precompile.build_launchers([SimpleNamespace(src=None, metadata=None)], None) == 0  # type: ignore[arg-type]


def _two_stage_graphs() -> dict[str, fg.Graph]:
    ce = fg.Graph("ce")
    x, t = ce.tensor((64, 256), "bfloat16", "x"), ce.tensor((64,), "int64", "t")
    ce.cross_entropy(x, t).set_output()
    lnb = fg.Graph("lnb")
    gy, xx = lnb.tensor((64, 128), "bfloat16", "g"), lnb.tensor((64, 128), "bfloat16", "x")
    w = lnb.tensor((128,), "bfloat16", "w")
    for out in lnb.layernorm_backward(gy, xx, weight=w, eps=1e-5):
        out.set_output()
    cols = fg.Graph("cols")
    y = cols.tensor((65536, 16), "float32", "y")
    cols.sum(y, dim=0).set_output()
    return {"ce": ce, "lnb": lnb, "cols": cols}


@pytest.mark.parametrize("which", ["ce", "lnb", "cols"])
def test_plan_precompile_covers_both_launches_of_two_stage_kernels(gpu, monkeypatch, which):
    """Split column reductions and row + column pairs: every launch of each compiled config, with the
    arguments of the kernel's signature (inputs, outputs, workspaces, then the constexprs)."""
    import inspect

    from fusegraph import lower
    from fusegraph.backends import plan_precompile
    from fusegraph.codegen.compile import load_triton_function
    from fusegraph.fusion.partition import partition_graph

    plan = _two_stage_graphs()[which].build(device="cpu")
    items = partition_graph(plan.graph).items
    assert any("_finish(" in k.source for k in plan.kernels), [k.name for k in plan.kernels]
    calls: list[tuple[str, int, tuple]] = []

    class Recorder:
        def __init__(self, source: str, name: str) -> None:
            self.name, self.real = name, load_triton_function(source, name)

        def warmup(self, *args, grid, num_warps, **constexprs):
            params = list(inspect.signature(self.real.fn).parameters)
            # USE_PDL (last, default False) is passed only where PDL launches are on (a Hopper GPU)
            passed = list(constexprs) + ([] if "USE_PDL" in constexprs else ["USE_PDL"])
            assert params == params[:len(args)] + passed, (self.name, params, len(args), constexprs)
            calls.append((self.name, len(args), grid))

    monkeypatch.setattr(plan_precompile, "interpreting", lambda: False)
    monkeypatch.setattr(plan_precompile, "load_triton_function", Recorder)
    monkeypatch.setattr(lower, "_example_inputs", lambda nodes, device: [torch.zeros(1) for _ in nodes])
    empty, empty_strided = torch.empty, torch.empty_strided    # the jobs allocate on "cuda": here on the CPU
    monkeypatch.setattr(torch, "empty", lambda *a, device=None, **kw: empty(*a, **kw))
    monkeypatch.setattr(torch, "empty_strided", lambda *a, device=None, **kw: empty_strided(*a, **kw))
    ran: list[int] = []
    monkeypatch.setattr("fusegraph.tune.precompile.compile_in_parallel",
                        lambda jobs, threads=None: ran.append(len(jobs)) or [job() for job in jobs])
    with override(tune="full", tune_min_floor_us=0, stream_compiles=False):
        stream = plan_precompile.precompile_plan(items, "cuda", {})
        with stream:   # (not streamed: compile_in_parallel runs the jobs)
            count = len(stream.jobs)
    names = {name for name, _, _ in calls}
    assert count == len(calls) == ran[0] and count >= 4
    assert any(n.endswith("_finish") for n in names) and any(not n.endswith("_finish") for n in names)
    assert sum(n.endswith("_finish") for n, _, _ in calls) * 2 == len(calls)   # both launches of each config


def test_launchers_of_async_compiles_and_of_kernels_already_in_the_jit_cache(monkeypatch):
    """Under AsyncCompileMode a warmup returns a FutureKernel (its CompiledKernel in .kernel once
    done) or, when the JIT already holds the kernel, the CompiledKernel itself (.kernel: its binary)."""
    from triton.runtime import _async_compile

    def compiled(sig: str) -> SimpleNamespace:
        return SimpleNamespace(src=SimpleNamespace(signature={0: sig}, constants={}), metadata=SimpleNamespace(),
                               kernel=b"cubin")

    def async_job(sig: str):
        def job():
            mode = _async_compile.active_mode.get()
            return mode.submit(("key", sig), lambda: compiled(sig), lambda kernel: None)
        return job

    built: list[str] = []
    lock = threading.Lock()

    def fake_launcher(src, metadata):
        with lock:
            built.append(src.signature[0])

    monkeypatch.setattr(precompile, "_launcher_class", lambda: fake_launcher)
    cached = compiled("*fp16")
    errors = precompile.compile_in_parallel([async_job("*bf16"), async_job("*fp32"), lambda: cached], threads=2)
    assert errors == [None, None, None]
    assert sorted(built) == ["*bf16", "*fp16", "*fp32"]


@pytest.mark.parametrize("extent, block, warps", [
    (4096 * 4096, 1024, 4),   # 16384 programs
    (1 << 21, 1024, 4),       # 2048 programs
    (1 << 19, 512, 4),        # 1024 would launch 512 programs, under 528
    (1 << 16, 512, 4),        # 128 programs: the narrowest block
    (100, 128, 4),            # a tiny tensor: one program covering it
])
def test_pointwise_heuristic_config_by_size(extent, block, warps):
    from fusegraph.codegen.configs import candidate_configs, pointwise_heuristic

    assert pointwise_heuristic(extent) == {"BLOCK": block, "num_warps": warps}
    gen = SimpleNamespace(kind="pointwise", extent=extent, meta={})
    configs = candidate_configs(gen)  # type: ignore[arg-type]
    assert configs[0] == {"BLOCK": block, "num_warps": warps}             # the untimed pick comes first
    assert len(configs) == len({tuple(sorted(c.items())) for c in configs})   # no duplicate to time


def test_triton_warmup_runs_once_on_its_thread_and_loading_a_kernel_waits_for_it(monkeypatch):
    from fusegraph.codegen import compile as codegen_compile

    started = threading.Event()
    release = threading.Event()
    runs: list[str] = []

    def slow_warm():
        runs.append(threading.current_thread().name)
        started.set()
        release.wait(5)

    monkeypatch.setattr(precompile, "_warmup", None)
    monkeypatch.setattr(precompile, "_warm_triton", slow_warm)
    monkeypatch.setattr(codegen_compile, "interpreting", lambda: False)
    precompile.start_triton_warmup("cpu")
    assert precompile._warmup is None                        # only for CUDA devices
    precompile.start_triton_warmup("cuda")
    precompile.start_triton_warmup("cuda:0")                 # once per process
    assert started.wait(5) and runs == ["fusegraph-triton-warmup"]
    waited = threading.Event()
    waiter = threading.Thread(target=lambda: (precompile.wait_for_triton_warmup(), waited.set()))
    waiter.start()
    assert not waited.wait(0.2)                              # blocked until the warm-up ends
    release.set()
    waiter.join(5)
    assert waited.is_set() and runs == ["fusegraph-triton-warmup"]


def test_triton_warmup_failure_is_silent(monkeypatch):
    """On a machine without a GPU driver the warm-up thread's error is left for the build to meet."""
    monkeypatch.setattr(precompile, "_warmup", None)
    from fusegraph.codegen import compile as codegen_compile

    monkeypatch.setattr(codegen_compile, "interpreting", lambda: False)
    precompile.start_triton_warmup("cuda")
    precompile.wait_for_triton_warmup()
    assert precompile._warmup is not None and not precompile._warmup.is_alive()
