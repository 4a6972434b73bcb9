"""The explain report: per kernel, how far it is from the hardware's limit and why.

`explain_plan(plan)` (what `plan.explain()` prints) gives, per kernel: measured time (GPU only),
min bytes, FLOPs, achieved bandwidth and FLOP/s, % of floor, the bound, the backend, and the ops
it fused with the user's source lines; then totals and the top opportunities.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..ir import dtypes
from .devices import DeviceSpec
from .roofline import Floor, classify_measured, kernel_floor, ops_with_sources, user_lines
from .timing import device_time


@dataclass
class KernelRow:
    index: int
    name: str
    kind: str
    backend: str
    floor: Floor
    measured_s: float | None
    ops: list[str]
    lines: list[str]
    timing_method: str = ""

    @property
    def bound(self) -> str:
        return classify_measured(self.floor, self.measured_s)

    @property
    def pct_of_floor(self) -> float | None:
        if self.measured_s is None or self.measured_s <= 0:
            return None
        return 100.0 * self.floor.seconds / self.measured_s

    @property
    def achieved_bandwidth(self) -> float | None:
        return self.floor.bytes / self.measured_s if self.measured_s else None

    @property
    def achieved_flops(self) -> float | None:
        return self.floor.flops / self.measured_s if self.measured_s else None

    @property
    def above_floor_s(self) -> float | None:
        return None if self.measured_s is None else max(self.measured_s - self.floor.seconds, 0.0)


@dataclass
class PlanReport:
    title: str
    spec: DeviceSpec
    rows: list[KernelRow]
    measured: bool
    note: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def total_floor_s(self) -> float:
        return sum(r.floor.seconds for r in self.rows)

    @property
    def total_measured_s(self) -> float | None:
        return sum(r.measured_s or 0.0 for r in self.rows) if self.measured else None

    def opportunities(self, top: int = 3) -> list[KernelRow]:
        """Kernels with the most time above their floor (without timings: the largest floors, and
        launch/latency-bound kernels, which are fusion candidates)."""
        if self.measured:
            ranked = sorted(self.rows, key=lambda r: r.above_floor_s or 0.0, reverse=True)
        else:
            ranked = sorted(self.rows, key=lambda r: (r.bound == "latency", r.floor.seconds), reverse=True)
        return ranked[:top]

    def to_text(self) -> str:
        return format_report(self)


# ---- measuring ----

def random_inputs(plan: Any, device: str) -> list[torch.Tensor]:
    """Fresh random tensors for the plan's inputs: floats ~N(0,1), bools, integers uniform over the
    dim they index where the plan reads them as indices (`index_extents`: token ids spread over an
    embedding as real ones do, not piled onto two rows), else in [0, 2)."""
    out = []
    extents = index_extents(plan.graph)
    for node in plan.graph.inputs:
        dtype = dtypes.to_torch(node.dtype)
        if dtype.is_floating_point:
            out.append(torch.randn(node.shape, device=device).to(dtype))
        elif dtype == torch.bool:
            out.append(torch.rand(node.shape, device=device) > 0.5)
        else:
            out.append(torch.randint(0, max(1, extents.get(node.id, 2)), node.shape, device=device, dtype=dtype))
    return out


INDEX_OPS = ("gather", "index_select", "index_copy", "scatter_add")   # (x, index, ...) with attrs["dim"]


def index_extents(graph: Any) -> dict[int, int]:
    """Graph inputs (by node id) that ops read as indices, through views and casts: the size of the
    dim they index, the smallest over their uses."""
    from ..ir.registry import VIEW, get_op

    inputs = {n.id for n in graph.inputs}

    def source(node: Any) -> Any:
        while node.id not in inputs and node.inputs and (node.op == "cast" or VIEW in get_op(node.op).props):
            node = node.inputs[0]
        return node if node.id in inputs else None

    out: dict[int, int] = {}
    for node in graph.nodes:
        ins, pairs = node.inputs, []
        if node.op == "embedding":
            pairs = [(ins[0], ins[1].shape[0])]
        elif node.op in INDEX_OPS:
            pairs = [(ins[1], ins[0].shape[int(node.attrs["dim"]) % len(ins[0].shape)])]
        elif node.op == "index_put":
            pairs = [(index, ins[0].shape[d]) for index, d in zip(ins[2:], node.attrs["index_dims"], strict=False)]
        for index, extent in pairs:
            src = source(index)
            if src is not None:
                out[src.id] = min(extent, out.get(src.id, extent))
    return out


def positional_inputs(plan: Any, inputs: Any) -> list[torch.Tensor]:
    """Inputs as a list in the graph's input order; accepts a list/tuple or a feed dict
    (keys: handles, input nodes or input names)."""
    if isinstance(inputs, Mapping):
        order = {n.id: k for k, n in enumerate(plan.graph.inputs)}
        names = {n.name: k for k, n in enumerate(plan.graph.inputs)}
        out: list[Any] = [None] * len(order)
        for key, value in inputs.items():
            node = getattr(key, "node", key)
            k = order.get(getattr(node, "id", -1), names.get(str(key)))
            if k is not None:
                out[k] = value
        return out
    return list(inputs)


def kernel_arguments(plan: Any, inputs: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Run the plan kernel by kernel, keeping each kernel's real input tensors."""
    env: dict[int, Any] = {n.id: t for n, t in zip(plan.graph.inputs, inputs, strict=True)}
    args_per_kernel = []
    for kernel in plan.kernels:
        args = [env[n.id] for n in kernel.inputs]
        args_per_kernel.append(args)
        for node, value in zip(kernel.outputs, kernel.launch(args), strict=True):
            env[node.id] = value
    return args_per_kernel


