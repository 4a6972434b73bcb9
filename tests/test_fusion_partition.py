"""Structure of fused plans: kernel counts, what is materialized, bytes, fallbacks, guards."""

from __future__ import annotations

import time
import warnings

import pytest
import torch

import fusegraph as fg
from conftest import assert_close, rand
from fusegraph import lower as lowering
from fusegraph.lower import FusionFallbackWarning
from fusegraph.settings import override

M, N = 6, 40


def _check(g: fg.Graph, feeds: list[torch.Tensor], **options: object) -> fg.Graph:
    plan = g.build(**options)
    outs = plan(*feeds)
    refs = fg.reference(g)(*feeds)
    outs = outs if isinstance(outs, tuple) else (outs,)
    refs = refs if isinstance(refs, tuple) else (refs,)
    for k, (o, r) in enumerate(zip(outs, refs, strict=True)):
        assert_close(o, r, what=f"output {k}")
    return plan


def _fused(plan: object) -> list:
    return [k for k in plan.kernels if k.backend == "triton"]  # type: ignore[attr-defined]


def test_add_layernorm_two_outputs_is_one_kernel() -> None:
    g = fg.Graph("add_ln")
    x, r = g.tensor((M, N), "bfloat16", "x"), g.tensor((M, N), "bfloat16", "r")
    w, b = g.tensor((N,), "bfloat16", "w"), g.tensor((N,), "bfloat16", "b")
    h = g.add(x, r)
    h.set_output()
    g.layernorm(h, weight=w, bias=b).set_output()
    plan = _check(g, [rand(M, N, dtype=torch.bfloat16) for _ in range(2)] + [rand(N, dtype=torch.bfloat16)] * 2)
    assert len(plan.kernels) == 1
    k = plan.kernels[0]
    assert (k.kind, k.backend, len(k.outputs)) == ("reduction", "triton", 2)
    assert k.cost.bytes == 4 * M * N * 2 + 2 * N * 2   # x, r read; h, y written; w, b read
    assert "@triton.jit" in k.source and "tl.sum" in k.source
    assert k.config["num_warps"] >= 1 and "BLOCK_C" in k.config


def test_chain_of_ten_pointwise_ops_with_broadcasting_is_one_kernel() -> None:
    g = fg.Graph("chain")
    x = g.tensor((4, M, N), "float32", "x")
    b = g.tensor((N,), "float32", "b")
    s = g.tensor((M, 1), "float32", "s")
    y = g.add(x, b)
    y = g.mul(y, s)
    y = g.exp(g.neg(g.abs(y)))
    y = g.sub(y, b)
    y = g.tanh(y)
    y = g.maximum(y, 0.1)
    y = g.div(y, g.add(s, 2.0))
    y = g.sigmoid(y)
    y.set_output()
    plan = _check(g, [rand(4, M, N), rand(N), rand(M, 1)])
    assert len(plan.kernels) == 1 and plan.kernels[0].kind == "pointwise"
    assert len(plan.kernels[0].nodes) >= 10
    assert plan.kernels[0].cost.bytes == (2 * 4 * M * N + N + M) * 4


@pytest.mark.parametrize("build", ["softmax", "log_softmax", "rmsnorm", "bias_gelu"])
def test_one_kernel_workloads(build: str) -> None:
    g = fg.Graph(build)
    x = g.tensor((M, N), "bfloat16", "x")
    v = g.tensor((N,), "bfloat16", "v")
    if build == "softmax":
        y = g.softmax(x, -1)
    elif build == "log_softmax":
        y = g.log_softmax(x, -1)
    elif build == "rmsnorm":
        y = g.rmsnorm(x, weight=v)
    else:
        y = g.gelu(g.add(x, v), approximate="tanh")
    y.set_output()
    plan = _check(g, [rand(M, N, dtype=torch.bfloat16), rand(N, dtype=torch.bfloat16)])
    assert len(plan.kernels) == 1 and plan.kernels[0].backend == "triton"
    assert plan.kernels[0].cost.bytes <= 2 * M * N * 2 + N * 2


def test_cross_entropy_forward_is_one_pass_with_partials_of_the_mean() -> None:
    # The mean over rows reduces across programs without atomics: each program sums its rows'
    # losses into one partial, and the pair's finish kernel reduces the partials in order.
    g = fg.Graph("ce")
    x = g.tensor((M, N), "bfloat16", "x")
    t = g.tensor((M,), "int64", "t")
    g.cross_entropy(x, t).set_output()
    plan = _check(g, [rand(M, N, dtype=torch.bfloat16), torch.randint(0, N, (M,))])
    assert len(plan.kernels) == 1
    kernel = plan.kernels[0]
    assert "_finish" in kernel.source and kernel.outputs[0].shape == ()
    assert kernel.cost.bytes < M * N * 2 + M * 8 + 64


