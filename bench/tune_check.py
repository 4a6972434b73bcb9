"""GPU check of fusegraph.tune: a real Triton kernel autotuned, timed by METHOD.md, cached across processes.

    python bench/tune_check.py                 # on the GPU machine (writes $OUT/tune_check.json if $OUT is set)
    TRITON_INTERPRET=1 python bench/tune_check.py --cpu   # logic check here, pretending a GPU

Checks, in order: every candidate is correct on fresh random data before it is timed; bench_ms
(triton do_bench, median) agrees with the CUDA-event fallback; a first process tunes and writes the
cache; a second process answers from the cache without timing anything; memo lookups are cheap.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch
import triton
import triton.language as tl

from fusegraph.settings import override
from fusegraph.tune import Config, bench_ms, clear_memo, keys, tune
from fusegraph.tune.timing import _event_bench_ms


@triton.jit
def softmax_rows(x_ptr, y_ptr, n_cols, stride, BLOCK_N: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride + cols, mask=mask, other=-float("inf")).to(tl.float32)
    x = x - tl.max(x, axis=0)
    e = tl.exp(x)
    tl.store(y_ptr + row * stride + cols, (e / tl.sum(e, axis=0)).to(y_ptr.dtype.element_ty), mask=mask)


def candidates(n_cols: int) -> list[Config]:
    block = triton.next_power_of_2(n_cols)
    return [Config.of(BLOCK_N=block, num_warps=w) for w in (8, 4, 16, 2, 32)]


def launch(x: torch.Tensor, y: torch.Tensor, cfg: Config) -> None:
    softmax_rows[(x.shape[0],)](x, y, x.shape[1], x.stride(0), BLOCK_N=cfg["BLOCK_N"], num_warps=cfg["num_warps"])


def make_bench(x: torch.Tensor, y: torch.Tensor, calls: list[Config], timed: bool):
    ref = torch.softmax(x.float(), dim=-1)

    def bench(cfg: Config) -> float:
        calls.append(cfg)
        y.fill_(float("nan"))  # poison: every element must be written
        launch(x, y, cfg)
        err = ((y.float() - ref).norm() / ref.norm()).item()
        if not err < 1e-2:
            raise RuntimeError(f"{cfg}: relative error {err:.3e}")
        return bench_ms(lambda: launch(x, y, cfg)) if timed else 1.0 / cfg["num_warps"]

    return bench


def tune_once(device: str, shape: tuple[int, int]) -> dict:
    x = torch.randn(shape, device=device, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    calls: list[Config] = []
    t0 = time.perf_counter()
    result = tune("check_softmax_rows", {"sig": "softmax_rows-v1", "shape": shape, "dtype": x.dtype},
                  candidates(shape[1]), make_bench(x, y, calls, timed=device == "cuda"))
    seconds = time.perf_counter() - t0
    no_bench = make_bench(x, y, calls, timed=False)  # a memo hit must not call it
    t0 = time.perf_counter()
    for _ in range(1000):
        tune("check_softmax_rows", {"sig": "softmax_rows-v1", "shape": shape, "dtype": x.dtype},
             candidates(shape[1]), no_bench)
    memo_us = (time.perf_counter() - t0) * 1e6 / 1000
    return {"config": result.config.to_json(), "source": result.source, "bench_calls": len(calls),
            "seconds": seconds, "memo_lookup_us": memo_us,
            "timings": [{"config": t.config.to_json(), "ms": t.ms, "error": t.error} for t in result.timings]}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cpu", action="store_true", help="pretend a GPU (logic check under TRITON_INTERPRET=1)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    device = "cpu" if args.cpu else "cuda"
    shape = (64, 1000) if args.cpu else (32768, 4096)
    if args.cpu:
        keys.gpu_identity = lambda: {"name": "pretend GPU", "capability": "0.0"}  # type: ignore[assignment]
    if args.child:
        with override(cache_dir=args.child, autotune=True):
            print(json.dumps(tune_once(device, shape)))
        return 0

    report: dict = {"gpu": keys.gpu_identity(), "versions": keys.library_versions()}
    if device == "cuda":
        x = torch.randn(shape, device=device, dtype=torch.bfloat16)
        y = torch.empty_like(x)
        cfg = candidates(shape[1])[0]
        fn = lambda: launch(x, y, cfg)  # noqa: E731
        runs = {"do_bench": [bench_ms(fn) for _ in range(3)], "events": [_event_bench_ms(fn, 25, 100)
                                                                          for _ in range(3)]}
        floor_ms = 2 * x.numel() * x.element_size() / 4.2e12 * 1e3
        report["timing"] = {**runs, "floor_ms_at_4.2TBps": floor_ms}
    with tempfile.TemporaryDirectory() as cache_dir:
        cmd = [sys.executable, __file__, "--child", cache_dir] + (["--cpu"] if args.cpu else [])
        first, second = (json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True,
                                                   env=os.environ).stdout) for _ in range(2))
        report["first_process"], report["second_process"] = first, second
        report["cache_files"] = os.listdir(os.path.join(cache_dir, "tune"))
    clear_memo()

    ok = (first["source"] == "tuned" and first["bench_calls"] == len(candidates(shape[1]))
          and second["source"] == "cache" and second["bench_calls"] == 0
          and second["config"] == first["config"] and len(report["cache_files"]) == 1)
    if "timing" in report:
        t = report["timing"]
        a, b = sorted(t["do_bench"])[1], sorted(t["events"])[1]
        ok = ok and abs(a - b) / a < 0.15
        print(f"bench_ms median of 3: do_bench {a:.4f} ms, events {b:.4f} ms, floor {t['floor_ms_at_4.2TBps']:.4f}")
    print(f"gpu: {report['gpu']}")
    for t in first["timings"]:
        print(f"  {t['config']}: {t['ms'] if t['ms'] is not None else t['error']}")
    print(f"first process: {first['source']} in {first['seconds']:.2f} s -> {first['config']}")
    print(f"second process: {second['source']} in {second['seconds'] * 1e3:.1f} ms, {second['bench_calls']} bench "
          f"calls; memo lookup {second['memo_lookup_us']:.1f} us")
    print("PASS" if ok else "FAIL")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "tune_check.json"), "w") as f:
            json.dump(report, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