def measure_kernels(plan: Any, inputs: Sequence[torch.Tensor] | None = None) -> list[tuple[float, str]]:
    """(seconds, method) per kernel: each kernel launched on its real inputs, graph replay of 20
    launches (back-to-back when not capturable), median of 5."""
    device = str(getattr(plan, "device", "cuda"))
    if inputs is None:
        inputs = random_inputs(plan, device)
    inputs = [t.to(device) if isinstance(t, torch.Tensor) and t.device.type != torch.device(device).type else t
              for t in inputs]
    all_args = kernel_arguments(plan, inputs)
    results = []
    for kernel, args in zip(plan.kernels, all_args, strict=True):
        t = device_time(functools.partial(kernel.launch, args), calls=20, repeats=5)
        results.append((t.ms * 1e-3, t.method))
    return results


def can_measure(plan: Any) -> bool:
    return torch.cuda.is_available() and str(getattr(plan, "device", "cuda")).startswith("cuda")


def analyze_plan(plan: Any, device_spec: DeviceSpec | str | None = None, measure: bool = True,
                 inputs: Any = None, title: str | None = None) -> PlanReport:
    """The report's data: floors from the cost model on `device_spec` (default: the present GPU,
    calibrated, else the H200 datasheet) and, on a GPU, measured times."""
    from .calibrate import effective_spec

    spec = effective_spec(device_spec)
    timings: list[tuple[float, str]] | None = None
    notes = []
    if measure and can_measure(plan):
        feeds = positional_inputs(plan, inputs) if inputs is not None else None
        timings = measure_kernels(plan, feeds)
    elif measure:
        notes.append("timings need a GPU: this plan runs on " + str(getattr(plan, "device", "cpu")) +
                     ("" if torch.cuda.is_available() else " and no GPU is present") +
                     "; columns that need them show '-'")
    rows = []
    for k, kernel in enumerate(plan.kernels):
        measured, method = (timings[k] if timings else (None, ""))
        rows.append(KernelRow(k, kernel.name, kernel.kind, kernel.backend, kernel_floor(kernel, spec), measured,
                              ops_with_sources(kernel), user_lines(kernel), method))
    from ..tune.autotuner import build_time_note
    if (build := build_time_note(plan.kernels)) is not None:
        notes.append(build)
    if (profile := getattr(plan, "build_profile", None)) is not None:   # FUSEGRAPH_PROFILE_BUILD=1
        notes.append(profile.report())
    name = str(title or getattr(getattr(plan, "graph", None), "name", "plan"))
    return PlanReport(name, spec, rows, timings is not None, notes=notes)


