"""cuDNN SDPA graphs as serialized plans (backends/cudnn_plans.SdpaRecipe) on the GPU: for GPT-2's
attention (bf16, causal, B8 H12 S1024 D64 unless told otherwise), the forward with its statistics and
the backward fed them. Per graph: the seconds of a direct build (graph_from_recipe + build_plans), of
build_serialized (what a build worker runs) and of deserialize (what a warm compile runs), the blob's
size, and the deserialized plan's results against the directly built plan's and torch's.

    PYTHONPATH=src python bench/cudnn_sdpa_plans_gpu.py [--shape 8 12 1024 64]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", type=int, nargs=4, default=(8, 12, 1024, 64), metavar=("B", "H", "S", "D"))
    args = parser.parse_args()
    from fusegraph.backends import cudnn_frontend as fe
    from fusegraph.backends import cudnn_plans as plans
    from fusegraph.ir.spec import strides_for_order

    cudnn, why = fe._load()
    if cudnn is None or not torch.cuda.is_available():
        print(f"needs a GPU and nvidia-cudnn-frontend: {why or 'no GPU'}")
        return 1
    b, h, s, d = args.shape
    dense = (tuple(args.shape), tuple(strides_for_order(tuple(args.shape), (0, 1, 2, 3))))
    stats = ((b, h, s, 1), (h * s, s, 1, 1))
    scale = d ** -0.5
    fwd = plans.SdpaRecipe(False, dense, dense, dense, dense, stats, None, None, "bfloat16", scale, True)
    bwd = plans.SdpaRecipe(True, dense, dense, dense, dense, stats, dense, (dense, dense, dense), "bfloat16",
                           scale, True)
    device = torch.device("cuda", torch.cuda.current_device())
    handle = fe._handle(cudnn, device)
    q, k, v, dout = (torch.randn(b, h, s, d, device=device, dtype=torch.bfloat16) for _ in range(4))
    with torch.enable_grad():
        qg, kg, vg = (t.detach().requires_grad_(True) for t in (q, k, v))
        ref = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True, scale=scale)
        ref_grads = torch.autograd.grad(ref, (qg, kg, vg), dout)
    results: dict[str, list[torch.Tensor]] = {}
    for recipe in (fwd, bwd):
        name = recipe.describe()
        start = time.perf_counter()
        graph, tensors = plans.graph_from_recipe(cudnn, handle, recipe)
        fe._build(graph, cudnn)
        direct_s = time.perf_counter() - start
        start = time.perf_counter()
        built = plans.build_serialized([recipe], 1, device.index)
        serialized_s = time.perf_counter() - start
        if not built.blobs:
            print(f"{name}: not serialized: {'; '.join(built.failures)}")
            continue
        blob = built.blobs[min(built.blobs)]
        start = time.perf_counter()
        loaded = plans.deserialize(cudnn, handle, blob)
        deserialize_s = time.perf_counter() - start
        outs = {}
        for label, g, keys in (("direct", graph, tensors), ("deserialized", loaded, dict(zip(
                recipe.roles(), recipe.uids(), strict=True)))):
            plan = fe.FrontendPlan(cudnn, g, handle, device)
            if not recipe.backward:
                o = torch.empty_like(q)
                st = torch.empty(b, h, s, 1, device=device, dtype=torch.float32)
                plan({keys["q"]: q, keys["k"]: k, keys["v"]: v, keys["o"]: o, keys["stats"]: st})
                outs[label] = [o, st]
                results["fwd"] = [o, st]
            else:
                o, st = results["fwd"]
                grads = [torch.empty_like(q) for _ in range(3)]
                plan({keys["q"]: q, keys["k"]: k, keys["v"]: v, keys["o"]: o, keys["dO"]: dout, keys["stats"]: st,
                      keys["dq"]: grads[0], keys["dk"]: grads[1], keys["dv"]: grads[2]})
                outs[label] = grads
        torch.cuda.synchronize()
        same = all(torch.equal(x, y) for x, y in zip(outs["direct"], outs["deserialized"], strict=True))
        want = [ref] if not recipe.backward else list(ref_grads)
        err = max(float((x.float() - y.float()).norm() / y.float().norm())
                  for x, y in zip(outs["deserialized"], want, strict=False))
        print(f"{name}: direct build {direct_s:.3f} s, build_serialized {serialized_s:.3f} s, deserialize "
              f"{deserialize_s * 1e3:.1f} ms, blob {len(blob) / 1024:.0f} KiB; deserialized == direct: {same}; "
              f"rel err vs torch {err:.1e}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
