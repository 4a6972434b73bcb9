"""Explain on CPU with a given device spec: the table, the HTML file and the PNG."""

from __future__ import annotations

import base64
import re

import pytest

import fusegraph as fg
from fusegraph.perf.devices import get_device
from fusegraph.perf.explain import analyze_plan, explain_plan
from perf_helpers import small_plan

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# small_plan() builds for the CPU, so these reports have no timings on any machine.


@pytest.fixture(scope="module")
def plan_and_inputs():
    return small_plan()


def test_plan_explain_table_on_cpu(plan_and_inputs) -> None:
    plan, _ = plan_and_inputs
    text = plan.explain()
    assert "timings need a GPU" in text
    for k in plan.kernels:
        assert k.name[:28] in text
    assert "total (" in text and "top opportunities" in text
    assert "perf_helpers.py" in text  # the user's source lines of the fused ops


def test_report_rows_follow_the_model(plan_and_inputs) -> None:
    plan, inputs = plan_and_inputs
    spec = get_device("B200")
    report = analyze_plan(plan, spec, inputs=inputs)
    assert report.spec.name == "B200" and not report.measured
    assert [r.name for r in report.rows] == [k.name for k in plan.kernels]
    for row, k in zip(report.rows, plan.kernels, strict=True):
        assert row.floor.bytes == k.cost.bytes and row.floor.flops == k.cost.flops
        assert row.floor.seconds >= k.cost.bytes / spec.bandwidth
        assert row.measured_s is None and row.pct_of_floor is None and row.ops
    text = explain_plan(plan, "B200", inputs=inputs)
    rows = [ln for ln in text.splitlines() if re.match(r"\s*\d+ ", ln) and " - " in ln]
    assert len(rows) >= len(plan.kernels)
    assert "B200" in text.splitlines()[0]


def test_html_report_names_each_kernel_and_embeds_the_roofline(plan_and_inputs, tmp_path) -> None:
    from fusegraph.perf.report import write_html

    plan, inputs = plan_and_inputs
    report = analyze_plan(plan, "H200", inputs=inputs)
    path = write_html(report, tmp_path / "report.html")
    page = path.read_text()
    assert page.startswith("<!DOCTYPE html>") and "<style>" in page
    for k in plan.kernels:
        assert k.name in page
    assert "Timeline" in page and "class=timeline" in page
    encoded = re.search(r"data:image/png;base64,([A-Za-z0-9+/=]+)", page)
    assert encoded and base64.b64decode(encoded.group(1)).startswith(PNG_SIGNATURE)
    assert "http://" not in page and "https://" not in page  # self-contained


def test_roofline_png_is_a_valid_image(plan_and_inputs, tmp_path) -> None:
    from fusegraph.perf.report import write_png

    plan, inputs = plan_and_inputs
    path = write_png(analyze_plan(plan, "A100", inputs=inputs), tmp_path / "roofline.png")
    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE) and len(data) > 10_000
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert width > 400 and height > 300


def test_random_inputs_spread_indices_over_the_dim_they_index() -> None:
    """explain times kernels on random inputs: integers read as indices (directly, or through a
    reshape and a cast) are drawn over the whole dim they index, so an embedding gradient's
    index_put is not timed with every token on two rows; other integers stay in [0, 2)."""
    from fusegraph.perf.explain import index_extents, random_inputs

    g = fg.Graph("indices")
    ids = g.tensor((64,), "int64", "ids")
    rows = g.tensor((8, 8), "int32", "rows")
    flag = g.tensor((64,), "int64", "flag")
    table = g.tensor((5000, 16), "float32", "table")
    grad = g.tensor((64, 16), "float32", "grad")
    g.embedding(ids, table).set_output()
    g.index_put(g.tensor((700, 16), "float32", "acc"), [g.cast(g.reshape(rows, 64), "int64")], grad,
                accumulate=True).set_output()
    g.add(g.cast(flag, "float32"), 1.0).set_output()
    plan = g.build(device="cpu")
    by_name = {n.name: n.id for n in plan.graph.inputs}
    assert index_extents(plan.graph) == {by_name["ids"]: 5000, by_name["rows"]: 700}
    feeds = dict(zip([n.name for n in plan.graph.inputs], random_inputs(plan, "cpu"), strict=True))
    assert int(feeds["ids"].min()) >= 0 and int(feeds["ids"].max()) < 5000 and int(feeds["ids"].max()) > 100
    assert int(feeds["rows"].max()) < 700 and len(feeds["rows"].unique()) > 10
    assert set(feeds["flag"].tolist()) <= {0, 1}
