"""Matmul kernels: the epilogue claimed into one GEMM kernel, the generated Triton GEMM (under
the interpreter on CPU) against the reference, batch/transpose/broadcast geometry, cuBLAS as a
candidate."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import fusegraph as fg
from conftest import assert_close
from fusegraph.backends import cublas
from fusegraph.codegen.matmul import gemm_configs, gemm_geometry
from fusegraph.fusion.epilogue import MatmulGroup, claim_epilogues
from fusegraph.fusion.partition import partition_graph


def _run(g: fg.Graph, handles: list, tensors: list[torch.Tensor],
         out: object) -> tuple[fg.Plan, torch.Tensor, torch.Tensor]:
    plan = g.build(device="cpu")
    got = plan.execute(dict(zip(handles, tensors, strict=False)))[out]
    ref = fg.reference(g).execute(dict(zip(handles, tensors, strict=False)))[out]
    return plan, got, ref


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_linear_bias_gelu_is_one_triton_kernel(dtype: str) -> None:
    g = fg.Graph(name="mlp", compute_dtype="float32")
    x = g.tensor((40, 24), dtype=dtype, name="x")
    w = g.tensor((36, 24), dtype=dtype, name="w")
    b = g.tensor((36,), dtype=dtype, name="b")
    y = g.gelu(g.linear(x, w, b), approximate="tanh")
    y.set_output()
    td = getattr(torch, dtype)
    tensors = [torch.randn(40, 24, dtype=td), torch.randn(36, 24, dtype=td), torch.randn(36, dtype=td)]
    plan, got, ref = _run(g, [x, w, b], tensors, y)
    assert len(plan.kernels) == 1
    k = plan.kernels[0]
    assert (k.kind, k.backend) == ("matmul", "triton")
    assert k.ops == ["matmul", "add", "gelu"]
    assert "tl.dot" in k.source and "GROUP_M" in k.source
    # bytes: x, w, b read once, y written once (the product never reaches memory)
    assert k.cost.bytes == sum(t.numel() * t.element_size() for t in tensors) + 40 * 36 * td.itemsize
    assert_close(got, ref, what=f"linear+bias+gelu {dtype}")


def test_batched_matmul_with_trans_flags_broadcast_and_residual() -> None:
    g = fg.Graph(name="bmm", compute_dtype="float32")
    a = g.tensor((3, 2, 20, 33), dtype="float16", name="a")
    b = g.tensor((2, 50, 20), dtype="float16", name="b")
    r = g.tensor((3, 1, 33, 50), dtype="float16", name="r")
    y = g.add(g.mul(g.matmul(a, b, transpose_a=True, transpose_b=True), 0.5), r)
    y.set_output()
    tensors = [torch.randn(3, 2, 20, 33, dtype=torch.float16), torch.randn(2, 50, 20, dtype=torch.float16),
               torch.randn(3, 1, 33, 50, dtype=torch.float16)]
    plan, got, ref = _run(g, [a, b, r], tensors, y)
    assert [k.kind for k in plan.kernels] == ["matmul"]
    assert plan.kernels[0].ops == ["matmul", "mul", "add"]
    assert_close(got, ref, what="batched trans matmul + scale + residual")


def test_geometry_of_transposed_broadcast_operands() -> None:
    g = fg.Graph(name="geo")
    a = g.tensor((4, 8, 16), name="a")
    b = g.tensor((32, 16), name="b")
    y = g.matmul(a, b, transpose_b=True)
    y.set_output()
    g.validate()
    geo = gemm_geometry(y.node)
    assert (geo.batch, geo.m, geo.n, geo.k) == ((4,), 8, 32, 16)
    assert geo.a_strides == (16, 1) and geo.b_strides == (1, 16)
    assert geo.a_batch == (128,) and geo.b_batch == (0,)
    configs = gemm_configs(geo)
    assert all(c["BLOCK_M"] == 16 and c["BLOCK_N"] == 32 and c["BLOCK_K"] == 16 for c in configs)


def test_epilogue_not_claimed_when_the_product_has_another_reader() -> None:
    g = fg.Graph(name="two", compute_dtype="float32")
    x = g.tensor((16, 16), dtype="float32", name="x")
    w = g.tensor((16, 16), dtype="float32", name="w")
    p = g.matmul(x, w)
    y = g.relu(p)
    p.set_output()
    y.set_output()
    plan = g.build(device="cpu")
    kinds = [(k.kind, tuple(k.ops)) for k in plan.kernels]
    assert kinds == [("matmul", ("matmul",)), ("pointwise", ("relu",))]
    xs = [torch.randn(16, 16), torch.randn(16, 16)]
    outs = plan(*xs)
    assert_close(outs[0], xs[0] @ xs[1])
    assert_close(outs[1], torch.relu(xs[0] @ xs[1]))


def test_claim_epilogues_structure() -> None:
    g = fg.Graph(name="claim", compute_dtype="float32")
    x = g.tensor((8, 16), dtype="float16", name="x")
    w = g.tensor((16, 32), dtype="float16", name="w")
    y = g.cast(g.relu(g.matmul(x, w)), "float32")
    y.set_output()
    plan = g.build(device="cpu")
    items = claim_epilogues(partition_graph(plan.graph).items, plan.graph)
    assert len(items) == 1 and isinstance(items[0], MatmulGroup)
    assert [n.op for n in items[0].epilogue_nodes] == ["relu", "cast"]


def test_cublas_candidate_matches_reference() -> None:
    g = fg.Graph(name="lib", compute_dtype="float32")
    x = g.tensor((2, 12, 16), dtype="float32", name="x")
    w = g.tensor((20, 16), dtype="float32", name="w")
    b = g.tensor((20,), dtype="float32", name="b")
    y = g.relu(g.linear(x, w, b))
    y.set_output()
    plan = g.build(device="cpu")
    items = claim_epilogues(partition_graph(plan.graph).items, plan.graph)
    group = items[0]
    assert isinstance(group, MatmulGroup)
    from fusegraph.lower import reference_launch

    launch = cublas.cublas_launch(group, reference_launch(group.epilogue, "float32"))
    tensors = [torch.randn(2, 12, 16), torch.randn(20, 16), torch.randn(20)]
    by_id = {n.name: t for n, t in zip(plan.graph.inputs, tensors, strict=False)}
    got = launch([by_id[n.name] for n in group.inputs])[0]
    assert_close(got, torch.relu(torch.nn.functional.linear(*tensors)))


def _linear_group(bias_dtype: str, extra: str = "") -> tuple[MatmulGroup, Any]:
    g = fg.Graph(name="own", compute_dtype="float32")
    x = g.tensor((24, 16), dtype="float16", name="x")    # fp16: the interpreter's bf16 tl.dot is wrong
    w = g.tensor((16, 40), dtype="float16", name="w")
    b = g.tensor((40,), dtype=bias_dtype, name="b")
    bias = b if bias_dtype == "float16" else g.cast(b, "float16")
    y = g.add(g.matmul(x, w), bias)
    if extra == "relu":
        y = g.relu(y)
    y.set_output()
    plan = g.build(device="cpu")
    items = claim_epilogues(partition_graph(plan.graph).items, plan.graph)
    assert len(items) == 1 and isinstance(items[0], MatmulGroup)
    return items[0], plan


@pytest.mark.parametrize("bias_dtype", ["float16", "float32"])
def test_cublas_computes_a_bias_epilogue_itself(bias_dtype: str) -> None:
    """matmul + bias (the bias cast to 16 bits first, as autocast writes a linear layer) is one addmm:
    the cuBLAS candidate needs no second launch, and matches the graph's reference."""
    group, plan = _linear_group(bias_dtype)
    own = cublas.own_epilogue(group, "cpu")
    assert own is not None and own.kind == "bias" and own.cast_bias == (bias_dtype == "float32")
    assert "addmm" in cublas.describe(group, own)
    x, w = torch.randn(24, 16).half(), torch.randn(16, 40).half()
    b = torch.randn(40).to(getattr(torch, bias_dtype))
    by_name = {"x": x, "w": w, "b": b}

    def no_epilogue(args: Any) -> Any:
        raise AssertionError("the epilogue must not run")

    got = cublas.cublas_launch(group, no_epilogue, own=own)([by_name[n.name] for n in group.inputs])[0]
    want = plan.run([by_name[n.name] for n in plan.graph.inputs])[0]
    assert got.dtype == torch.float16 and got.shape == (24, 40)
    assert_close(got, want, what="addmm vs reference")


