"""Per-kernel explain report (minimal: cost-model columns; timing columns come with perf tooling)."""

from __future__ import annotations

from typing import Any


def explain_plan(plan: Any) -> str:
    lines = [f"{'kernel':<32} {'kind':<10} {'backend':<10} {'bytes':>14} {'FLOPs':>14}  ops"]
    for k in plan.kernels:
        lines.append(f"{k.name[:32]:<32} {k.kind:<10} {k.backend:<10} {k.cost.bytes:>14,} "
                     f"{k.cost.flops:>14,}  {'+'.join(k.ops[:6])}")
    return "\n".join(lines)
