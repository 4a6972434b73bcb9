"""Print the generated source, launch config and operand layouts of the plan kernels whose names
contain any of the given substrings, for the GPT-2-124M training step (bench/targets_gpu.py's
model, autocast bf16) compiled with fusegraph on this device. A diagnosis aid:

    PYTHONPATH=src python bench/dump_kernels_gpu.py mul_pow_add_tanh mul_sub_pow_add iota_reshape_ne
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="+", help="substrings of kernel names (fg_k{k}_ prefixes ignored)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--size", default="full", help="full (124M) or tiny (CPU)")
    args = parser.parse_args()
    import targets_gpu as T
    from zoo_models import ensure_torchvision_importable

    import fusegraph as fg

    ensure_torchvision_importable()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    T.S.device = device
    model = T.LMWithLoss(T.gpt2(args.size)).to(device)
    vocab = 50257 if args.size == "full" else 128
    seq = 1024 if args.size == "full" else 16
    ids = torch.randint(0, vocab, (args.batch, seq), device=device)
    step = T.TrainStep(model, fg.compile(model), ids, ids.clone(), torch.bfloat16 if device == "cuda" else None)
    step()
    seen: set[str] = set()
    for graph in step.fusegraph_report.graphs:
        for part in graph.partitions:
            for k in (part.plan.kernels if part.plan is not None else []):
                short = k.name.split("_", 2)[-1]
                if not any(n in k.name for n in args.names) or (short, k.source) in {(s, "") for s in seen}:
                    continue
                if short in seen:
                    continue
                seen.add(short)
                print(f"===== [{graph.kind}] {k.name} {k.kind}/{k.backend} config {k.config} tuning {k.tuning}")
                for label, nodes in (("in", k.inputs), ("out", k.outputs)):
                    for n in nodes:
                        print(f"  {label} {n.name}: {n.dtype}{list(n.shape)} strides {list(n.spec.memory_strides)}")
                print(k.source)


if __name__ == "__main__":
    main()