def test_cublas_own_epilogue_only_for_its_forms() -> None:
    group, _ = _linear_group("float16", extra="relu")   # bias then relu: cuBLAS + our epilogue kernel
    assert cublas.own_epilogue(group, "cpu") is None
    g = fg.Graph(name="cast", compute_dtype="float32")
    x = g.tensor((24, 16), dtype="bfloat16", name="x")
    w = g.tensor((16, 40), dtype="bfloat16", name="w")
    g.cast(g.matmul(x, w), "float32").set_output()
    plan = g.build(device="cpu")
    group = claim_epilogues(partition_graph(plan.graph).items, plan.graph)[0]
    assert isinstance(group, MatmulGroup)
    cpu_out_dtype = cublas.out_dtype_supported("cpu")   # torch's CPU mm has no out_dtype (2.13)
    assert (cublas.own_epilogue(group, "cpu") is not None) == cpu_out_dtype


@pytest.mark.parametrize("keep_preactivation", [False, True])
def test_cublas_adds_the_bias_first_then_launches_the_rest(keep_preactivation: bool) -> None:
    """bias + gelu (the pre-activation kept too, as a training forward saves it): the cuBLAS candidate
    is addmm, then our kernel for the gelu alone reading addmm's result; outputs in the group's order
    and equal to the reference. An epilogue that also reads the raw product does not split."""
    from fusegraph.lower import reference_launch

    g = fg.Graph(name="linear_gelu", compute_dtype="float32")
    x, w = g.tensor((24, 16), dtype="float16", name="x"), g.tensor((16, 40), dtype="float16", name="w")
    b = g.tensor((40,), dtype="float32", name="b")
    h = g.add(g.matmul(x, w), g.cast(b, "float16"))
    if keep_preactivation:
        h.set_output()
    g.gelu(h).set_output()
    plan = g.build(device="cpu")
    (group,) = claim_epilogues(partition_graph(plan.graph).items, plan.graph)
    assert isinstance(group, MatmulGroup) and cublas.own_epilogue(group, "cuda") is None
    split = cublas.bias_first(group, "cuda")
    assert split is not None and split.own.cast_bias and split.add.op == "add"
    assert "add" not in [n.op for n in split.rest.nodes] and len(split.rest.stores) == 1
    assert cublas.library_form(group, "cuda") == "bias_first" and cublas.bias_first(group, "cpu") is None
    launch = cublas.cublas_launch(group, reference_launch(split.rest, "float32"), split=split)
    inputs = {"x": torch.randn(24, 16).half(), "w": torch.randn(16, 40).half(), "b": torch.randn(40)}
    got = launch([inputs[n.name] for n in group.inputs])
    want = plan.run([inputs[n.name] for n in plan.graph.inputs])
    assert len(got) == len(want) == (2 if keep_preactivation else 1)
    for a, e in zip(got, want, strict=True):
        assert a.dtype == e.dtype and a.shape == e.shape
        assert_close(a, e, what="addmm + the rest vs reference")

    g = fg.Graph(name="raw_product_read_twice", compute_dtype="float32")
    x, w = g.tensor((24, 16), dtype="float16", name="x"), g.tensor((16, 40), dtype="float16", name="w")
    p = g.matmul(x, w)
    g.mul(g.add(p, g.tensor((40,), dtype="float16", name="b")), p).set_output()
    plan = g.build(device="cpu")
    (group,) = claim_epilogues(partition_graph(plan.graph).items, plan.graph)
    assert isinstance(group, MatmulGroup) and cublas.bias_first(group, "cuda") is None


