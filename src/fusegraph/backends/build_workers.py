"""Worker processes for build steps that hold the GIL: a small pool of `python -m
fusegraph.backends.build_workers` subprocesses, each running submitted jobs one at a time.

    future = pool().submit("fusegraph.backends.cudnn_plans:build_serialized", recipes, 4, 0)
    result = future.result()        # or the job's exception (WorkerError when the worker died)

Why processes: the cuDNN frontend's plan builds (runtime-fusion kernels compiled by NVRTC, 0.1-0.8 s
each) hold the GIL, so threads do not overlap them (bench/results/cudnn_build_threads_20261201_1140.txt);
a worker builds a plan and returns it serialized, which the parent deserializes in milliseconds.

The workers are started by command (not `multiprocessing`), so a user's unguarded script is never
re-imported; they get the parent's sys.path as PYTHONPATH. Jobs name a module-level function as
"module:function"; arguments and results travel pickled over the worker's stdin and stdout (a
length-prefixed frame each; the worker points its own fd 1 at stderr, so library prints cannot
corrupt the channel). A worker that dies fails its job with WorkerError and is not reused; the pool
starts a replacement for the next job, until MAX_FAILURES die in a row: then every job fails at once
(its caller builds in-process). Idle workers exit after `IDLE_S` (each may hold a CUDA
context) and at interpreter exit. settings.build_workers sets the pool size (0: no pool, callers
build in-process).
"""

from __future__ import annotations

import atexit
import importlib
import os
import pickle
import queue
import struct
import subprocess
import sys
import threading
from concurrent.futures import Future
from typing import IO, Any

from ..settings import settings

IDLE_S = 30.0          # a worker with nothing to do for this long exits
MAX_AUTO_WORKERS = 8
MAX_FAILURES = 3       # workers dying this many times in a row (no job answered between) disable the pool
_HEADER = struct.Struct("<Q")


class WorkerError(RuntimeError):
    """A worker process died or answered garbage; the job's caller falls back to building in-process."""


def auto_size() -> int:
    """settings.build_workers, or when it is negative (auto): half the usable CPU cores, shared among the
    local ranks of a distributed job (LOCAL_WORLD_SIZE), at most MAX_AUTO_WORKERS."""
    wanted = int(settings.build_workers)
    if wanted >= 0:
        return wanted
    from ..tune.precompile import usable_cpus

    ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    return max(1, min(MAX_AUTO_WORKERS, usable_cpus() // (2 * ranks)))


def _write_frame(stream: IO[bytes], payload: Any) -> None:
    data = pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(data)))
    stream.write(data)
    stream.flush()


def _read_frame(stream: IO[bytes]) -> Any:
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        raise EOFError("the channel closed")
    size = _HEADER.unpack(header)[0]
    data = stream.read(size)
    if len(data) < size:
        raise EOFError("the channel closed mid-frame")
    return pickle.loads(data)


class _Job:
    __slots__ = ("args", "function", "future")

    def __init__(self, function: str, args: tuple[Any, ...]) -> None:
        self.function, self.args = function, args
        self.future: Future[Any] = Future()


