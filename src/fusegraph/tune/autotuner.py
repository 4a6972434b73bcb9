"""`autotune`: pick the fastest of a kernel's candidate configs on this GPU, remembering the choice.

    cfg = autotune("fused_layernorm_3", {"sig": sig_hash, "shape": (M, N), "dtype": "bfloat16"},
                   candidates, bench=lambda cfg: bench_ms(lambda: launch(cfg)), prune=too_big)

Candidates come best-guess first (the cost model's order). Without timing (bench None,
settings.autotune off, or no CUDA GPU) the first candidate is the answer. A kernel whose cost-model
floor (`floor_ms`) is under settings.tune_min_floor_us (10 us) is launch-bound: candidates differ
by a few microseconds at most, less than compiling one more candidate costs, so the first
candidate is the answer ("launch-bound"). Under settings.tune "fast" (the default) a memory-bound
kernel (`memory_bound=True`: pointwise and reduction kernels) whose floor is under
settings.tune_heuristic_floor_us (50 us) takes the first candidate too, the heuristic config of its
shape ("heuristic"): its candidates differ by a few percent of a few tens of microseconds, less
than compiling and timing them costs; tune "full" times them. Otherwise the answer comes from, in order: this
process's memo, the disk cache, or timing every candidate that `prune` keeps (`prune(cfg)` True
means "do not try this one"); the timed choice is written to the cache. Before timing,
`precompile(kept)` may compile all kept candidates at once (in parallel: tune/precompile.py).
`TuneResult.seconds` is what the call cost, so plans can show where build time went.
"""

from __future__ import annotations

import functools
import math
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from ..errors import InvalidValueError, UnsupportedError
from ..settings import settings
from . import keys
from .cache import CacheEntry, Timing, TuneCache
from .config import Config
from .progress import TuningProgress

BenchFn = Callable[[Config], float]
PruneFn = Callable[[Config], bool]
PrecompileFn = Callable[[Sequence[Config]], Any]


@dataclass(frozen=True)
class TuneResult:
    """The chosen config and where it came from."""
    config: Config
    source: str                      # default | launch-bound | heuristic | single | memo | cache | tuned
    timings: tuple[Timing, ...] = ()
    key_digest: str | None = None    # names the cache file; None when nothing was keyed
    seconds: float = 0.0             # wall time of this tune() call (precompile + timing + cache)

    def __str__(self) -> str:
        return f"{self.config} ({self.source})"


_memo: dict[str, TuneResult] = {}
_memo_lock = threading.Lock()


def clear_memo() -> None:
    """Forget this process's choices (the disk cache stays)."""
    with _memo_lock:
        _memo.clear()


def autotune(name: str, key: Mapping[str, Any], candidates: Sequence[Config], bench: BenchFn | None, *,
             prune: PruneFn | None = None, floor_ms: float | None = None,
             precompile: PrecompileFn | None = None, memory_bound: bool = False) -> Config:
    """The fastest candidate for `key` on this GPU (see the module doc); candidates[0] without timing."""
    return tune(name, key, candidates, bench, prune=prune, floor_ms=floor_ms, precompile=precompile,
                memory_bound=memory_bound).config


TUNE_MODES = ("fast", "full")


def tune_mode() -> str:
    """settings.tune, checked: "fast" or "full"."""
    mode = str(settings.tune).strip().lower()
    if mode not in TUNE_MODES:
        raise InvalidValueError(f"setting tune (FUSEGRAPH_TUNE) = {settings.tune!r}: use one of "
                                f"{', '.join(TUNE_MODES)}")
    return mode


def launch_bound(floor_ms: float | None) -> bool:
    """True when a kernel with this cost-model floor is not worth timing (see the module doc)."""
    return floor_ms is not None and floor_ms * 1e3 < settings.tune_min_floor_us


