"""The measured-report bookkeeping (what a GPU run fills in), with a fake clock on CPU:
% of floor, achieved rates, opportunities, HTML timeline, what-if validation errors."""

from __future__ import annotations

import statistics

import pytest

from fusegraph.perf import explain
from fusegraph.perf.devices import get_device
from fusegraph.perf.timing import Timing
from fusegraph.perf.whatif import project, validate_plan, validation_text
from perf_helpers import small_plan

SPEC = get_device("H200")


@pytest.fixture
def measured_plan(monkeypatch):
    """A CPU plan whose kernels 'measure' at 2x, 3x, 4x ... their floor plus launch."""
    plan, inputs = small_plan()
    floors = {k.name: project([k], SPEC, l2_model=False).kernels[0].floor.seconds for k in plan.kernels}
    timed: list[str] = []

    def fake_device_time(fn, calls=20, repeats=5, graph=True):  # kernels are timed in launch order
        name = plan.kernels[len(timed)].name
        timed.append(name)
        return Timing((1 + len(timed)) * floors[name] * 1e3, "graph-replay", repeats)

    monkeypatch.setattr(explain, "can_measure", lambda plan: True)
    monkeypatch.setattr(explain, "device_time", fake_device_time)
    return plan, inputs, floors


def test_measured_report_fills_every_column(measured_plan) -> None:
    plan, inputs, floors = measured_plan
    report = explain.analyze_plan(plan, SPEC, inputs=inputs)
    assert report.measured and not report.notes
    for i, row in enumerate(report.rows):
        assert row.measured_s == pytest.approx((2 + i) * floors[row.name])
        assert row.pct_of_floor == pytest.approx(100 / (2 + i))
        assert row.achieved_bandwidth == pytest.approx(row.floor.bytes / row.measured_s)
    ranked = report.opportunities(top=len(report.rows))
    gaps = [r.above_floor_s for r in ranked]
    assert gaps == sorted(gaps, reverse=True)
    text = report.to_text()
    assert "%" in text and "above its floor" in text and "timings need a GPU" not in text


def test_measured_html_timeline_uses_measured_time(measured_plan, tmp_path) -> None:
    from fusegraph.perf.report import html_report

    plan, inputs, _ = measured_plan
    page = html_report(explain.analyze_plan(plan, SPEC, inputs=inputs))
    assert "Timeline (measured time)" in page and "% of floor)" in page


def test_validation_reports_error_per_kernel_and_median(measured_plan, monkeypatch) -> None:
    from fusegraph.perf import whatif

    plan, inputs, _ = measured_plan
    monkeypatch.setattr(whatif, "project", lambda kernels, spec, l2_model=True, host_launch=False:
                        project(kernels, spec.scaled(spec.name, launch=0.0), l2_model=l2_model))
    rows = validate_plan(plan, SPEC, inputs, workload="perf_block")
    assert [r.kernel for r in rows] == [k.name for k in plan.kernels]
    for i, r in enumerate(rows):
        assert r.error == pytest.approx(1 / (2 + i) - 1)  # predicted floor vs measured (2+i) x floor
    text = validation_text(rows, SPEC)
    median = statistics.median(abs(r.error) for r in rows)
    assert f"median |error| over {len(rows)} kernels: {median * 100:.1f}%" in text
