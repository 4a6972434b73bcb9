"""FUSEGRAPH_PROFILE_BUILD: where a build's time goes (stages, kernels, tuning, Triton compiles)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import fusegraph as fg
from fusegraph.settings import override
from fusegraph.tune import build_profile
from fusegraph.tune.build_profile import BuildProfile, kernels_built, mark, profile_build, stage


def norm_graph() -> fg.Graph:
    g = fg.Graph(name="profiled", compute_dtype="float32")
    x = g.tensor((8, 32), dtype="float32", name="x")
    w = g.tensor((32, 16), dtype="float32", name="w")
    h = g.layernorm(g.add(x, x), eps=1e-5)
    g.relu(g.matmul(h, w)).set_output()
    return g


def test_build_is_profiled_per_stage_and_kernel_when_enabled(capsys):
    with override(profile_build=True):
        plan = norm_graph().build(device="cpu")
    profile = plan.build_profile
    stages = profile.stage_seconds()
    for name in ("verify", "passes", "decompose + passes", "partition", "precompile (parallel)", "kernels",
                 "plan (memory plan, guards)"):
        assert name in stages, (name, stages)
    built = [n for r in profile.records for n in r.kernels]
    assert built == [k.name for k in plan.kernels]                  # every kernel, in plan order
    assert abs(sum(r.seconds for r in profile.records) - profile.total) < 0.05
    text = capsys.readouterr().err
    assert "build profile of profiled" in text and "kernels" in text
    assert "build profile" in profile.report() and profile.as_dict()["stages"]["verify"] >= 0.0


def test_build_is_not_profiled_by_default():
    plan = norm_graph().build(device="cpu")
    assert getattr(plan, "build_profile", None) is None
    assert build_profile.active() is None


def test_marks_attach_sub_stages_compiles_and_tuning_to_their_kernel():
    with profile_build("g", enabled=True) as profile:
        assert profile is not None
        mark("verify")
        with stage("first launch + check"):
            time.sleep(0.01)
        profile.add_compile("fg_k0_add", 0.25, cache_hit=False)
        profile.add_compile("fg_k0_add", 0.001, cache_hit=True)
        kernel = SimpleNamespace(name="fg_k0_add", tuning={"source": "tuned", "seconds": 0.5, "candidates": 5})
        kernels_built([kernel], 0)
        with profile_build("nested", enabled=True) as inner:
            assert inner is None                                      # a rebuild inside adds to the outer one
    assert build_profile.active() is None
    record = profile.records[-1]
    assert record.kernels == ("fg_k0_add",) and record.seconds >= 0.01
    assert [s.name for s in record.subs] == ["first launch + check", "tuning (tuned, 5 candidates)"]
    assert record.compiles == [("fg_k0_add", 0.25, False), ("fg_k0_add", 0.001, True)]
    text = profile.report()
    assert "Triton: 1 compiled, 0.25 s summed over threads, 1 from its cache" in text
    assert "first launch + check" in text


def test_triton_compile_listener_is_installed_and_restored():
    from triton import knobs

    before = knobs.compilation.listener
    seen = []
    knobs.compilation.listener = lambda **kw: seen.append(kw["cache_hit"])
    try:
        with profile_build("g", enabled=True) as profile:
            assert profile is not None
            times = SimpleNamespace(total=120_000)   # microseconds
            knobs.compilation.listener(src=SimpleNamespace(name="fg_k3_mul"), metadata={}, metadata_group={},
                                       times=times, cache_hit=False)
            mark("precompile (parallel)")
        assert profile.records[-1].compiles == [("fg_k3_mul", 0.12, False)]
        assert seen == [False]                                     # the previous listener still hears it
        assert knobs.compilation.listener is not None and knobs.compilation.listener.__name__ == "<lambda>"
    finally:
        knobs.compilation.listener = before


def test_report_lists_slowest_kernels_first_and_counts_the_rest():
    profile = BuildProfile("many")
    for k in range(15):
        profile.records.append(build_profile.StageRecord("kernel", 0.001 * k, (f"k{k}",)))
    profile.total = sum(r.seconds for r in profile.records)
    lines = profile.report(top_kernels=3).splitlines()
    assert lines[2].strip().startswith("k14") and lines[4].strip().startswith("k12")
    assert "12 more kernels" in lines[5]


def test_explain_shows_the_build_profile():
    with override(profile_build=True):
        plan = norm_graph().build(device="cpu")
    text = plan.explain()
    assert "build profile of profiled" in text and "partition" in text


def test_gc_is_paused_during_a_build_and_restored(monkeypatch):
    import gc

    from fusegraph import compiler

    seen = []
    real = compiler.optimize
    monkeypatch.setattr(compiler, "optimize", lambda g: seen.append(gc.isenabled()) or real(g))
    assert gc.isenabled()
    norm_graph().build(device="cpu")
    assert seen and not any(seen) and gc.isenabled()
    seen.clear()
    with override(build_gc_pause=False):
        norm_graph().build(device="cpu")
    assert seen and all(seen)
    gc.disable()
    try:
        norm_graph().build(device="cpu")
        assert not gc.isenabled()                       # a caller's own gc.disable() is left alone
    finally:
        gc.enable()


def test_a_nested_build_records_no_stages_of_its_own():
    """An inner plan built while a kernel is built (conv as GEMM): its stage marks and kernels are not
    the outer build's; its time, sub-stages and compiles go to the outer kernel being built."""
    with profile_build("outer", enabled=True) as profile:
        assert profile is not None
        mark("verify")
        with profile_build("inner", enabled=True) as inner:
            assert inner is None
            mark("verify")
            mark("passes")
            kernels_built([SimpleNamespace(name="fg_k0_matmul", tuning={})], 0)
            with stage("parallel compile"):
                time.sleep(0.01)
        kernels_built([SimpleNamespace(name="fg_k3_conv", tuning={})], 0)
        mark("plan (memory plan, guards)")
    assert [(r.name, r.kernels) for r in profile.records] == [
        ("verify", ()), ("kernel", ("fg_k3_conv",)), ("plan (memory plan, guards)", ())]
    conv = profile.records[1]
    assert [s.name for s in conv.subs] == ["parallel compile"] and conv.seconds >= 0.01
    with profile_build("next", enabled=True) as again:   # the nesting count went back to zero
        assert again is not None
        mark("verify")
    assert [r.name for r in again.records] == ["verify"]