def test_check_same_rejects_a_wrong_candidate() -> None:
    from fusegraph.backends.matmul_kernel import check_same

    want = [torch.randn(8, 8, dtype=torch.float16)]
    check_same([want[0].clone()], want, "same")
    with pytest.raises(ValueError, match="relative error"):
        check_same([want[0] * 1.1], want, "scaled")
    with pytest.raises(ValueError, match="non-finite"):
        check_same([torch.full((8, 8), float("nan"), dtype=torch.float16)], want, "nan")


def test_check_same_limit_follows_a_16_bit_product() -> None:
    """An fp32 output of a bf16 product (matmul + cast) gets the 16-bit limit: a different summation
    order flips bf16 roundings (3e-3 on GPT-2's LM-head backward), which is no wrong result."""
    from fusegraph.backends.matmul_kernel import check_same

    torch.manual_seed(0)
    exact = torch.randn(64, 64, dtype=torch.float64)
    one_order = [exact.to(torch.bfloat16).float()]
    other = exact + exact.abs() * 2.0 ** -9 * torch.randint(0, 2, exact.shape)   # half-ulp nudges
    other_order = [other.to(torch.bfloat16).float()]
    with pytest.raises(ValueError, match="limit 1e-03"):
        check_same(other_order, one_order, "fp32 limit")
    check_same(other_order, one_order, "bf16 product", low_precision=True)
    with pytest.raises(ValueError, match="relative error"):
        check_same([one_order[0] * 1.1], one_order, "scaled", low_precision=True)


