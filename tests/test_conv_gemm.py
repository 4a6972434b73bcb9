"""backends/conv_gemm.py: 1x1, stride-1 channels-last conv groups offered as a GEMM plan. Which groups
get the candidate (and why not, under FUSEGRAPH_DEBUG), and, through Triton's interpreter in fp16, that
its inner plan computes the group (conv, folded batchnorm, residual with or without its own scale,
activation) as the reference conv + our epilogue kernel does, in the group's output layout."""

from __future__ import annotations

import os
from typing import Any

import pytest

import fusegraph as fg
from conftest import assert_close, single_conv_group
from fusegraph.backends import conv_gemm
from fusegraph.backends.conv_kernel import LIBRARY_SOURCES, conv_group_kernel, library_candidates, library_source
from fusegraph.fusion.epilogue import ConvGroup, claim_epilogues
from fusegraph.fusion.partition import partition_graph
from fusegraph.settings import override

INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
on_the_interpreter = pytest.mark.skipif(not INTERPRETING, reason="runs the kernel on CPU tensors: TRITON_INTERPRET=1")


def _group(kind: str, *, k: int = 1, stride: int = 1, layout: str | None = "NHWC", dtype: str = "float16",
           bias: bool = False) -> ConvGroup:
    """conv2d (C_in 32 -> 24, k x k) + the inference epilogue `kind` as one ConvGroup."""
    g = fg.Graph(name=f"conv_gemm_{kind}", compute_dtype="float32")
    x = g.tensor((2, 32, 6, 5), dtype=dtype, name="x", **({"layout": layout} if layout else {}))
    w = g.tensor((24, 32, k, k), dtype=dtype, name="w")
    b = g.tensor((24,), dtype=dtype, name="b") if bias else None
    y = g.conv2d(x, w, b, stride=stride, padding=k // 2)
    oh, ow = -(-6 // stride), -(-5 // stride)

    def bn(v: Any, tag: str) -> Any:
        rm, rv = g.tensor((24,), dtype="float32", name=f"rm{tag}"), g.tensor((24,), dtype="float32", name=f"rv{tag}")
        gw, gb = g.tensor((24,), dtype=dtype, name=f"gw{tag}"), g.tensor((24,), dtype=dtype, name=f"gb{tag}")
        return g.batch_norm(v, rm, rv, weight=gw, bias=gb, training=False)

    if kind != "none":
        y = bn(y, "")
        if kind in ("residual", "bn_residual"):
            r = g.tensor((2, 24, oh, ow), dtype=dtype, name="r", **({"layout": layout} if layout else {}))
            y = g.add(y, bn(r, "r") if kind == "bn_residual" else r)
        y = g.gelu(y, approximate="tanh") if kind == "gelu" else (g.silu(y) if kind == "silu" else g.relu(y))
    y.set_output()
    plan = g.build(device="cpu")
    (item,) = claim_epilogues(partition_graph(plan.graph).items, plan.graph)
    assert isinstance(item, ConvGroup)
    return item


def _epilogue_kernel(group: ConvGroup) -> Any:
    from fusegraph.lower import fused_kernel
    return fused_kernel(group.epilogue, "k_epilogue", "float32", "cpu", {}) if group.epilogue_nodes else None


def test_offered_for_dense_channels_last_1x1_stride_1_on_a_gpu_only(capsys: pytest.CaptureFixture[str]) -> None:
    group = _group("residual")
    offered = library_candidates(group, "cuda", "k", "float32", _epilogue_kernel(group))
    assert isinstance(offered.get("conv_as_gemm"), conv_gemm.ConvAsGemm)      # planned, built lazily
    assert "conv_as_gemm" not in library_candidates(group, "cpu", "k")
    with override(conv_as_gemm=False):
        assert "conv_as_gemm" not in library_candidates(group, "cuda", "k", "float32", _epilogue_kernel(group))
    with override(debug=1):
        for label, other in [("k_3x3", _group("residual", k=3)), ("k_s2", _group("residual", stride=2)),
                             ("k_nchw", _group("residual", layout=None)),
                             ("k_fp32", _group("residual", dtype="float32"))]:
            assert "conv_as_gemm" not in library_candidates(other, "cuda", label, "float32", _epilogue_kernel(other))
        grouped = single_conv_group((2, 32, 6, 5), (24, 16, 1, 1), padding=0, groups=2)
        assert "conv_as_gemm" not in library_candidates(grouped, "cuda", "k_grouped", "float32",
                                                        _epilogue_kernel(grouped))
    printed = capsys.readouterr().out
    assert "k_3x3: conv as GEMM not used: kernel (3, 3) stride (1, 1)" in printed
    assert "k_s2: conv as GEMM not used: kernel (1, 1) stride (2, 2)" in printed
    assert "k_nchw: conv as GEMM not used: input or output not dense channels-last" in printed
    assert "k_fp32: conv as GEMM not used: dtype float32" in printed
    assert "k_grouped: conv as GEMM not used:" in printed and "groups 2" in printed


@on_the_interpreter
@pytest.mark.parametrize("kind,bias", [("residual", False), ("bn_residual", False), ("relu", False), ("none", True),
                                       ("none", False), ("gelu", True), ("silu", False), ("relu", True)])
def test_the_inner_gemm_plan_computes_the_group(kind: str, bias: bool) -> None:
    from fusegraph.lower import _example_inputs

    group = _group(kind, bias=bias)
    launch = library_candidates(group, "cuda", "k", "float32", _epilogue_kernel(group))["conv_as_gemm"]
    launch.device = "cpu"                                 # the inner plan built here, run by the interpreter
    args = _example_inputs(group.inputs, "cpu")
    for k in launch.leaf_at:                              # BN variances positive (as conv_kernel._choose makes them)
        args[k] = args[k].abs() + 0.5
    plain = conv_group_kernel(group, "k", "float32", "cpu", {})   # the reference conv + our epilogue kernel
    (want,), (got,) = plain.launch(args), launch(args)
    assert got.shape == want.shape and got.stride() == want.stride() and got.dtype == want.dtype
    assert_close(got, want, tol=5e-3, what=f"conv as GEMM, {kind}")
    matmuls = [k for k in launch.prepare().kernels if k.kind == "matmul"]
    assert len(matmuls) == 1 and matmuls[0].backend == "triton"
    assert len(launch.prepare().kernels) == 1             # the epilogue in the GEMM's store: one kernel
    source = library_source("conv_as_gemm", launch, "conv2d", "NHWC (channels-last)", group)
    assert source.startswith(LIBRARY_SOURCES["conv_as_gemm"].split("{")[0]) and "as GEMM [60, 32] x [32, 24]" in source
    again = library_candidates(group, "cuda", "k2", "float32", _epilogue_kernel(group))["conv_as_gemm"]
    again.device = "cpu"
    assert again.prepare() is launch.prepare()            # one inner plan per GEMM and epilogue form
    if launch.fused is not None and launch.fused.fold:    # vectors refolded when a BN input changes in place
        args[launch.leaf_at[-1]].mul_(1.5)
        assert_close(launch(args)[0], plain.launch(args)[0], tol=5e-3, what=f"{kind} after an in-place update")


def test_the_inner_plans_candidates_are_precompiled_with_the_outer_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    """plan_precompile submits the inner GEMM plan's compile jobs with the outer plan's (one parallel
    batch) instead of each inner plan compiling its own when the conv kernel is built."""
    from fusegraph.backends import matmul_kernel, plan_precompile
    from fusegraph.fusion.epilogue import MatmulGroup

    asked: list[tuple[Any, str, str]] = []

    def jobs(item: Any, name: str, device: str, seen: Any, candidates: str = "full") -> list[str]:
        asked.append((item, name, device))
        assert candidates == "conv"      # the inner plan's GEMM candidate set
        return [f"compile {name}"]

    monkeypatch.setattr(matmul_kernel, "gemm_warmup_jobs", jobs)
    group = _group("residual")
    got = plan_precompile.precompile_jobs([group], "cuda", {}, "float32", set())
    ((item, name, device),) = asked
    assert isinstance(item, MatmulGroup) and name == "fg_k0_matmul" and device == "cuda"   # as the inner build names it
    assert got[-1] == "compile fg_k0_matmul"
    assert [n.op for n in item.epilogue_nodes][-1] == "cast" and item.compute.spec.shape == (60, 24)
    # an inner plan that exists already compiles nothing more
    launch = library_candidates(group, "cuda", "k", "float32", _epilogue_kernel(group))["conv_as_gemm"]
    monkeypatch.setitem(conv_gemm._PLANS, launch.plan_key(), object())
    assert plan_precompile.conv_gemm_warmup_jobs(group, 0, "cuda", "float32", set()) == []
    with override(conv_as_gemm=False):
        assert plan_precompile.conv_gemm_warmup_jobs(group, 0, "cuda", "float32", set()) == []
    asked.clear()
    seen: set[str] = set()
    twice = plan_precompile.precompile_jobs([_group("none"), _group("none")], "cuda", {}, "float32", seen)
    assert len(asked) == 1 and twice == ["compile fg_k0_matmul"]      # a repeated block's twin adds nothing


def test_the_inner_gemm_plan_takes_the_conv_candidate_set(monkeypatch: pytest.MonkeyPatch) -> None:
    """The inner plan's GEMM is offered the "conv" candidate set (codegen/gemm_configs.GEMM_CANDIDATE_SETS:
    no tiled TMA config, one persistent config), both where the outer plan precompiles it and where it is
    built; an ordinary plan's GEMM keeps the full set."""
    from fusegraph.backends import matmul_kernel
    from fusegraph.backends.plan_precompile import conv_gemm_warmup_jobs

    asked: list[str] = []
    real = matmul_kernel._gemm_candidates

    def spy(gen: Any, device: str, group: Any, candidates: str = "full") -> Any:
        asked.append(candidates)
        return real(gen, device, group, candidates)

    monkeypatch.setattr(matmul_kernel, "_gemm_candidates", spy)
    group = _group("relu")
    conv_gemm_warmup_jobs(group, 0, "cuda", "float32", set())   # the outer plan precompiles it (here: planned)
    assert asked and set(asked) == {"conv"}
    launch = library_candidates(group, "cuda", "k", "float32", _epilogue_kernel(group))["conv_as_gemm"]
    launch.device = "cpu"
    conv_gemm._PLANS.pop(launch.plan_key(), None)
    launch.prepare()                                             # the inner plan's build
    assert asked and set(asked) == {"conv"}
    asked.clear()
    g = fg.Graph("mm")
    g.matmul(g.tensor((64, 32), "float16", "a"), g.tensor((32, 48), "float16", "b")).set_output()
    g.build(device="cpu")
    assert asked and set(asked) == {"full"}
