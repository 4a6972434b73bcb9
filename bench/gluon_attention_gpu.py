"""A warp-specialized causal flash-attention forward for Hopper in Gluon, against torch's SDPA backends
and fusegraph's plan: can the softmax be hidden behind the tensor cores, as FlashAttention-3 does?

Why: issue 4 asks 600 TFLOP/s for causal attention at B4 H32 S4096 D128 bf16; our Triton kernel and
torch's cuDNN run ~520-530, cuDNN's best engine 557 (bench/RESULTS.md, twenty-sixth session). Our Triton
kernel runs each key block's QK^T, softmax and PV in sequence on the same warps; Triton 3.6 offers warp
specialization on Hopper only through Gluon. This kernel (one program per 128 query rows of one head):
  - a producer warp loads the program's Q tile once, then K and V blocks by TMA into rings of their own
    (K_STAGES, V_STAGES deep: a K block is free once its scores are computed, a V block one iteration
    later), in the order they are needed: K0, then K(j+1) before V(j) (`ready` barriers completed by the
    copies' bytes; `empty` arrived by both consumers);
  - two consumer warpgroups take 64 query rows each; each pipelines within itself: it issues key block
    j's S = Q K^T and block j-1's O += P V together, runs block j's softmax while both run, and rescales O
    after the PV finishes;
  - the two consumers alternate on the tensor cores: a `turn` barrier pair hands the issue of each
    iteration's two GEMMs from one consumer to the other, so one's softmax runs under the other's GEMMs
    (TURN; without it the two run free);
  - causal: the program's key blocks stop at its diagonal block, the only one masked; programs run the
    longest rows first (HEADS_FIRST: every head's last query block before any head's second-to-last; else
    one head's blocks after another, each head's from its last).

Prepared without a GPU: `--cpu-compile` compiles it for sm_90 on the CPU. On the GPU it checks its output
against torch's SDPA (fp32 math) before timing it beside torch's SDPA backends and fusegraph's plan.

    PYTHONPATH=src python bench/gluon_attention_gpu.py [--b 4 --h 32 --s 4096] [--stages 3,3]
    python bench/gluon_attention_gpu.py --cpu-compile
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Any

import torch
import triton
from gluon_common import checked, compile_for_sm90
from out_files import write_report
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

BM, BN, D = 128, 128, 128      # query rows a program (64 a consumer), keys a block, head dim
HALF = BM // 2
CONSUMER_REGS = gl.constexpr(240)
PRODUCER_REGS = gl.constexpr(24)
LOG2E = 1.4426950408889634


@gluon.jit
def _program(HEADS_FIRST: gl.constexpr):
    """(query block, head) of this program, longest rows first: with HEADS_FIRST the grid is (heads, query
    blocks) and every head's last query block launches before any head's second-to-last; else (query blocks,
    heads), one head's blocks after another."""
    if HEADS_FIRST:
        return gl.num_programs(1) - 1 - gl.program_id(1), gl.program_id(0)
    return gl.num_programs(0) - 1 - gl.program_id(0), gl.program_id(1)


