"""`bench_ms`: the median time of one call, measured as /work/.library/device/METHOD.md says.

On a CUDA GPU: device time from CUDA events around each call, each after flushing L2, and the
median. By default the number of calls scales with the kernel's duration (`short_budget`): after
one call and a 3-call estimate, a few warm-up calls and 10..50 timed calls, so a kernel of tens
of microseconds is timed in a few milliseconds, not 125 ms. The GPU's queue is kept ahead of the
host (`queued_bench_ms`): inside a plan build a Triton launch took the host 70-110 us (the
training forward's build ran under AOTAutograd's Python dispatcher, since switched off there),
longer than the flush before it, and plain event timing then counted the GPU's wait for the launch
(GPT-2's forward GEMMs timed 1.3-2.9x their device time, so the tuner picked slower kernels;
bench/tune_timing_gpu.py). Any slow launch path would do the same; the spin makes the timing
independent of it. Passing `warmup_ms`/`rep_ms` asks for
the fixed-duration protocol (triton.testing.do_bench when Triton is installed).
Without a GPU the same protocol runs on the host clock, so CPU code and tests can use it too.

Inside `losing_above(ms)` (the autotuner's loop: the best candidate's time so far, times
settings.tune_early_stop) a call whose median over its first EARLY_STOP_REPS timed calls is above
`ms` stops there and returns that median: a candidate that cannot win is not timed in full.
"""

from __future__ import annotations

import contextlib
import contextvars
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

L2_FLUSH_BYTES = 256 * 1024 * 1024  # larger than any current GPU's L2 (H200: 60 MiB)
_ESTIMATE_CALLS = 5
_SHORT_ESTIMATE_CALLS = 3


# The short budget: timed calls worth about TARGET_MS, but never fewer than MIN_REPS (a median
# needs samples) nor more than MAX_REPS (tuning a microsecond kernel must take milliseconds).
TARGET_MS = 10.0
MIN_REPS, MAX_REPS = 10, 50
WARMUP_CALLS = 3


EARLY_STOP_REPS = 5   # timed calls after which a candidate above the cutoff stops (losing_above)
_CUTOFF: contextvars.ContextVar[float | None] = contextvars.ContextVar("fusegraph_tune_cutoff", default=None)


@contextlib.contextmanager
def losing_above(ms: float | None) -> Iterator[None]:
    """Inside: bench_ms's default protocol stops a call timed above `ms` (median of its first
    EARLY_STOP_REPS timed calls) and returns that median; None times in full."""
    token = _CUTOFF.set(ms)
    try:
        yield
    finally:
        _CUTOFF.reset(token)


def _losing(times_ms: list[float]) -> bool:
    cutoff = _CUTOFF.get()
    return cutoff is not None and len(times_ms) >= EARLY_STOP_REPS and statistics.median(times_ms) > cutoff


def short_budget(estimate_ms: float) -> tuple[int, int]:
    """(warm-up calls, timed calls) for a call that takes about `estimate_ms`."""
    reps = int(TARGET_MS / max(estimate_ms, 1e-4))
    return WARMUP_CALLS, max(MIN_REPS, min(MAX_REPS, reps))


def bench_ms(fn: Callable[[], Any], *, warmup_ms: float | None = None, rep_ms: float | None = None) -> float:
    """Median milliseconds per call of `fn` (device time on a CUDA GPU, host time otherwise).
    Without `warmup_ms`/`rep_ms` the number of calls scales with the call's duration (see the module doc)."""
    import torch
    fixed = warmup_ms is not None or rep_ms is not None
    warm = 25.0 if warmup_ms is None else warmup_ms
    rep = 100.0 if rep_ms is None else rep_ms
    if not torch.cuda.is_available():
        return _host_bench_ms(fn, warm, rep, short=not fixed)
    if not fixed:
        return queued_bench_ms(fn)
    try:
        from triton.testing import do_bench
    except ImportError:
        return _event_bench_ms(fn, warm, rep)
    return float(do_bench(fn, warmup=warm, rep=rep, return_mode="median"))


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
        fn()
    end.record()
    torch.cuda.synchronize()
    estimate = start.elapsed_time(end) / _ESTIMATE_CALLS
    n_warmup, n_repeat = _repeat_counts(estimate, warmup_ms, rep_ms)
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


STREAMING_LEAD_US = 10000.0   # the lead while a plan's compiles run beside the timing (tune/precompile.CompileStream)


def queued_bench_ms(fn: Callable[[], Any], *, lead_us: float = 2000.0) -> float:
    """Median device milliseconds per call of `fn`, each after an L2 flush, with the GPU's queue kept
    ahead of the host: a spin (torch.cuda._sleep) of `lead_us` first, then, before each timed call,
    a spin as long as one call takes the host to launch. Device events then bracket the kernels only,
    never a wait for the host's next launch (a slow host launch, e.g. through a Python-level launcher
    or under a busy interpreter, inflated event timings of short kernels by up to 3x). While a plan's
    compiles run on other threads the lead is STREAMING_LEAD_US and each spin twice as long: a launch
    may then wait for the GIL."""
    import torch

    from .precompile import streaming

    busy = streaming()
    if busy:
        lead_us = max(lead_us, STREAMING_LEAD_US)
    flush = torch.empty(L2_FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(_SHORT_ESTIMATE_CALLS):
        fn()
    host_us = (time.perf_counter() - t0) * 1e6 / _SHORT_ESTIMATE_CALLS
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(_cycles(lead_us))
    start.record()
    for _ in range(_SHORT_ESTIMATE_CALLS):
        fn()
    end.record()
    torch.cuda.synchronize()
    n_warmup, n_repeat = short_budget(start.elapsed_time(end) / _SHORT_ESTIMATE_CALLS)
    pad = _cycles((3.0 if busy else 1.5) * host_us + 20.0)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n_repeat)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n_repeat)]
    # a cutoff (losing_above) splits the timed calls: the first EARLY_STOP_REPS, a look at their median,
    # then the rest behind a new lead
    first = EARLY_STOP_REPS if _CUTOFF.get() is not None and n_repeat > EARLY_STOP_REPS else n_repeat
    torch.cuda._sleep(_cycles(lead_us))
    for _ in range(n_warmup):
        fn()
    for k, (s, e) in enumerate(zip(starts, ends, strict=True)):
        if k == first:
            torch.cuda.synchronize()
            early = [a.elapsed_time(b) for a, b in zip(starts[:k], ends[:k], strict=True)]
            if _losing(early):
                return float(statistics.median(early))
            torch.cuda._sleep(_cycles(lead_us))
        flush.zero_()
        torch.cuda._sleep(pad)
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return float(statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)))


def _cycles(us: float) -> int:
    """GPU clock cycles in `us` microseconds at the device's rated clock (a spin takes longer when
    the clock runs lower, which only lengthens the lead)."""
    import torch
    khz = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "clock_rate", 0) or 2_000_000
    return max(1, int(us * khz / 1e3))


def _host_bench_ms(fn: Callable[[], Any], warmup_ms: float, rep_ms: float, short: bool = False) -> float:
    fn()
    calls = _SHORT_ESTIMATE_CALLS if short else _ESTIMATE_CALLS
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    estimate = (time.perf_counter() - t0) * 1e3 / calls
    n_warmup, n_repeat = short_budget(estimate) if short else _repeat_counts(estimate, warmup_ms, rep_ms)
    for _ in range(n_warmup):
        fn()
    times: list[float] = []
    for _ in range(n_repeat):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
        if short and len(times) == EARLY_STOP_REPS and _losing(times):
            break
    return float(statistics.median(times))
