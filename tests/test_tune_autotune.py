"""autotune: fastest candidate chosen with a fake bench on a pretend GPU, cached, memoized, failures skipped."""

from __future__ import annotations

import io
import json
import math
import sys
import time
from pathlib import Path

import pytest
import torch

from fusegraph.errors import UnsupportedError
from fusegraph.settings import override
from fusegraph.tune import CacheWarning, Config, TuneCache, autotune, bench_ms, clear_memo, keys, progress, tune

GPU = {"name": "Fake GPU H200", "capability": "9.0"}
CANDIDATES = [Config.of(BLOCK_C=1024, num_warps=4), Config.of(BLOCK_C=2048, num_warps=8),
              Config.of(BLOCK_C=4096, num_warps=8), Config.of(BLOCK_C=8192, num_warps=16)]
TIMES = {1024: 0.30, 2048: 0.12, 4096: 0.20, 8192: 0.50}
KEY = {"sig": "deadbeef", "shape": (4096, 4096), "dtype": "bfloat16"}


class FakeBench:
    """Pretends to time a kernel: each BLOCK_C has a fixed time; some configs fail to compile."""

    def __init__(self, times: dict[int, float] | None = None, fail: tuple[int, ...] = ()) -> None:
        self.times, self.fail, self.calls = dict(times or TIMES), fail, []

    def __call__(self, config: Config) -> float:
        self.calls.append(config)
        if config["BLOCK_C"] in self.fail:
            raise RuntimeError(f"out of resources: shared memory for BLOCK_C={config['BLOCK_C']}")
        return self.times[config["BLOCK_C"]]


@pytest.fixture
def gpu(tmp_path: Path, monkeypatch):
    """A pretend GPU, autotuning on, an empty cache in tmp_path, an empty memo."""
    monkeypatch.setattr(keys, "gpu_identity", lambda: dict(GPU))
    clear_memo()
    with override(cache_dir=str(tmp_path), autotune=True):
        yield TuneCache(tmp_path / "tune")
    clear_memo()


def test_picks_fastest_and_caches_it(gpu: TuneCache):
    bench = FakeBench()
    result = tune("fused_softmax_0", KEY, CANDIDATES, bench)
    assert result.config == Config.of(BLOCK_C=2048, num_warps=8) and result.source == "tuned"
    assert bench.calls == CANDIDATES
    [path] = gpu.entry_paths()
    data = json.loads(path.read_text())
    assert data["config"] == {"BLOCK_C": 2048, "num_warps": 8}
    assert data["key"]["name"] == "fused_softmax_0" and data["key"]["gpu"] == GPU
    assert data["key"]["key"] == {"dtype": "bfloat16", "shape": [4096, 4096], "sig": "deadbeef"}
    assert set(data["key"]["versions"]) >= {"torch", "triton", "cuda", "cudnn", "fusegraph"}
    assert sorted(t["ms"] for t in data["timings"]) == sorted(TIMES.values())


def test_memo_avoids_disk_and_cache_avoids_timing(gpu: TuneCache, monkeypatch):
    first = autotune("k", KEY, CANDIDATES, FakeBench())

    def no_disk(*args, **kwargs):
        raise AssertionError("the memo should have answered without touching the disk")

    with monkeypatch.context() as m:
        m.setattr(TuneCache, "load", no_disk)
        m.setattr(TuneCache, "store", no_disk)
        bench = FakeBench()
        again = tune("k", KEY, CANDIDATES, bench)
    assert again.config == first and again.source == "memo" and bench.calls == []

    clear_memo()  # a new process: the disk answers
    bench = FakeBench()
    from_disk = tune("k", KEY, CANDIDATES, bench)
    assert from_disk.config == first and from_disk.source == "cache" and bench.calls == []


def test_other_key_or_candidates_or_versions_tune_again(gpu: TuneCache, monkeypatch):
    autotune("k", KEY, CANDIDATES, FakeBench())
    bench = FakeBench({**TIMES, 8192: 0.01})
    assert autotune("k", {**KEY, "shape": (4096, 4097)}, CANDIDATES, bench) == CANDIDATES[3]
    assert len(bench.calls) == 4
    bench = FakeBench()
    assert autotune("k", KEY, CANDIDATES[2:], bench) == CANDIDATES[2] and len(bench.calls) == 2
    clear_memo()
    monkeypatch.setattr(keys, "library_versions", lambda: {"torch": "9.9", "triton": "9.9", "fusegraph": "9.9"})
    bench = FakeBench({**TIMES, 1024: 0.01})
    assert autotune("k", KEY, CANDIDATES, bench) == CANDIDATES[0] and len(bench.calls) == 4
    assert len(gpu.entry_paths()) == 4