GEOMETRIES = {  # name: (build, input shapes, expected ops of the kernels)
    "vector_b": (lambda g, a, b: g.relu(g.matmul(a, b)), [(20, 16), (16,)], [["matmul", "relu"]]),
    "vector_a": (lambda g, a, b: g.relu(g.matmul(a, b)), [(16,), (16, 24)], [["matmul", "relu"]]),
    "one_row": (lambda g, a, b: g.mul(g.matmul(a, b), 2.0), [(1, 16), (16, 24)], [["matmul", "mul"]]),
    "cast_up": (lambda g, a, b: g.cast(g.matmul(a, b), "float32"), [(20, 16), (16, 24)], [["matmul", "cast"]]),
    "batch_broadcast_residual": (lambda g, a, b, r: g.add(g.matmul(a, b), r), [(3, 20, 16), (16, 24), (20, 24)],
                                 [["matmul", "add"]]),
    "per_row_scale": (lambda g, a, b, s: g.mul(g.matmul(a, b), s), [(3, 20, 16), (3, 16, 24), (3, 20, 1)],
                      [["matmul", "mul"]]),
    "transposed_reader_not_claimed": (lambda g, a, b: g.relu(g.transpose(g.matmul(a, b), 0, 1)),
                                      [(20, 16), (16, 24)], [["matmul"], ["transpose", "relu"]]),
    "swiglu": (lambda g, x, w1, w3: g.mul(g.silu(g.matmul(x, w1)), g.matmul(x, w3)),
               [(20, 16), (16, 24), (16, 24)], [["matmul"], ["matmul", "silu", "mul"]]),
}


@pytest.mark.parametrize("case", sorted(GEOMETRIES))
def test_gemm_geometries_and_epilogue_claims(case: str) -> None:
    build, shapes, expected = GEOMETRIES[case]
    g = fg.Graph(name=case, compute_dtype="float32")
    ins = [g.tensor(s, dtype="float16", name=f"i{k}") for k, s in enumerate(shapes)]
    y = build(g, *ins)
    y.set_output()
    plan = g.build(device="cpu")
    assert [k.ops for k in plan.kernels] == expected
    xs = [torch.randn(*s, dtype=torch.float16) for s in shapes]
    assert_close(plan(*xs), fg.reference(g)(*xs), what=case)


@pytest.mark.parametrize("trans_a,trans_b,batch", [(False, False, ()), (False, True, (2,)), (True, False, (2,)),
                                                   (True, True, ())])
def test_tma_descriptor_path_matches_reference(trans_a: bool, trans_b: bool, batch: tuple) -> None:
    from fusegraph.backends.matmul_kernel import GemmLaunch
    from fusegraph.codegen.compile import load_triton_function
    from fusegraph.codegen.matmul import generate_gemm

    m, n, k = 40, 24, 48  # edges in every dim (K = 1.5 tiles of 32): TMA zero-fills past them
    a_shape = (*batch, k, m) if trans_a else (*batch, m, k)
    b_shape = (n, k) if trans_b else (k, n)
    g = fg.Graph(name=f"tma_{trans_a}_{trans_b}", compute_dtype="float32")
    a = g.tensor(a_shape, dtype="float16", name="a")
    b = g.tensor(b_shape, dtype="float16", name="b")
    bias = g.tensor((n,), dtype="float16", name="bias")
    y = g.relu(g.add(g.matmul(a, b, transpose_a=trans_a, transpose_b=trans_b), bias))
    y.set_output()
    plan = g.build(device="cpu")
    (group,) = claim_epilogues(partition_graph(plan.graph).items, plan.graph)
    assert isinstance(group, MatmulGroup)
    gen = generate_gemm(group, f"tma_test_{int(trans_a)}{int(trans_b)}{len(batch)}")
    assert gen.tma and "tl.make_tensor_descriptor" in gen.source
    # a 2-D product stores its fp16 tile through a descriptor (its shared-memory tile counts in the configs'
    # stages); a batched one stores through pointers
    assert gen.tma_store_itemsize == (0 if batch else 2)
    assert ("_desc.store(" in gen.source) is not bool(batch)
    tma_configs = [c for c in gemm_configs(gen.geometry, tma=True) if c.get("USE_TMA")]
    assert tma_configs
    launch = GemmLaunch(load_triton_function(gen.source, gen.name), gen, dict(tma_configs[0], BLOCK_K=32), "cpu")
    xs = {a: torch.randn(a_shape, dtype=torch.float16), b: torch.randn(b_shape, dtype=torch.float16),
          bias: torch.randn(n, dtype=torch.float16)}
    by_name = {h.name: t for h, t in xs.items()}
    (got,) = launch([by_name[node.name] for node in gen.inputs])
    assert_close(got, fg.reference(g).execute(xs)[y], what="TMA GEMM")


