"""bench/gluon_gemm_gpu.py (a warp-specialized Hopper GEMM in Gluon) and bench/gluon_attention_gpu.py (a
warp-specialized causal flash-attention forward) keep compiling for sm_90: their --cpu-compile modes run
Triton's compiler on this machine (no GPU, no interpreter) and report what the PTX holds: the wgmma and TMA
instructions of the two consumers and the producer, and the register moves (setmaxnreg) between the
warp-specialized partitions."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _cpu_compile(script: str) -> tuple[int, int, int, int]:
    """Run bench/<script> --cpu-compile without the interpreter: (shared bytes, wgmma, TMA copies, setmaxnreg)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(BENCH / script), "--cpu-compile"], capture_output=True, text=True,
                          env=env, timeout=600)
    if done.returncode != 0 and "CompilationError" not in done.stderr:   # no CUDA compiler toolchain here
        pytest.skip(f"cannot compile sm_90 here: {done.stderr[-300:]}")
    assert done.returncode == 0, done.stderr[-2000:]
    found = re.search(r"shared (\d+) bytes, (\d+) wgmma, (\d+) TMA copies, (\d+) setmaxnreg", done.stdout)
    assert found, done.stdout
    shared, wgmma, tma, setmaxnreg = (int(g) for g in found.groups())
    return shared, wgmma, tma, setmaxnreg


def test_the_gluon_pingpong_gemm_compiles_for_sm90() -> None:
    shared, wgmma, tma, setmaxnreg = _cpu_compile("gluon_gemm_gpu.py")
    assert 4 * 32768 + 2 * 32768 <= shared <= 232448     # 4 stages of A+B tiles and two store tiles, within an SM
    assert wgmma > 0 and tma > 0 and setmaxnreg > 0


def test_the_gluon_flash_attention_compiles_for_sm90() -> None:
    """bench/gluon_attention_gpu.py's warp-specialized causal attention forward: Q, K and V rings in shared
    memory within an SM, wgmma for both GEMMs, TMA loads, and the partitions' register moves."""
    shared, wgmma, tma, setmaxnreg = _cpu_compile("gluon_attention_gpu.py")
    assert 32768 + 6 * 32768 <= shared <= 232448         # Q, three K and three V blocks, within an SM
    assert wgmma > 0 and tma > 0 and setmaxnreg > 0
