"""What-if: project a plan's kernel list onto another device with the same cost model, and ask how
the total moves when one physical limit changes.

Model, per kernel: time = max(HBM bytes / bandwidth, tensor FLOPs / tensor peak + other FLOPs /
fp32 peak) + launch overhead. HBM bytes are the kernel's min bytes, less the reads of
intermediates that are still in L2: a value written by an earlier kernel is read from L2 when it,
plus every byte the kernels in between touched, fits in L2. Writes are always charged (a
write-back cache still evicts dirty lines to HBM).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .devices import DeviceSpec
from .roofline import Floor, kernel_floor

ASSUMPTIONS = (
    "per kernel: time = max(HBM bytes / bandwidth, tensor-core FLOPs / tensor peak + other FLOPs / fp32 peak)"
    " + launch overhead",
    "HBM bytes = min bytes (each input read once, each output written once), less reads of intermediates "
    "still resident in L2 (written by an earlier kernel, and they plus everything touched since fit in L2); "
    "writes are always charged",
    "launch overhead = the per-kernel gap of a CUDA-graph replay (use --host-launch for kernels launched one "
    "by one from Python)",
    "kernels run one after another (no overlap); peak rates are reached at any size (no tile/wave "
    "quantization), so small kernels are optimistic beyond the launch term",
    "'2x tensor-core rate' doubles tf32/bf16/fp16/fp8/int8 peaks, not the fp32 CUDA-core rate",
)


@dataclass(frozen=True)
class KernelProjection:
    name: str
    hbm_bytes: int
    l2_bytes_saved: int
    floor: Floor
    launch_s: float

    @property
    def seconds(self) -> float:
        return self.floor.seconds + self.launch_s


@dataclass(frozen=True)
class Projection:
    spec: DeviceSpec
    kernels: list[KernelProjection]

    @property
    def total_s(self) -> float:
        return sum(k.seconds for k in self.kernels)


def _nbytes(node: Any) -> int:
    return sum(s.nbytes for s in node.specs)


def l2_resident_reads(kernels: Sequence[Any], l2_bytes: int) -> list[int]:
    """Per kernel, the bytes of its inputs served from L2 (see the module docstring)."""
    producer: dict[int, int] = {}
    for i, kernel in enumerate(kernels):
        for node in kernel.outputs:
            producer[node.id] = i
    saved = []
    for i, kernel in enumerate(kernels):
        total = 0
        for node in kernel.inputs:
            p = producer.get(node.id)
            if p is None or p >= i:
                continue
            between = sum(int(k.cost.bytes) for k in kernels[p + 1:i])
            if _nbytes(node) + between <= l2_bytes:
                total += _nbytes(node)
        saved.append(min(total, int(kernel.cost.bytes)))
    return saved


def project(kernels: Sequence[Any], spec: DeviceSpec, l2_model: bool = True, host_launch: bool = False) -> Projection:
    """The kernel list's projected times on `spec`."""
    saved = l2_resident_reads(kernels, spec.l2_bytes) if l2_model else [0] * len(kernels)
    launch_s = (spec.host_launch_us if host_launch else spec.launch_us) * 1e-6
    out = []
    for kernel, s in zip(kernels, saved, strict=True):
        hbm = int(kernel.cost.bytes) - s
        out.append(KernelProjection(kernel.name, hbm, s, kernel_floor(kernel, spec, nbytes=hbm), launch_s))
    return Projection(spec, out)


def sensitivity(kernels: Sequence[Any], spec: DeviceSpec, host_launch: bool = False) -> list[tuple[str, float]]:
    """(label, total seconds) for the base spec and one limit changed at a time."""
    cases = [
        ("base", spec),
        ("2x memory bandwidth", spec.scaled(spec.name + " 2x bw", bandwidth=2.0)),
        ("2x tensor-core rate", spec.scaled(spec.name + " 2x tc", tensor=2.0)),
        ("2x L2 capacity", spec.scaled(spec.name + " 2x L2", l2=2.0)),
        ("zero launch overhead", spec.scaled(spec.name + " no launch", launch=0.0)),
        ("all of the above", spec.scaled(spec.name + " all", bandwidth=2.0, tensor=2.0, l2=2.0, launch=0.0)),
    ]
    return [(label, project(kernels, s, host_launch=host_launch).total_s) for label, s in cases]