def test_tma_not_planned_for_unaligned_strides() -> None:
    from fusegraph.codegen.matmul import GemmGeometry, tma_plan

    aligned = GemmGeometry((), 40, 24, 48, (48, 1), (24, 1), (), ())
    assert tma_plan(aligned, 2) is not None
    odd_rows = GemmGeometry((), 40, 24, 33, (33, 1), (24, 1), (), ())  # 66-byte rows
    assert tma_plan(odd_rows, 2) is None


def test_decode_gemv_rule_takes_cublas_untimed():
    """backends/matmul_kernel._library_only: a single-entry GEMM of <= gemm_library_max_m rows (a
    decode GEMV streaming its weight) runs in cuBLAS on a GPU; more rows, a batch, or the setting at 0
    go through the usual candidates."""
    from types import SimpleNamespace

    from fusegraph.backends.matmul_kernel import _library_only
    from fusegraph.settings import override

    def gen(m: int, batch: int = 1) -> Any:
        return SimpleNamespace(geometry=SimpleNamespace(m=m, batch_numel=batch))

    assert _library_only(gen(1)) and _library_only(gen(16))
    assert not _library_only(gen(17)) and not _library_only(gen(1, batch=32))
    with override(gemm_library_max_m=0):
        assert not _library_only(gen(1))


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_decode_gemv_kernel_with_fused_epilogue(rows: int, dtype: str) -> None:
    """A few rows times an nn.Linear weight ([N, K], read along K) run the weight-streaming GEMV
    variant (codegen/matmul.py write_gemv), bias + silu + residual in its store; K not a multiple of
    BLOCK_K and N not a multiple of BLOCK_N cover the edges. Off (settings.gemv_kernel): the usual
    candidates."""
    from fusegraph.settings import override

    g = fg.Graph(name="gemv", compute_dtype="float32")
    x = g.tensor((1, rows, 1100), dtype=dtype, name="x")
    w = g.tensor((72, 1100), dtype=dtype, name="w")
    b = g.tensor((72,), dtype=dtype, name="b")
    r = g.tensor((1, rows, 72), dtype=dtype, name="r")
    y = g.add(g.silu(g.linear(x, w, b)), r)
    y.set_output()
    td = getattr(torch, dtype)
    tensors = [torch.randn(1, rows, 1100, dtype=td), torch.randn(72, 1100, dtype=td) / 30,
               torch.randn(72, dtype=td), torch.randn(1, rows, 72, dtype=td)]
    plan, got, ref = _run(g, [x, w, b, r], tensors, y)
    assert len(plan.kernels) == 1
    k = plan.kernels[0]
    assert k.backend == "triton" and k.config["VARIANT"] == "gemv", k.config
    assert k.ops == ["matmul", "add", "silu", "add"]
    assert "tl.dot" not in k.source and f"acc{rows - 1} +=" in k.source
    assert k.config["BLOCK_M"] == (1 if rows == 1 else 4)
    assert_close(got, ref, what=f"gemv {rows} rows {dtype}")
    with override(gemv_kernel=False):
        plan, got, ref = _run(g, [x, w, b, r], tensors, y)
    assert plan.kernels[0].config.get("VARIANT", "tiled") != "gemv"
    assert_close(got, ref, what=f"gemm {rows} rows {dtype}")
    explicit = g.build(device="cpu", gemm_variant="tiled")   # an explicit variant wins over the rule
    assert explicit.kernels[0].config.get("VARIANT", "tiled") == "tiled"


