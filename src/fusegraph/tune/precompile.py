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

import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ..settings import settings
from .build_profile import active as active_profile

MAX_THREADS = 16


def compile_threads(jobs: int) -> int:
    """How many threads compile `jobs` candidates (settings.compile_threads; 0: one per core)."""
    wanted = settings.compile_threads or min(MAX_THREADS, os.cpu_count() or 1)
    return max(1, min(wanted, jobs))


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


_warmup_lock = threading.Lock()
_warmup: threading.Thread | None = None


def start_triton_warmup(device: str) -> None:
    """Import Triton and start its CUDA driver (which builds or loads its cuda_utils C module) on a
    background thread, once per process, so that this overlaps the passes and the partitioner;
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
    try:
        from triton.runtime.driver import driver

        driver.active.get_current_target()
    except Exception:  # the build meets the same error, with its message, where it uses Triton
        pass


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
        src, metadata = getattr(kernel, "src", None), getattr(kernel, "metadata", None)
        signature = getattr(src, "signature", None)
        if signature is None or metadata is None:
            continue
        key = repr((sorted(signature.items(), key=str), sorted(getattr(src, "constants", {}).items(), key=str),
                    getattr(metadata, "tensordesc_meta", None)))
        if key not in seen:
            seen.add(key)
            futures.append(pool.submit(launcher_cls, src, metadata))
    for future in futures:
        future.exception()
    return len(futures)


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
