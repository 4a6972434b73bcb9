"""How long fusegraph's partitioner takes on GPT-2-124M's training graphs, on the CPU.

Compiles GPT-2 (12 layers, 128 tokens: the graphs depend on the length only through the split
thresholds of long reductions, fusion/partition.py) through
fg.compile with the reference lowering (no kernels are compiled), runs one forward and backward
under bf16 autocast, and reports the seconds spent grouping nodes into kernels
(fusion.partition._group, with its same-domain merge round, _merge_same_domain, separately), the
kernel counts per graph, and the loss and one gradient norm so that two source trees can be
compared.

    PYTHONPATH=src python bench/partition_time_cpu.py [--layers 12] [--batch 1 --tokens 128]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

import fusegraph as fg
import fusegraph.fusion.partition as partition
from fusegraph.settings import override

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from zoo_models import ensure_torchvision_importable


def timed(spent: dict[str, float], key: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[key] += time.perf_counter() - start
    return wrapper


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=128,
                        help="sequence length (kernel grouping depends on sizes only through split thresholds)")
    args = parser.parse_args()
    ensure_torchvision_importable()
    from transformers import GPT2Config, GPT2LMHeadModel

    spent = {"group": 0.0, "merge_same_domain": 0.0}
    partition._group = timed(spent, "group", partition._group)                      # type: ignore[assignment]
    partition._merge_same_domain = timed(spent, "merge_same_domain",               # type: ignore[assignment]
                                         partition._merge_same_domain)
    torch.manual_seed(0)
    cfg = GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                     n_positions=max(args.tokens, 128), n_layer=args.layers)
    model = GPT2LMHeadModel(cfg)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.tokens))
    start = time.perf_counter()
    with override(use_triton=False):
        compiled = fg.compile(model)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = compiled(ids, labels=ids).loss
        loss.backward()
    total = time.perf_counter() - start
    kernels = [(g.kind, sum(p.kernels for p in g.partitions)) for g in compiled.fusegraph_report.graphs]
    grad = model.transformer.h[0].mlp.c_fc.weight.grad
    print(f"GPT-2 {args.layers} layers: compile + one step {total:.1f} s; grouping {spent['group']:.1f} s "
          f"(same-domain merges {spent['merge_same_domain']:.1f} s); kernels {kernels}; "
          f"loss {loss.item():.6f}, layer-0 c_fc grad norm {float(grad.norm()):.6f}")


if __name__ == "__main__":
    main()