def test_gemv_covers_only_few_rows_of_a_weight_read_along_k() -> None:
    """codegen/gemm_configs.gemv_covers: one batch entry (after folding), <= GEMV_MAX_M rows, B'
    with unit stride along K; a [K, N] weight (x @ W) or a batched GEMM keeps the GEMM kernels."""
    from fusegraph.codegen.gemm_configs import GEMV_MAX_M, GemmGeometry, gemv_configs, gemv_covers

    linear = GemmGeometry((), 1, 4096, 4096, (4096, 1), (1, 4096), (), ())
    assert gemv_covers(linear)
    (cfg,) = gemv_configs(linear)
    assert (cfg["VARIANT"], cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]) == ("gemv", 1, 1, 1024)
    assert not gemv_covers(GemmGeometry((), GEMV_MAX_M + 1, 4096, 4096, (4096, 1), (1, 4096), (), ()))
    assert not gemv_covers(GemmGeometry((), 1, 4096, 4096, (4096, 1), (4096, 1), (), ()))   # W stored [K, N]
    assert not gemv_covers(GemmGeometry((8,), 1, 64, 64, (64, 1), (1, 64), (64,), (4096,)))
    assert gemv_configs(GemmGeometry((), 4, 4096, 4096, (4096, 1), (1, 4096), (), ()))[0]["BLOCK_N"] == 8


def test_the_cublas_candidates_epilogue_kernel_precompiles_when_that_candidate_runs(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """plan_precompile adds the generated epilogue kernel the cuBLAS candidate launches (fg_kK_matmul_
    epilogue) exactly when the GEMM's build will run that candidate: timed (it is the baseline the
    Triton candidates are checked against) or chosen; not when cuBLAS computes the epilogue itself,
    when the cache says Triton, or with autotuning off."""
    from fusegraph.backends import matmul_kernel, plan_precompile
    from fusegraph.settings import override
    from fusegraph.tune import clear_memo, keys, tune

    monkeypatch.setattr(keys, "gpu_identity", lambda: {"name": "test GPU", "capability": "9.0"})
    monkeypatch.setattr("fusegraph.tune.autotuner.launch_bound", lambda floor: False)   # the shape is timed
    named: list[str] = []
    monkeypatch.setattr(plan_precompile, "fused_warmup_jobs",
                        lambda group, k, device, options, seen=None, name=None, **kw: named.append(str(name)) or [])
    monkeypatch.setattr(matmul_kernel, "gemm_warmup_jobs", lambda *a, **kw: [])
    relu, _ = _linear_group("float16", extra="relu")        # bias + relu: a second launch after cuBLAS
    bias_only, _ = _linear_group("float16")                  # addmm computes it: no second launch
    clear_memo()
    with override(cache_dir=str(tmp_path), autotune=True):
        second = matmul_kernel.cublas_second_launch(relu, "fg_k0_matmul", "cuda")
        assert second is not None and [n.op for n in second.nodes] == ["relu"]   # addmm adds the bias
        assert matmul_kernel.cublas_second_launch(bias_only, "fg_k0_matmul", "cuda") is None
        assert matmul_kernel.cublas_second_launch(relu, "fg_k0_matmul", "cpu") is None
        plan_precompile.precompile_jobs([relu], "cuda", {}, "float32", set())
        assert named == ["fg_k0_matmul_epilogue"]
        gen, configs, runs = matmul_kernel.build_preview(relu, "fg_k0_matmul", "cuda")
        assert gen is not None and len(configs) > 1 and runs
        candidates = matmul_kernel._candidates(configs, gen)
        key = matmul_kernel._tune_key(gen, "cuda", cublas.library_form(relu, "cuda"))
        triton_pick = next(c for c in candidates if c["backend"] == "triton")
        tune("fg_k0_matmul", key, candidates, lambda c: 1.0 if c == triton_pick else 2.0)
        clear_memo()
        _, cached, runs = matmul_kernel.build_preview(relu, "fg_k0_matmul", "cuda")
        assert not runs and cached == [{a: v for a, v in triton_pick.items() if a != "backend"}]
    with override(autotune=False):
        assert matmul_kernel.cublas_second_launch(relu, "fg_k0_matmul", "cuda") is None
    clear_memo()
