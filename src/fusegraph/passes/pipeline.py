"""The optimization pipeline, in order. Read top to bottom.

`decompose` is not here: the fusion lowering calls it (it decides which composites to keep). Nor are
the passes that need build options, which compiler.front_end runs after this list, in this order:
the layout pass (passes/layout.py), pad_gemm_dims (passes/pad_dims.py: outputs the caller takes
padded) and pad_outputs (passes/pad_align.py).
The list runs repeatedly until a round changes nothing (at most MAX_ROUNDS rounds): simplifying
can expose constants to fold, folding can expose identities (x * (2 - 1)), and merging
duplicates can expose both.
"""

from __future__ import annotations

from ..ir.graph import Graph
from ..settings import settings
from .attention_match import attention_match, gqa_match
from .base import Pass
from .cse import cse
from .dce import dce
from .fold import fold
from .layout import fold_batchnorm
from .pad_align import pad_align
from .simplify import simplify

PIPELINE: list[Pass] = [
    simplify,   # algebraic identities, cast/layout chains (may leave dead nodes behind)
    attention_match,  # matmul -> scale -> (mask) -> softmax -> matmul becomes one attention op
    gqa_match,  # k/v repeated per query group (repeat_kv) feed attention as their kv heads (enable_gqa)
    fold_batchnorm,   # inference batchnorm with constant parameters folded into conv weights
    fold,       # evaluate what is known at build time
    cse,        # merge structurally equal nodes
    dce,        # drop what no output needs
    pad_align,  # misaligned GEMM operands/results get padded row strides (16/128-byte aligned)
]

MAX_ROUNDS = 4


def optimize(graph: Graph, passes: list[Pass] | None = None, max_rounds: int = MAX_ROUNDS) -> Graph:
    """Run `passes` (default PIPELINE) in order, repeating until a fixed point or `max_rounds`."""
    for _ in range(max(max_rounds, 1)):
        before = tuple(n.id for n in graph.nodes), tuple(n.id for n in graph.outputs)
        for p in passes if passes is not None else PIPELINE:
            graph = p(graph)
            if settings.debug >= 4:
                print(f"--- after {p.name} ---\n{graph}")
        if (tuple(n.id for n in graph.nodes), tuple(n.id for n in graph.outputs)) == before:
            break
    return graph