def test_candidate_that_raises_is_skipped_and_recorded(gpu: TuneCache):
    bench = FakeBench(fail=(2048,))
    result = tune("k", KEY, CANDIDATES, bench)
    assert result.config == CANDIDATES[2] and len(bench.calls) == 4
    failed = [t for t in result.timings if t.ms is None]
    assert [t.config for t in failed] == [CANDIDATES[1]]
    assert "RuntimeError" in failed[0].error and "BLOCK_C=2048" in failed[0].error
    [path] = gpu.entry_paths()
    assert any(t["error"] for t in json.loads(path.read_text())["timings"])


def test_bad_measurement_counts_as_failure(gpu: TuneCache):
    bench = FakeBench({**TIMES, 2048: math.nan})
    assert autotune("k", KEY, CANDIDATES, bench) == CANDIDATES[2]


def test_all_candidates_fail_raises_naming_the_kernel(gpu: TuneCache):
    with pytest.raises(UnsupportedError, match=r"fused_xent_2.*none of its 4 candidate") as info:
        autotune("fused_xent_2", KEY, CANDIDATES, FakeBench(fail=tuple(TIMES)))
    assert "BLOCK_C=8192" in str(info.value)
    assert gpu.entry_paths() == []


def test_no_timing_returns_first_candidate(gpu: TuneCache, monkeypatch):
    bench = FakeBench()
    assert autotune("k", KEY, CANDIDATES, None) == CANDIDATES[0]
    with override(autotune=False):
        assert tune("k", KEY, CANDIDATES, bench).source == "default"
    monkeypatch.setattr(keys, "gpu_identity", lambda: None)
    assert autotune("k", KEY, CANDIDATES, bench) == CANDIDATES[0]
    assert bench.calls == [] and gpu.entry_paths() == []
    with pytest.raises(ValueError, match="no candidate"):
        autotune("k", KEY, [], bench)


def test_prune_drops_candidates_before_timing(gpu: TuneCache):
    bench = FakeBench()
    too_big = lambda c: c["BLOCK_C"] <= 2048  # noqa: E731
    assert autotune("k", KEY, CANDIDATES, bench, prune=too_big) == CANDIDATES[2]
    assert [c["BLOCK_C"] for c in bench.calls] == [4096, 8192]
    bench = FakeBench()
    only_one = tune("k", KEY, CANDIDATES, bench, prune=lambda c: c["BLOCK_C"] != 8192)
    assert only_one.config == CANDIDATES[3] and only_one.source == "single" and bench.calls == []


def test_corrupt_cache_entry_is_retuned_with_warning(gpu: TuneCache):
    autotune("k", KEY, CANDIDATES, FakeBench())
    [path] = gpu.entry_paths()
    path.write_text('{"schema": 1, "key": {"trunc')
    clear_memo()
    bench = FakeBench()
    with pytest.warns(CacheWarning, match="corrupt"):
        assert autotune("k", KEY, CANDIDATES, bench) == CANDIDATES[1]
    assert len(bench.calls) == 4
    assert json.loads(path.read_text())["config"] == CANDIDATES[1].to_json()


def test_progress_shown_when_tuning_is_slow(gpu: TuneCache, monkeypatch, capsys):
    autotune("quick", KEY, CANDIDATES, FakeBench())
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(progress, "SHOW_AFTER_S", 0.0)
    autotune("slow_kernel", KEY, CANDIDATES, FakeBench(fail=(1024,)))
    err = capsys.readouterr().err
    assert "tuning slow_kernel: 4/4 candidates, best 0.12 ms" in err


def test_debug_prints_timings(gpu: TuneCache, capsys):
    with override(debug=2):
        autotune("k", KEY, CANDIDATES, FakeBench(fail=(4096,)))
    err = capsys.readouterr().err
    assert "chose Config(BLOCK_C=2048, num_warps=8)" in err and "failed: RuntimeError" in err


def test_bench_ms_host_clock_median(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the host-clock path, also on a GPU machine

    def sleep_1ms():
        time.sleep(0.001)
    ms = bench_ms(sleep_1ms, warmup_ms=2, rep_ms=20)
    assert 0.9 <= ms < 20


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("with_rich", [True, False])
def test_progress_on_a_terminal(monkeypatch, with_rich: bool):
    if not with_rich:
        monkeypatch.setitem(sys.modules, "rich.progress", None)  # import fails: the one-line counter
    else:
        pytest.importorskip("rich")
    stream = _Terminal()
    with progress.TuningProgress("fused_softmax_0", 3, stream=stream, show_after_s=0.0) as bar:
        for ms in (0.3, None, 0.1):
            bar.advance(ms)
    out = stream.getvalue()
    assert "fused_softmax_0" in out and "3/3" in out and "best 0.1 ms" in out
    assert ("\r" in out and "fusegraph: tuning" in out) if not with_rich else "━" in out
