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
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ..settings import settings

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
    workers = threads or compile_threads(len(jobs))
    if workers == 1:
        return [_run(job) for job in jobs]
    mode = _async_compile_mode() if triton_jobs else None
    if mode is not None and _async_mode_active():  # the caller's own AsyncCompileMode takes the jobs
        return [_run(job) for job in jobs]
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="fusegraph-compile") as pool:
        if mode is None:
            return [_error_of(f) for f in [pool.submit(job) for job in jobs]]
        errors: list[str | None] = [None] * len(jobs)
        handles: list[Any] = [None] * len(jobs)
        with mode(pool, ignore_errors=True):
            for k, job in enumerate(jobs):
                try:
                    handles[k] = job()
                except Exception as err:  # binding failed before anything was submitted
                    errors[k] = _describe(err)
        for k, handle in enumerate(handles):
            future = getattr(handle, "future", None)
            if errors[k] is None and isinstance(future, Future):
                errors[k] = _error_of(future)
        return errors


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


def _run(job: Callable[[], Any]) -> str | None:
    try:
        job()
    except Exception as err:
        return _describe(err)
    return None


def _error_of(future: Future[Any]) -> str | None:
    err = future.exception()
    return None if err is None else _describe(err)


def _describe(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text[:300]}" if text else type(err).__name__
