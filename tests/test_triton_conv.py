"""Our Triton implicit-GEMM conv2d (backends/triton_conv.py) under the Triton interpreter, against
F.conv2d in fp32 (fp16 and fp32 operands: tl.dot on bf16 is wrong under the interpreter), in both
variants (direct, and padded: backends/triton_conv_pad.py): the ResNet stem scaled down, C_in 1 and
5, 3x3, 1x1, dilation, non-square input and kernel, bias or none, C_out not a power of two, NCHW
operands and output strides, tile configs with K tails and grouped tile order, Inf inputs; the
padded variant's alignment/contiguity hints (which the interpreter ignores) checked against the
addresses it computes; both variants among the tuner's candidates; the stem compiled for sm_90
without a GPU (the padded variant's loads are vectors);
the gemm variant (1x1 convolutions of any width as a plain GEMM: K, row and column tails, stride 2,
alignment below 16 bytes, vector loads when compiled for sm_90, offered for narrow 1x1 only, fused
with a BN + residual + ReLU epilogue); and the ConvGroup candidate hook: offered for a narrow-channel
group on a GPU, not for wide or grouped convolutions (with the FUSEGRAPH_DEBUG reason), and the
candidate (our conv + the group's epilogue kernel) computes what the plain conv + epilogue path
computes."""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import fusegraph as fg
from conftest import assert_close, rand, single_conv_group
from fusegraph.backends import triton_conv
from fusegraph.backends.conv_kernel import LIBRARY_SOURCES, conv_group_kernel, library_candidates, library_source
from fusegraph.fusion.epilogue import ConvGroup, claim_epilogues
from fusegraph.fusion.partition import partition_graph
from fusegraph.settings import override
from ptx_helpers import sm90_ptx_exact

CL = torch.channels_last
INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
# our kernel launched on CPU tensors: the interpreter (conftest's default; a GPU run with TRITON_INTERPRET=0 skips)
on_the_interpreter = pytest.mark.skipif(not INTERPRETING, reason="runs the kernel on CPU tensors: TRITON_INTERPRET=1")

# (name, N, C_in, H, W, C_out, KH, KW, stride, padding, dilation, bias)
CASES = [
    ("stem_7x7s2", 2, 3, 16, 16, 16, 7, 7, (2, 2), (3, 3), (1, 1), False),
    ("stem_7x7s2_rect_bias", 2, 3, 20, 18, 16, 7, 7, (2, 2), (3, 3), (1, 1), True),
    ("3x3s1p1_cout_odd", 2, 4, 9, 9, 10, 3, 3, (1, 1), (1, 1), (1, 1), True),
    ("1x1", 2, 8, 7, 5, 24, 1, 1, (1, 1), (0, 0), (1, 1), False),
    ("dilation2", 1, 3, 12, 11, 20, 3, 3, (1, 1), (2, 2), (2, 2), True),
    ("rect_kernel_asym", 2, 5, 10, 13, 12, 2, 5, (2, 1), (0, 2), (1, 1), False),
    ("patch4x4s4", 2, 3, 16, 16, 40, 4, 4, (4, 4), (0, 0), (1, 1), True),
    ("patch_ragged_dil", 1, 3, 18, 17, 8, 4, 3, (4, 3), (0, 0), (1, 2), False),   # unused last rows/cols
    ("gray_c1_7x7s2", 2, 1, 13, 12, 8, 7, 7, (2, 2), (3, 3), (1, 1), True),        # C_PAD 1
    ("c5_3x3s1p1", 1, 5, 9, 8, 12, 3, 3, (1, 1), (1, 1), (1, 1), False),            # C_PAD 8
]
VARIANTS = ("direct", "padded")


def _config(problem: triton_conv.ConvProblem, variant: str) -> dict[str, Any]:
    """The variant's first (best-guess) config for the problem. The padded variant is not a candidate
    where it has nothing to pad (no spatial padding, C_in a power of two); it still computes the same."""
    offered = [c for c in triton_conv.configs(problem) if c["VARIANT"] == variant]
    if offered:
        return offered[0]
    assert variant == "padded" and not triton_conv.padded_helps(problem), (variant, problem)
    return {**_config(problem, "direct"), "VARIANT": "padded"}


def _operands(n: int, c: int, h: int, w: int, co: int, kh: int, kw: int, bias: bool, dtype: torch.dtype,
              seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    x = rand(n, c, h, w, dtype=dtype, seed=seed).contiguous(memory_format=CL)
    wt = (rand(co, c, kh, kw, dtype=torch.float32, seed=seed + 1) / (c * kh * kw) ** 0.5).to(dtype)
    b = rand(co, dtype=dtype, seed=seed + 2) if bias else None
    return x, wt.contiguous(memory_format=CL), b


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, stride: Any, padding: Any,
               dilation: Any) -> torch.Tensor:
    return F.conv2d(x.float(), w.float(), None if b is None else b.float(), stride=stride, padding=padding,
                    dilation=dilation)


@on_the_interpreter
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_triton_conv_matches_torch(case: tuple[Any, ...], dtype: torch.dtype, variant: str) -> None:
    _, n, c, h, w, co, kh, kw, stride, padding, dilation, bias = case
    x, wt, b = _operands(n, c, h, w, co, kh, kw, bias, dtype, seed=len(case[0]))
    problem = triton_conv.problem_of_tensors(x, wt, b, stride, padding, dilation)
    out = triton_conv.conv2d(x, wt, b, stride, padding, dilation, config=_config(problem, variant))
    ref = _reference(x, wt, b, stride, padding, dilation)
    assert out.dtype == dtype and out.is_contiguous(memory_format=CL)   # NHWC-dense in the operands' dtype
    assert_close(out.float(), ref, tol=5e-3 if dtype == torch.float16 else 1e-5, what=case[0])


