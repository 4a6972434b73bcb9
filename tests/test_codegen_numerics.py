"""Generated Triton kernels (run by Triton's interpreter on CPU) against the reference executor:
odd sizes, one row, rows wide enough to force the looped path, non-contiguous inputs, float32 /
float16 / bfloat16."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import fusegraph as fg
from conftest import assert_close, rand, rel_err
from fusegraph.settings import override

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (rows, cols, max_row_block): the last case holds less than a row in registers -> looped path
SHAPES = [(1, 7, None), (5, 33, None), (4, 300, 64), (17, 64, None)]


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _run(g: fg.Graph, feeds: list[torch.Tensor], max_row_block: int | None = None,
         expect_kernels: int | None = None) -> None:
    options = {} if max_row_block is None else {"max_row_block": max_row_block}
    plan = g.build(**options)
    computed = [k for k in plan.kernels if k.ops != ["constant"]]   # folded constants are buffers
    assert all(k.backend == "triton" for k in computed), [(k.name, k.note) for k in plan.kernels]
    if expect_kernels is not None:
        assert len(computed) == expect_kernels
    if max_row_block is not None:
        assert any("for c0 in tl.range" in k.source for k in computed)
    outs = plan(*feeds)
    refs = fg.reference(g)(*feeds)
    outs = outs if isinstance(outs, tuple) else (outs,)
    refs = refs if isinstance(refs, tuple) else (refs,)
    for k, (o, r) in enumerate(zip(outs, refs, strict=True)):
        assert_close(o, r, what=f"output {k}")


def _add_layernorm(g: fg.Graph, m: int, n: int, dt: torch.dtype) -> list[torch.Tensor]:
    x, r = g.tensor((m, n), _dt(dt), "x"), g.tensor((m, n), _dt(dt), "r")
    w, b = g.tensor((n,), _dt(dt), "w"), g.tensor((n,), _dt(dt), "b")
    h = g.add(x, r)
    h.set_output()
    g.layernorm(h, weight=w, bias=b).set_output()
    return [rand(m, n, dtype=dt), rand(m, n, dtype=dt), rand(n, dtype=dt), rand(n, dtype=dt)]


def _softmax(g: fg.Graph, m: int, n: int, dt: torch.dtype) -> list[torch.Tensor]:
    x = g.tensor((m, n), _dt(dt), "x")
    g.softmax(g.mul(x, 3.0), -1).set_output()
    return [rand(m, n, dtype=dt)]


def _log_softmax(g: fg.Graph, m: int, n: int, dt: torch.dtype) -> list[torch.Tensor]:
    x = g.tensor((m, n), _dt(dt), "x")
    g.log_softmax(x, -1).set_output()
    return [rand(m, n, dtype=dt)]


def _rmsnorm(g: fg.Graph, m: int, n: int, dt: torch.dtype) -> list[torch.Tensor]:
    x, w = g.tensor((m, n), _dt(dt), "x"), g.tensor((n,), _dt(dt), "w")
    g.rmsnorm(x, weight=w).set_output()
    return [rand(m, n, dtype=dt), rand(n, dtype=dt)]


def _bias_gelu(g: fg.Graph, m: int, n: int, dt: torch.dtype) -> list[torch.Tensor]:
    x, b = g.tensor((m, n), _dt(dt), "x"), g.tensor((n,), _dt(dt), "b")
    g.gelu(g.add(x, b), approximate="tanh").set_output()
    g.gelu(x).set_output()
    return [rand(m, n, dtype=dt), rand(n, dtype=dt)]


def _cross_entropy(g: fg.Graph, m: int, n: int, dt: torch.dtype) -> list[torch.Tensor]:
    x, t = g.tensor((m, n), _dt(dt), "x"), g.tensor((m,), "int64", "t")
    g.cross_entropy(x, t).set_output()
    return [rand(m, n, dtype=dt), torch.randint(0, n, (m,))]


def _layernorm_backward(g: fg.Graph, m: int, n: int, dt: torch.dtype) -> list[torch.Tensor]:
    gy, x, w = g.tensor((m, n), _dt(dt), "g"), g.tensor((m, n), _dt(dt), "x"), g.tensor((n,), _dt(dt), "w")
    for out in g.layernorm_backward(gy, x, weight=w):
        out.set_output()
    return [rand(m, n, dtype=dt), rand(m, n, dtype=dt), rand(n, dtype=dt)]


WORKLOADS: dict[str, Callable[[fg.Graph, int, int, torch.dtype], list[torch.Tensor]]] = {
    "add_layernorm": _add_layernorm, "softmax": _softmax, "log_softmax": _log_softmax,
    "rmsnorm": _rmsnorm, "bias_gelu": _bias_gelu, "cross_entropy": _cross_entropy,
    "layernorm_backward": _layernorm_backward,
}


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}{'-looped' if s[2] else ''}")
@pytest.mark.parametrize("dtype", DTYPES, ids=_dt)
@pytest.mark.parametrize("workload", list(WORKLOADS))
def test_workload_matches_reference(workload: str, dtype: torch.dtype, shape: tuple[int, int, int | None]) -> None:
    m, n, block = shape
    if workload == "bias_gelu" and block is not None:
        pytest.skip("pointwise: no rows to loop over")
    g = fg.Graph(workload)
    feeds = WORKLOADS[workload](g, m, n, dtype)
    _run(g, feeds, max_row_block=block)


@pytest.mark.parametrize("dtype", DTYPES, ids=_dt)
def test_non_contiguous_inputs(dtype: torch.dtype) -> None:
    g = fg.Graph("strided")
    x, r = g.tensor((9, 21), _dt(dtype), "x"), g.tensor((9, 21), _dt(dtype), "r")
    h = g.add(x, r)
    h.set_output()
    g.layernorm(h).set_output()
    xt = rand(21, 9, dtype=dtype).t()          # transposed
    rs = rand(9, 42, dtype=dtype)[:, ::2]      # every other column
    _run(g, [xt, rs])


def test_reductions_over_inner_and_outer_dims_of_3d() -> None:
    g = fg.Graph("3d")
    x = g.tensor((3, 10, 7), "float32", "x")
    g.sum(x, (0, 2)).set_output()           # kept dim in the middle
    g.max(x, 1, keepdim=True).set_output()  # column-like: the contiguous dim is kept
    g.mean(x, 2).set_output()
    g.min(x, None).set_output()
    _run(g, [rand(3, 10, 7)])


def test_column_reduction_looped_over_many_rows() -> None:
    g = fg.Graph("colsum")
    x = g.tensor((300, 5), "float32", "x")
    g.sum(g.exp(x), 0).set_output()
    _run(g, [rand(300, 5)])


def test_broadcast_row_and_column_vectors() -> None:
    g = fg.Graph("bcast")
    x = g.tensor((2, 5, 13), "float16", "x")
    col = g.tensor((5, 1), "float16", "col")
    row = g.tensor((13,), "float32", "row")
    g.where(g.gt(x, 0.0), g.mul(x, col), g.add(x, row)).set_output()
    with override(round_intermediates=True):   # the fp32 result holds an fp16 product, rounded as the reference does
        _run(g, [rand(2, 5, 13, dtype=torch.float16), rand(5, 1, dtype=torch.float16), rand(13)],
             expect_kernels=1)


def _tanh_gelu_chain(dtype: str) -> tuple[fg.Graph, fg.Tensor]:
    g = fg.Graph("gelu_chain")
    x, dy = g.tensor((8, 96), dtype, "x"), g.tensor((8, 96), dtype, "dy")
    inner = g.mul(g.add(x, g.mul(g.mul(g.mul(x, x), x), 0.044715)), 0.7978845608028654)
    gelu = g.mul(g.mul(x, 0.5), g.add(g.tanh(inner), 1.0))
    out = g.mul(gelu, dy)
    out.set_output()
    g.cast(g.mul(out, 2.0), "float32").set_output()   # reads the stored value
    return g, x


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_intermediates_stay_fp32_unless_asked(dtype: torch.dtype) -> None:
    """round_intermediates off: a 16-bit op's result stays fp32 in registers (no round trip per op),
    so the kernel is closer to the fp32 computation than eager's op-by-op rounding is; a stored value
    that later ops read is rounded first, so they see what the tensor holds. On (the default): every
    op rounds, as the reference (and eager PyTorch) does."""
    g, _ = _tanh_gelu_chain(_dt(dtype))
    feeds = [rand(8, 96, dtype=dtype), rand(8, 96, dtype=dtype)]
    exact = fg.reference(g)(*feeds)
    g32, _ = _tanh_gelu_chain("float32")   # what the 16-bit graph approximates
    truth = fg.reference(g32)(*[f.float() for f in feeds])

    with override(round_intermediates=False):
        plan = g.build()
    low = f".to({'tl.float16' if dtype == torch.float16 else 'tl.bfloat16'}).to(tl.float32)"
    (kernel,) = [k for k in plan.kernels if k.backend == "triton"]
    assert kernel.source.count(low) == 1, kernel.source          # only the stored product, read again
    out, doubled = plan(*feeds)
    assert_close(out, exact[0], what="16-bit output")
    assert torch.equal(doubled, out.float() * 2.0)                # the stored value, not the fp32 one
    assert rel_err(out.float(), truth[0]) <= rel_err(exact[0].float(), truth[0])

    rounded = g.build()
    (kernel,) = [k for k in rounded.kernels if k.backend == "triton"]
    assert kernel.source.count(low) >= 10
    for got, want in zip(rounded(*feeds), exact, strict=True):   # a few values an ulp apart (tanh, products)
        assert_close(got, want, tol=1e-3 if dtype == torch.float16 else 5e-3, what="op-by-op rounding")


def test_views_fold_into_indexing() -> None:
    g = fg.Graph("views")
    x = g.tensor((6, 11), "float32", "x")
    y = g.transpose(g.exp(x), 0, 1)            # [11, 6]
    g.add(y, g.expand(g.reshape(g.sum(x, 1), 1, 6), 11, 6)).set_output()
    _run(g, [rand(6, 11)])


def test_iota_and_dropout_generators() -> None:
    g = fg.Graph("gen")
    x = g.tensor((7, 19), "float32", "x")
    g.dropout(x, p=0.3, seed=5).set_output()
    g.add(x, g.iota((7, 19), dim=1, dtype="float32")).set_output()
    _run(g, [rand(7, 19)], expect_kernels=1)


def test_integer_and_bool_inputs() -> None:
    g = fg.Graph("ints")
    x = g.tensor((4, 9), "int32", "x")
    m = g.tensor((4, 9), "bool", "m")
    g.where(m, g.cast(x, "float32"), g.neg(g.cast(x, "float32"))).set_output()
    g.gt(x, 2).set_output()
    _run(g, [torch.randint(-5, 5, (4, 9), dtype=torch.int32), torch.rand(4, 9) > 0.5])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_dt)
def test_long_column_reductions_split_in_two_stages(dtype: torch.dtype) -> None:
    g = fg.Graph("split")
    x = g.tensor((1000, 5), _dt(dtype), "x")
    g.sum(g.mul(x, x), 0).set_output()
    g.max(x, 0).set_output()
    plan = g.build()
    assert any("_finish" in k.source for k in plan.kernels)
    _run(g, [rand(1000, 5, dtype=dtype)])


def test_layernorm_backward_in_one_pass_with_column_partials() -> None:
    g = fg.Graph("ln_bwd_one_pass")
    feeds = _layernorm_backward(g, 600, 24, torch.float32)
    plan = g.build()
    assert len(plan.kernels) == 1 and "_finish" in plan.kernels[0].source
    assert "for r0 in tl.range(0, RPP, ROWS, num_stages=STAGES)" in plan.kernels[0].source
    _run(g, feeds)


def test_layernorm_backward_too_wide_for_one_pass_splits_columns() -> None:
    g = fg.Graph("ln_bwd_two_kernels")
    feeds = _layernorm_backward(g, 24, 40, torch.float32)
    plan = g.build(max_row_block=16)
    assert len(plan.kernels) == 2 and "for c0 in tl.range" in plan.kernels[0].source
    _run(g, feeds, max_row_block=16)


def test_long_full_reduction_and_non_finite_literals() -> None:
    g = fg.Graph("full")
    x = g.tensor((2000,), "float32", "x")
    g.sum(x, None).set_output()
    g.max(g.where(g.gt(x, 0.5), x, float("-inf")), None).set_output()
    plan = g.build()
    assert all("_finish" in k.source for k in plan.kernels)
    _run(g, [rand(2000, low=0.1)])   # positive: a sum near zero would make its relative error noise


def test_online_softmax_reads_a_wide_row_once_for_its_statistics() -> None:
    g = fg.Graph("online")
    x = g.tensor((3, 500), "float32", "x")
    t = g.tensor((3,), "int64", "t")
    g.softmax(x, -1).set_output()
    g.cross_entropy(x, t, reduction="none").set_output()
    plan = g.build(max_row_block=64)
    rows = [k for k in plan.kernels if k.kind == "reduction"]
    assert len(rows) == 1
    looped = rows[0].source.split("else:", 1)[1]
    # one loop for max, sum of exp and the target logit; one to write the softmax
    assert looped.count("for c0 in tl.range") == 2 and "e_on = tl.exp(-tl.abs(d_on))" in looped
    body = looped.split("for c0 in tl.range")[1].split("if 500 % BLOCK_C")[0]   # the statistics' loop
    assert body.count("tl.exp(") == 1                                          # one exp an element
    x_t = rand(3, 500) * 4
    x_t[:, 450:] += 10    # the max sits in the last chunk: the running sum must be rescaled
    _run(g, [x_t, torch.tensor([1, 470, 499])], max_row_block=64)


@pytest.mark.parametrize("width", [509, 512], ids=["tail", "whole-chunks"])
@pytest.mark.parametrize("prefetch", [False, True], ids=["direct", "prefetch"])
def test_looped_rows_with_or_without_prefetch_match_the_reference(
        width: int, prefetch: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The looped row reduction's two forms offered to the tuner (PREFETCH: the next chunk's loads
    issued into registers at the top of each chunk): softmax, cross-entropy and a log-sum-exp over
    wide rows, with and without a tail chunk, bf16 input, each form against the reference."""
    import fusegraph.lower as lower
    from fusegraph.codegen import configs

    def pick(gen: Any, options: Any = None) -> list[dict[str, Any]]:
        out = configs.candidate_configs(gen, options)
        if gen.kind == "reduction" and gen.meta.get("prefetch"):
            out = [c for c in out if bool(c.get("PREFETCH")) == prefetch]
        return out

    monkeypatch.setattr(lower, "candidate_configs", pick)
    g = fg.Graph("prefetch_rows")
    x = g.cast(g.tensor((4, width), "bfloat16", "x"), "float32")
    t = g.tensor((4,), "int64", "t")
    g.softmax(x, -1).set_output()
    g.cross_entropy(x, t, reduction="none").set_output()
    m = g.max(x, dim=1, keepdim=True)
    g.add(g.log(g.sum(g.exp(g.sub(x, m)), dim=1, keepdim=True)), m).set_output()
    plan = g.build(max_row_block=64)
    (kernel,) = [k for k in plan.kernels if k.kind == "reduction"]
    assert "if PREFETCH:" in kernel.source and bool(kernel.config.get("PREFETCH")) == prefetch
    for part in kernel.source.split(f"if {width} % BLOCK_C != 0:\n")[1:]:   # each tail chunk's block
        block = []
        for line in part.splitlines():
            if not line.startswith(" " * 12):
                break
            block.append(line)
        assert block and not any("pf_" in line for line in block)              # loads directly
    x_t = (rand(4, width) * 4).to(torch.bfloat16)
    x_t[:, width - 20:] += 10
    x_t[2, ::5] = float("-inf")
    _run(g, [x_t, torch.tensor([1, 470, width - 1, 3])], max_row_block=64)