def whatif_text(kernels: Sequence[Any], spec: DeviceSpec, reference: DeviceSpec | None = None,
                title: str = "plan", host_launch: bool = False) -> str:
    """The projection on `spec` (beside `reference`, e.g. the present GPU), the sensitivity table and
    the assumptions, as text."""
    proj = project(kernels, spec, host_launch=host_launch)
    ref = project(kernels, reference, host_launch=host_launch) if reference else None
    lines = [f"what-if: {title} projected onto {spec.name} "
             f"({'measured' if spec.measured else 'datasheet'}: {spec.summary()})"]
    if ref and reference:
        lines.append(f"reference device: {reference.name} ({'measured' if reference.measured else 'datasheet'})")
    head = (f"{'#':>2} {'kernel':<30} {'HBM bytes':>10} {'L2 saved':>9} {'FLOPs':>9} {spec.name[:10] + ' ms':>13} "
            f"{'bound':>8}" + (f" {reference.name[:10] + ' ms':>13} {'speedup':>8}" if ref and reference else ""))
    lines += [head, "-" * len(head)]
    for i, k in enumerate(proj.kernels):
        row = (f"{i:>2} {k.name[:30]:<30} {k.hbm_bytes:>10,} {k.l2_bytes_saved:>9,} {k.floor.flops:>9.3g} "
               f"{k.seconds * 1e3:>13.4f} {k.floor.bound:>8}")
        if ref:
            r = ref.kernels[i]
            row += f" {r.seconds * 1e3:>13.4f} {r.seconds / k.seconds if k.seconds else 0:>7.2f}x"
        lines.append(row)
    lines.append("-" * len(head))
    label = f"total ({len(proj.kernels)} kernels)"
    total = f"   {label:<30} {'':>10} {'':>9} {'':>9} {proj.total_s * 1e3:>13.4f}"
    if ref:
        total += f" {'':>8} {ref.total_s * 1e3:>13.4f} {ref.total_s / proj.total_s if proj.total_s else 0:>7.2f}x"
    lines += [total, "", f"sensitivity on {spec.name} (total ms, change vs base):"]
    base = None
    for label, seconds in sensitivity(kernels, spec, host_launch=host_launch):
        base = seconds if base is None else base
        change = (seconds / base - 1) * 100 if base else 0.0
        lines.append(f"  {label:<24} {seconds * 1e3:>11.4f} ms  {change:+6.1f}%")
    lines += ["", "assumptions:"] + [f"  - {a}" for a in ASSUMPTIONS]
    return "\n".join(lines)


# ---- validation: predicted vs measured on the present GPU ----

@dataclass(frozen=True)
class ValidationRow:
    workload: str
    kernel: str
    predicted_s: float
    measured_s: float
    method: str

    @property
    def error(self) -> float:
        """Signed relative error of the prediction: (predicted - measured) / measured."""
        return (self.predicted_s - self.measured_s) / self.measured_s


def validate_plan(plan: Any, spec: DeviceSpec, inputs: Any = None, workload: str = "") -> list[ValidationRow]:
    """Predict each kernel on `spec` (in isolation: its inputs were just written by the previous launch of
    the same kernel, so no L2 credit) and measure it on the present GPU."""
    from .explain import measure_kernels, positional_inputs

    feeds = positional_inputs(plan, inputs) if inputs is not None else None
    measured = measure_kernels(plan, feeds)
    proj = project(plan.kernels, spec, l2_model=False)
    return [ValidationRow(workload or plan.graph.name, k.name, p.seconds, m, method)
            for k, p, (m, method) in zip(plan.kernels, proj.kernels, measured, strict=True)]


def validation_text(rows: Sequence[ValidationRow], spec: DeviceSpec) -> str:
    lines = [f"what-if validation on {spec.name} ({'measured' if spec.measured else 'datasheet'} ceilings): "
             "predicted vs measured per kernel",
             f"{'workload':<18} {'kernel':<30} {'predicted ms':>12} {'measured ms':>12} {'error':>8}  timing"]
    for r in rows:
        lines.append(f"{r.workload[:18]:<18} {r.kernel[:30]:<30} {r.predicted_s * 1e3:>12.4f} "
                     f"{r.measured_s * 1e3:>12.4f} {r.error * 100:>+7.1f}%  {r.method}")
    if rows:
        med = statistics.median(abs(r.error) for r in rows)
        lines.append(f"median |error| over {len(rows)} kernels: {med * 100:.1f}%")
    return "\n".join(lines)