@on_the_interpreter
@pytest.mark.parametrize("group_m", [1, 3])
def test_small_tiles_k_tail_several_column_tiles_and_grouped_order(group_m: int) -> None:
    # M = 2*8*8 = 128 rows -> 8 row tiles; 40 columns -> 3 column tiles; K = 3*3*3 = 27 -> two K tiles of 16
    x, wt, b = _operands(2, 3, 8, 8, 40, 3, 3, True, torch.float32, seed=7)
    config = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": group_m, "num_warps": 2, "num_stages": 2}
    out = triton_conv.conv2d(x, wt, b, (1, 1), (1, 1), (1, 1), config=config)
    assert_close(out, _reference(x, wt, b, 1, 1, 1), tol=1e-5)


@on_the_interpreter
@pytest.mark.parametrize("block_k", [16, 32, 64])
def test_padded_variant_k_tiles_of_half_one_and_two_rows_with_row_and_column_tails(block_k: int) -> None:
    # the stem scaled down, fp16: K rows of 7*4 = 28 -> 32; 16: half rows, 64: two rows and a masked 8th;
    # M = 2*9*8 = 144 rows (a 16-row tail of the 32-row tile), 20 columns (a 4-column tail)
    x, wt, b = _operands(2, 3, 17, 15, 20, 7, 7, True, torch.float16, seed=9)
    config = {"VARIANT": "padded", "BLOCK_M": 32, "BLOCK_N": 16, "BLOCK_K": block_k, "GROUP_M": 3,
              "num_warps": 2, "num_stages": 2}
    out = triton_conv.conv2d(x, wt, b, (2, 2), (3, 3), (1, 1), config=config)
    assert_close(out.float(), _reference(x, wt, b, 2, 3, 1), tol=5e-3)


@on_the_interpreter
@pytest.mark.parametrize("variant", VARIANTS)
def test_inf_and_nan_reach_only_the_outputs_whose_window_holds_them(variant: str) -> None:
    # the padded variant reads whole K rows of x_pad (8 taps for 7): its K mask keeps the 8th tap, a
    # neighbour outside the window, out of the product (x_pad column 11 is the 8th tap of output column 2)
    x, wt, _ = _operands(1, 3, 12, 12, 16, 7, 7, False, torch.float32, seed=13)
    x[0, 1, 5, 8] = float("inf")
    x[0, 0, 10, 3] = float("nan")
    problem = triton_conv.problem_of_tensors(x, wt, None, (2, 2), (3, 3), (1, 1))
    out = triton_conv.conv2d(x, wt, None, (2, 2), (3, 3), (1, 1), config=_config(problem, variant))
    ref = _reference(x, wt, None, 2, 3, 1)
    assert torch.equal(out.isnan(), ref.isnan()) and torch.equal(out.isinf(), ref.isinf())
    finite = ref.isfinite()
    assert 0 < int(finite.sum()) < ref.numel()
    assert_close(out[finite], ref[finite], tol=1e-5)


# (name, N, C_in, H, W, C_out, stride, config tile (BLOCK_M, BLOCK_N, BLOCK_K))
GEMM_CASES = [
    ("c32_s1_one_k_step", 2, 32, 7, 5, 48, 1, (32, 32, 32)),             # 70 rows: a 6-row tail; 48 = 32 + 16 tail
    ("c40_k_tail", 1, 40, 6, 6, 24, 1, (16, 16, 16)),                    # K 40 = 16 + 16 + 8 (masked K tail)
    ("c64_s2_downsample", 2, 64, 9, 8, 40, 2, (32, 16, 32)),              # 5x4 outputs from odd rows/cols
    ("c36_align4_fp16", 1, 36, 5, 7, 16, 1, (16, 16, 32)),               # pixel stride 36: 8-byte runs only
]