def untimed_reason(floor_ms: float | None, memory_bound: bool = False) -> str | None:
    """"launch-bound" or "heuristic" when a kernel with this floor takes its first candidate
    untimed (see the module doc), None when it is worth timing."""
    if floor_ms is None:
        return None
    if launch_bound(floor_ms):
        return "launch-bound"
    if memory_bound and tune_mode() == "fast" and floor_ms * 1e3 < settings.tune_heuristic_floor_us:
        return "heuristic"
    return None


def floor_ms_of(kernel: Any) -> float | None:
    """The kernel's cost-model floor in ms on the present GPU's datasheet spec (H200 without one):
    datasheet, not calibrated, so the same plan gets the same tuning decisions on every machine."""
    try:
        from ..perf.roofline import kernel_floor
        return kernel_floor(kernel, _datasheet_spec()).seconds * 1e3
    except Exception:  # a kernel the cost model cannot price is simply tuned
        return None


@functools.lru_cache(maxsize=1)
def _datasheet_spec() -> Any:
    from ..perf.calibrate import effective_spec
    return effective_spec(use_calibration=False)


def summary(result: TuneResult, candidates: int) -> dict[str, Any]:
    """What a Kernel records of its tuning (Kernel.tuning): where the choice came from, seconds, count."""
    return {"source": result.source, "seconds": round(result.seconds, 4), "candidates": candidates}


def tune(name: str, key: Mapping[str, Any], candidates: Sequence[Config | Mapping[str, Any]],
         bench: BenchFn | None, *, prune: PruneFn | None = None, floor_ms: float | None = None,
         precompile: PrecompileFn | None = None, memory_bound: bool = False) -> TuneResult:
    """`autotune` returning a `TuneResult` (the config, its source, the timings behind it, the seconds spent)."""
    start = time.perf_counter()
    result = _tune(name, key, candidates, bench, prune, floor_ms, precompile, memory_bound)
    return replace(result, seconds=time.perf_counter() - start)


def _tune(name: str, key: Mapping[str, Any], candidates: Sequence[Config | Mapping[str, Any]],
          bench: BenchFn | None, prune: PruneFn | None, floor_ms: float | None,
          precompile: PrecompileFn | None, memory_bound: bool = False) -> TuneResult:
    configs = [c if isinstance(c, Config) else Config(c) for c in candidates]
    if not configs:
        raise ValueError(f"autotune {name!r}: no candidate configurations given")
    if bench is None or not settings.autotune:
        return TuneResult(configs[0], "default")
    gpu = keys.gpu_identity()
    if gpu is None:
        return TuneResult(configs[0], "default")

    kept = _unique([c for c in configs if prune is None or not prune(c)]) or configs[:1]
    untimed = untimed_reason(floor_ms, memory_bound)
    if untimed is not None:
        return TuneResult(kept[0], untimed)
    if len(kept) == 1:
        return TuneResult(kept[0], "single")

    full_key = keys.full_key(name, key, kept, gpu)
    digest = keys.digest(full_key)
    with _memo_lock:
        remembered = _memo.get(digest)
    if remembered is not None:
        return replace(remembered, source="memo")

    cache = TuneCache()
    entry = cache.load(full_key)
    if entry is not None and entry.config in kept:
        result = TuneResult(entry.config, "cache", entry.timings, digest)
    else:
        start = time.perf_counter()
        if precompile is not None:
            try:
                precompile(kept)
            except Exception as err:  # each candidate still compiles (or fails) when it is timed
                if settings.debug >= 1:
                    print(f"[fusegraph] {name}: parallel precompile failed: {_describe(err)}", file=sys.stderr)
        timings = _time_candidates(name, key, kept, bench)
        best = min((t for t in timings if t.ms is not None), key=lambda t: t.ms or 0.0)
        tuning_s = time.perf_counter() - start
        cache.store(full_key, CacheEntry(best.config, tuple(timings), tuning_s))
        result = TuneResult(best.config, "tuned", tuple(timings), digest)
        if settings.debug >= 2:
            _print_timings(name, result, tuning_s)
    with _memo_lock:
        _memo[digest] = result
    return result


