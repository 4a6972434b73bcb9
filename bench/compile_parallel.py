"""Threads or processes for Triton compiles? Compiles the same set of distinct sm_90 GEMM
specializations (a plain tl.dot kernel, varied tile sizes, warps and stages) on one thread, on N
threads and on N processes, each from an empty Triton cache, and prints the wall seconds of each.
Needs no GPU (triton.compile against GPUTarget("cuda", 90, 32)); run it where the cores are.

    python bench/compile_parallel.py [--jobs 48] [--workers 16]
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing
import os
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor

import triton
import triton.language as tl


@triton.jit
def gemm(a, b, c, M, N, K, sam, sak, sbk, sbn, scm, scn,
         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    grid_m, grid_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    width = GROUP_M * grid_n
    group = pid // width
    first = group * GROUP_M
    size = min(grid_m - first, GROUP_M)
    pm = first + (pid % size)
    pn = (pid % width) // size
    rm = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        kk = k * BLOCK_K + rk
        x = tl.load(a + rm[:, None] * sam + kk[None, :] * sak, mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        y = tl.load(b + kk[:, None] * sbk + rn[None, :] * sbn, mask=(kk[:, None] < K) & (rn[None, :] < N), other=0.0)
        acc += tl.dot(x, y)
    tl.store(c + rm[:, None] * scm + rn[None, :] * scn, acc.to(c.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def specs(n: int) -> list[tuple[int, int, int, int, int]]:
    tiles = [(64, 64), (64, 128), (128, 64), (128, 128), (128, 256), (256, 128)]
    out = list(itertools.product(tiles, (32, 64), (4, 8), (3, 4)))
    return [(bm, bn, bk, w, s) for (bm, bn), bk, w, s in out][:n]


def compile_one(job: tuple[str, tuple[int, int, int, int, int]]) -> float:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    cache, (bm, bn, bk, warps, stages) = job
    triton.knobs.cache.dir = cache
    target = GPUTarget("cuda", 90, 32)
    sig = {"a": "*bf16", "b": "*bf16", "c": "*bf16", **{k: "i32" for k in
           ("M", "N", "K", "sam", "sak", "sbk", "sbn", "scm", "scn")}}
    for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M"):
        sig[k] = "constexpr"
    src = ASTSource(gemm, sig, {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}, {})
    start = time.perf_counter()
    triton.compile(src, target=target, options={"num_warps": warps, "num_stages": stages})
    return time.perf_counter() - start


def run(label: str, jobs: list, executor: object | None) -> None:
    with tempfile.TemporaryDirectory() as cache:
        work = [(cache, spec) for spec in jobs]
        start = time.perf_counter()
        per = [compile_one(j) for j in work] if executor is None else list(executor.map(compile_one, work))
        wall = time.perf_counter() - start
    print(f"{label:<22} {len(jobs)} compiles: {wall:6.2f} s wall, {sum(per):7.2f} s summed, "
          f"{sum(per) / len(per):.3f} s mean per compile", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=48)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--serial", type=int, default=8, help="how many of the jobs the one-thread run compiles")
    args = parser.parse_args()
    jobs = specs(args.jobs)
    print(f"{os.cpu_count()} cores, triton {triton.__version__}", flush=True)
    run("1 thread", jobs[:args.serial], None)
    with ThreadPoolExecutor(args.workers) as pool:
        run(f"{args.workers} threads", jobs, pool)
    with ProcessPoolExecutor(args.workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        list(pool.map(abs, range(args.workers)))   # start the workers before the clock
        run(f"{args.workers} processes", jobs, pool)


if __name__ == "__main__":
    main()
