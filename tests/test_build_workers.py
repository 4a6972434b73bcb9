"""The build worker pool (backends/build_workers.py): jobs run in real subprocesses and come back
pickled; a job's exception comes back as itself; a worker that dies fails its job with WorkerError
and the next job gets a fresh worker; library prints in a job never corrupt the channel; idle
workers exit; settings.build_workers=0 means no pool."""

from __future__ import annotations

import os
import time

import pytest

from fusegraph.backends import build_workers
from fusegraph.settings import override


@pytest.fixture
def pool() -> build_workers.WorkerPool:
    p = build_workers.WorkerPool(2)
    yield p
    p.shutdown()


def test_jobs_run_in_other_processes_and_return_their_results(pool: build_workers.WorkerPool) -> None:
    futures = [pool.submit("math:factorial", n) for n in range(8)]
    assert [f.result(timeout=120) for f in futures] == [1, 1, 2, 6, 24, 120, 720, 5040]
    pids = {pool.submit("os:getpid").result(timeout=60) for _ in range(4)}
    assert os.getpid() not in pids and 1 <= len(pids) <= 2


def test_a_failing_job_raises_its_own_exception_and_the_worker_lives_on(pool: build_workers.WorkerPool) -> None:
    with pytest.raises(ValueError, match="math domain error"):
        pool.submit("math:sqrt", -1.0).result(timeout=120)
    assert pool.submit("math:sqrt", 16.0).result(timeout=60) == 4.0


def test_prints_inside_a_job_do_not_corrupt_the_channel(pool: build_workers.WorkerPool) -> None:
    assert pool.submit("builtins:print", "a line a library printed to stdout").result(timeout=120) is None
    assert pool.submit("math:factorial", 5).result(timeout=60) == 120


def test_a_dead_worker_fails_its_job_and_the_next_job_gets_a_new_one() -> None:
    pool = build_workers.WorkerPool(1)
    try:
        first = pool.submit("os:getpid").result(timeout=120)
        with pytest.raises(build_workers.WorkerError, match="failed"):
            pool.submit("os:_exit", 3).result(timeout=60)
        second = pool.submit("os:getpid").result(timeout=120)
        assert second != first
    finally:
        pool.shutdown()


def test_idle_workers_exit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(build_workers, "IDLE_S", 0.3)
    pool = build_workers.WorkerPool(1)
    assert pool.submit("math:factorial", 3).result(timeout=120) == 6
    (worker,) = pool.workers
    deadline = time.monotonic() + 30
    while pool.workers and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not pool.workers and worker.process.poll() is not None
    assert pool.submit("math:factorial", 4).result(timeout=120) == 24   # a new worker starts for new work
    pool.shutdown()


def test_pool_size_follows_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    with override(build_workers=0):
        assert build_workers.pool() is None
    with override(build_workers=3):
        p = build_workers.pool()
        assert p is not None and p.size == 3
    monkeypatch.setattr("fusegraph.tune.precompile.usable_cpus", lambda: 16)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with override(build_workers=-1):
        assert build_workers.auto_size() == 2          # 16 cores, 4 local ranks: 2 workers each
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    with override(build_workers=-1):
        assert build_workers.auto_size() == build_workers.MAX_AUTO_WORKERS


def test_workers_that_keep_dying_disable_the_pool_and_fail_what_is_queued() -> None:
    """A worker that cannot run (here: each one exits at once) must not respawn forever, and queued
    jobs must not wait for a worker that will never come: after MAX_FAILURES deaths in a row every job
    fails at once (its caller builds in-process)."""
    pool = build_workers.WorkerPool(1)
    try:
        futures = [pool.submit("os:_exit", 5) for _ in range(build_workers.MAX_FAILURES + 2)]
        for f in futures:
            with pytest.raises(build_workers.WorkerError):
                f.result(timeout=120)
        assert pool.failures == build_workers.MAX_FAILURES and not pool.workers
        start = time.monotonic()
        with pytest.raises(build_workers.WorkerError, match="disabled"):
            pool.submit("math:factorial", 3).result(timeout=5)
        assert time.monotonic() - start < 1.0 and not pool.workers      # no worker started for it
    finally:
        pool.shutdown()