def test_cross_entropy_without_reduction_stays_a_row_kernel() -> None:
    g = fg.Graph("ce_none")
    x = g.tensor((M, N), "bfloat16", "x")
    t = g.tensor((M,), "int64", "t")
    g.cross_entropy(x, t, reduction="none").set_output()
    plan = _check(g, [rand(M, N, dtype=torch.bfloat16), torch.randint(0, N, (M,))])
    assert len(plan.kernels) == 1 and "_finish" not in plan.kernels[0].source


def test_layernorm_backward_materializes_no_full_size_intermediate() -> None:
    g = fg.Graph("ln_bwd")
    gy, x = g.tensor((M, N), "float32", "g"), g.tensor((M, N), "float32", "x")
    w = g.tensor((N,), "float32", "w")
    for out in g.layernorm_backward(gy, x, weight=w):
        out.set_output()
    plan = _check(g, [rand(M, N), rand(M, N), rand(N)])
    # one pass: dx per row, and dw/db as per-program column partials reduced by a finish launch
    assert len(plan.kernels) == 1
    outputs = {n.id for n in plan.graph.outputs}
    assert {n.id for n in plan.kernels[0].outputs} == outputs
    assert plan.kernels[0].cost.bytes == 3 * M * N * 4 + 3 * N * 4   # g, x read, dx written; w, dw, db


def test_column_and_full_reductions() -> None:
    g = fg.Graph("cols")
    x = g.tensor((33, 7), "float32", "x")
    g.sum(g.mul(x, x), 0).set_output()
    g.max(x, None).set_output()
    g.mean(x, (0, 1)).set_output()
    plan = _check(g, [rand(33, 7)])
    assert all(k.backend == "triton" for k in plan.kernels)


def test_a_value_read_by_two_kernels_is_written_once() -> None:
    g = fg.Graph("shared")
    x = g.tensor((M, N), "float32", "x")
    h = g.exp(x)
    h.set_output()
    g.sum(h, 0).set_output()   # column reduction: another domain
    g.sum(h, 1).set_output()   # row reduction
    plan = _check(g, [rand(M, N)])
    writes = [n.id for k in plan.kernels for n in k.outputs]
    assert len(writes) == len(set(writes))


def test_op_without_codegen_runs_by_reference_in_the_same_plan() -> None:
    g = fg.Graph("cat")  # (matmul has its own kernel now: tests/test_compute_matmul.py)
    # (a concat of one dtype is generated code now, tests/test_fusion_slice_concat.py; one that
    # promotes its inputs is not)
    a, b = g.tensor((M, 8), "float16", "a"), g.tensor((M, 8), "float32", "b")
    y = g.relu(g.add(g.concat([a, b], 1), 1.0))
    y.set_output()
    plan = _check(g, [rand(M, 8, dtype=torch.float16), rand(M, 8)])
    backends = [k.backend for k in plan.kernels]
    assert "reference" in backends and "triton" in backends


def test_compile_failure_falls_back_with_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(source: str, name: str) -> None:
        raise RuntimeError("simulated Triton compile error")

    monkeypatch.setattr(lowering, "load_triton_function", broken)
    g = fg.Graph("fallback")
    x = g.tensor((M, N), "float32", "x")
    g.softmax(x, -1).set_output()
    with pytest.warns(FusionFallbackWarning, match="simulated Triton compile error"):
        plan = _check(g, [rand(M, N)])
    assert plan.kernels[0].backend == "reference" and "compile" in plan.kernels[0].note


def test_codegen_failure_falls_back_with_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(group: object, name: str) -> None:
        raise ValueError("simulated codegen bug")

    monkeypatch.setattr(lowering, "generate", broken)
    g = fg.Graph("fallback2")
    x = g.tensor((M, N), "float32", "x")
    g.relu(x).set_output()
    with pytest.warns(FusionFallbackWarning, match="simulated codegen bug"):
        _check(g, [rand(M, N)])


def test_new_shape_rebuilds_and_static_raises() -> None:
    g = fg.Graph("guards")
    x = g.tensor((M, N), "float32", "x")
    g.softmax(x, -1).set_output()
    plan = g.build()
    other = rand(3, 17)
    assert_close(plan(other), torch.softmax(other, -1))
    assert plan.variants() == 1
    plan(rand(3, 17))
    assert plan.variants() == 1   # cached by signature
    static = g.build(static=True)
    with pytest.raises(fg.ExecutionError, match="shape"):
        static(other)
    with pytest.raises(fg.ExecutionError, match="dtype"):
        static(rand(M, N, dtype=torch.float16))


def test_non_contiguous_input_rebuilds_with_its_strides() -> None:
    g = fg.Graph("strided")
    x = g.tensor((M, N), "float32", "x")
    g.softmax(x, -1).set_output()
    plan = g.build()
    xt = rand(N, M).t()
    assert not xt.is_contiguous()
    assert_close(plan(xt), torch.softmax(xt, -1))
    variant = next(iter(plan._variants.values()))
    assert f"* {M}" in variant.kernels[0].source   # strides are index arithmetic, no copy


