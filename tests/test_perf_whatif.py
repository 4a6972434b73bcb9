"""What-if projection: exact model numbers, the L2 rule, sensitivity, assumptions stated."""

from __future__ import annotations

import pytest

from fusegraph.perf.devices import custom_spec, get_device
from fusegraph.perf.whatif import ASSUMPTIONS, l2_resident_reads, project, sensitivity, whatif_text
from perf_helpers import kernel, small_plan, value

MiB = 2**20


def chain(middle_bytes: int = 0):
    """k0: a -> b; [big: unrelated traffic]; k1: b -> c. b is 1 MiB (fp32)."""
    a, b, c = value("a", MiB // 4), value("b", MiB // 4), value("c", MiB // 4)
    ks = [kernel("k0", 2 * MiB, inputs=(a,), outputs=(b,))]
    if middle_bytes:
        ks.append(kernel("big", middle_bytes))
    ks.append(kernel("k1", 2 * MiB, inputs=(b,), outputs=(c,)))
    return ks


def test_projection_is_floor_plus_launch() -> None:
    spec = custom_spec(bandwidth="1TB/s", bf16="1PF", launch_us="2us", l2="1KB")
    proj = project([kernel("copy", 10**9)], spec)
    assert proj.total_s == pytest.approx(1e9 / 1e12 + 2e-6)
    host = project([kernel("copy", 10**9)], spec, host_launch=True)
    assert host.total_s == pytest.approx(1e-3 + spec.host_launch_us * 1e-6)


def test_intermediate_read_from_l2_when_it_fits() -> None:
    assert l2_resident_reads(chain(), 50 * MiB) == [0, MiB]
    assert l2_resident_reads(chain(), MiB // 2) == [0, 0]  # b alone does not fit
    assert l2_resident_reads(chain(60 * MiB), 50 * MiB) == [0, 0, 0]  # evicted by the traffic between
    assert l2_resident_reads(chain(60 * MiB), 100 * MiB) == [0, 0, MiB]
    proj = project(chain(), get_device("H200"))
    assert [k.hbm_bytes for k in proj.kernels] == [2 * MiB, MiB]


def test_sensitivity_moves_the_right_terms() -> None:
    spec = custom_spec(bandwidth="1TB/s", bf16="1PF", launch_us="1us", l2="50MB")
    mem = [kernel("mem", 10**9)]
    table = dict(sensitivity(mem, spec))
    assert table["base"] == pytest.approx(1e-3 + 1e-6)
    assert table["2x memory bandwidth"] == pytest.approx(0.5e-3 + 1e-6)
    assert table["2x tensor-core rate"] == pytest.approx(table["base"])
    assert table["zero launch overhead"] == pytest.approx(1e-3)
    gemm = [kernel("gemm", 10**6, 10**15, kind="matmul", inputs=(value("x", 8, "bfloat16"),))]
    assert dict(sensitivity(gemm, spec))["2x tensor-core rate"] == pytest.approx(0.5 + 1e-6)
    l2 = dict(sensitivity(chain(60 * 10**6), spec))
    assert l2["2x L2 capacity"] < l2["base"]


def test_whatif_text_on_a_real_plan_states_assumptions() -> None:
    plan, _ = small_plan()
    text = whatif_text(plan.kernels, get_device("B200"), get_device("H200"), title="perf_block")
    for k in plan.kernels:
        assert k.name[:30] in text
    assert "sensitivity on B200" in text and "2x L2 capacity" in text and "zero launch overhead" in text
    assert "assumptions:" in text and all(a[:40] in text for a in ASSUMPTIONS)
    assert "H200 ms" in text and "speedup" in text
