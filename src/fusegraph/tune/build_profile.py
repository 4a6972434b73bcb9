"""Where a build's time goes, per stage and per kernel (FUSEGRAPH_PROFILE_BUILD=1).

    with profile_build("block") as profile:       # compile_graph does this; None when the setting is off
        verify(graph); mark("verify")             # time since the last mark goes to "verify"
        with stage("tuning"): ...                 # a sub-stage of whatever the next mark closes
        kernels_built(kernels, since=n)           # time since the last mark goes to kernels[n:]
    print(profile.report())

Marks are flat and cheap: each records the wall time since the previous mark (or the start) under
one top-level stage name, and what happened in between (sub-stages, Triton compiles) is attached to
that record. Triton compiles are seen through `triton.knobs.compilation.listener` (called from the
compile threads too): the compile time of every kernel Triton compiled or found in its cache. With
the setting off every call here is a no-op costing one global read.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ..settings import settings


@dataclass
class SubStage:
    name: str
    seconds: float
    detail: str = ""


@dataclass
class StageRecord:
    """One mark: `seconds` of wall time since the previous mark, named `name` (a stage, or
    "kernel" with the names of the kernels built), with what ran inside it."""
    name: str
    seconds: float
    kernels: tuple[str, ...] = ()
    subs: list[SubStage] = field(default_factory=list)
    compiles: list[tuple[str, float, bool]] = field(default_factory=list)   # (function, seconds, cache hit)


class BuildProfile:
    """The marks of one build; thread-safe (Triton's listener runs on compile threads)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.records: list[StageRecord] = []
        self._lock = threading.Lock()
        self._start = self._last = time.perf_counter()
        self._subs: list[SubStage] = []
        self._compiles: list[tuple[str, float, bool]] = []
        self.total = 0.0

    def mark(self, name: str, kernels: Sequence[str] = ()) -> None:
        now = time.perf_counter()
        with self._lock:
            record = StageRecord(name, now - self._last, tuple(kernels), self._subs, self._compiles)
            self._subs, self._compiles = [], []
            self._last = now
            self.records.append(record)

    def add_sub(self, name: str, seconds: float, detail: str = "") -> None:
        with self._lock:
            self._subs.append(SubStage(name, seconds, detail))

    def add_compile(self, function: str, seconds: float, cache_hit: bool) -> None:
        with self._lock:
            self._compiles.append((function, seconds, cache_hit))

    def finish(self) -> None:
        if self._subs or self._compiles:
            self.mark("other")
        self.total = time.perf_counter() - self._start

    # ---- reading it --------------------------------------------------------------------------

    def stage_seconds(self) -> dict[str, float]:
        """Seconds per top-level stage name (kernels summed under "kernels"), in first-seen order."""
        out: dict[str, float] = {}
        for r in self.records:
            key = "kernels" if r.kernels else r.name
            out[key] = out.get(key, 0.0) + r.seconds
        return out

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "total_s": round(self.total, 4),
                "stages": {k: round(v, 4) for k, v in self.stage_seconds().items()},
                "records": [{"stage": r.name, "seconds": round(r.seconds, 4), "kernels": list(r.kernels),
                             "subs": [{"name": s.name, "seconds": round(s.seconds, 4), "detail": s.detail}
                                      for s in r.subs],
                             "triton_compiles": [{"function": f, "seconds": round(s, 4), "cache_hit": hit}
                                                 for f, s, hit in r.compiles]} for r in self.records]}

    def report(self, top_kernels: int = 12) -> str:
        lines = [f"build profile of {self.name}: {self.total:.2f} s"]
        for stage, seconds in self.stage_seconds().items():
            records = [r for r in self.records if (r.kernels and stage == "kernels") or r.name == stage]
            lines.append(f"  {stage:<28} {seconds:8.3f} s{_extras(records)}")
            if stage == "kernels":
                ranked = sorted(records, key=lambda r: -r.seconds)
                for r in ranked[:top_kernels]:
                    subs = ", ".join(f"{s.name} {s.seconds:.3f} s" + (f" ({s.detail})" if s.detail else "")
                                     for s in r.subs)
                    lines.append(f"      {' + '.join(r.kernels)[:44]:<44} {r.seconds:7.3f} s{_extras([r])}"
                                 + (f"  [{subs}]" if subs else ""))
                if len(ranked) > top_kernels:
                    rest = sum(r.seconds for r in ranked[top_kernels:])
                    lines.append(f"      ... {len(ranked) - top_kernels} more kernels, {rest:.3f} s")
            else:
                for r in records:
                    for s in r.subs:
                        lines.append(f"      {s.name:<18} {s.seconds:8.3f} s" + (f"  {s.detail}" if s.detail else ""))
        accounted = sum(r.seconds for r in self.records)
        if self.total - accounted > 0.005:
            lines.append(f"  {'(after the last mark)':<28} {self.total - accounted:8.3f} s")
        return "\n".join(lines)


def _extras(records: Sequence[StageRecord]) -> str:
    compiles = [c for r in records for c in r.compiles]
    if not compiles:
        return ""
    built = [s for _, s, hit in compiles if not hit]
    hits = len(compiles) - len(built)
    return (f"  (Triton: {len(built)} compiled, {sum(built):.2f} s summed over threads"
            + (f", {hits} from its cache" if hits else "") + ")")


