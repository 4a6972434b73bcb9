"""bench/memory_train_gpu.py's replay of an allocator trace: the step's peak and what is live at it."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import memory_train_gpu as tool


def frames(name: str) -> list[dict[str, object]]:
    return [{"filename": "/x/torch/nn/functional.py", "line": 1, "name": "relu"},
            {"filename": f"/work/{name}.py", "line": 7, "name": name},
            {"filename": "/work/train.py", "line": 3, "name": "step"}]


def test_peak_is_the_highest_running_total_and_lists_what_is_live_then() -> None:
    trace = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": frames("conv")},
        {"action": "alloc", "addr": 2, "size": 50, "frames": frames("bn")},
        {"action": "free_requested", "addr": 1, "size": 100},
        {"action": "free_completed", "addr": 1, "size": 100},
        {"action": "alloc", "addr": 3, "size": 80, "frames": frames("relu")},   # 1000 + 50 + 80 < 1150
        {"action": "free_requested", "addr": 99, "size": 500},                   # allocated before the trace
        {"action": "alloc", "addr": 4, "size": 30, "frames": []},
    ]
    best, at, live = tool.replay_peak(trace, base=1000)
    assert (best, at) == (1160, 6)     # 1000 + 50 + 80 + 30: the old block's free is not subtracted
    assert sorted(size for size, _ in live) == [30, 50, 80]
    sites = dict((size, where) for size, where in live)
    assert sites[80] == "relu.py:7 relu <- train.py:3 step"   # torch's own frames skipped
    assert sites[30] == "(no frames)"


def test_a_step_that_only_frees_peaks_at_its_start() -> None:
    best, at, live = tool.replay_peak([{"action": "free_requested", "addr": 5, "size": 10}], base=64)
    assert (best, at, live) == (64, 0, [])
