"""The bench harness on CPU: correctness stage on tiny shapes, failures detected, results written."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from fusegraph.errors import UnsupportedError
from fusegraph.perf import bench
from fusegraph.perf.bench import check_outputs, markdown_table, run_bench, run_workload
from fusegraph.perf.devices import get_device
from fusegraph.perf.workloads import WORKLOADS, select

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU correctness-only path")


def by_name(name: str):
    return next(w for w in WORKLOADS if w.name == name)


def test_suites_select_workloads() -> None:
    assert [w.name for w in select("memory")][:5] == ["add_layernorm", "rmsnorm", "softmax", "bias_gelu",
                                                      "cross_entropy"]
    assert {w.suite for w in select("compute")} == {"compute"}
    assert len(select("all")) == len(WORKLOADS)
    with pytest.raises(UnsupportedError, match="unknown suite"):
        select("models-of-the-future")


def test_workload_bytes_and_flops_follow_benchmarks_md() -> None:
    full = by_name("add_layernorm").shapes["full"]
    assert by_name("add_layernorm").min_bytes(full) == 4 * 16384 * 4096 * 2 + 2 * 4096 * 2
    mlp = by_name("gelu_mlp")
    assert mlp.flops(mlp.shapes["full"]) == 4 * 8192 * 4096 * 16384
    sdpa = by_name("sdpa")
    assert sdpa.flops(sdpa.shapes["full"]) == 2 * 4 * 32 * 4096 * 4096 * 128


def test_eager_twins_match_the_reference_on_small_shapes() -> None:
    import fusegraph as fg

    for w in WORKLOADS:
        if w.missing():
            continue
        dims = w.shapes["small"]
        inputs = w.make_inputs(dims, "cpu")
        refs = fg.reference(w.graph(dims))(*inputs)
        err, ok = check_outputs(w.eager(*inputs), refs if isinstance(refs, tuple) else (refs,))
        assert ok, f"{w.name}: eager twin differs from the reference executor (rel err {err})"


def test_bench_correctness_stage_on_cpu(tmp_path) -> None:
    record = run_bench("add_layernorm,softmax", ["eager", "inductor"], "small", tmp_path, show_progress=False)
    assert record["timed"] is False and record["versions"]["torch"] == torch.__version__
    for r in record["results"]:
        assert r["status"] == "ok", r
        assert r["impls"]["fusegraph"]["ok"] and r["impls"]["eager"]["ok"]
        assert r["impls"]["fusegraph"]["device_ms"] is None and "timings need a GPU" in r["note"]
        assert "inductor" not in r["impls"]  # nothing to compare on CPU
    saved = json.loads(next(tmp_path.glob("bench-*.json")).read_text())
    assert [r["name"] for r in saved["results"]] == ["add_layernorm", "softmax"]
    table = next(tmp_path.glob("bench-*.md")).read_text()
    assert "| add_layernorm | ok |" in table and "torch " + torch.__version__ in table


def test_wrong_fusegraph_result_fails_the_workload(monkeypatch) -> None:
    def wrong(workload, dims, device):
        plan = workload.graph(dims).build(device=device)
        return lambda *xs: [t * 1.5 for t in plan.run(list(xs))]

    monkeypatch.setattr(bench, "_fusegraph_impl", wrong)
    quiet = bench.Progress(1, enabled=False)
    result = run_workload(by_name("softmax"), ["eager"], "small", "cpu", get_device("H200"), quiet)
    assert result.status == "failed" and "differs" in result.note
    assert result.impls["fusegraph"].ok is False and result.impls["fusegraph"].error > 0.1


def test_wrong_eager_twin_is_flagged_not_timed() -> None:
    softmax = by_name("softmax")
    broken = replace(softmax, eager=lambda x: (torch.softmax(x, 0),))  # wrong axis
    result = run_workload(broken, ["eager"], "small", "cpu", get_device("H200"), bench.Progress(1, enabled=False))
    assert result.status == "ok" and result.impls["eager"].ok is False and "wrong result" in result.impls["eager"].note
    assert "FAIL" in markdown_table({"versions": {"gpu": "none", "torch": "t", "triton": "t", "cuda": "-",
                                                  "cudnn": "-", "fusegraph": "0"}, "shapes": "small", "device": "cpu",
                                     "spec": {"name": "H200", "measured": []}, "timed": False,
                                     "results": [bench.asdict(result)]})


def test_missing_op_is_skipped_with_a_note() -> None:
    ghost = replace(by_name("softmax"), name="ghost", requires=("no_such_op_method",))
    result = run_workload(ghost, ["eager"], "small", "cpu", get_device("H200"), bench.Progress(1, enabled=False))
    assert result.status == "skipped" and "no_such_op_method" in result.note


def test_check_outputs_rejects_nan_and_shape_mismatch() -> None:
    ref = torch.randn(8, 8)
    assert check_outputs([ref.clone()], [ref]) == (0.0, True)
    assert check_outputs([torch.full((8, 8), float("nan"))], [ref])[1] is False
    assert check_outputs([ref[:4]], [ref])[1] is False
    assert check_outputs([ref.to(torch.bfloat16)], [ref])[1] is True  # within bf16 tolerance


def test_full_shapes_refused_without_gpu(tmp_path) -> None:
    with pytest.raises(UnsupportedError, match="need a GPU"):
        run_bench("memory", ["eager"], "full", tmp_path, show_progress=False)
    with pytest.raises(UnsupportedError, match="unknown --compare"):
        run_bench("memory", ["tvm"], "small", tmp_path, show_progress=False)


def test_timed_path_bookkeeping_with_fake_clocks(monkeypatch) -> None:
    """The GPU stage's arithmetic (% of floor, ratios, compile times, table) with fixed fake timings."""
    from fusegraph.perf.timing import Timing

    w = by_name("rmsnorm")

    def fake_device_time(fn, calls=100, repeats=5, graph=True):  # fn is partial(impl, *inputs)
        return Timing(0.4 if fn.func is w.eager else 0.2, "graph-replay", repeats)

    monkeypatch.setattr(bench, "device_time", fake_device_time)
    monkeypatch.setattr(bench, "call_latency", lambda fn, repeats=50: Timing(0.05, "per-call", repeats))
    spec = get_device("H200")
    result = run_workload(w, ["eager"], "small", "cpu", spec, bench.Progress(1, enabled=False), timed=True)
    assert result.status == "ok"
    fg_res, eager_res = result.impls["fusegraph"], result.impls["eager"]
    assert fg_res.device_ms == 0.2 and eager_res.device_ms == 0.4 and fg_res.latency_ms == 0.05
    floor = w.min_bytes(w.shapes["small"]) / spec.bandwidth * 1e3
    assert result.floor_ms == pytest.approx(floor)
    assert fg_res.pct_of_floor == pytest.approx(100 * floor / 0.2)
    assert fg_res.compile_cold_s is not None and fg_res.compile_warm_s is not None
    record = {"versions": {"gpu": "H200", "torch": "t", "triton": "t", "cuda": "c", "cudnn": "d", "fusegraph": "0"},
              "shapes": "small", "device": "cuda", "spec": spec.to_json(), "timed": True,
              "results": [bench.asdict(result)]}
    table = markdown_table(record)
    assert "| rmsnorm | ok |" in table and "2.00x" in table and "0.2000" in table