class _Worker:
    """One subprocess and the thread that feeds it jobs from the pool's queue."""

    def __init__(self, pool: WorkerPool) -> None:
        self.pool = pool
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self.process = subprocess.Popen([sys.executable, "-m", "fusegraph.backends.build_workers"],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        self.thread = threading.Thread(target=self._serve, name="fusegraph-build-worker", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        proc = self.process
        assert proc.stdin is not None and proc.stdout is not None
        try:
            while True:
                try:
                    job = self.pool.jobs.get(timeout=IDLE_S)
                except queue.Empty:
                    break
                if job is None:
                    break
                if not job.future.set_running_or_notify_cancel():
                    continue
                try:
                    _write_frame(proc.stdin, (job.function, job.args))
                    ok, value = _read_frame(proc.stdout)
                except Exception as err:  # the worker died or the frame did not parse
                    self.pool.failures += 1
                    job.future.set_exception(WorkerError(f"build worker (pid {proc.pid}) failed: "
                                                         f"{type(err).__name__}: {err}"))
                    break
                self.pool.failures = 0
                if ok:
                    job.future.set_result(value)
                else:
                    job.future.set_exception(value if isinstance(value, BaseException) else WorkerError(str(value)))
        finally:
            self.close()
            self.pool.retire(self)

    def close(self) -> None:
        proc = self.process
        try:
            if proc.stdin is not None:
                proc.stdin.close()
            proc.wait(timeout=5)
        except Exception:  # stuck: make sure it goes
            proc.kill()


class WorkerPool:
    """Up to `size` workers, started as jobs arrive; jobs go to whichever worker is free."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.jobs: queue.Queue[_Job | None] = queue.Queue()
        self.workers: list[_Worker] = []
        self.lock = threading.Lock()
        self.failures = 0     # workers that died in a row; MAX_FAILURES of them disable the pool

    def submit(self, function: str, *args: Any) -> Future[Any]:
        job = _Job(function, args)
        if self.failures >= MAX_FAILURES:   # workers cannot run here (no usable interpreter, no GPU, ...)
            job.future.set_exception(WorkerError(f"build workers disabled: {self.failures} died in a row"))
            return job.future
        with self.lock:
            self.jobs.put(job)
            if len(self.workers) < self.size:
                self.workers.append(_Worker(self))
        return job.future

    def retire(self, worker: _Worker) -> None:
        with self.lock:
            if worker in self.workers:
                self.workers.remove(worker)
            if self.workers or self.jobs.empty():
                return
            if self.failures < MAX_FAILURES:   # jobs left behind by a dead worker still get one
                self.workers.append(_Worker(self))
                return
            while True:   # disabled: nobody will run what is queued, so it fails now
                try:
                    job = self.jobs.get_nowait()
                except queue.Empty:
                    break
                if job is not None and job.future.set_running_or_notify_cancel():
                    job.future.set_exception(WorkerError(f"build workers disabled: {self.failures} died in a row"))

    def shutdown(self) -> None:
        with self.lock:
            workers = list(self.workers)
            for _ in workers:
                self.jobs.put(None)
        for w in workers:
            w.thread.join(timeout=10)


_POOL: WorkerPool | None = None
_POOL_LOCK = threading.Lock()


def pool() -> WorkerPool | None:
    """The process's pool (None when settings.build_workers is 0)."""
    global _POOL
    size = auto_size()
    if size <= 0:
        return None
    with _POOL_LOCK:
        if _POOL is None or _POOL.size != size:
            _POOL = WorkerPool(size)
        return _POOL


@atexit.register
def _shutdown() -> None:
    if _POOL is not None:
        _POOL.shutdown()


def run_job(function: str, args: tuple[Any, ...]) -> Any:
    """Call "module:function" with args (what a worker does for each job; also the in-process path)."""
    module, _, name = function.partition(":")
    return getattr(importlib.import_module(module), name)(*args)


def _serve_forever() -> None:
    """The worker's loop: read a job, run it, answer (ok, result) or (False, the exception)."""
    channel_in = os.fdopen(os.dup(0), "rb")
    channel_out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)   # prints from libraries go to stderr, never into the channel
    sys.stdout = sys.stderr
    while True:
        try:
            function, args = _read_frame(channel_in)
        except EOFError:
            return
        answer: tuple[bool, Any]
        try:
            answer = (True, run_job(function, args))
        except BaseException as err:  # the job's failure goes back to the caller; the worker lives on
            answer = (False, err)
        try:
            pickle.dumps(answer, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as err:  # an unpicklable result or exception: its text instead
            answer = (False, f"{type(answer[1]).__name__}: {answer[1]} (not picklable: {err})")
        _write_frame(channel_out, answer)


if __name__ == "__main__":
    _serve_forever()
