"""`bench_ms`: the median time of one call, measured as /work/.library/device/METHOD.md says.

On a CUDA GPU: device time from events around each call (triton.testing.do_bench when Triton is
installed, else the same protocol here): one call first (compilation, module load), an estimate,
`warmup_ms` of warm-up, then calls for about `rep_ms`, each after flushing L2, and the median.
Without a GPU the same protocol runs on the host clock, so CPU code and tests can use it too.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

L2_FLUSH_BYTES = 256 * 1024 * 1024  # larger than any current GPU's L2 (H200: 60 MiB)
_ESTIMATE_CALLS = 5


def bench_ms(fn: Callable[[], Any], *, warmup_ms: float = 25, rep_ms: float = 100) -> float:
    """Median milliseconds per call of `fn` (device time on a CUDA GPU, host time otherwise)."""
    import torch
    if not torch.cuda.is_available():
        return _host_bench_ms(fn, warmup_ms, rep_ms)
    try:
        from triton.testing import do_bench
    except ImportError:
        return _event_bench_ms(fn, warmup_ms, rep_ms)
    return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def _repeat_counts(estimate_ms: float, warmup_ms: float, rep_ms: float) -> tuple[int, int]:
    estimate_ms = max(estimate_ms, 1e-4)
    return max(1, int(warmup_ms / estimate_ms)), max(1, int(rep_ms / estimate_ms))


def _event_bench_ms(fn: Callable[[], Any], warmup_ms: float, rep_ms: float) -> float:
    import torch
    flush = torch.empty(L2_FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(_ESTIMATE_CALLS):
        flush.zero_()
        fn()
    end.record()
    torch.cuda.synchronize()
    n_warmup, n_repeat = _repeat_counts(start.elapsed_time(end) / _ESTIMATE_CALLS, warmup_ms, rep_ms)
    for _ in range(n_warmup):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n_repeat)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n_repeat)]
    for s, e in zip(starts, ends, strict=True):
        flush.zero_()
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return float(statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)))


def _host_bench_ms(fn: Callable[[], Any], warmup_ms: float, rep_ms: float) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(_ESTIMATE_CALLS):
        fn()
    n_warmup, n_repeat = _repeat_counts((time.perf_counter() - t0) * 1e3 / _ESTIMATE_CALLS, warmup_ms, rep_ms)
    for _ in range(n_warmup):
        fn()
    times = []
    for _ in range(n_repeat):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return float(statistics.median(times))
