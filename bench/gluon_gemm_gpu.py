"""A warp-specialized ("ping-pong") Hopper GEMM with a fused bias + tanh-GELU epilogue, written in Gluon,
against our Triton persistent GEMM and cuBLAS: can the epilogue be hidden behind the tensor cores?

Why: gelu_mlp's first GEMM (8192x16384x4096 + bias + gelu) runs ~13% below its second for the same FLOPs
because our Triton kernel runs each tile's epilogue on the warps that issue its MMAs, and Triton 3.6 has no
warp specialization on Hopper; a second resident program hides the epilogue but its smaller tile loses the
same in the main loop (bench/gemm_occupancy_gpu.py, bench/RESULTS.md twenty-sixth session). Gluon (Triton's
lower-level dialect, in triton 3.6) does offer warp specialization on Hopper. This kernel:
  - one producer warp issues TMA loads of A [BM, BK] and B [BK, BN] tiles into a STAGES-deep ring
    (mbarriers: `ready` per stage, completed by the TMA transaction bytes; `empty`, arrived by the consumer);
  - two consumer warpgroups take alternate output tiles of the CTA's persistent sequence (tile
    pid, pid + P, ...): consumer c takes the CTA's tiles 2j + c. Their k-blocks follow one another in the
    ring, and a pair of `turn` barriers hands the ring from one consumer to the other when it has taken its
    tile's last stage, so one consumer's main loop runs while the other finishes its epilogue (bias, GELU,
    bf16, TMA store): the tensor cores stay busy through epilogues;
  - each consumer holds a [BM, BN] fp32 accumulator (async wgmma, one group in flight), and its own
    [BM, BN] bf16 staging tile for the TMA store.

Prepared in the twenty-sixth session without a GPU: `--cpu-compile` compiles it for sm_90 on the CPU
(Triton needs no GPU for that); it had not run on a GPU when committed. On the GPU it checks its result
against torch (bf16 matmul + bias + gelu in fp32) before timing, and prints TFLOP/s beside cuBLAS +
torch's epilogue and fusegraph's own plan of the same graph.

    PYTHONPATH=src python bench/gluon_gemm_gpu.py [--m 8192 --n 16384 --k 4096] [--stages 4]
    python bench/gluon_gemm_gpu.py --cpu-compile        # sm_90 compile check, no GPU (no TRITON_INTERPRET)
"""

from __future__ import annotations

import argparse
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
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

BM, BN, BK = 128, 128, 64
GROUP_M = 8
CONSUMER_REGS = gl.constexpr(232)   # setmaxnreg of the second consumer warpgroup
PRODUCER_REGS = gl.constexpr(40)    # ... and of the producer warp's warpgroup


