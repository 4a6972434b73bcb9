"""The explain report as pictures: a roofline PNG (matplotlib, Agg) and a self-contained HTML page
(inline CSS, the roofline embedded as base64, a per-kernel table and a timeline)."""

from __future__ import annotations

import base64
import html
import io
from pathlib import Path
from typing import Any

from ..errors import UnsupportedError
from .explain import KernelRow, PlanReport, fmt_count, fmt_ms

MIN_INTENSITY = 1e-2   # kernels with no FLOPs are drawn at this intensity (log axis)


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise UnsupportedError("the roofline plot needs matplotlib: pip install 'fusegraph[report]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def roofline_png_bytes(report: PlanReport) -> bytes:
    """The roofline: attainable FLOP/s vs arithmetic intensity, one point per kernel (measured
    where timings exist, else at its floor, drawn hollow)."""
    plt = _pyplot()
    spec = report.spec
    fig, ax = plt.subplots(figsize=(8, 5.5), dpi=110)
    intensities = [max(r.floor.intensity, MIN_INTENSITY) for r in report.rows if r.floor.bytes] or [1.0]
    lo = min(min(intensities) / 4, 0.1)
    hi = max(max(intensities) * 4, 4 * max(spec.peak.values()) / spec.bandwidth)
    xs = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    ax.plot(xs, [spec.bandwidth * x for x in xs], color="#555", lw=1, ls="--")
    colors = {"fp32": "#1f77b4", "tf32": "#2ca02c", "bf16": "#d62728", "fp16": "#ff7f0e", "fp8": "#9467bd",
              "int8": "#8c564b"}
    for key in ("fp32", "tf32", "bf16", "fp8"):
        if spec.has_rate(key):
            peak = spec.rate(key)
            ax.plot(xs, [min(spec.bandwidth * x, peak) for x in xs], color=colors[key], lw=1.6,
                    label=f"{key} roof {peak / 1e12:.0f} TF/s")
    for r in report.rows:
        x = max(r.floor.intensity, MIN_INTENSITY) if r.floor.bytes else hi / 4
        # at the floor a kernel sits on its roof; a measured one sits below it by its % of floor.
        # Kernels without FLOPs are drawn at MIN_INTENSITY on the memory roof, scaled the same way.
        y_floor = r.floor.flops / r.floor.seconds if r.floor.flops and r.floor.seconds else spec.bandwidth * x
        color = colors.get(r.floor.rate_key, "#333")
        if r.measured_s:
            y = y_floor * r.floor.seconds / r.measured_s
            ax.scatter([x], [y], color=color, zorder=3, s=28)
        else:
            y = y_floor
            ax.scatter([x], [y], facecolors="none", edgecolors=color, zorder=3, s=28)
        ax.annotate(r.name[:24], (x, y), fontsize=7, xytext=(4, 3), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(f"arithmetic intensity (FLOP / byte of min traffic; no-FLOP kernels at {MIN_INTENSITY})")
    ax.set_ylabel("FLOP/s")
    what = "measured" if report.measured else "at floor (no timings: hollow)"
    ax.set_title(f"{report.title} on {spec.name}: kernels {what}; memory roof {spec.bandwidth / 1e12:.2f} TB/s",
                 fontsize=9)
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def write_png(report: PlanReport, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(roofline_png_bytes(report))
    return path


_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px;color:#222;max-width:1200px}
h1{font-size:20px}h2{font-size:16px;margin-top:28px}
table{border-collapse:collapse;font-size:12px;width:100%}
th,td{border-bottom:1px solid #ddd;padding:4px 6px;text-align:right;vertical-align:top}
th{background:#f4f4f4}td.l,th.l{text-align:left}
.bound-memory{color:#1f5fa8}.bound-compute{color:#b22}.bound-latency{color:#a60}
.timeline{display:flex;height:28px;border:1px solid #ccc;margin:8px 0}
.timeline div{overflow:hidden;white-space:nowrap;font-size:10px;color:#fff;padding:2px;border-right:1px solid #fff}
.k-memory{background:#3b7dd8}.k-compute{background:#d84b3b}.k-latency{background:#d8a03b}
.note{color:#666;font-size:12px}code{font-size:11px}
"""


def _esc(value: Any) -> str:
    return html.escape(str(value))


def html_report(report: PlanReport, include_png: bool = True) -> str:
    spec = report.spec
    rows_html = []
    for r in report.rows:
        pct = "-" if r.pct_of_floor is None else f"{r.pct_of_floor:.0f}%"
        gbs = "-" if r.achieved_bandwidth is None else f"{r.achieved_bandwidth / 1e9:.0f}"
        tfs = "-" if r.achieved_flops is None else f"{r.achieved_flops / 1e12:.2f}"
        rows_html.append(
            f"<tr><td>{r.index}</td><td class=l><b>{_esc(r.name)}</b></td><td class=l>{_esc(r.kind)}</td>"
            f"<td class=l>{_esc(r.backend)}</td><td>{fmt_ms(r.measured_s)}</td><td>{fmt_ms(r.floor.seconds)}</td>"
            f"<td>{fmt_count(r.floor.bytes)}</td><td>{fmt_count(r.floor.flops)}</td><td>{gbs}</td><td>{tfs}</td>"
            f"<td>{pct}</td><td class='l bound-{r.bound}'>{r.bound}</td>"
            f"<td class=l><code>{_ops_html(r.ops)}</code></td></tr>")
    total = report.total_measured_s if report.measured else report.total_floor_s
    segments = []
    for r in report.rows:
        t = r.measured_s if report.measured and r.measured_s is not None else r.floor.seconds
        share = 100.0 * t / total if total else 100.0 / max(len(report.rows), 1)
        segments.append(f"<div class=k-{r.bound} style='width:{max(share, 0.3):.2f}%' "
                        f"title='{_esc(r.name)}: {t * 1e3:.4f} ms ({r.bound})'>{_esc(r.name)}</div>")
    timeline_what = "measured time" if report.measured else "floor (no timings on this machine)"
    img = ""
    if include_png:
        data = base64.b64encode(roofline_png_bytes(report)).decode("ascii")
        img = f"<img alt='roofline' src='data:image/png;base64,{data}' style='max-width:100%'>"
    opp = "".join(f"<li><b>{_esc(r.name)}</b>: {_esc(r.bound)}-bound, {_gap_text(r)}"
                  f"{' (' + _esc(', '.join(r.lines[:3])) + ')' if r.lines else ''}</li>"
                  for r in report.opportunities())
    notes = "".join(f"<p class=note>{_esc(n)}</p>" for n in report.notes)
    total_line = (f"{len(report.rows)} kernels; floor {report.total_floor_s * 1e3:.4f} ms"
                  + (f"; measured {report.total_measured_s * 1e3:.4f} ms "  # type: ignore[operator]
                     f"({100 * report.total_floor_s / report.total_measured_s:.0f}% of floor)"  # type: ignore[operator]
                     if report.measured and report.total_measured_s else "; measured: - (timings need a GPU)"))
    return f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>fusegraph explain: {_esc(report.title)}</title>
<style>{_CSS}</style></head><body>
<h1>fusegraph explain: {_esc(report.title)}</h1>
<p>Device model: <b>{_esc(spec.name)}</b> ({'measured ceilings' if spec.measured else 'datasheet ceilings'}):
{_esc(spec.summary())}<br><span class=note>Source: {_esc(spec.source)}</span></p>
{notes}
<p>{_esc(total_line)}</p>
<h2>Kernels</h2>
<table><tr><th>#</th><th class=l>kernel</th><th class=l>kind</th><th class=l>backend</th><th>time ms</th>
<th>floor ms</th><th>min bytes</th><th>FLOPs</th><th>GB/s</th><th>TFLOP/s</th><th>% floor</th><th class=l>bound</th>
<th class=l>ops fused (user line)</th></tr>
{''.join(rows_html)}
</table>
<h2>Timeline ({timeline_what})</h2>
<div class=timeline>{''.join(segments)}</div>
<p class=note>Blue: memory-bound, red: compute-bound, amber: launch/latency-bound. Widths are shares of the total.</p>
<h2>Roofline</h2>
{img}
<h2>Top opportunities</h2>
<ol>{opp}</ol>
<p class=note>Floor = max(min bytes / bandwidth, tensor-core FLOPs / tensor peak + other FLOPs / fp32 peak);
kernels whose floor is under a few microseconds are launch/latency-bound.</p>
</body></html>
"""


def _ops_html(groups: list[str], limit: int = 8) -> str:
    return "<br>".join(_esc(g) for g in groups[:limit]) + (" ..." if len(groups) > limit else "")


def _gap_text(r: KernelRow) -> str:
    if r.measured_s is not None:
        return f"{(r.above_floor_s or 0) * 1e3:.4f} ms above floor"
    return f"floor {r.floor.seconds * 1e3:.4f} ms"


def write_html(report: PlanReport, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(html_report(report))
    return path