def test_online_log_sum_exp_special_values_match_the_reference() -> None:
    """The one-exp online update and special values: -inf entries add nothing (also before a lane has
    seen a finite one); +inf gives NaN and NaN gives NaN, as the reference executor does op by op
    (inf - inf inside the exp); a row of only -inf gives -inf as torch.logsumexp does (as the online
    kernels always did), where the op-by-op reference computes exp(-inf - -inf) = NaN."""
    g = fg.Graph("lse_special")
    x = g.tensor((5, 300), "float32", "x")
    m = g.max(x, dim=1, keepdim=True)
    g.add(g.log(g.sum(g.exp(g.sub(x, m)), dim=1, keepdim=True)), m).set_output()
    x_t = rand(5, 300) * 3
    x_t[0, :200] = float("-inf")        # the first chunks' lanes start at -inf
    x_t[1, :] = float("-inf")
    x_t[2, 123] = float("inf")
    x_t[3, 257] = float("nan")
    x_t[4, ::7] = float("-inf")
    plan = g.build(max_row_block=64)
    out = plan(x_t)
    ref = fg.reference(g)(x_t)
    assert torch.isnan(ref[1:4]).all()
    assert torch.isneginf(out[1]).all() and torch.isnan(out[2]).all() and torch.isnan(out[3]).all()
    finite = [0, 4]
    assert_close(out[finite], ref[finite], what="finite rows")