@gluon.jit
def _tile_coords(t, num_m, num_n, GROUP: gl.constexpr):
    """Grouped (swizzled) order: GROUP row tiles walk the column tiles together (B stays in L2)."""
    per_group = GROUP * num_n
    first_m = (t // per_group) * GROUP
    rows = gl.minimum(num_m - first_m, GROUP)
    pid_m = first_m + (t % per_group) % rows
    pid_n = (t % per_group) // rows
    return pid_m, pid_n


@gluon.jit
def _producer(a_desc, b_desc, a_bufs, b_bufs, ready, empty, num_m, num_n, k_tiles,
              STAGES: gl.constexpr, GROUP: gl.constexpr):
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[1]
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    p = 0   # position in the ring over the CTA's whole k-block sequence
    for t in range(pid, num_m * num_n, programs):
        pid_m, pid_n = _tile_coords(t, num_m, num_n, GROUP)
        for kk in range(k_tiles):
            s = p % STAGES
            # a stage is free once its consumer arrived on `empty` (first pass: phase 1 is complete at init)
            mbarrier.wait(empty.index(s), ((p // STAGES) & 1) ^ 1)
            bar = ready.index(s)
            mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(a_desc, [pid_m * BLOCK_M, kk * BLOCK_K], bar, a_bufs.index(s))
            tma.async_copy_global_to_shared(b_desc, [kk * BLOCK_K, pid_n * BLOCK_N], bar, b_bufs.index(s))
            p += 1


@gluon.jit
def _consumer(a_bufs, b_bufs, ready, empty, turn, c_desc, c_smem, bias_ptr, num_m, num_n, k_tiles, N,
              WHICH: gl.constexpr, STAGES: gl.constexpr, GROUP: gl.constexpr, GELU: gl.constexpr):
    BLOCK_M: gl.constexpr = c_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    for t in range(pid, num_m * num_n, programs):
        j = (t - pid) // programs   # the CTA's local tile index: this consumer takes j = WHICH, WHICH + 2, ...
        if j % 2 == WHICH:
            pid_m, pid_n = _tile_coords(t, num_m, num_n, GROUP)
            base = j * k_tiles
            # our turn: the other consumer has waited for all of its previous tile's stages. An mbarrier wait
            # by parity is only right one phase behind, and the ring's `ready` phases are: without the turn,
            # consumer 1 would wait for round k_tiles / STAGES while the ring is on round 0 and pass early.
            # (consumer 0's first wait passes at once: parity 1 counts as complete at init)
            mbarrier.wait(turn.index(WHICH), ((j // 2) & 1) ^ (1 - WHICH))
            acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout)
            for kk in range(k_tiles):
                p = base + kk
                s = p % STAGES
                mbarrier.wait(ready.index(s), (p // STAGES) & 1)
                acc = warpgroup_mma(a_bufs.index(s), b_bufs.index(s), acc, is_async=True)
                # one wgmma group in flight: the previous one (stage p - 1) has finished reading its tiles
                acc = warpgroup_mma_wait(num_outstanding=1, deps=[acc])
                if kk > 0:
                    mbarrier.arrive(empty.index((p - 1) % STAGES), count=1)
            mbarrier.arrive(turn.index(1 - WHICH), count=1)   # the other consumer's main loop may start
            acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
            mbarrier.arrive(empty.index((base + k_tiles - 1) % STAGES), count=1)
            # epilogue: bias, tanh-GELU as x * sigmoid(2u), bf16, TMA store (the other consumer's main
            # loop runs meanwhile)
            offs_n = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout))
            bias = gl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(gl.float32)
            acc = acc + gl.expand_dims(bias, 0)
            if GELU:
                inner = 1.5957691216057308 * (acc + 0.044715 * acc * acc * acc)
                acc = acc / (1.0 + gl.exp(-inner))
            tma.store_wait(0)   # this consumer's previous store has left c_smem
            c_smem.store(acc.to(c_desc.dtype))
            fence_async_shared()
            tma.async_copy_shared_to_global(c_desc, [pid_m * BLOCK_M, pid_n * BLOCK_N], c_smem)
    tma.store_wait(0)


@gluon.jit
def _consumer0(a_bufs, b_bufs, ready, empty, turn, c_desc, c_smem0, c_smem1, bias_ptr, num_m, num_n, k_tiles, N,
               STAGES: gl.constexpr, GROUP: gl.constexpr, GELU: gl.constexpr):
    _consumer(a_bufs, b_bufs, ready, empty, turn, c_desc, c_smem0, bias_ptr, num_m, num_n, k_tiles, N, 0, STAGES,
              GROUP, GELU)


@gluon.jit
def _consumer1(a_desc, b_desc, a_bufs, b_bufs, ready, empty, turn, c_desc, c_smem0, c_smem1, bias_ptr, num_m,
               num_n, k_tiles, N, STAGES: gl.constexpr, GROUP: gl.constexpr, GELU: gl.constexpr):
    _consumer(a_bufs, b_bufs, ready, empty, turn, c_desc, c_smem1, bias_ptr, num_m, num_n, k_tiles, N, 1, STAGES,
              GROUP, GELU)


@gluon.jit
def _producer_worker(a_desc, b_desc, a_bufs, b_bufs, ready, empty, turn, c_desc, c_smem0, c_smem1, bias_ptr,
                     num_m, num_n, k_tiles, N, STAGES: gl.constexpr, GROUP: gl.constexpr, GELU: gl.constexpr):
    _producer(a_desc, b_desc, a_bufs, b_bufs, ready, empty, num_m, num_n, k_tiles, STAGES, GROUP)


@gluon.jit
def fg_gluon_pingpong_gemm(a_desc, b_desc, c_desc, bias_ptr, M, N, K,
                           STAGES: gl.constexpr, GROUP: gl.constexpr, GELU: gl.constexpr):
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[1]
    dtype: gl.constexpr = a_desc.dtype
    a_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_K, BLOCK_N], b_desc.layout)
    c_smem0 = gl.allocate_shared_memory(c_desc.dtype, [BLOCK_M, BLOCK_N], c_desc.layout)
    c_smem1 = gl.allocate_shared_memory(c_desc.dtype, [BLOCK_M, BLOCK_N], c_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(turn.index(i), count=1)
    num_m = gl.cdiv(M, BLOCK_M)
    num_n = gl.cdiv(N, BLOCK_N)
    k_tiles = gl.cdiv(K, BLOCK_K)
    worker_args = (a_desc, b_desc, a_bufs, b_bufs, ready, empty, turn, c_desc, c_smem0, c_smem1, bias_ptr, num_m,
                   num_n, k_tiles, N, STAGES, GROUP, GELU)
    gl.warp_specialize([
        (_consumer0, (a_bufs, b_bufs, ready, empty, turn, c_desc, c_smem0, c_smem1, bias_ptr, num_m, num_n,
                      k_tiles, N, STAGES, GROUP, GELU)),
        (_consumer1, worker_args),
        (_producer_worker, worker_args),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


def descriptors(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> tuple[Any, Any, Any]:
    gl_dtype = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[a.dtype]
    a_layout = gl.NVMMASharedLayout.get_default_for([BM, BK], gl_dtype)
    b_layout = gl.NVMMASharedLayout.get_default_for([BK, BN], gl_dtype)
    c_layout = gl.NVMMASharedLayout.get_default_for([BM, BN], gl_dtype)
    return (TensorDescriptor.from_tensor(a, [BM, BK], a_layout), TensorDescriptor.from_tensor(b, [BK, BN], b_layout),
            TensorDescriptor.from_tensor(c, [BM, BN], c_layout))


def gemm_bias_gelu(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor, stages: int = 4, gelu: bool = True,
                   programs: int | None = None, group: int = GROUP_M) -> torch.Tensor:
    """gelu(a @ b + bias) (tanh form) in a's dtype; a [M, K], b [K, N] row-major."""
    m, k = a.shape
    n = b.shape[1]
    c = torch.empty(m, n, dtype=a.dtype, device=a.device)
    a_desc, b_desc, c_desc = descriptors(a, b, c)
    sms = programs or torch.cuda.get_device_properties(a.device).multi_processor_count
    grid = (min(sms, triton.cdiv(m, BM) * triton.cdiv(n, BN)),)
    # 4 warps for the default partition (consumer 0); registers are then moved between the partitions
    # (setmaxnreg): maxnreg sizes the whole CTA, 12 warps at 168 fit the register file
    fg_gluon_pingpong_gemm[grid](a_desc, b_desc, c_desc, bias, m, n, k, stages, group, gelu, num_warps=4,
                                 maxnreg=168)
    return c


def cpu_compile(stages: int) -> int:
    """Compile the kernel for sm_90 without a GPU (no launch) and report its shared memory and PTX size."""
    m, n, k = 1024, 1024, 512
    a = torch.empty(m, k, dtype=torch.bfloat16)
    b = torch.empty(k, n, dtype=torch.bfloat16)
    c = torch.empty(m, n, dtype=torch.bfloat16)
    bias = torch.empty(n, dtype=torch.bfloat16)
    a_desc, b_desc, c_desc = descriptors(a, b, c)
    fn = fg_gluon_pingpong_gemm
    values = {"a_desc": a_desc, "b_desc": b_desc, "c_desc": c_desc, "bias_ptr": bias, "M": m, "N": n, "K": k}
    constexprs = {"STAGES": stages, "GROUP": GROUP_M, "GELU": True}
    return compile_for_sm90(fn, values, constexprs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--m", type=int, default=8192)
    parser.add_argument("--n", type=int, default=16384)
    parser.add_argument("--k", type=int, default=4096)
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--no-gelu", action="store_true", help="bias only (gelu_mlp's second GEMM: --m 8192 "
                        "--n 4096 --k 16384)")
    parser.add_argument("--cpu-compile", action="store_true")
    parser.add_argument("--sweep", action="store_true", help="also time the kernel at 3-5 stages x GROUP_M 4-16")
    parser.add_argument("--weight-nk", action="store_true", help="fusegraph's rows take the weight as [N, K] "
                        "(nn.Linear's layout, read transposed); the bench's own kernel keeps [K, N]")
    parser.add_argument("--rounds", type=int, default=5, help="alternating timing rounds")
    parser.add_argument("--epilogue-forms", action="store_true",
                        help="also fusegraph's ping-pong kernel (forced) with the GELU as one op or spelled out as "
                             "GPT-2 writes it (0.5 x (1 + tanh(...))), each with the pre-activation as a second "
                             "output (a training forward saves it) or not")
    opts = parser.parse_args()
    if opts.cpu_compile:
        return cpu_compile(opts.stages)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
    import torch.nn.functional as F
    from gemm_tune_gpu import alternating_rows

    import fusegraph as fg

    torch.manual_seed(0)
    m, n, k = opts.m, opts.n, opts.k
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = (torch.randn(k, n, device="cuda") / k ** 0.5).to(torch.bfloat16)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    gelu = not opts.no_gelu
    ref = a.float() @ b.float() + bias.float()
    ref = F.gelu(ref, approximate="tanh") if gelu else ref
    flops = 2 * m * n * k
    lines = [f"# python bench/gluon_gemm_gpu.py {' '.join(sys.argv[1:])}; {torch.cuda.get_device_name()}, "
             f"torch {torch.__version__}, triton {triton.__version__}",
             f"{'gelu(x @ W + b)' if gelu else 'x @ W + b'}: {m}x{n}x{k} bf16, tiles {BM}x{BN}x{BK}, "
             f"{opts.stages} stages"]
    g = fg.Graph("mm_bias_gelu", compute_dtype="float32")
    nk = opts.weight_nk   # the weight stored [N, K] (nn.Linear's), read transposed
    x = g.tensor((m, k), "bfloat16", "x")   # inputs in the plan's positional order: x, w, b
    w = g.tensor((n, k) if nk else (k, n), "bfloat16", "w")
    bb = g.tensor((n,), "bfloat16", "b")
    y = g.add(g.matmul(x, w, transpose_b=nk), bb)
    (g.gelu(y, approximate="tanh") if gelu else y).set_output()
    wt = b.t().contiguous() if nk else b
    plan = g.build(device="cuda")
    forced = g.build(device="cuda", options={"gemm_variant": "pingpong"})
    impls = {"gluon ping-pong": lambda: gemm_bias_gelu(a, b, bias, opts.stages, gelu),
             "fusegraph plan": lambda: plan(a, wt, bias),
             "fusegraph ping-pong": lambda: forced(a, wt, bias),
             "cuBLAS + torch epilogue": (lambda: F.gelu(torch.addmm(bias, a, b), approximate="tanh")) if gelu
             else (lambda: torch.addmm(bias, a, b))}
    if opts.epilogue_forms and gelu:
        for spelled in (False, True):
            for saved in (False, True):
                fg_ = fg.Graph(f"form_{int(spelled)}{int(saved)}", compute_dtype="float32")
                fx, fw = fg_.tensor((m, k), "bfloat16", "x"), fg_.tensor((n, k) if nk else (k, n), "bfloat16", "w")
                fy = fg_.add(fg_.matmul(fx, fw, transpose_b=nk), fg_.tensor((n,), "bfloat16", "b"))
                if saved:
                    fy.set_output()
                if spelled:
                    inner = fg_.mul(fg_.add(fy, fg_.mul(fg_.pow(fy, 3.0), 0.044715)), 0.7978845608028654)
                    act = fg_.mul(fg_.mul(fy, 0.5), fg_.add(fg_.tanh(inner), 1.0))
                else:
                    act = fg_.gelu(fy, approximate="tanh")
                act.set_output()
                form = fg_.build(device="cuda", options={"gemm_variant": "pingpong"})
                impls[f"ping-pong {'spelled' if spelled else 'gelu op'}{', saved' if saved else ''}"] = (
                    (lambda f=form: f(a, wt, bias)[-1]) if saved else (lambda f=form: f(a, wt, bias)))
    if opts.sweep:
        for stages in (3, 4, 5):
            for group in (4, 8, 16):
                impls[f"gluon stages={stages} group={group}"] = (
                    lambda s=stages, gr=group: gemm_bias_gelu(a, b, bias, s, gelu, group=gr))
    for tag, kernel in ((t, p.kernels) for t, p in (("fusegraph plan", plan), ("fusegraph ping-pong", forced))):
        lines.append(f"  {tag}: " + "; ".join(f"{k.name} {k.backend} {k.config.get('VARIANT', '')}"
                                             for k in kernel if k.kind == "matmul"))
    timed, notes = checked(impls, ref)   # each checked against torch before any timing
    # timed in alternation (rounds of every candidate): power and clock drift fall on all alike
    lines += alternating_rows(timed, list(impls), notes, flops,
                              lambda med: med.get("cuBLAS + torch epilogue"), rounds=opts.rounds, width=30)
    print("\n".join(lines), flush=True)
    write_report("gluon_gemm", lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
