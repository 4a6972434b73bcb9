"""Programmatic dependent launch (codegen/triton_gen.py PDL_PROLOGUE, runtime/launch.py pdl_enabled): every
generated kernel starts by waiting for the kernel before it (griddepcontrol.wait) when launched with
USE_PDL, and the launchers ask for it only on a Hopper-or-newer GPU, never under the interpreter."""

from __future__ import annotations

from pathlib import Path

import pytest

import fusegraph as fg
from fusegraph.runtime.launch import pdl_enabled, pdl_options
from fusegraph.settings import override
from ptx_helpers import sm90_ptx


def _plan() -> fg.Plan:
    g = fg.Graph(name="pdl", compute_dtype="float32")
    x = g.tensor((64, 32), dtype="float32", name="x")
    w = g.tensor((48, 32), dtype="float32", name="w")
    y = g.relu(g.add(g.exp(x), 1.0))
    z = g.linear(y, w)
    y.set_output()
    z.set_output()
    return g.build(device="cpu")


def test_every_generated_kernel_starts_with_the_pdl_prologue() -> None:
    plan = _plan()
    generated = [k for k in plan.kernels if k.backend == "triton"]
    assert {k.kind for k in generated} >= {"pointwise", "matmul"}
    for k in generated:
        assert "USE_PDL: tl.constexpr = False" in k.source, k.name
        _, _, body = k.source.partition(f"def {k.name}(")
        first = body.split("\n")[1:4]
        assert [line.strip() for line in first] == [
            "if USE_PDL:", "tl.extra.cuda.gdc_wait()", "tl.extra.cuda.gdc_launch_dependents()"], k.name


def test_pdl_is_off_on_cpu_and_under_the_interpreter() -> None:
    assert not pdl_enabled("cpu") and pdl_options("cpu") == ({"USE_PDL": False}, {})
    assert not pdl_enabled("cuda")   # the interpreter (or no GPU) in CI
    with override(pdl=False):
        assert not pdl_enabled("cuda")


@pytest.mark.parametrize("use_pdl", [True, False])
def test_pdl_prologue_compiles_to_griddepcontrol(use_pdl: bool, tmp_path: Path) -> None:
    """The pointwise kernel compiled for sm_90 (no GPU needed): griddepcontrol.wait and
    .launch_dependents with USE_PDL, neither without."""
    kernel = next(k for k in _plan().kernels if k.kind == "pointwise")
    ptx = sm90_ptx(kernel.source, kernel.name, {"BLOCK": 1024, "USE_PDL": use_pdl}, {}, tmp_path)
    assert ("griddepcontrol.wait" in ptx) == use_pdl
    assert ("griddepcontrol.launch_dependents" in ptx) == use_pdl
