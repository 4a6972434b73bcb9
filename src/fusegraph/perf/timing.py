"""Timing on the GPU per METHOD.md: warm up, device events, many repeats, median.

Two numbers per function: device time (steady state: a CUDA-graph replay of many calls, or many
back-to-back calls between two events) and per-call latency (events around one call).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Timing:
    ms: float          # median milliseconds per call
    method: str        # "graph-replay" | "back-to-back" | "per-call"
    samples: int


def gpu_available() -> bool:
    return torch.cuda.is_available()


def _events_ms(fn: Callable[[], Any], calls: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return float(start.elapsed_time(end)) / calls


def warm_up(fn: Callable[[], Any], calls: int = 3) -> None:
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()


def device_time(fn: Callable[[], Any], calls: int = 100, repeats: int = 5, graph: bool = True) -> Timing:
    """Steady-state device time per call: a CUDA graph of `calls` calls replayed `repeats` times
    (falls back to `calls` back-to-back launches between events when capture fails), median."""
    warm_up(fn)
    if graph:
        captured = _capture(fn, calls)
        if captured is not None:
            captured.replay()
            torch.cuda.synchronize()
            samples = [_events_ms(captured.replay, 1) / calls for _ in range(repeats)]
            return Timing(statistics.median(samples), "graph-replay", repeats)
    samples = [_events_ms(fn, calls) for _ in range(repeats)]
    return Timing(statistics.median(samples), "back-to-back", repeats)


def call_latency(fn: Callable[[], Any], repeats: int = 50) -> Timing:
    """Events around one call (the GPU idle before each), median of `repeats`."""
    warm_up(fn)
    samples = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        samples.append(_events_ms(fn, 1))
    return Timing(statistics.median(samples), "per-call", repeats)


def _capture(fn: Callable[[], Any], calls: int) -> Any:
    """A CUDAGraph of `calls` calls of fn, or None when fn cannot be captured (host syncs, ...)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(stream):
            fn()  # warm the side stream's allocator pool
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
        return graph
    except Exception:  # not capturable: time back-to-back launches instead
        torch.cuda.synchronize()
        return None


def host_seconds(fn: Callable[[], Any]) -> float:
    """Wall-clock seconds of one call, GPU synchronized before and after (compile times)."""
    import time

    if gpu_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if gpu_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0
