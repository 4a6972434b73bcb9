"""The GPT-2 LM head's backward as the training step builds it: dh = dlogits @ W followed by a cast to
fp32 (autocast's bf16 product feeding the fp32 residual stream), dlogits [8192, 50257] made in the plan
(padded rows, passes/pad_align.py). In the full step this GEMM ran as cuBLAS's align1 kernel (4.9 ms)
with the note "cuBLAS was faster"; this builds it alone and prints, per GEMM, the backend, the note and
every candidate's timing or failure (FUSEGRAPH_DEBUG=2 shows the tuner's table too), then times the plan.

    PYTHONPATH=src FUSEGRAPH_DEBUG=2 python bench/lm_head_cast_gpu.py
"""

from __future__ import annotations

import os
import sys

import torch

import fusegraph as fg
from fusegraph.tune import bench_ms

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from host_syncs_gpu import emit
from pad_align_gpu import make_inputs


def main() -> None:
    m, k, n = 8192, 768, 50257
    g = fg.Graph(name="lm_head_backward_cast", compute_dtype="float32")
    h = g.tensor((m, k), dtype="bfloat16", name="h")
    w = g.tensor((n, k), dtype="bfloat16", name="w")
    y = g.tensor((m,), dtype="int64", name="y")
    gloss = g.tensor((), dtype="float32", name="gloss")
    logits = g.matmul(h, w, transpose_b=True, name="logits")
    dlogits = g.cross_entropy_backward(gloss, logits, y, reduction="sum", name="dlogits")
    g.cast(g.matmul(dlogits, w, name="dh"), "float32").set_output()
    g.cast(g.matmul(g.transpose(dlogits, 0, 1), h, name="dw"), "float32").set_output()
    plan = g.build()
    inputs = make_inputs(m, k, n, torch.bfloat16, "cuda")
    lines = []
    for kernel in plan.kernels:
        if kernel.kind == "matmul":
            ins = " ".join(f"{list(i.shape)}/{list(i.spec.memory_strides)}" for i in kernel.nodes[0].inputs)
            lines.append(f"{kernel.name} {kernel.backend} {kernel.config} in={ins}\n   note: {kernel.note}\n"
                         f"   tuning: {kernel.tuning}")
    ms = bench_ms(lambda: plan(*inputs))
    lines.append(f"plan: {ms:.3f} ms per call ({len(plan.kernels)} kernels)")
    emit("\n".join(lines), "lm_head_cast.txt")


if __name__ == "__main__":
    main()