@on_the_interpreter
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("case", GEMM_CASES, ids=[c[0] for c in GEMM_CASES])
def test_gemm_variant_matches_torch(case: tuple[Any, ...], dtype: torch.dtype) -> None:
    _, n, c, h, w, co, stride, (bm, bn, bk) = case
    x, wt, b = _operands(n, c, h, w, co, 1, 1, True, dtype, seed=c)
    problem = triton_conv.problem_of_tensors(x, wt, b, (stride, stride), (0, 0), (1, 1))
    assert triton_conv.gemm_unsupported(problem) is None
    assert [v for v in (cfg["VARIANT"] for cfg in triton_conv.configs(problem))][-1] == "gemm"
    config = {"VARIANT": "gemm", "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 2, "num_warps": 2,
              "num_stages": 2}
    conv = triton_conv.TritonConv(problem, config)
    assert conv.constexprs["GEMM"] and conv.constexprs["ALIGN"] == (4 if c == 36 and dtype == torch.float16 else
                                                                     16 // x.element_size())
    out = conv(x, wt, b)
    ref = _reference(x, wt, b, stride, 0, 1)
    assert out.dtype == dtype and out.is_contiguous(memory_format=CL)
    assert_close(out.float(), ref, tol=5e-3 if dtype == torch.float16 else 1e-5, what=case[0])


def test_gemm_variant_offered_for_1x1_only_and_alone_for_wide_channels() -> None:
    def problem(c: int, k: int, padding: int = 0, cl: bool = True) -> triton_conv.ConvProblem:
        fmt = CL if cl else torch.contiguous_format
        x = torch.empty(2, c, 8, 8, dtype=torch.bfloat16).contiguous(memory_format=fmt)
        w = torch.empty(16, c, k, k, dtype=torch.bfloat16).contiguous(memory_format=CL)
        return triton_conv.problem_of_tensors(x, w, None, (1, 1), (padding, padding), (1, 1))

    assert {c["VARIANT"] for c in triton_conv.configs(problem(256, 1))} == {"gemm"}
    assert {c["VARIANT"] for c in triton_conv.configs(problem(8, 1))} == {"direct", "gemm"}   # nothing to pad
    assert {c["VARIANT"] for c in triton_conv.configs(problem(6, 1))} == {"direct", "padded", "gemm"}
    assert {c["VARIANT"] for c in triton_conv.configs(problem(8, 3, 1))} == {"direct", "padded"}
    assert triton_conv.gemm_unsupported(problem(64, 3, 1)) == "kernel 3x3, not 1x1"
    assert triton_conv.gemm_unsupported(problem(64, 1, 1)) == "padding (1, 1)"
    nchw = problem(64, 1, cl=False)
    assert triton_conv.gemm_unsupported(nchw) == "channels not contiguous in x or w (not channels-last)"
    with pytest.raises(fg.InvalidValueError, match="VARIANT='gemm' for a convolution it does not apply to"):
        triton_conv.TritonConv(nchw, {"VARIANT": "gemm", "BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16,
                                      "GROUP_M": 1, "num_warps": 1, "num_stages": 1})
    assert all(c["BLOCK_K"] <= 64 and c["BLOCK_N"] <= 16 for c in triton_conv.configs(problem(256, 1)))


def test_compiled_for_sm90_the_gemm_variant_loads_and_stores_only_vectors() -> None:
    """A ResNet-50 bottleneck's 1x1 convolutions (bf16, NHWC), with its fused BN + residual + ReLU
    epilogue, compiled for sm_90 without a GPU: no scalar global loads (the direct variant issues
    2-byte ones for the same problem), K loops of several steps as 16-byte cp.async, tensor cores."""
    import re

    pytest.importorskip("triton.backends.nvidia.compiler")
    for c_in, c_out, stride in ((64, 256, 1), (256, 64, 1), (256, 512, 2)):
        x = torch.empty(128, c_in, 56, 56, dtype=torch.bfloat16).contiguous(memory_format=CL)
        w = torch.empty(c_out, c_in, 1, 1, dtype=torch.bfloat16).contiguous(memory_format=CL)
        problem = triton_conv.problem_of_tensors(x, w, None, (stride, stride), (0, 0), (1, 1))
        form = triton_conv.EpilogueForm(scale=True, shift=True, residual_strides=problem.out_strides,
                                        activation="relu")
        config = {"VARIANT": "gemm", "BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8,
                  "num_stages": 3}
        ptx = _sm90_ptx(triton_conv.TritonConv(problem, config, form))
        assert "ld.global.b16" not in ptx and "ld.global.u16" not in ptx, (c_in, c_out)
        assert set(re.findall(r"\bst\.global[.\w]*", ptx)) == {"st.global.v4.b32"}, (c_in, c_out)
        assert "wgmma.mma_async" in ptx
        if c_in > 64:
            copies = set(re.findall(r"\bcp\.async\.c[ag]\.shared\.global[^;]*?\],\s*\[[^\]]*\],\s*(\w+)", ptx))
            assert copies == {"0x10"}, (c_in, copies)
        direct = dict(config, VARIANT="direct")
        if c_in == 64:
            assert "ld.global.b16" in _sm90_ptx(triton_conv.TritonConv(problem, direct, form))


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("case", [("stem", 3, 7, 7, (2, 2), (3, 3), (1, 1)), ("s1", 3, 3, 3, (1, 1), (1, 1), (1, 1)),
                                  ("gray", 1, 7, 7, (2, 2), (3, 3), (1, 1)), ("c5", 5, 3, 3, (2, 1), (1, 2), (1, 1)),
                                  ("dil", 3, 3, 3, (1, 1), (2, 2), (2, 3)), ("patch", 3, 4, 4, (4, 4), (0, 0), (1, 1))],
                         ids=lambda c: c[0] if isinstance(c, tuple) else c)
def test_padded_variant_alignment_and_contiguity_hints_hold(case: tuple[Any, ...], dtype: str) -> None:
    """tl.multiple_of / tl.max_contiguous / tl.max_constancy are promises the interpreter ignores
    and the GPU build trusts (a wrong one loads wrong data): recompute the padded kernel's A offsets
    and mask for every output row and K tile, and check each run of A_CONTIG offsets is contiguous
    and starts at a multiple of ROW_ALIGN, and the K mask is constant over its stated runs."""
    _, c_in, kh, kw, stride, padding, dilation = case
    x = torch.empty(2, c_in, 13, 11)
    w = torch.empty(8, c_in, kh, kw)
    problem = triton_conv.problem_of_tensors(x, w, None, stride, padding, dilation)
    problem = replace(problem, dtype=dtype)
    n, _, oh, ow = problem.out_shape
    for config in [c for c in triton_conv.configs(problem) if c["VARIANT"] == "padded"]:
        conv = triton_conv.TritonConv(problem, config)
        assert conv.padder is not None
        k_ = conv.constexprs
        sxn, _, sxh, sxw = conv.padder.geom.strides
        m = torch.arange(n * oh * ow)
        row = (m // (ow * oh)) * sxn + ((m // ow) % oh * stride[0]) * sxh + (m % ow * stride[1]) * sxw
        bk, k_row, c_pad, align, run = (k_["BLOCK_K"], k_["K_ROW"], k_["C_PAD"], k_["ROW_ALIGN"], k_["A_CONTIG"])
        assert align >= 1 and run >= 1 and bk % run == 0
        k_steps = -(-kh * k_row // bk)
        assert conv.padder.k_pad == k_steps * bk
        for kb in range(k_steps):
            k = kb * bk + torch.arange(bk)
            kh_, j = k // k_row, k % k_row
            col = kh_ * dilation[0] * sxh + (j if dilation[1] == 1 else (j // c_pad) * dilation[1] * sxw + j % c_pad)
            offs = (row[:, None] + col[None, :]).reshape(len(row), bk // run, run)
            assert bool((offs[:, :, 0] % align == 0).all()), (config, kb)
            assert bool((offs - offs[:, :, :1] == torch.arange(run)).all()), (config, kb)
            mask = (kh_ < kh) & ((j // c_pad) < kw)
            const = c_pad if kw * c_pad < k_row else run
            assert bool((mask.reshape(-1, const) == mask.reshape(-1, const)[:, :1]).all()), (config, kb)


def _sm90_ptx(conv: triton_conv.TritonConv) -> str:
    """The conv's PTX compiled for an H100/H200 (sm_90) without a GPU: triton.compile of the kernel
    specialized as a launch would be (16-byte-aligned pointers; ints divisible by 16 marked so, ints
    equal to 1 constant)."""
    from triton.runtime.jit import JITFunction

    p = conv.problem
    fn = conv.fn if isinstance(conv.fn, JITFunction) else JITFunction(conv.fn.fn)
    x_strides = p.x_strides if conv.padder is None else conv.padder.geom.strides
    hw = p.x_shape[2:] if conv.padder is None else (conv.padder.geom.hp, conv.padder.geom.wa)
    res_strides = conv.epilogue.residual_strides or (0, 0, 0, 0)
    ints = iter([p.x_shape[0], *hw, *p.out_shape[2:], *x_strides, *conv.inner.w_strides, *p.out_strides,
                 *res_strides])
    element = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}[p.dtype]
    signature: dict[str, str] = {}
    constants: dict[str, Any] = {}
    attrs: dict[tuple[int, ...], Any] = {}
    for i, name in enumerate(fn.arg_names):
        if name in conv.constexprs:
            signature[name], constants[name] = "constexpr", conv.constexprs[name]
        elif name.endswith("_ptr"):
            signature[name] = "*" + ("fp32" if name in ("scale_ptr", "shift_ptr", "rscale_ptr") else element)
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            value = next(ints)
            signature[name] = "constexpr" if value == 1 else "i32"
            if value == 1:
                constants[name] = 1
            elif value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    options = {"num_warps": conv.launch_options["num_warps"], "num_stages": conv.launch_options["num_stages"]}
    # compiled in a child process: under TRITON_INTERPRET=1 (`make test`) the interpreter may have
    # patched triton.language in this one
    return sm90_ptx_exact(triton_conv.TRITON_CONV_SOURCE, triton_conv.KERNEL_NAME, signature, constants, attrs,
                          options)


def test_compiled_for_sm90_the_padded_stem_loads_vectors_where_the_direct_one_loads_elements() -> None:
    """Without a GPU: the ResNet stem (bf16) compiled for sm_90 in both variants. The direct kernel
    gathers A and B one 2-byte element at a time; the padded one copies each tap's 4 channels of A as
    one 8-byte cp.async and w_pad in 16-byte cp.async, and issues no scalar loads at all."""
    import re

    pytest.importorskip("triton.backends.nvidia.compiler")
    x = torch.empty(128, 3, 224, 224, dtype=torch.bfloat16).contiguous(memory_format=CL)
    w = torch.empty(64, 3, 7, 7, dtype=torch.bfloat16).contiguous(memory_format=CL)
    stem = triton_conv.problem_of_tensors(x, w, None, (2, 2), (3, 3), (1, 1))
    loads = {}
    for variant in VARIANTS:
        ptx = _sm90_ptx(triton_conv.TritonConv(stem, _config(stem, variant)))
        loads[variant] = (set(re.findall(r"\bld\.global[.\w]*", ptx)),
                          set(re.findall(r"\bcp\.async\.c[ag]\.shared\.global[^;]*?\],\s*\[[^\]]*\],\s*(\w+)", ptx)))
        assert "wgmma.mma_async" in ptx, variant                          # tensor cores either way
    assert loads["direct"] == ({"ld.global.b16"}, set())
    assert loads["padded"] == (set(), {"0x8", "0x10"})


@on_the_interpreter
def test_autotuning_checks_and_times_every_config_and_caches_the_choice(monkeypatch: pytest.MonkeyPatch,
                                                                         tmp_path: Any) -> None:
    import fusegraph.tune
    from fusegraph.tune import clear_memo, keys

    monkeypatch.setattr(keys, "gpu_identity", lambda: {"name": "test GPU", "capability": "9.0"})
    timed: list[dict[str, Any]] = []
    real_tune = fusegraph.tune.tune

    def spy(name: str, key: Any, candidates: Any, bench: Any, **kw: Any) -> Any:
        def recorded(config: Any) -> float:
            timed.append(dict(config.items()))
            return float(bench(config))
        return real_tune(name, key, candidates, recorded, **kw)

    monkeypatch.setattr(fusegraph.tune, "tune", spy)
    x, wt, b = _operands(1, 3, 6, 6, 16, 3, 3, True, torch.float32, seed=5)
    problem = triton_conv.problem_of_tensors(x, wt, b, (1, 1), (1, 1), (1, 1))
    clear_memo()
    with override(cache_dir=str(tmp_path), autotune=True, tune_min_floor_us=0):
        conv, tuning = triton_conv.autotuned(problem, "cpu")      # the GPU path, timed on the host clock
        assert tuning["source"] == "tuned" and tuning["candidates"] == len(triton_conv.configs(problem)) > 1
        assert sorted(map(str, timed), key=str) == sorted(map(str, triton_conv.configs(problem)), key=str)
        assert {c["VARIANT"] for c in timed} == {"direct", "padded"}     # each checked, then timed
        assert conv.config in triton_conv.configs(problem)
        assert_close(conv(x, wt, b), _reference(x, wt, b, 1, 1, 1), tol=1e-5)
        clear_memo()
        again, cached = triton_conv.autotuned(problem, "cpu")
    assert cached["source"] == "cache" and again.config == conv.config


def test_the_tuner_is_offered_both_variants_for_the_resnet_stem(monkeypatch: pytest.MonkeyPatch) -> None:
    import fusegraph.tune
    from fusegraph.tune import Config, TuneResult

    offered: dict[str, Any] = {}

    def fake_tune(name: str, key: Any, candidates: Any, bench: Any, **kw: Any) -> Any:
        offered.update(name=name, key=key, candidates=[dict(c.items()) for c in candidates], floor=kw["floor_ms"])
        return TuneResult(Config(next(c for c in candidates if c["VARIANT"] == "padded")), "tuned")

    monkeypatch.setattr(fusegraph.tune, "tune", fake_tune)
    x = torch.empty(128, 3, 224, 224, dtype=torch.bfloat16).contiguous(memory_format=CL)
    w = torch.empty(64, 3, 7, 7, dtype=torch.bfloat16).contiguous(memory_format=CL)
    stem = triton_conv.problem_of_tensors(x, w, None, (2, 2), (3, 3), (1, 1))
    conv, _ = triton_conv.autotuned(stem, "cpu")
    variants = [c["VARIANT"] for c in offered["candidates"]]
    assert offered["name"] == triton_conv.KERNEL_NAME and offered["key"]["version"] == 4
    assert variants.count("direct") >= 8 and variants.count("padded") >= 4 and variants[0] == "direct"
    assert variants.count("s2d") >= 4                                       # the stride-2 stem regrouped
    assert conv.variant == "padded" and conv.padder is not None            # the tuner's pick is what runs
    geom = conv.padder.geom
    assert (geom.c_pad, geom.k_row, geom.shape, conv.constexprs["ROW_ALIGN"]) == (4, 32, (128, 4, 230, 230), 8)
    assert triton_conv.padded_k(stem) == 7 * 32
    # its floor counts the scratch: x_pad (54 MB) written and read again, on top of x, w and out
    assert triton_conv.floor_bytes(stem, "padded") - triton_conv.floor_bytes(stem) == 2 * 128 * 230 * 230 * 4 * 2
    direct_floor, padded_floor = triton_conv.floor_ms(stem), triton_conv.floor_ms(stem, "padded")
    assert offered["floor"] == direct_floor and direct_floor is not None and padded_floor is not None
    assert padded_floor > direct_floor

@on_the_interpreter
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("case", [c for c in CASES if triton_conv.s2d_unsupported(
    triton_conv.problem_of_tensors(torch.empty(c[1:5]), torch.empty(c[5], c[2], c[6], c[7]), None, c[8], c[9],
                                   c[10])) is None], ids=lambda c: c[0])
def test_s2d_variant_matches_torch(case: tuple[Any, ...], dtype: torch.dtype) -> None:
    """Space-to-depth: the strided convolution as a stride-1 one over stride x stride blocks."""
    _, n, c, h, w, co, kh, kw, stride, padding, dilation, bias = case
    x, wt, b = _operands(n, c, h, w, co, kh, kw, bias, dtype, seed=len(case[0]))
    problem = triton_conv.problem_of_tensors(x, wt, b, stride, padding, dilation)
    for config in [cfg for cfg in triton_conv.configs(problem) if cfg["VARIANT"] == "s2d"][:2]:
        out = triton_conv.conv2d(x, wt, b, stride, padding, dilation, config=config)
        assert out.dtype == dtype and out.is_contiguous(memory_format=CL)
        assert_close(out.float(), _reference(x, wt, b, stride, padding, dilation),
                     tol=5e-3 if dtype == torch.float16 else 1e-5, what=f"{case[0]} {config}")


def test_s2d_geometry_of_the_resnet_stem() -> None:
    stem = triton_conv.problem_of_tensors(torch.empty(128, 3, 224, 224, dtype=torch.bfloat16),
                                          torch.empty(64, 3, 7, 7, dtype=torch.bfloat16), None, (2, 2), (3, 3), (1, 1))
    inner, geom = triton_conv.s2d_problem(stem), triton_conv.s2d_geometry(stem)
    # 4x4 stride-1 over 16 channels (2x2 blocks of 4 padded channels), 112 + 4 - 1 rows and columns
    assert (inner.w_shape, inner.stride, inner.padding, inner.k) == ((64, 16, 4, 4), (1, 1), (0, 0), 256)
    assert (geom.shape, geom.c_group, geom.k_row, geom.s2d) == ((128, 16, 115, 115), 4, 64, 2)
    assert triton_conv.floor_bytes(stem, "s2d") - triton_conv.floor_bytes(stem) == 2 * geom.nbytes
    assert "dilation" in str(triton_conv.s2d_unsupported(replace(stem, dilation=(2, 2))))
    assert "stride" in str(triton_conv.s2d_unsupported(replace(stem, stride=(1, 1))))
    with pytest.raises(fg.InvalidValueError, match="VARIANT='s2d' for a convolution it does not apply to"):
        triton_conv.TritonConv(replace(stem, stride=(1, 1)), {"VARIANT": "s2d", "BLOCK_M": 16, "BLOCK_N": 16,
                                                              "BLOCK_K": 16, "GROUP_M": 1, "num_warps": 1,
                                                              "num_stages": 1})


@on_the_interpreter
@pytest.mark.parametrize("variant", ["padded", "s2d"])
def test_operand_pass_folds_the_epilogue_scale_into_the_weight(variant: str) -> None:
    """scale * conv + shift -> relu with the scale multiplied into the weight the operand pass writes:
    the store applies the shift only (HAS_SCALE off in the conv)."""
    x, wt, _ = _operands(2, 3, 15, 13, 16, 7, 7, False, torch.float16, seed=9)
    problem = triton_conv.problem_of_tensors(x, wt, None, (2, 2), (3, 3), (1, 1))
    config = _config(problem, variant)
    form = triton_conv.EpilogueForm(scale=True, shift=True, activation="relu")
    conv = triton_conv.TritonConv(problem, config, form)
    assert conv.fold_scale and conv.padder is not None and conv.padder.constexprs["HAS_SCALE"]
    assert not conv.constexprs["HAS_SCALE"] and conv.constexprs["HAS_SHIFT"]
    vectors = {"scale": rand(16, low=0.5), "shift": rand(16)}
    want = torch.relu(_reference(x, wt, None, 2, 3, 1) * vectors["scale"][:, None, None]
                      + vectors["shift"][:, None, None])
    assert_close(conv(x, wt, None, vectors).float(), want, tol=5e-3)
    with pytest.raises(ValueError, match="without one"):
        conv(x, wt, None, {"shift": vectors["shift"]})


@on_the_interpreter
@pytest.mark.parametrize("variant", [*VARIANTS, "s2d"])
def test_nchw_operands_and_given_output_strides(variant: str) -> None:
    x = rand(2, 3, 11, 9, seed=3)                      # NCHW-contiguous input and weight
    wt = rand(8, 3, 3, 3, seed=4) / 5.0
    oh, ow = 6, 5
    nchw = (8 * oh * ow, oh * ow, ow, 1)
    problem = triton_conv.problem_of_tensors(x, wt, None, (2, 2), (1, 1), (1, 1), nchw)
    out = triton_conv.conv2d(x, wt, None, (2, 2), (1, 1), (1, 1), out_strides=nchw, config=_config(problem, variant))
    assert out.stride() == nchw
    assert_close(out, _reference(x, wt, None, 2, 1, 1), tol=1e-5)


def test_configs_are_clamped_to_the_problem_and_fp32_keeps_small_k_tiles() -> None:
    x, wt, _ = _operands(1, 3, 6, 6, 10, 3, 3, False, torch.float16, seed=1)
    problem = triton_conv.problem_of_tensors(x, wt, None, (1, 1), (1, 1), (1, 1))
    assert (problem.m, problem.k, problem.out_shape[1]) == (36, 27, 10)
    assert triton_conv.padded_k(problem) == 3 * 16            # kh rows of 3*4 = 12 -> 16
    for cfg in triton_conv.configs(problem):
        assert cfg["BLOCK_M"] <= 64 and cfg["BLOCK_N"] == 16
        assert cfg["BLOCK_K"] <= (32 if cfg["VARIANT"] == "direct" else 64)
    assert triton_conv.configs(problem)[0]["VARIANT"] == "direct"    # the untimed default is unchanged
    stem = triton_conv.problem_of_tensors(torch.empty(128, 3, 224, 224), torch.empty(64, 3, 7, 7), None,
                                          (2, 2), (3, 3), (1, 1))
    assert stem.m == 128 * 112 * 112 and stem.k == 147
    assert all(c["BLOCK_K"] <= 32 for c in triton_conv.configs(stem))        # fp32
    key = stem.key("cuda:0")
    assert key["conv"] == [(2, 2), (3, 3), (1, 1)] and key["dtype"] == "float32"
    assert key["x"][1] == (3 * 224 * 224, 224 * 224, 224, 1)                    # strides are part of the key
    assert key["version"] == triton_conv.TUNING_VERSION == 4     # entries from before the variants do not alias


def _conv_group(c_in: int = 3, groups: int = 1, activation: str = "relu", dtype: str = "float16") -> ConvGroup:
    group: ConvGroup = single_conv_group((2, c_in, 10, 9), (12, c_in // groups, 3, 3), activation=activation,
                                         dtype=dtype, stride=2, padding=1, groups=groups)
    return group


def _epilogue_kernel(group: ConvGroup) -> Any:
    from fusegraph.lower import fused_kernel
    return fused_kernel(group.epilogue, "k_epilogue", "float32", "cpu", {})


def test_candidate_offered_for_narrow_channels_on_a_gpu_only(capsys: pytest.CaptureFixture[str]) -> None:
    narrow = _conv_group()
    assert "triton_conv" not in library_candidates(narrow, "cpu", "k")
    offered = library_candidates(narrow, "cuda", "k", "float32", _epilogue_kernel(narrow))
    assert isinstance(offered.get("triton_conv"), triton_conv.ConvGroupLaunch)   # planned for a GPU, built lazily
    plain = _conv_group(activation="")                  # conv + bias only: no epilogue kernel needed
    assert not plain.epilogue_nodes and "triton_conv" in library_candidates(plain, "cuda", "k")
    with override(debug=1):
        wide = _conv_group(c_in=32)
        assert "triton_conv" not in library_candidates(wide, "cuda", "k_wide", "float32", _epilogue_kernel(wide))
        grouped = _conv_group(c_in=4, groups=2)
        assert "triton_conv" not in library_candidates(grouped, "cuda", "k_grouped", "float32",
                                                       _epilogue_kernel(grouped))
        pointwise = single_conv_group((2, 32, 6, 5), (12, 32, 1, 1), padding=0)     # wide 1x1: measured slower
        assert "triton_conv" not in library_candidates(pointwise, "cuda", "k_1x1", "float32",
                                                       _epilogue_kernel(pointwise))
        narrow = single_conv_group((2, 12, 6, 5), (12, 12, 1, 1), padding=0)        # narrow 1x1: all three
        offered = library_candidates(narrow, "cuda", "k_n1x1", "float32", _epilogue_kernel(narrow))
        variants = {c["VARIANT"] for c in triton_conv.configs(offered["triton_conv"].problem)}
        assert variants == {"direct", "padded", "gemm"}
    printed = capsys.readouterr().out
    assert "k_wide: Triton conv not used: C_in=32 > 16" in printed
    assert "k_1x1: Triton conv not used: C_in=32 > 16" in printed and "0.51-1.02x cuDNN" in printed
    assert "k_n1x1: Triton conv not used" not in printed
    assert "k_grouped: Triton conv not used: grouped convolution (groups=2)" in printed
    g = fg.Graph(name="f64")
    x64, w64 = g.tensor((1, 3, 5, 5), dtype="float64", name="x"), g.tensor((4, 3, 3, 3), dtype="float64", name="w")
    g.conv2d(x64, w64).set_output()
    node = next(n for n in g.to_ir().nodes if n.op == "conv2d")
    assert triton_conv.unsupported(node) == "dtype float64 (fp16, bf16 and fp32 only)"


def _use_variant(launch: triton_conv.ConvGroupLaunch, variant: str) -> None:
    """Run the launch here, under the interpreter, with the variant's first config (as if tuned so)."""
    launch.device = "cpu"
    if variant != "direct":
        launch.conv = triton_conv.TritonConv(launch.problem, _config(launch.problem, variant))


@on_the_interpreter
@pytest.mark.parametrize("variant", VARIANTS)
def test_candidate_runs_our_conv_then_the_epilogue_like_the_plain_path(variant: str) -> None:
    from fusegraph.lower import _example_inputs

    group = _conv_group(activation="silu", dtype="float32")
    epilogue = _epilogue_kernel(group)
    launch = library_candidates(group, "cuda", "k", "float32", epilogue)["triton_conv"]
    _use_variant(launch, variant)
    args = _example_inputs(group.inputs, "cpu")
    plain = conv_group_kernel(group, "k", "float32", "cpu", {})   # reference conv + our epilogue kernel
    (got,), (want,) = launch(args), plain.launch(args)
    assert got.stride() == want.stride()
    assert_close(got, want, tol=1e-5, what="triton conv + silu epilogue")
    source = library_source("triton_conv", launch, "conv2d", "NHWC (channels-last)", group)
    assert source.startswith(LIBRARY_SOURCES["triton_conv"].split("{")[0])
    assert "def fg_conv2d_implicit_gemm" in source and "tl.dot" in source and "epilogue kernel" in source
    assert ("def fg_conv_pad_operands" in source) == (variant == "padded")


def _fused_graph(kind: str, layout: str | None = "NHWC", c_in: int = 3, k: int = 3) -> ConvGroup:
    """conv2d (fp16, C_in 3, 3x3/2 padded; or 1x1/2 unpadded) + an inference epilogue of `kind` as one
    ConvGroup."""
    g = fg.Graph(name=f"fused_{kind}", compute_dtype="float32")
    x = g.tensor((2, c_in, 11, 10), dtype="float16", name="x", layout=layout)
    w = g.tensor((12, c_in, k, k), dtype="float16", name="w")
    b = g.tensor((12,), dtype="float16", name="b")
    y = g.conv2d(x, w, b, stride=2, padding=k // 2)
    if kind in ("bn_relu", "bn_residual_relu"):
        rm, rv = g.tensor((12,), dtype="float32", name="rm"), g.tensor((12,), dtype="float32", name="rv")
        gw, gb = g.tensor((12,), dtype="float16", name="gw"), g.tensor((12,), dtype="float16", name="gb")
        y = g.batch_norm(y, rm, rv, weight=gw, bias=gb, training=False)
        if kind == "bn_residual_relu":
            y = g.add(y, g.tensor((2, 12, 6, 5), dtype="float16", name="r", layout="NHWC"))
        y = g.relu(y)
    else:
        y = getattr(g, kind.removeprefix("bias_"))(y)
    y.set_output()
    plan = g.build(device="cpu")
    (item,) = claim_epilogues(partition_graph(plan.graph).items, plan.graph)
    assert isinstance(item, ConvGroup)
    return item


@on_the_interpreter
@pytest.mark.parametrize("kind,layout,variant", [
    ("bias_relu", "NHWC", "direct"), ("bias_relu", None, "direct"), ("bias_silu", "NHWC", "direct"),
    ("bias_gelu", "NHWC", "direct"), ("bn_relu", "NHWC", "direct"), ("bn_residual_relu", "NHWC", "direct"),
    ("bias_relu", "NHWC", "padded"), ("bias_relu", None, "padded"), ("bn_residual_relu", "NHWC", "padded"),
    ("bn_residual_relu", "NHWC", "gemm"), ("bias_gelu", "NHWC", "gemm")])
def test_fused_candidate_applies_the_epilogue_in_the_conv_store(kind: str, layout: str | None, variant: str) -> None:
    from fusegraph.lower import _example_inputs

    # the gemm variant: a 1x1 convolution (C_in 16, alignment 8 elements)
    group = _fused_graph(kind, layout, c_in=16, k=1) if variant == "gemm" else _fused_graph(kind, layout)
    offered = library_candidates(group, "cuda", "k", "float32", _epilogue_kernel(group))
    fused = offered["triton_conv_fused"]
    assert isinstance(fused, triton_conv.FusedGroupLaunch)
    assert fused.direct_bias == kind.startswith("bias_")          # conv bias read directly, no per-call fold
    assert fused.form.residual_strides is not None if "residual" in kind else fused.form.residual_strides is None
    _use_variant(offered["triton_conv"], variant)                  # the config comes from the plain candidate
    args = _example_inputs(group.inputs, "cpu")
    for k in fused.leaf_at:                                        # BN variances positive (as _choose makes them)
        args[k] = args[k].abs() + 0.5
    plain = conv_group_kernel(group, "k", "float32", "cpu", {})
    want = plain.launch(args)[0]
    (got,) = fused(args)
    assert got.stride() == want.stride() and got.dtype == want.dtype   # the group's output layout (NCHW: the exit copy)
    assert_close(got, want, tol=5e-3, what=kind)
    if fused.fold:   # the folded vectors are cached, and refolded when a BN input is written in place
        cached = fused.folded._cache
        assert cached is not None and fused.vectors(args) is cached[1]
        args[fused.leaf_at[-1]].mul_(1.5)
        assert_close(fused(args)[0], plain.launch(args)[0], tol=5e-3, what=f"{kind} after an in-place update")
    assert fused.prepare().variant == variant
    source = library_source("triton_conv_fused", fused, "conv2d", "NHWC (channels-last)", group)
    assert "epilogue fused into its store" in source and "ACTIVATION" in source


def test_fused_candidate_not_offered_for_an_epilogue_it_does_not_compute(capsys: pytest.CaptureFixture[str]) -> None:
    group = _fused_graph("bias_sigmoid")
    with override(debug=1):
        offered = library_candidates(group, "cuda", "k_sig", "float32", _epilogue_kernel(group))
    assert "triton_conv" in offered and "triton_conv_fused" not in offered
    assert "k_sig: Triton conv not used: fused epilogue:" in capsys.readouterr().out


@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETING,
                    reason="needs a GPU and compiled kernels (TRITON_INTERPRET=0): tuned configs, bf16 dots")
def test_on_the_gpu_tuned_bf16_and_a_plan_that_offers_both_candidates() -> None:
    x, wt, b = _operands(4, 3, 64, 64, 64, 7, 7, True, torch.bfloat16, seed=11)
    x, wt, b = x.cuda(), wt.cuda(), None if b is None else b.cuda()
    out = triton_conv.conv2d(x, wt, b, (2, 2), (3, 3), (1, 1))          # autotuned on this GPU
    assert_close(out.float(), _reference(x, wt, b, 2, 3, 1), tol=2e-2)
    problem = triton_conv.problem_of_tensors(x, wt, b, (2, 2), (3, 3), (1, 1))
    for config in triton_conv.configs(problem):     # every candidate compiled (hints trusted) and right in bf16
        got = triton_conv.conv2d(x, wt, b, (2, 2), (3, 3), (1, 1), config=config)
        assert_close(got.float(), _reference(x, wt, b, 2, 3, 1), tol=2e-2, what=str(config))
    g = fg.Graph(name="stem_gpu", compute_dtype="float32")
    xs = g.tensor(tuple(x.shape), dtype="bfloat16", name="x", layout="NHWC")
    ws, bs = g.tensor(tuple(wt.shape), dtype="bfloat16", name="w"), g.tensor((64,), dtype="bfloat16", name="b")
    y = g.relu(g.conv2d(xs, ws, bs, stride=2, padding=3))
    y.set_output()
    plan = g.build(device="cuda")
    (kernel,) = plan.kernels
    assert kernel.tuning["candidates"] >= 3      # conv + epilogue, triton_conv, triton_conv_fused (+ cuDNN fused)
    got = plan.execute({xs: x, ws: wt, bs: b})[y]
    assert_close(got.float(), torch.relu(_reference(x, wt, b, 2, 3, 1)), tol=2e-2)


@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETING,
                    reason="needs a GPU and compiled kernels (TRITON_INTERPRET=0): tuned configs, bf16 dots")
def test_on_the_gpu_every_gemm_config_of_a_bottleneck_1x1_is_right_in_bf16() -> None:
    x, wt, b = _operands(8, 256, 28, 28, 128, 1, 1, True, torch.bfloat16, seed=17)
    x, wt, b = x.cuda(), wt.cuda(), None if b is None else b.cuda()
    for stride in (1, 2):
        problem = triton_conv.problem_of_tensors(x, wt, b, (stride, stride), (0, 0), (1, 1))
        assert {c["VARIANT"] for c in triton_conv.configs(problem)} == {"gemm"}
        for config in triton_conv.configs(problem):   # hints trusted on real hardware: each config checked
            got = triton_conv.conv2d(x, wt, b, (stride, stride), (0, 0), (1, 1), config=config)
            assert_close(got.float(), _reference(x, wt, b, stride, 0, 1), tol=2e-2, what=str(config))


def test_the_plan_precompile_batch_gets_every_config_the_tuner_would_time(monkeypatch: pytest.MonkeyPatch,
                                                                          tmp_path: Any) -> None:
    """triton_conv.warmup_jobs (the plan's precompile batch) compiles what autotuned would: every
    config when it will time them, the remembered choice when the cache has one, the first config
    when it will not time; once per problem."""
    from fusegraph.tune import Config, clear_memo, keys, tune

    group = single_conv_group((2, 3, 12, 12), (8, 3, 3, 3), layout="NHWC", dtype="float16")
    node = group.compute
    assert triton_conv.unsupported(node) is None
    problem = triton_conv.problem_of(node, node.spec.memory_strides)
    compiled: list[dict[str, Any]] = []
    real_operands = triton_conv.example_operands
    monkeypatch.setattr(triton_conv, "example_operands",
                        lambda p, device: real_operands(p, "cpu"))   # the operands only shape the jobs
    monkeypatch.setattr(triton_conv.TritonConv, "warmup_job",
                        lambda self, x, w, b: compiled.append(dict(self.config)) or (lambda: None))
    monkeypatch.setattr(keys, "gpu_identity", lambda: {"name": "test GPU", "capability": "9.0"})
    clear_memo()
    every = triton_conv.configs(problem)
    with override(cache_dir=str(tmp_path), autotune=True, tune_min_floor_us=0):
        jobs = triton_conv.warmup_jobs(node, "cuda", False, seen := set())
        assert len(jobs) == len(every) > 1 and compiled == every
        assert triton_conv.warmup_jobs(node, "cuda", False, seen) == []          # the same problem: once
        pick = Config(every[-1])
        tune(triton_conv.KERNEL_NAME, problem.key("cuda"), [Config(c) for c in every],
             lambda c: 1.0 if c == pick else 2.0)
        compiled.clear()
        triton_conv.warmup_jobs(node, "cuda", False, set())
        assert compiled == [every[-1]]                                             # the remembered choice only
    compiled.clear()
    with override(autotune=False):
        triton_conv.warmup_jobs(node, "cuda", False, set())
    assert compiled == [every[0]]
    assert triton_conv.warmup_jobs(node, "cpu", False, set()) == []