@gluon.jit
def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty, S,
              K_STAGES: gl.constexpr, V_STAGES: gl.constexpr, HEADS_FIRST: gl.constexpr):
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    HALF_M: gl.constexpr = q_desc.block_type.shape[0]
    pid_m, bh = _program(HEADS_FIRST)
    row0 = bh * S                                           # this head's first row in the [B*H*S, D] views
    q_row = row0 + pid_m * 2 * HALF_M
    mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [q_row, 0], q_bar, q_smem.index(0))
    tma.async_copy_global_to_shared(q_desc, [q_row + HALF_M, 0], q_bar, q_smem.index(1))
    n_blocks = (pid_m * 2 * HALF_M) // BLOCK_N + 1
    # in the order the consumers need them: K0, then K(j+1) before V(j) (iteration j multiplies S(j) = Q K(j)^T
    # and O += P(j-1) V(j-1))
    mbarrier.expect(k_ready.index(0), k_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [row0, 0], k_ready.index(0), k_smem.index(0))
    for j in range(n_blocks):
        if j + 1 < n_blocks:
            ks = (j + 1) % K_STAGES
            mbarrier.wait(k_empty.index(ks), (((j + 1) // K_STAGES) & 1) ^ 1)
            mbarrier.expect(k_ready.index(ks), k_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [row0 + (j + 1) * BLOCK_N, 0], k_ready.index(ks), k_smem.index(ks))
        vs = j % V_STAGES
        mbarrier.wait(v_empty.index(vs), ((j // V_STAGES) & 1) ^ 1)
        mbarrier.expect(v_ready.index(vs), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [row0 + j * BLOCK_N, 0], v_ready.index(vs), v_smem.index(vs))


@gluon.jit
def _softmax_step(s_acc, m_i, qk_scale, offs_m, offs_n, MASK: gl.constexpr):
    """Block scores -> (p, new row max, alpha = exp2(old max - new max)), base-2 domain. The scale goes into
    the max (one multiply a row) and into the exponent's argument as one fused multiply-add an element."""
    if MASK:
        s_acc = gl.where(gl.expand_dims(offs_n, 0) <= gl.expand_dims(offs_m, 1), s_acc, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s_acc, axis=1) * qk_scale)
    p = gl.exp2(s_acc * qk_scale - gl.expand_dims(m_new, 1))
    alpha = gl.exp2(m_i - m_new)
    return p, m_new, alpha


@gluon.jit
def _consumer(q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty, turn, o_ptr, lse_ptr, S, qk_scale,
              WHICH: gl.constexpr, K_STAGES: gl.constexpr, V_STAGES: gl.constexpr, TURN: gl.constexpr,
              HEADS_FIRST: gl.constexpr):
    HALF_M: gl.constexpr = q_smem.shape[1]
    HEAD_D: gl.constexpr = q_smem.shape[2]
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    pid_m, bh = _program(HEADS_FIRST)
    q_start = pid_m * 2 * HALF_M + WHICH * HALF_M           # first query row of this consumer, within the head
    n_blocks = (pid_m * 2 * HALF_M) // BLOCK_N + 1           # the last is the diagonal block
    offs_m = q_start + gl.arange(0, HALF_M, layout=gl.SliceLayout(1, s_layout))
    q = q_smem.index(WHICH)
    mbarrier.wait(q_bar, 0)

    m_i = gl.full([HALF_M], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([HALF_M], gl.float32, layout=gl.SliceLayout(1, s_layout))
    acc = gl.zeros([HALF_M, HEAD_D], gl.float32, o_layout)
    zero_s = gl.zeros([HALF_M, BLOCK_N], gl.float32, s_layout)

    # block 0: its scores alone (turn 0); operands are waited for before the turn is taken
    mbarrier.wait(k_ready.index(0), 0)
    if TURN:
        mbarrier.wait(turn.index(WHICH), 1 ^ WHICH)
    s_acc = warpgroup_mma(q, k_smem.index(0).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    if TURN:
        mbarrier.arrive(turn.index(1 - WHICH), count=1)
    s_acc = warpgroup_mma_wait(num_outstanding=0, deps=[s_acc])
    mbarrier.arrive(k_empty.index(0), count=1)
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    if n_blocks == 1:
        p, m_i, alpha = _softmax_step(s_acc, m_i, qk_scale, offs_m, offs_n, True)
    else:
        p, m_i, alpha = _softmax_step(s_acc, m_i, qk_scale, offs_m, offs_n, False)
    l_i = gl.sum(p, axis=1)
    p_op = gl.convert_layout(p.to(gl.bfloat16), p_layout)

    for j in range(1, n_blocks):
        ks = j % K_STAGES
        vs = (j - 1) % V_STAGES
        mbarrier.wait(k_ready.index(ks), (j // K_STAGES) & 1)
        mbarrier.wait(v_ready.index(vs), ((j - 1) // V_STAGES) & 1)
        if TURN:
            mbarrier.wait(turn.index(WHICH), (j & 1) ^ (1 - WHICH))
        s_acc = warpgroup_mma(q, k_smem.index(ks).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        acc = warpgroup_mma(p_op, v_smem.index(vs), acc, is_async=True)
        if TURN:
            mbarrier.arrive(turn.index(1 - WHICH), count=1)       # the other consumer may issue its two GEMMs
        s_acc = warpgroup_mma_wait(num_outstanding=1, deps=[s_acc])
        mbarrier.arrive(k_empty.index(ks), count=1)           # K(j) is read
        offs_n = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        if j == n_blocks - 1:
            p, m_new, alpha = _softmax_step(s_acc, m_i, qk_scale, offs_m, offs_n, True)
        else:
            p, m_new, alpha = _softmax_step(s_acc, m_i, qk_scale, offs_m, offs_n, False)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
        mbarrier.arrive(v_empty.index(vs), count=1)           # V(j-1) is read
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
        l_i = l_i * alpha + gl.sum(p, axis=1)
        m_i = m_new
        p_op = gl.convert_layout(p.to(gl.bfloat16), p_layout)

    last = (n_blocks - 1) % V_STAGES
    mbarrier.wait(v_ready.index(last), ((n_blocks - 1) // V_STAGES) & 1)
    if TURN:
        mbarrier.wait(turn.index(WHICH), (n_blocks & 1) ^ (1 - WHICH))
    acc = warpgroup_mma(p_op, v_smem.index(last), acc, is_async=True)
    if TURN:
        mbarrier.arrive(turn.index(1 - WHICH), count=1)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
    mbarrier.arrive(v_empty.index(last), count=1)

    # out = acc / l; lse (natural log) = (m + log2 l) / log2(e)
    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
    out = acc / gl.expand_dims(l_o, 1)
    rows = bh * S + q_start + gl.arange(0, HALF_M, layout=gl.SliceLayout(1, o_layout))
    cols = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, o_layout))
    gl.store(o_ptr + gl.expand_dims(rows, 1) * HEAD_D + gl.expand_dims(cols, 0), out.to(gl.bfloat16))
    lse = (m_i + gl.log2(l_i)) * 0.6931471805599453
    gl.store(lse_ptr + bh * S + offs_m, lse)


@gluon.jit
def fg_gluon_flash_fwd(q_desc, k_desc, v_desc, o_ptr, lse_ptr, S, qk_scale, K_STAGES: gl.constexpr,
                       V_STAGES: gl.constexpr, TURN: gl.constexpr, HEADS_FIRST: gl.constexpr):
    HALF_M: gl.constexpr = q_desc.block_type.shape[0]
    HEAD_D: gl.constexpr = q_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [2, HALF_M, HEAD_D], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [K_STAGES, BLOCK_N, HEAD_D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [V_STAGES, BLOCK_N, HEAD_D], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [K_STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [K_STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [V_STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [V_STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(K_STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)      # both consumers release a stage
    for i in gl.static_range(V_STAGES):
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(v_empty.index(i), count=2)
    for i in gl.static_range(2):
        mbarrier.init(turn.index(i), count=1)
    # one function serves both consumers: WHICH, a constexpr, is written into each partition's tuple
    gl.warp_specialize([
        (_consumer, (q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty, turn, o_ptr, lse_ptr, S,
                     qk_scale, 0, K_STAGES, V_STAGES, TURN, HEADS_FIRST)),
        (_consumer, (q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty, turn, o_ptr, lse_ptr, S,
                     qk_scale, 1, K_STAGES, V_STAGES, TURN, HEADS_FIRST)),
        (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty, S,
                     K_STAGES, V_STAGES, HEADS_FIRST)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


def descriptors(q2: torch.Tensor, k2: torch.Tensor, v2: torch.Tensor) -> tuple[Any, Any, Any]:
    gl_dtype = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[q2.dtype]
    q_layout = gl.NVMMASharedLayout.get_default_for([HALF, D], gl_dtype)
    kv_layout = gl.NVMMASharedLayout.get_default_for([BN, D], gl_dtype)
    return (TensorDescriptor.from_tensor(q2, [HALF, D], q_layout), TensorDescriptor.from_tensor(k2, [BN, D], kv_layout),
            TensorDescriptor.from_tensor(v2, [BN, D], kv_layout))


def flash_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, stages: tuple[int, int] = (3, 3),
              turn: bool = True, heads_first: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of q, k, v [B, H, S, 128] (contiguous, S a multiple of 128): (out, lse [B, H, S])."""
    b, h, s, d = q.shape
    assert d == D and s % BM == 0 and q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
    out = torch.empty_like(q)
    lse = torch.empty(b, h, s, device=q.device, dtype=torch.float32)
    q_desc, k_desc, v_desc = descriptors(q.view(-1, d), k.view(-1, d), v.view(-1, d))
    grid = (b * h, s // BM) if heads_first else (s // BM, b * h)
    fg_gluon_flash_fwd[grid](q_desc, k_desc, v_desc, out, lse, s, LOG2E / math.sqrt(d), *stages, turn, heads_first,
                             num_warps=4, maxnreg=168)
    return out, lse


def cpu_compile(stages: tuple[int, int]) -> int:
    """Compile the kernel for sm_90 without a GPU (no launch) and report its shared memory and PTX size."""
    b, h, s = 1, 2, 512
    q = torch.empty(b * h * s, D, dtype=torch.bfloat16)
    q_desc, k_desc, v_desc = descriptors(q, q, q)
    out = torch.empty(b * h * s, D, dtype=torch.bfloat16)
    lse = torch.empty(b * h * s, dtype=torch.float32)
    fn = fg_gluon_flash_fwd
    values = {"q_desc": q_desc, "k_desc": k_desc, "v_desc": v_desc, "o_ptr": out, "lse_ptr": lse, "S": s,
              "qk_scale": 0.1}
    constexprs = {"K_STAGES": stages[0], "V_STAGES": stages[1], "TURN": True, "HEADS_FIRST": True}
    attrs = {(3,): [["tt.divisibility", 16]], (4,): [["tt.divisibility", 16]]}
    return compile_for_sm90(fn, values, constexprs, attrs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--b", type=int, default=4)
    parser.add_argument("--h", type=int, default=32)
    parser.add_argument("--s", type=int, default=4096)
    parser.add_argument("--stages", default="3,3", help="K and V ring stages (Q + both rings fit 227 KiB: "
                        "K + V <= 6)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating timing rounds")
    parser.add_argument("--cpu-compile", action="store_true")
    opts = parser.parse_args()
    stages = tuple(int(x) for x in opts.stages.split(","))
    assert len(stages) == 2
    if opts.cpu_compile:
        return cpu_compile(stages)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
    import torch.nn.functional as F
    from gemm_tune_gpu import alternating_rows
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import fusegraph as fg

    torch.manual_seed(0)
    b, h, s = opts.b, opts.h, opts.s
    q, k, v = (torch.randn(b, h, s, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    flops = 4 * b * h * s * s * D // 2     # causal: half the score matrix, two GEMMs
    lines = [f"# python bench/gluon_attention_gpu.py {' '.join(sys.argv[1:])}; {torch.cuda.get_device_name()}, "
             f"torch {torch.__version__}, triton {triton.__version__}",
             f"causal attention forward B{b} H{h} S{s} D{D} bf16, blocks {BM}x{BN}, K/V stages {opts.stages} "
             f"({flops / 1e12:.3f} TFLOP a call)"]
    g = fg.Graph("sdpa_causal", compute_dtype="float32")
    gq, gk, gv = (g.tensor((b, h, s, D), "bfloat16", n) for n in "qkv")
    g.scaled_dot_product_attention(gq, gk, gv, is_causal=True).set_output()
    plan = g.build(device="cuda")
    lines.append("  fusegraph plan: " + "; ".join(f"{kn.name} {kn.backend}" for kn in plan.kernels))

    def backend(which: Any) -> Any:
        def call() -> torch.Tensor:
            with sdpa_kernel(which):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return call

    impls = {"gluon warp-specialized": lambda: flash_fwd(q, k, v, stages)[0],
             "gluon, heads first": lambda: flash_fwd(q, k, v, stages, heads_first=True)[0],
             "gluon, no turn": lambda: flash_fwd(q, k, v, stages, turn=False)[0],
             "gluon, heads first, no turn": lambda: flash_fwd(q, k, v, stages, turn=False, heads_first=True)[0],
             "fusegraph plan": lambda: plan(q, k, v),
             "torch cuDNN": backend(SDPBackend.CUDNN_ATTENTION),
             "torch flash": backend(SDPBackend.FLASH_ATTENTION)}
    timed, notes = checked(impls, ref)   # each checked against torch before any timing
    try:   # the log-sum-exp the backward needs, against fp32
        _, lse = flash_fwd(q, k, v, stages)
        scores = (q[0, :2].float() @ k[0, :2].float().transpose(-1, -2)) / math.sqrt(D)   # two heads
        scores = scores.masked_fill(torch.ones(s, s, device="cuda", dtype=torch.bool).triu(1), float("-inf"))
        lse_err = ((lse[0, :2] - torch.logsumexp(scores, -1)).abs().max()).item()
        lines.append(f"  gluon lse (first two heads): max abs error {lse_err:.2e}")
        del scores
    except Exception as exc:
        lines.append(f"  gluon lse: ERROR {type(exc).__name__}: {str(exc)[:300]}")
    lines += alternating_rows(timed, list(impls), notes, flops, lambda med: med.get("torch cuDNN"),
                              rounds=opts.rounds, width=28)
    print("\n".join(lines), flush=True)
    write_report("gluon_attention", lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