def test_sources_are_dumped(tmp_path: object) -> None:
    g = fg.Graph("dumped")
    x = g.tensor((M, N), "float32", "x")
    g.relu(x).set_output()
    with override(dump_dir=str(tmp_path)):
        plan = g.build()
    files = sorted(p.name for p in tmp_path.iterdir())  # type: ignore[attr-defined]
    assert f"dumped.{plan.kernels[0].name}.py" in files
    g2 = fg.Graph("dumped")   # another graph of the same name (two torch.compile frames): its own files
    g2.exp(g2.tensor((M, N), "float32", "x")).set_output()
    with override(dump_dir=str(tmp_path)):
        g2.build()
    assert "exp" in (tmp_path / "dumped.2.plan.txt").read_text()          # type: ignore[operator]
    assert "relu" in (tmp_path / "dumped.plan.txt").read_text()           # type: ignore[operator]


def test_cpu_without_interpreter_runs_planned_kernels_by_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    g = fg.Graph("cpu")
    x = g.tensor((M, N), "float32", "x")
    g.softmax(x, -1).set_output()
    plan = _check(g, [rand(M, N)])
    assert plan.kernels[0].backend == "triton" and "reference" in plan.kernels[0].note


def test_plan_host_overhead_smoke() -> None:
    """Per-call Python work of a one-kernel plan, with the launch itself replaced by a no-op."""
    g = fg.Graph("overhead")
    x = g.tensor((M, N), "float32", "x")
    g.relu(x).set_output()
    plan = g.build()
    out = torch.empty(M, N)
    plan._steps = tuple((lambda args: [out], ins, outs, frees) for _, ins, outs, frees in plan._steps)
    plan._run_fast = plan._compile_run()
    t = rand(M, N)
    for _ in range(200):
        plan(t)
    calls = 2000
    start = time.perf_counter()
    for _ in range(calls):
        plan(t)
    per_call_us = (time.perf_counter() - start) / calls * 1e6
    warnings.warn(f"plan host overhead beyond the launch: {per_call_us:.2f} us/call", stacklevel=1)
    assert per_call_us < 50   # the GPU target is < 10 us; CI machines vary


def test_generated_run_path_equals_the_step_by_step_one() -> None:
    g = fg.Graph("two_kernels")
    x = g.tensor((M, N), "float32", "x")
    y = g.exp(x)
    y.set_output()
    x.set_output()                       # an input as output: copied, never aliased
    g.sum(y, 0).set_output()
    g.softmax(y, -1).set_output()
    plan = g.build()
    t = rand(M, N)
    fast, slow = plan.run([t]), plan.run_slow([t])
    assert len(fast) == len(slow) == 4
    for a, b in zip(fast, slow, strict=True):
        assert torch.equal(a, b)
    assert fast[1] is not t and torch.equal(fast[1], t)


def test_constants_are_made_once_and_outputs_do_not_alias_them() -> None:
    g = fg.Graph("consts")
    x = g.tensor((M, N), "float32", "x")
    c = g.constant(torch.arange(N, dtype=torch.float32))
    g.mul(x, c).set_output()
    c.set_output()
    plan = g.build()
    assert [k.kind for k in plan.kernels].count("constant") == 1
    t = rand(M, N)
    y, c1 = plan(t)
    assert_close(y, t * torch.arange(N, dtype=torch.float32))
    c1.zero_()                                  # the user's copy, not the plan's constant
    y2, c2 = plan(t)
    assert torch.equal(c2, torch.arange(N, dtype=torch.float32)) and torch.equal(y, y2)


@pytest.mark.parametrize("channels_last", [False, True])
def test_batchnorm_statistics_at_resnet_size_stay_split_reductions(channels_last) -> None:
    """Training batchnorm over [16, 64, 56, 56] (ResNet-50's first stage, NCHW or channels-last) at
    the default thresholds: the mean and the centered variance are split reductions (partials +
    finish: 50176 elements per channel, 64 channels) and the normalization a pointwise kernel,
    not one kernel looping over the batch per block of channels (KernelGroup.needs_split).
    Built only (the structure); the interpreter checks the numerics on small shapes elsewhere."""
    g = fg.Graph(name="bn_train")
    shape = (16, 64, 56, 56)
    strides = (64 * 56 * 56, 1, 56 * 64, 64) if channels_last else None
    x = g.tensor(shape, dtype="float16", name="x", strides=strides)
    xf = g.cast(x, "float32")
    mean = g.mean(xf, (0, 2, 3), keepdim=True)
    centered = g.sub(xf, mean)
    var = g.mean(g.mul(centered, centered), (0, 2, 3), keepdim=True)
    y = g.cast(g.mul(centered, g.rsqrt(g.add(var, 1e-5))), "float16")
    y.set_output()
    mean.set_output()
    var.set_output()
    plan = g.build(device="cpu")
    reductions = [k for k in plan.kernels if k.kind == "reduction"]
    assert len(reductions) == 2 and all("_finish" in k.source for k in reductions), \
        [(k.name, k.ops) for k in plan.kernels]
    assert [k.kind for k in plan.kernels].count("pointwise") == 1