def _time_candidates(name: str, key: Mapping[str, Any], configs: list[Config], bench: BenchFn) -> list[Timing]:
    """bench() each config; one that raises (compile error, out of resources) is recorded and skipped.
    With settings.tune_early_stop > 0, once one has a time, each later one is timed inside
    timing.losing_above(best * tune_early_stop): a clear loser stops after its first few calls (its
    recorded time is their median)."""
    from .timing import losing_above

    timings: list[Timing] = []
    last_error: Exception | None = None
    ratio = settings.tune_early_stop
    with TuningProgress(name, len(configs)) as progress:
        for config in configs:
            times = [t.ms for t in timings if t.ms is not None]
            cutoff = min(times) * ratio if times and ratio > 0 else None
            try:
                with losing_above(cutoff):
                    ms = float(bench(config))
                if not math.isfinite(ms) or ms < 0:
                    raise ValueError(f"bench returned {ms!r} ms")
                timings.append(Timing(config, ms))
            except Exception as err:
                last_error = err
                timings.append(Timing(config, None, _describe(err)))
            progress.advance(timings[-1].ms)
    if all(t.ms is None for t in timings):
        lines = "\n".join(f"  {t.config}: {t.error}" for t in timings)
        raise UnsupportedError(f"kernel {name!r}: none of its {len(configs)} candidate configurations ran "
                               f"(key {dict(key)}):\n{lines}") from last_error
    return timings


def _describe(err: Exception) -> str:
    text = " ".join(str(err).split())
    if len(text) > 300:
        text = text[:297] + "..."
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def _unique(configs: list[Config]) -> list[Config]:
    seen: set[Config] = set()
    out = []
    for c in configs:
        if c not in seen:
            seen.add(c)
            out.append(c)
    return out


def _print_timings(name: str, result: TuneResult, tuning_s: float) -> None:
    print(f"[fusegraph] tuned {name} in {tuning_s:.2f} s: chose {result.config}", file=sys.stderr)
    for t in sorted(result.timings, key=lambda t: math.inf if t.ms is None else t.ms):
        what = f"{t.ms:.4f} ms" if t.ms is not None else f"failed: {t.error}"
        print(f"    {t.config}: {what}", file=sys.stderr)


def build_time_note(kernels: Sequence[Any]) -> str | None:
    """One line on where a plan's build time went (Kernel.tuning), or None when nothing was tuned."""
    infos = [(k.name, getattr(k, "tuning", None) or {}) for k in kernels]
    infos = [(n, t) for n, t in infos if t]
    if not any(t.get("source") not in ("default", None) for _, t in infos):
        return None
    sources: dict[str, int] = {}
    for _, t in infos:
        sources[str(t.get("source"))] = sources.get(str(t.get("source")), 0) + 1
    tuning = sum(float(t.get("seconds", 0.0)) for _, t in infos)
    build = sum(float(t.get("build_s", t.get("seconds", 0.0))) for _, t in infos)
    name, slowest = max(infos, key=lambda nt: float(nt[1].get("build_s", nt[1].get("seconds", 0.0))))
    how = ", ".join(f"{n} {s}" for s, n in sorted(sources.items()))
    return (f"build: kernels took {build:.1f} s, {tuning:.1f} s of it tuning ({how}); slowest {name} "
            f"{float(slowest.get('build_s', slowest.get('seconds', 0.0))):.1f} s")


def cached_choice(name: str, key: Mapping[str, Any], candidates: Sequence[Config]) -> Config | None:
    """The choice tune() would find in the memo or the disk cache for these arguments (None: it would
    time them, or there is no GPU); used to compile only that candidate ahead of time."""
    gpu = keys.gpu_identity()
    kept = _unique(list(candidates))
    if gpu is None or len(kept) < 2:
        return None
    full_key = keys.full_key(name, key, kept, gpu)
    with _memo_lock:
        remembered = _memo.get(keys.digest(full_key))
    if remembered is not None:
        return remembered.config
    entry = TuneCache().load(full_key)
    return entry.config if entry is not None and entry.config in kept else None