def explain_plan(plan: Any, device_spec: DeviceSpec | str | None = None, measure: bool = True,
                 inputs: Any = None) -> str:
    """The explain report as text (what `plan.explain()` returns)."""
    return analyze_plan(plan, device_spec, measure, inputs).to_text()


# ---- formatting ----

def fmt_ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.4f}"


def fmt_count(n: float) -> str:
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


def _opt(value: float | None, scale: float, digits: int = 1) -> str:
    return "-" if value is None else f"{value / scale:.{digits}f}"


def format_report(report: PlanReport) -> str:
    spec = report.spec
    lines = [f"explain: {report.title} on {spec.name} "
             f"({'measured ceilings' if spec.measured else 'datasheet ceilings'}: {spec.summary()})"]
    lines += [f"note: {n}" for n in report.notes]
    head = (f"{'#':>2} {'kernel':<28} {'kind/backend':<20} {'time ms':>9} {'floor ms':>9} {'min bytes':>9} "
            f"{'FLOPs':>8} {'GB/s':>7} {'TFLOP/s':>8} {'%floor':>6}  bound")
    lines += [head, "-" * len(head)]
    for r in report.rows:
        pct = "-" if r.pct_of_floor is None else f"{r.pct_of_floor:.0f}%"
        lines.append(f"{r.index:>2} {r.name[:28]:<28} {(r.kind + '/' + r.backend)[:20]:<20} "
                     f"{fmt_ms(r.measured_s):>9} {fmt_ms(r.floor.seconds):>9} {fmt_count(r.floor.bytes):>9} "
                     f"{fmt_count(r.floor.flops):>8} {_opt(r.achieved_bandwidth, 1e9, 0):>7} "
                     f"{_opt(r.achieved_flops, 1e12, 2):>8} {pct:>6}  {r.bound}")
    lines.append("-" * len(head))
    total_m = report.total_measured_s
    pct_total = "-" if not total_m else f"{100 * report.total_floor_s / total_m:.0f}%"
    total_bytes = sum(r.floor.bytes for r in report.rows)
    total_flops = sum(r.floor.flops for r in report.rows)
    lines.append(f"   {'total (' + str(len(report.rows)) + ' kernels)':<49} {fmt_ms(total_m):>9} "
                 f"{fmt_ms(report.total_floor_s):>9} {fmt_count(total_bytes):>9} {fmt_count(total_flops):>8} "
                 f"{'':>7} {'':>8} {pct_total:>6}")
    lines.append(f"launch overhead if launched one by one from Python: ~{len(report.rows) * spec.host_launch_us:.0f}"
                 f" us; inside one CUDA graph: ~{len(report.rows) * spec.launch_us:.1f} us")
    lines.append("")
    lines.append("ops fused per kernel, by the user's source line:")
    for r in report.rows:
        lines.append(f"{r.index:>2} {r.name} [{r.backend}]:")
        lines += [f"     {group}" for group in r.ops]
    lines.append("")
    how = "most time above floor" if report.measured else "no timings: largest floors and launch-bound kernels"
    lines.append(f"top opportunities ({how}):")
    for r in report.opportunities():
        lines.append("  " + _advice(r))
    return "\n".join(lines)


def _advice(r: KernelRow) -> str:
    where = f" from {', '.join(r.lines[:2])}" if r.lines else ""
    if r.measured_s is not None:
        gap = f"{(r.above_floor_s or 0) * 1e3:.4f} ms above its floor ({r.pct_of_floor or 0:.0f}% of floor)"
    else:
        gap = f"floor {r.floor.seconds * 1e3:.4f} ms"
    if r.bound == "latency":
        why = "launch/latency-bound: fuse it with its neighbours or capture the plan in a CUDA graph"
    elif r.bound == "memory":
        why = "memory-bound: fewer bytes (fusion, lower precision) or closer to copy bandwidth"
    else:
        why = "compute-bound: tensor-core utilization (tile shapes, fp8) decides"
    return f"{r.name}{where}: {gap}; {why}"
