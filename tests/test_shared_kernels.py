"""Identical kernels at different plan positions (every layer's copy of a block kernel) share one
compiled Triton function and one tuning: codegen/compile.shared_kernel_text strips the position
lower_fused puts in kernel names (fg_k{k}_<ops>) before loading and before keying the tuner."""

from __future__ import annotations

import torch

import fusegraph as fg
from conftest import assert_close, rand
from fusegraph.codegen.compile import load_triton_function, shared_kernel_text
from fusegraph.tune import Config
from fusegraph.tune.keys import digest, full_key

SOURCE = '''import triton
import triton.language as tl


@triton.jit
def {name}(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=mask) * 2.0 + 1.0, mask=mask)


@triton.jit
def {name}_finish(y_ptr):
    pass
'''
GPU = {"name": "test-gpu", "capability": "9.0"}


def test_positions_are_stripped_only_from_kernel_names() -> None:
    assert shared_kernel_text("fg_k12_mul_add") == shared_kernel_text("fg_k3_mul_add") == "fg_mul_add"
    assert shared_kernel_text("fg_k3_mul_add_finish") == "fg_mul_add_finish"
    assert shared_kernel_text("x = fg_k10_a(y); k10_b; xfg_k1_c") == "x = fg_a(y); k10_b; xfg_k1_c"


def test_identical_kernels_at_two_positions_load_one_function() -> None:
    first = load_triton_function(SOURCE.format(name="fg_k3_twice"), "fg_k3_twice")
    again = load_triton_function(SOURCE.format(name="fg_k17_twice"), "fg_k17_twice")
    other = load_triton_function(SOURCE.format(name="fg_k17_thrice"), "fg_k17_thrice")
    assert first is again and first is not other
    finish = load_triton_function(SOURCE.format(name="fg_k9_twice"), "fg_k9_twice_finish")
    assert finish is load_triton_function(SOURCE.format(name="fg_k4_twice"), "fg_k4_twice_finish")


def test_identical_kernels_share_one_tuning_key() -> None:
    cands = [Config(BLOCK=128), Config(BLOCK=256)]
    a = full_key("fg_k3_twice", {"source": SOURCE.format(name="fg_k3_twice"), "device": "cuda"}, cands, GPU)
    b = full_key("fg_k17_twice", {"source": SOURCE.format(name="fg_k17_twice"), "device": "cuda"}, cands, GPU)
    c = full_key("fg_k17_thrice", {"source": SOURCE.format(name="fg_k17_thrice"), "device": "cuda"}, cands, GPU)
    assert digest(a) == digest(b) != digest(c)


def test_a_model_with_repeated_blocks_shares_kernel_functions() -> None:
    """Three identical blocks (layer norm, GEMM, gelu): the plan is LN | GEMM | gelu+LN | GEMM | gelu+LN |
    GEMM+gelu, and the two middle GEMMs and the two gelu+LN kernels each share one function."""
    g = fg.Graph(name="two_blocks", compute_dtype="float32")
    x = g.tensor((16, 32), dtype="float32", name="x")
    ws = [g.tensor((32, 32), dtype="float32", name=f"w{i}") for i in range(3)]
    h = x
    for w in ws:
        h = g.gelu(g.matmul(g.layer_norm(h, (32,)), w))
    h.set_output()
    plan = g.build()
    launched = [k for k in plan.kernels if getattr(k.launch, "fn", None) is not None]
    fns = [k.launch.fn for k in launched]
    assert len(launched) == 6 and len({id(f) for f in fns}) == 4, [k.name for k in launched]
    assert fns[1] is fns[3] and fns[2] is fns[4]
    assert len({k.name for k in launched}) == 6           # the plan still names each kernel by position
    xv, wv = rand(16, 32), [rand(32, 32) for _ in ws]
    want = xv
    for w in wv:
        want = torch.nn.functional.gelu(torch.nn.functional.layer_norm(want, (32,)) @ w)
    assert_close(plan(xv, *wv), want)
