"""Compile a kernel's candidate configurations in parallel before any of them is timed.

    errors = compile_in_parallel([lambda: fn.warmup(*args, grid=g, **consts) for ...])

Each job is a call that makes Triton compile one specialization (a `JITFunction.warmup`). Under
Triton's `AsyncCompileMode` (Triton >= 3.4) the job itself runs here, on the calling thread: Triton
binds the arguments and hands only `triton.compile` to our thread pool, and on leaving the mode
every finished kernel is in the function's in-memory cache, so the timing loop that follows
launches without compiling. Without AsyncCompileMode the jobs themselves run in the pool.

Threads are enough (measured on the demo block's GEMMs, compiled for sm_90 on a 2-core CPU):
about 75% of a compile is ptxas, a subprocess; the rest (AST -> TTIR, MLIR and LLVM passes,
PTX) mostly runs outside the GIL too: with ptxas stubbed out, 8 compiles took 3.5 s on one
thread and 2.0 s on two (1.7x). With ptxas, 4 compiles: 4.4 s -> 3.3 s on two threads (the two
cores were saturated). So a process pool (Inductor's way) would add little over threads here.

Launchers: Triton 3.x also builds a small C launcher per kernel signature with the host C compiler
(`driver.active.launcher_cls`, cached on disk in TRITON_CACHE_DIR by its source), and it does so at
a kernel's first launch, one kernel after another. Once the compiles are done, the distinct
launchers of the compiled kernels are built here in the same pool (a gcc subprocess each), so the
first launches only load them from the cache. FUSEGRAPH_PROFILE_BUILD shows both phases.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ..settings import settings
from .build_profile import active as active_profile

MAX_THREADS = 16


def compile_threads(jobs: int) -> int:
    """How many threads compile `jobs` candidates (settings.compile_threads; 0: one per usable core)."""
    wanted = settings.compile_threads or min(MAX_THREADS, usable_cpus())
    return max(1, min(wanted, jobs))


CGROUP_CPU_MAX = "/sys/fs/cgroup/cpu.max"


def usable_cpus(cpu_max: str = CGROUP_CPU_MAX) -> int:
    """The CPUs this process may run on (its affinity mask), capped by the container's CPU quota
    (cgroup v2 cpu.max, "<quota> <period>" or "max ..."), which os.cpu_count() does not see."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity API (macOS)
        cpus = os.cpu_count() or 1
    try:
        with open(cpu_max) as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            cpus = min(cpus, max(1, -(-int(quota) // int(period))))
    except (OSError, ValueError):  # no cgroup v2 quota here
        pass
    return max(1, cpus)


def compile_in_parallel(jobs: Sequence[Callable[[], Any]], threads: int | None = None, *,
                        triton_jobs: bool = True) -> list[str | None]:
    """Run every job (each compiles one candidate); per job, None or why it failed. Never raises.
    `triton_jobs`: the jobs are Triton JIT warmups (run here, under AsyncCompileMode, when this
    Triton has it); False: the jobs do their whole compile themselves and run in the pool."""
    if not jobs:
        return []
    start = time.perf_counter()
    workers = threads or compile_threads(len(jobs))
    if workers == 1:
        results = [_run(job) for job in jobs]
        _note("parallel compile", start, f"{len(jobs)} jobs on 1 thread")
        return [error for error, _ in results]
    mode = _async_compile_mode() if triton_jobs else None
    if mode is not None and _async_mode_active():  # the caller's own AsyncCompileMode takes the jobs
        return [error for error, _ in (_run(job) for job in jobs)]
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="fusegraph-compile") as pool:
        errors: list[str | None] = [None] * len(jobs)
        compiled: list[Any] = [None] * len(jobs)
        if mode is None:
            futures = [pool.submit(job) for job in jobs]
            for k, future in enumerate(futures):
                errors[k] = _error_of(future)
                compiled[k] = future.result() if errors[k] is None else None
        else:
            handles: list[Any] = [None] * len(jobs)
            with mode(pool, ignore_errors=True):
                for k, job in enumerate(jobs):
                    try:
                        handles[k] = job()
                    except Exception as err:  # binding failed before anything was submitted
                        errors[k] = _describe(err)
            for k, handle in enumerate(handles):
                pending = getattr(handle, "future", None)
                if errors[k] is None and isinstance(pending, Future):
                    errors[k] = _error_of(pending)
                # a FutureKernel holds its CompiledKernel in .kernel; a kernel already in the JIT's cache
                # comes back as the CompiledKernel itself (whose .kernel is its binary)
                compiled[k] = None if errors[k] is not None else handle.kernel if isinstance(pending, Future) \
                    else handle
        _note("parallel compile", start, f"{len(jobs)} jobs on {workers} threads")
        if settings.prebuild_launchers:
            start = time.perf_counter()
            built = build_launchers(compiled, pool)
            _note("launcher builds", start, f"{built} distinct launchers")
        return errors


class CompileStream:
    """compile_in_parallel without the wait, as a context around the builds that use the kernels:

        with CompileStream(jobs):      # binds every job, hands the compiles to a thread pool, returns
            build kernels              # a first launch waits for its own compile only
                                       # leaving: the compiles no build waited for are finished

    Inside, Triton's AsyncCompileMode stays active on this thread, so a kernel's launch (or warmup)
    that Triton has not finished finds its pending compile and waits for it (JITFunction.run calls
    the FutureKernel's result()); nested compile_in_parallel calls (a kernel's own candidates, an
    inner plan) add their jobs to the same pool. A kernel's C launcher is built on the compile
    thread as soon as the kernel is compiled. While compiles are in flight, this thread's timing
    (tune/timing.py) keeps a longer lead and Python switches threads more often, so the launches
    of a timed kernel are not held behind the compile threads. Falls back to compile_in_parallel
    (waiting at the start) without AsyncCompileMode, with one thread, inside another stream, or
    with settings.stream_compiles off."""

    def __init__(self, jobs: Sequence[Callable[[], Any]], threads: int | None = None) -> None:
        self.jobs, self.threads = list(jobs), threads
        self.pool: ThreadPoolExecutor | None = None
        self.mode: Any = None
        self.start = 0.0
        self.switch_interval = 0.0

    def __enter__(self) -> CompileStream:
        global _streams
        self.start = time.perf_counter()
        mode = _async_compile_mode()
        workers = self.threads or compile_threads(len(self.jobs))
        if not self.jobs or mode is None or workers == 1 or _async_mode_active() or not settings.stream_compiles:
            compile_in_parallel(self.jobs, self.threads)
            return self
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="fusegraph-compile")
        self.mode = mode(self.pool, ignore_errors=True)
        self.mode.__enter__()
        launchers = _LauncherBuilds() if settings.prebuild_launchers else None
        for job in self.jobs:
            try:
                handle = job()
            except Exception:  # binding failed: the kernel's build meets it again and reports it
                continue
            pending = getattr(handle, "future", None)
            if launchers is not None and isinstance(pending, Future):
                pending.add_done_callback(launchers.build)
        with _streams_lock:
            _streams += 1
        self.switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(STREAM_SWITCH_INTERVAL_S)
        _note("compiles submitted", self.start, f"{len(self.jobs)} jobs to {workers} threads")
        return self

    def __exit__(self, *exc: Any) -> None:
        global _streams
        if self.mode is None:
            return
        try:
            self.mode.__exit__(None, None, None)   # finishes the compiles no build waited for
        finally:
            assert self.pool is not None
            self.pool.shutdown(wait=True)
            sys.setswitchinterval(self.switch_interval)
            with _streams_lock:
                _streams -= 1
            _note("parallel compile (streamed)", self.start, f"{len(self.jobs)} jobs, done when the builds were")


STREAM_SWITCH_INTERVAL_S = 0.0005   # Python's default is 5 ms: a timed launch could wait that long for the GIL
_streams = 0
_streams_lock = threading.Lock()


def streaming() -> bool:
    """True while a CompileStream's compiles may be running (tune/timing.py then keeps a longer lead)."""
    return _streams > 0


class _LauncherBuilds:
    """Builds each distinct C launcher once, on the compile thread that finished a kernel needing it."""

    def __init__(self) -> None:
        self.launcher_cls = _launcher_class()
        self.seen: set[str] = set()
        self.lock = threading.Lock()

    def build(self, future: Future[Any]) -> None:
        if self.launcher_cls is None or future.cancelled() or future.exception() is not None:
            return
        kernel = future.result()
        key = _launcher_key(kernel)
        if key is None:
            return
        with self.lock:
            if key in self.seen:
                return
            self.seen.add(key)
        with contextlib.suppress(Exception):   # fails again, with its message, at the kernel's first launch
            self.launcher_cls(kernel.src, kernel.metadata)


_warmup_lock = threading.Lock()
_warmup: threading.Thread | None = None


def start_triton_warmup(device: str) -> None:
    """Import Triton, make its disk cache the lean one (tune/triton_cache.py), start its CUDA driver
    (which builds or loads its cuda_utils C module) and hash
    Triton's own files (its compile cache key) on a background thread, once per process, so that
    this overlaps the passes and the partitioner;
    `wait_for_triton_warmup` (load_triton_function calls it) joins it before Triton is used."""
    global _warmup
    from ..codegen.compile import interpreting

    if _warmup is not None or not device.startswith("cuda") or not settings.use_triton or interpreting():
        return
    with _warmup_lock:
        if _warmup is None:
            _warmup = threading.Thread(target=_warm_triton, name="fusegraph-triton-warmup", daemon=True)
            _warmup.start()


def wait_for_triton_warmup() -> None:
    thread = _warmup
    if thread is not None and thread.is_alive():
        thread.join()


def _warm_triton() -> None:
    with contextlib.suppress(Exception):
        from .triton_cache import install

        install()   # before any compile: Triton's cache written with fewer file-system operations
    try:
        from triton.runtime.driver import driver

        driver.active.get_current_target()
    except Exception:  # the build meets the same error, with its message, where it uses Triton
        pass
    # Triton's hash of its own sources and library (0.36 s for triton 3.6's 416 MB libtriton on the
    # CPU here; cached for the process): otherwise the first compile pays it, and every thread of the
    # first parallel batch computes it at once (the cache does not lock)
    with contextlib.suppress(Exception):
        from triton.runtime.cache import triton_key

        triton_key()


def build_launchers(compiled: Sequence[Any], pool: ThreadPoolExecutor) -> int:
    """Build the distinct C launchers of these compiled kernels in `pool` (each a host-compiler run
    the first time, a disk-cache load after); returns how many. Never raises: a launcher that fails
    here fails again, with its message, at the kernel's first launch."""
    launcher_cls = _launcher_class()
    if launcher_cls is None:
        return 0
    seen: set[str] = set()
    futures = []
    for kernel in compiled:       # CompiledKernels (None: failed)
        key = _launcher_key(kernel)
        if key is not None and key not in seen:
            seen.add(key)
            futures.append(pool.submit(launcher_cls, kernel.src, kernel.metadata))
    for future in futures:
        future.exception()
    return len(futures)


def _launcher_key(kernel: Any) -> str | None:
    """What a compiled kernel's C launcher depends on (None: not a CompiledKernel)."""
    src, metadata = getattr(kernel, "src", None), getattr(kernel, "metadata", None)
    signature = getattr(src, "signature", None)
    if signature is None or metadata is None:
        return None
    return repr((sorted(signature.items(), key=str), sorted(getattr(src, "constants", {}).items(), key=str),
                 getattr(metadata, "tensordesc_meta", None)))


def _launcher_class() -> Any:
    try:
        from triton.runtime.driver import driver

        return getattr(driver.active, "launcher_cls", None)
    except Exception:  # no GPU driver (CPU, interpreter): nothing to build
        return None


def _note(what: str, start: float, detail: str) -> None:
    profile = active_profile()
    if profile is not None:
        profile.add_sub(what, time.perf_counter() - start, detail)


def _async_compile_mode() -> Any:
    try:
        from triton import AsyncCompileMode
    except ImportError:
        return None
    return AsyncCompileMode


def _async_mode_active() -> bool:
    try:
        from triton.runtime import _async_compile
    except ImportError:
        return False
    return _async_compile.active_mode.get() is not None


def _run(job: Callable[[], Any]) -> tuple[str | None, Any]:
    try:
        return None, job()
    except Exception as err:
        return _describe(err), None


def _error_of(future: Future[Any]) -> str | None:
    err = future.exception()
    return None if err is None else _describe(err)


def _describe(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text[:300]}" if text else type(err).__name__