@pytest.mark.parametrize("dtype", DTYPES, ids=_dt)
def test_pow_by_small_integer_literal_is_a_product_with_pow_special_values(dtype: torch.dtype) -> None:
    """GELU's tanh form (x ** 3) and its gradient (x ** 2) as products in the kernel, not
    libdevice.pow; a fractional or tensor exponent keeps pow; NaN, +-inf and -0.0 come out as pow's."""
    g = fg.Graph(name="powers")
    x, e = g.tensor((4, 37), _dt(dtype), "x"), g.tensor((4, 37), _dt(dtype), "e")
    for k in (2, 3.0, 4):
        g.pow(x, k).set_output()
    g.pow(g.abs(x), 1.5).set_output()
    g.pow(g.abs(x), e).set_output()
    plan = g.build()
    source = "\n".join(k.source for k in plan.kernels)
    assert source.count("libdevice.pow(") == 2, source      # the 1.5 and the tensor exponent only
    xs = rand(4, 37, dtype=dtype) * 3
    xs[0, :5] = torch.tensor([float("nan"), float("inf"), float("-inf"), -0.0, 0.0], dtype=dtype)
    es = rand(4, 37, dtype=dtype)
    outs, refs = plan(xs, es), fg.reference(g)(xs, es)
    for k, (o, r) in enumerate(zip(outs, refs, strict=True)):
        assert torch.equal(o.isnan(), r.isnan()) and torch.equal(o.isinf(), r.isinf()), k
        assert torch.equal(torch.signbit(o[0, 1:5]), torch.signbit(r[0, 1:5])), k   # -0.0 ** 3 is -0.0
        finite = r.isfinite()
        assert_close(o[finite], r[finite], what=f"output {k}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=_dt)
@pytest.mark.parametrize("cols,block,row_tiled", [(2100, None, True), (2100, 1024, True), (4096, 2048, True),
                                                  (2100, 1024, False), (4133, 1024, 2), (4133, 4096, 2),
                                                  (4096, 2048, 2)])
def test_row_tiled_pointwise_with_per_row_and_scalar_operands(dtype: torch.dtype, cols: int, block: int | None,
                                                               row_tiled: bool,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows of >= 2048 columns with a per-row operand (a log-sum-exp) and a scalar (a loss scale), as in
    a cross-entropy backward: the kernel holds a row-tiled body (per-row and scalar values load once per
    program; one or several blocks per row with a ragged last one) and the flat one, chosen by the
    ROW_TILED knob the tuner times; either matches the reference. Rows of >= 4096 also get the
    segmented body (ROW_TILED 2: flat blocks, each holding the end of at most one row, the per-row
    operand read for its two rows), e.g. an odd 4133-wide row whose blocks straddle row ends."""
    import fusegraph.lower as lower
    from fusegraph.codegen import configs

    seen: list[tuple[Any, list[dict[str, Any]]]] = []

    def candidates(gen: Any, options: Any = None) -> list[dict[str, Any]]:
        out = configs.candidate_configs(gen, options)
        seen.append((gen, out))
        return [{"BLOCK": block, "num_warps": 4, "ROW_TILED": row_tiled}] if block and gen.meta.get("row_tiled") \
            else out

    monkeypatch.setattr(lower, "candidate_configs", candidates)
    g = fg.Graph(name="row_tiled")
    x, r = g.tensor((6, cols), _dt(dtype), "x"), g.tensor((6, 1), "float32", "lse")
    s = g.tensor((), "float32", "scale")
    g.mul(g.exp(g.sub(x, r)), s).set_output()
    plan = g.build()
    (kernel,) = plan.kernels
    assert "row = pid //" in kernel.source and "tl.load(in1 + row)" in kernel.source, kernel.source
    assert "tl.load(in2)" in kernel.source                       # the scalar: once per program
    xs, rs, ss = rand(6, cols, dtype=dtype), rand(6, 1, dtype=torch.float32), torch.tensor(0.37)
    assert_close(plan(xs, rs, ss), fg.reference(g)(xs, rs, ss), what="row-tiled")
    ((gen, offered),) = seen
    assert gen.meta["row_tiled"] == (6, cols) and offered[0] == {"BLOCK": 4096, "num_warps": 8, "ROW_TILED": True}
    # every body is a tuning candidate; the segmented one only for rows of >= 4096
    assert {c["ROW_TILED"] for c in offered} == ({True, False, 2} if cols >= 4096 else {True, False})
    assert ("if ROW_TILED == 2:" in kernel.source) is (cols >= 4096)
    for config in [*offered, {"BLOCK": 1024, "num_warps": 4, "ROW_TILED": True}]:
        (grid,), consts, _ = configs.launch_parameters(gen, config)
        per_row = -(-cols // config["BLOCK"])
        assert consts["ROW_TILED"] == config["ROW_TILED"]
        flat = config["ROW_TILED"] is False or config["ROW_TILED"] == 2
        assert grid == ((-(-6 * cols // config["BLOCK"]),) if flat else (6 * per_row,))


@pytest.mark.parametrize("config", [{"BLOCK": 4096, "num_warps": 8, "ROW_TILED": 2},
                                    {"BLOCK": 1024, "num_warps": 4, "ROW_TILED": 2},
                                    {"BLOCK": 2048, "num_warps": 4, "ROW_TILED": True}])
def test_segmented_cross_entropy_backward(config: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """A cross-entropy backward over odd-width rows (softmax minus the one-hot target, scaled): the
    per-row log-sum-exp and int64 target of a block's two rows, and the column index (iota) for the
    one-hot, in the segmented body; the row-tiled body for comparison. Both match the reference."""
    import fusegraph.lower as lower

    monkeypatch.setattr(lower, "candidate_configs", lambda gen, options=None: [config])
    rows, vocab = 7, 4133
    g = fg.Graph(name="ce_backward")
    x, lse = g.tensor((rows, vocab), "float16", "x"), g.tensor((rows, 1), "float32", "lse")
    target, scale = g.tensor((rows, 1), "int64", "target"), g.tensor((), "float32", "scale")
    onehot = g.cast(g.eq(g.iota((rows, vocab), 1, "int64"), target), "float32")
    g.cast(g.mul(g.sub(g.exp(g.sub(g.cast(x, "float32"), lse)), onehot), scale), "float16").set_output()
    plan = g.build()
    (kernel,) = plan.kernels
    assert "second = offs >=" in kernel.source and kernel.config["ROW_TILED"] == config["ROW_TILED"]
    xs = rand(rows, vocab, dtype=torch.float16)
    ls = torch.logsumexp(xs.float(), dim=1, keepdim=True)
    ts = torch.randint(0, vocab, (rows, 1))
    ss = torch.tensor(0.37)
    assert_close(plan(xs, ls, ts, ss), fg.reference(g)(xs, ls, ts, ss), what=f"ROW_TILED={config['ROW_TILED']}")


def test_segmented_body_stores_into_padded_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """A cross-entropy-backward-like gradient read by a GEMM: pad_align gives it padded rows (4133 ->
    4160 fp16 elements: 128-byte rows), so its kernel stores row by row; the segmented body is still
    offered (dense loads, per-row operands as two scalars, stores at row * 4160 + col) and matches
    the reference."""
    import fusegraph.lower as lower
    from fusegraph.codegen import configs

    seen: list[tuple[Any, list[dict[str, Any]]]] = []

    def candidates(gen: Any, options: Any = None) -> list[dict[str, Any]]:
        out = configs.candidate_configs(gen, options)
        if gen.meta.get("row_tiled"):
            seen.append((gen, out))
            return [{"BLOCK": 1024, "num_warps": 4, "ROW_TILED": 2}]
        return out

    monkeypatch.setattr(lower, "candidate_configs", candidates)
    rows, vocab = 6, 4133
    g = fg.Graph(name="ce_backward_gemm")
    x, lse = g.tensor((rows, vocab), "float16", "x"), g.tensor((rows, 1), "float32", "lse")
    w = g.tensor((vocab, 16), "float16", "w")
    grad = g.cast(g.mul(g.exp(g.sub(g.cast(x, "float32"), lse)), 0.5), "float16")
    g.matmul(grad, w).set_output()
    plan = g.build()
    ((gen, offered),) = seen
    assert gen.meta.get("segmented") and {c["ROW_TILED"] for c in offered} == {True, 2, False}
    (pointwise,) = [k for k in plan.kernels if k.kind == "pointwise"]
    assert pointwise.outputs[0].spec.memory_strides[0] == 4160, pointwise.outputs[0].spec.memory_strides
    assert "second = offs >=" in pointwise.source and "* 4160 + cols" in pointwise.source, pointwise.source
    xs, ls, ws = rand(rows, vocab, dtype=torch.float16), rand(rows, 1), rand(vocab, 16, dtype=torch.float16)
    assert_close(plan(xs, ls, ws), fg.reference(g)(xs, ls, ws), what="segmented, padded rows")


def test_batch_one_operand_loads_at_the_flat_index() -> None:
    """A [1, T, C] tensor read in a [T, C] domain (batch-1 logits squeezed by a reshape) has the
    domain's memory order: it loads at `offs` (16-byte vectors), not at a per-element row/column
    offset, and its result matches the reference."""
    g = fg.Graph(name="batch_one")
    x, r = g.tensor((1, 8, 4100), "float16", "x"), g.tensor((8, 1), "float32", "r")
    g.exp(g.sub(g.cast(g.reshape(x, (8, 4100)), "float32"), r)).set_output()
    plan = g.build()
    (kernel,) = plan.kernels
    assert "tl.load(in0 + offs" in kernel.source, kernel.source
    xs, rs = rand(1, 8, 4100, dtype=torch.float16), rand(8, 1)
    assert_close(plan(xs, rs), fg.reference(g)(xs, rs), what="batch-1 operand")


def test_flat_pointwise_stays_flat_for_narrow_rows_and_plain_layouts() -> None:
    g = fg.Graph(name="flat")
    x, r = g.tensor((6, 768), "float32", "x"), g.tensor((6, 1), "float32", "r")
    g.exp(g.sub(x, r)).set_output()                                  # per-row operand, but rows of 768
    y = g.tensor((6, 4096), "float32", "y")
    g.relu(y).set_output()                                           # wide rows, nothing per row or padded
    plan = g.build()
    assert all("row = pid //" not in k.source for k in plan.kernels)


def test_integer_literals_stay_integers_in_int_kernels() -> None:
    """where(t != -100, t, 0) + 7 on int64 values above 2**24: the literals are spelled as ints, so
    the int64 operand is not promoted to fp32 (which would round these values)."""
    g = fg.Graph(name="int_literals")
    t = g.tensor((3, 50), "int64", "t")
    g.add(g.where(g.ne(t, -100), t, 0), 7).set_output()
    plan = g.build()
    source = "\n".join(k.source for k in plan.kernels)
    assert "-100.0" not in source and "7.0" not in source, source
    ts = torch.randint(2**40, 2**41, (3, 50))
    ts[0, :4] = -100
    out = plan(ts)
    assert out.dtype == torch.int64 and torch.equal(out, torch.where(ts != -100, ts, 0) + 7)


def test_tanh_is_branch_free_and_close_to_torch_elementwise() -> None:
    """tanh is generated without libdevice's per-element branch (a series near 0, the exponential
    form beyond); elementwise within a few fp32 ulp of torch over magnitudes from 1e-30 to 30, and
    +-inf, NaN and +-0 map as torch maps them."""
    mags = torch.cat([torch.logspace(-30, 1.5, 4001), torch.linspace(0.0, 12.0, 4001)])
    x = torch.cat([mags, -mags, torch.tensor([float("inf"), float("-inf"), float("nan"), 0.0, -0.0])])
    g = fg.Graph("tanh_range")
    g.tanh(g.tensor(tuple(x.shape), "float32", "x")).set_output()
    plan = g.build()
    (kernel,) = [k for k in plan.kernels if k.backend == "triton"]
    assert "libdevice.tanh" not in kernel.source and "tl.where(tl.abs(" in kernel.source
    got, want = plan(x), torch.tanh(x.double())
    finite = want.isfinite()
    ulps = ((got.double() - want).abs() / torch.finfo(torch.float32).eps / want.abs().clamp_min(1e-38))[finite]
    assert ulps.max() < 8, float(ulps.max())
    assert torch.equal(got[-5:-3], torch.tensor([1.0, -1.0])) and got[-3].isnan() and (got[-2:] == 0).all()
    with override(tanh_branch_free=False):
        assert "libdevice.tanh" in next(k.source for k in g.build().kernels if k.backend == "triton")
