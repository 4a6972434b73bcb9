"""What a Hugging Face GPT-2 (transformers' SDPA attention) hands to scaled_dot_product_attention under
torch.compile, and what fusegraph's plan makes of it: a small GPT-2 on the CPU, no GPU needed.

Why: in the GPT-2 training step on the H200, torch.compile's row ran the same cuDNN attention kernels as
ours (same names) in 4.4 ms against our 2.4 ms (results/profile_targets_20261203_0210.txt). transformers
passes its causal mask as a [B, 1, S, S] tensor with is_causal=False, so a backend given that call cannot
skip the masked blocks; fusegraph's frontend proves the mask is the causal triangle
(frontends/causal_mask.py) and calls attention with is_causal=True.

    python bench/sdpa_mask_cpu.py       # needs transformers (pip install -e '.[zoo]')
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main() -> int:
    import targets_gpu as T
    from zoo_models import ensure_torchvision_importable

    import fusegraph as fg

    ensure_torchvision_importable()
    T.S.device = "cpu"
    torch.manual_seed(0)
    ids = torch.randint(0, 128, (2, 16))
    calls: list[str] = []

    def recording(gm: torch.fx.GraphModule, inputs: Any) -> Any:
        for node in gm.graph.nodes:
            if "scaled_dot_product_attention" in str(node.target):
                mask = node.kwargs.get("attn_mask", node.args[3] if len(node.args) > 3 else None)
                shape = tuple(mask.meta["example_value"].shape) if isinstance(mask, torch.fx.Node) else mask
                calls.append(f"attn_mask {shape}, is_causal={node.kwargs.get('is_causal', False)}")
        return gm.forward

    torch.compile(T.LMWithLoss(T.gpt2("tiny")), backend=recording)(ids, ids)
    print(f"torch.compile (Dynamo's graph): {len(calls)} SDPA calls; first: {calls[0] if calls else '-'}")
    torch._dynamo.reset()
    compiled = fg.compile(T.LMWithLoss(T.gpt2("tiny")))
    compiled(ids, ids).backward()
    for graph in compiled.fusegraph_report.graphs:
        for part in graph.partitions:
            for k in (part.plan.kernels if part.plan is not None else []):
                if k.kind == "attention":
                    node = k.nodes[0]
                    print(f"fusegraph [{graph.kind}] {k.name}: inputs {[n.name for n in node.inputs]}, "
                          f"is_causal={node.attrs.get('is_causal', False)}")
                    break
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
