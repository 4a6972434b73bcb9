"""Combo kernels: several independent pointwise kernels in one launch (fusion/horizontal.py).

Each member keeps the flat pointwise body it would have alone (_PointwiseWriter._write_flat: BLOCK
elements a program, row-major), with its own pointer names. Programs are handed out member after
member: member i owns programs [start_i, start_i + cdiv(numel_i, BLOCK)), and its body runs under
`if (pid >= start_i) & (pid < end_i)` with block number pid - start_i. The starts depend on BLOCK, so
the source is written for one BLOCK (COMBO_BLOCK, 4 warps: the pointwise heuristic's pick) and the
kernel has that one config (memory-bound elementwise work: nothing to tune).
"""

from __future__ import annotations

import math
from typing import Any

from ..fusion.horizontal import ComboGroup
from .triton_gen import HEADER, GeneratedKernel, _PointwiseWriter, jit_head

COMBO_BLOCK = 1024
COMBO_WARPS = 4


def write_combo(group: ComboGroup, name: str, block: int = COMBO_BLOCK) -> GeneratedKernel:
    in_names: dict[int, str] = {}
    out_names: list[str] = []
    inputs: list[Any] = []
    outputs: list[Any] = []
    body = ["    pid = tl.program_id(0)"]
    start = 0
    for i, member in enumerate(group.members):
        writer = _PointwiseWriter(member, name)
        for n in member.inputs:
            if n.id not in in_names:
                in_names[n.id] = f"in{len(in_names)}"
                inputs.append(n)
        writer.ptr = {n.id: in_names[n.id] for n in member.inputs}
        writer.out_ptr = {}
        for e in member.stores:
            writer.out_ptr[e.key] = f"out{len(out_names)}"
            out_names.append(writer.out_ptr[e.key])
            outputs.append(e.node)
        shape = tuple(member.domain.shape)
        programs = max(1, -(-math.prod(shape) // block))
        writer._write_flat(tuple(range(len(shape))), pid=f"(pid - {start})")
        body.append(f"    # member {i}: {' '.join(n.op for n in member.nodes) or 'copy'} over {list(shape)}, "
                    f"programs {start}..{start + programs - 1}")
        body.append(f"    if (pid >= {start}) & (pid < {start + programs}):")
        body.extend("    " + line for line in writer.lines)
        start += programs
    params = ", ".join([in_names[n.id] for n in inputs] + out_names + ["BLOCK: tl.constexpr"])
    head = [jit_head(name, params)]
    source = HEADER + "\n".join(head + body) + "\n"
    return GeneratedKernel(name, source, "pointwise", inputs, outputs,
                           extent=sum(math.prod(m.domain.shape) for m in group.members),
                           meta={"combo": start, "config": {"BLOCK": block, "num_warps": COMBO_WARPS}})