# ---- the active profile ------------------------------------------------------------------------

_active: BuildProfile | None = None
_nested = 0   # builds running inside the profiled one: their stage marks are not the outer build's
_active_lock = threading.Lock()


def active() -> BuildProfile | None:
    return _active


@contextlib.contextmanager
def profile_build(name: str, enabled: bool | None = None) -> Iterator[BuildProfile | None]:
    """Profile the build inside (settings.profile_build unless `enabled` says otherwise); the
    outermost build owns the profile. A nested build (an inner plan built while a kernel is built)
    yields None and records no stages of its own: its time, sub-stages and Triton compiles belong to
    the outer build's kernel being built (before, its marks split that kernel's time under stage names
    like "verify" and "passes")."""
    global _active, _nested
    if _active is not None:   # a build inside a build (an inner plan): its time is the enclosing kernel's
        with _active_lock:
            _nested += 1
        try:
            yield None
        finally:
            with _active_lock:
                _nested -= 1
        return
    if not (settings.profile_build if enabled is None else enabled):
        yield None
        return
    profile = BuildProfile(name)
    with _active_lock:
        _active = profile
    imported = "triton" in sys.modules
    restore = _listen_to_triton(profile)
    if not imported and "triton" in sys.modules:
        profile.mark("import triton")
    try:
        yield profile
    finally:
        with _active_lock:
            _active = None
        restore()
        profile.finish()


def mark(name: str) -> None:
    """Close a top-level stage: the time since the previous mark is `name`'s."""
    if _active is not None and not _nested:
        _active.mark(name)


def kernels_built(kernels: Sequence[Any], since: int) -> None:
    """The time since the previous mark built kernels[since:] (one iteration of lowering)."""
    if _active is None or _nested:
        return
    for k in kernels[since:]:
        tuning = getattr(k, "tuning", None) or {}
        if float(tuning.get("seconds", 0.0)) > 0.0005:
            _active.add_sub(f"tuning ({tuning.get('source', '?')}, {tuning.get('candidates', '?')} candidates)",
                            float(tuning["seconds"]))
    _active.mark("kernel", [getattr(k, "name", str(k)) for k in kernels[since:]] or ["(none)"])


@contextlib.contextmanager
def stage(name: str, detail: str = "") -> Iterator[None]:
    """Time a sub-stage (tuning, first launch + check, launcher builds) of the current mark."""
    if _active is None:
        yield
        return
    profile, start = _active, time.perf_counter()
    try:
        yield
    finally:
        profile.add_sub(name, time.perf_counter() - start, detail)


F = TypeVar("F", bound=Callable[..., Any])


def timed_stage(name: str) -> Callable[[F], F]:
    """Decorator: each call is a sub-stage `name` of the current mark."""
    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def inner(*args: Any, **kwargs: Any) -> Any:
            if _active is None:
                return fn(*args, **kwargs)
            with stage(name):
                return fn(*args, **kwargs)
        return inner  # type: ignore[return-value]
    return wrap


def profiled_build(build: F) -> F:
    """Decorator of compile_graph: the build runs under `profile_build(graph.name)` (the profile is
    kept as plan.build_profile and printed to stderr) and with Python's cyclic garbage collector
    paused (`gc_paused`)."""
    @functools.wraps(build)
    def inner(graph: Any, *args: Any, **kwargs: Any) -> Any:
        with gc_paused(), profile_build(str(getattr(graph, "name", "graph"))) as profile:
            plan = build(graph, *args, **kwargs)
        if profile is not None:
            with contextlib.suppress(AttributeError):
                plan.build_profile = profile
            report_if_enabled(profile)
        return plan
    return inner  # type: ignore[return-value]


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector during a build (settings.build_gc_pause). A build
    allocates many short-lived objects; with torch imported the heap holds millions of tracked
    objects, and the full (generation 2) collection those allocations trigger took ~0.3 s of a
    1.3 s CPU-side build of the demo block. Reference counting still frees everything acyclic;
    cycles wait for the next collection after the build."""
    import gc

    if not settings.build_gc_pause or not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def report_if_enabled(profile: BuildProfile | None) -> None:
    if profile is not None:
        print(profile.report(), file=sys.stderr)


def _listen_to_triton(profile: BuildProfile) -> Any:
    """Install a Triton compilation listener feeding `profile`; returns what restores the old one."""
    if "triton" not in sys.modules and not _triton_importable():
        return lambda: None
    try:
        from triton import knobs
    except Exception:  # an old Triton without knobs: no per-compile times
        return lambda: None
    previous = knobs.compilation.listener

    def listener(*, src: Any, metadata: Any, metadata_group: Any, times: Any, cache_hit: bool) -> None:
        try:
            name = str(getattr(src, "name", None) or (metadata or {}).get("name", "?"))
            profile.add_compile(name, float(times.total) / 1e6, bool(cache_hit))
        finally:
            if previous is not None:
                previous(src=src, metadata=metadata, metadata_group=metadata_group, times=times, cache_hit=cache_hit)

    knobs.compilation.listener = listener

    def restore() -> None:
        knobs.compilation.listener = previous

    return restore


def _triton_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None
