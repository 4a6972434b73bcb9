"""Quantize epilogue: matmul -> scale -> quantize (given scale, delayed scaling) to int8 / fp8 with
the per-tensor amax of the same product, fused into the GEMM: one kernel writes the quantized
tile and folds the tile's max into the amax with an atomic max (order-free, so deterministic).
int8 numerics under the interpreter exactly; fp8 structurally plus numerics away from the
interpreter's fp32 -> fp8 rounding bug (a mantissa carry into the exponent is dropped: 31.9 -> 16)."""

from __future__ import annotations

import pytest
import torch

import fusegraph as fg
from fusegraph.backends import cublas
from fusegraph.backends.matmul_kernel import GemmLaunch, _reference_group_launch
from fusegraph.codegen.compile import load_triton_function
from fusegraph.codegen.matmul import generate_gemm
from fusegraph.fusion.epilogue import MatmulGroup, claim_epilogues
from fusegraph.fusion.partition import partition_graph
from fusegraph.lower import reference_launch


def _quant_graph(qdtype: str, m: int = 40, k: int = 64, n: int = 48, dtype: str = "float16"):
    g = fg.Graph(name=f"qgemm_{qdtype}_{m}_{k}", compute_dtype="float32")
    x = g.tensor((m, k), dtype=dtype, name="x")
    w = g.tensor((k, n), dtype=dtype, name="w")
    s = g.tensor((), dtype="float32", name="s")
    y = g.mul(g.matmul(x, w), 0.5)
    q, _ = g.quantize(y, qdtype, scale=s)
    amax = g.max(g.abs(y))
    q.set_output()
    amax.set_output()
    td = getattr(torch, dtype)
    feeds = {x: torch.randn(m, k, dtype=td), w: torch.randn(k, n, dtype=td), s: torch.tensor(0.05)}
    return g, q, amax, feeds


def _fp8_close(got: torch.Tensor, want: torch.Tensor) -> None:
    got, want = got.float(), want.float()
    carry_bug = (got * 2 == want) & (want.abs().log2() == want.abs().log2().round())  # want a power of two
    # one e4m3 step (3 mantissa bits) apart at most, rarely: the product's fp32 sum order differs from
    # torch's, which can move a value across a rounding boundary
    step = torch.exp2(torch.floor(torch.log2(want.abs().clamp(min=2.0 ** -6))) - 3)
    differ = ((got - want).abs() > step) & ~carry_bug
    assert not differ.any(), torch.stack([got[differ], want[differ]], 1)[:8].tolist()
    assert ((got != want) & ~carry_bug).float().mean() < 0.02
    assert carry_bug.float().mean() < 0.1


def _int8_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal but for rare off-by-one codes: the GEMM's fp32 sum order differs from torch's, which can
    move x / scale across a rounding boundary."""
    assert got.dtype == torch.int8
    diff = (got.int() - want.int()).abs()
    assert diff.max() <= 1 and (diff > 0).float().mean() < 0.02


def _amax_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and abs(got.item() - want.item()) <= 1e-5 * abs(want.item())


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_int8_quantize_and_amax_in_the_gemm_epilogue(dtype: str) -> None:
    g, q, amax, feeds = _quant_graph("int8", dtype=dtype)
    plan = g.build(device="cpu")
    (kernel,) = plan.kernels
    assert (kernel.kind, kernel.backend) == ("matmul", "triton")
    assert kernel.ops[:2] == ["matmul", "mul"] and kernel.ops[-2:] == ["abs", "max"]
    assert [o.dtype for o in kernel.outputs] == ["int8", dtype]
    assert "tl.atomic_max(" in kernel.source and kernel.source.count("tl.store(") == 1
    # bytes: x, w, s read once, q (1 byte an element) and amax written once
    assert kernel.cost.bytes == sum(t.numel() * t.element_size() for t in feeds.values()) + 40 * 48 + \
        torch.empty((), dtype=getattr(torch, dtype)).element_size()
    got, want = plan.execute(feeds), fg.reference(g).execute(feeds)
    _int8_close(got[q], want[q])
    _amax_close(got[amax], want[amax])


def test_fp8_quantize_epilogue_is_one_kernel_with_the_cast_in_the_store() -> None:
    g, q, amax, feeds = _quant_graph("float8_e4m3fn")
    plan = g.build(device="cpu")
    (kernel,) = plan.kernels          # the fp8 cast (a library node on its own) is taken into the epilogue
    assert kernel.kind == "matmul" and kernel.ops.count("cast") >= 1 and kernel.ops[-1] == "max"
    assert [o.dtype for o in kernel.outputs] == ["float8_e4m3fn", "float16"]
    assert "tl.atomic_max(" in kernel.source and ".to(out0.dtype.element_ty)" in kernel.source
    got, want = plan.execute(feeds), fg.reference(g).execute(feeds)
    assert got[q].dtype == torch.float8_e4m3fn
    _fp8_close(got[q], want[q])
    _amax_close(got[amax], want[amax])


@pytest.mark.parametrize("variant", ["splitk", "persistent"])
def test_quantize_epilogue_in_split_k_and_persistent_kernels(variant: str) -> None:
    g, q, amax, feeds = _quant_graph("int8", m=4, k=1024) if variant == "splitk" else _quant_graph("int8")
    plan = g.build(device="cpu")
    (group,) = claim_epilogues(partition_graph(plan.graph).items, plan.graph)
    assert isinstance(group, MatmulGroup) and len(group.reductions) == 1
    gen = generate_gemm(group, f"qgemm_{variant}")
    assert gen.atomic_max_outputs == (1,)
    config = ({"VARIANT": "splitk", "BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 128, "GROUP_M": 1, "SPLITS": 4,
               "CHUNK_K": 256, "num_warps": 4, "num_stages": 3} if variant == "splitk" else
              {"VARIANT": "persistent", "BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32, "GROUP_M": 2, "NUM_PROGRAMS": 3,
               "FLATTEN": True, "USE_TMA": False, "num_warps": 4, "num_stages": 3})
    launch = GemmLaunch(load_triton_function(gen.source, gen.name), gen, config, "cpu")
    by_name = {h.name: t for h, t in feeds.items()}
    got = launch([by_name[n.name] for n in gen.inputs])
    want = fg.reference(g).execute(feeds)
    _int8_close(got[0], want[q])
    _amax_close(got[1], want[amax])


def test_cublas_and_reference_candidates_compute_the_amax_too() -> None:
    g, q, amax, feeds = _quant_graph("int8")
    plan = g.build(device="cpu")
    (group,) = claim_epilogues(partition_graph(plan.graph).items, plan.graph)
    assert isinstance(group, MatmulGroup)
    by_name = {h.name: t for h, t in feeds.items()}
    args = [by_name[n.name] for n in group.inputs]
    want = fg.reference(g).execute(feeds)
    library = cublas.cublas_launch(group, reference_launch(group.epilogue, "float32"),
                                   [reference_launch(r, "float32") for r in group.reductions])
    for launch in (library, _reference_group_launch(group, "float32", reference_launch)):
        got = launch(args)
        assert torch.equal(got[0], want[q]) and torch.equal(got[1], want[amax])


def test_amax_not_fused_when_the_scale_comes_from_the_same_output() -> None:
    g = fg.Graph(name="qdyn", compute_dtype="float32")
    x = g.tensor((16, 32), dtype="float16", name="x")
    w = g.tensor((32, 16), dtype="float16", name="w")
    q, scale = g.quantize(g.matmul(x, w), "int8")      # needs the amax before any element is quantized
    q.set_output()
    scale.set_output()
    plan = g.build(device="cpu")
    assert [k.kind for k in plan.kernels] == ["matmul", "reduction"] and plan.kernels[0].ops == ["matmul"]


def test_candidate_check_tolerates_rare_off_by_one_int8_codes() -> None:
    from fusegraph.backends.matmul_kernel import check_same

    want = torch.randint(-100, 100, (64, 64), dtype=torch.int8)
    want[0, 0] = 0
    near = want.clone()
    near[0, 0] += 1                                          # 1 of 4096 codes, by one
    check_same([near], [want], "one code")
    with pytest.raises(ValueError, match="int8"):
        check_same([want + 1], [want], "every code")
    far = want.clone()
    far[0, 0] = 50
    with pytest.raises(ValueError, match="int8"):
        check_same([far], [want], "far")
    fp8 = torch.randn(32, 32).to(torch.float8_e4m3fn)
    check_same([fp8], [fp8.clone()], "fp8")


def test_quantize_epilogue_in_the_gemv_kernel() -> None:
    """Two rows times an nn.Linear weight (a decode step) take the GEMV kernel, whose epilogue
    quantizes and folds the tile's max into the amax like the other variants."""
    g = fg.Graph(name="qgemv", compute_dtype="float32")
    x = g.tensor((2, 300), dtype="float16", name="x")
    w = g.tensor((40, 300), dtype="float16", name="w")
    s = g.tensor((), dtype="float32", name="s")
    y = g.mul(g.linear(x, w), 0.5)
    q, _ = g.quantize(y, "int8", scale=s)
    amax = g.max(g.abs(y))
    q.set_output()
    amax.set_output()
    feeds = {x: torch.randn(2, 300, dtype=torch.float16), w: torch.randn(40, 300, dtype=torch.float16) / 4,
             s: torch.tensor(0.05)}
    plan = g.build(device="cpu")
    (kernel,) = [k for k in plan.kernels if k.kind == "matmul"]
    assert kernel.config["VARIANT"] == "gemv" and "tl.atomic_max" in kernel.source
    got, want = plan.execute(feeds), fg.reference(g).execute(feeds)
    _int8_close(got[q], want[q])
    _amax_close(got[amax], want[amax])
