"""Our Triton depthwise convolution against cuDNN's, shape by shape, on the GPU.

The depthwise convolutions of torchvision models (shapes read on the meta device) at the zoo's batch,
bf16 channels-last: for each distinct shape, cuDNN through F.conv2d (its first call and its time once
set up) against our depthwise kernel (backends/triton_conv.py, VARIANT "depthwise"), every offered
tile config compiled, checked against cuDNN and timed (tune.bench_ms: L2 flushed, median call), in
alternating rounds; the byte floor (x read once, out written once, at the copy ceiling passed) beside.

    PYTHONPATH=src python bench/depthwise_conv_gpu.py [--models mobilenet_v3_large,efficientnet_b0] [--batch 64]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cudnn_first_call_gpu import conv_shapes

from fusegraph.backends import triton_conv
from fusegraph.tune import bench_ms
from fusegraph.tune.precompile import compile_in_parallel

ROUNDS = 3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="mobilenet_v3_large,efficientnet_b0")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--copy-tbs", type=float, default=4.0, help="copy ceiling for the floor, TB/s")
    opts = parser.parse_args()
    torch.empty(1, device="cuda")
    cl, bf16 = torch.channels_last, torch.bfloat16
    lines = [f"# python bench/depthwise_conv_gpu.py {' '.join(sys.argv[1:])}; {torch.cuda.get_device_name()}, "
             f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}"]
    totals = {"cudnn": 0.0, "ours": 0.0, "floor": 0.0}
    for model in opts.models.split(","):
        shapes: list[dict[str, Any]] = []
        for s in conv_shapes(model, opts.batch):
            if s["groups"] > 1 and s["groups"] == s["x"][1] and s["w"][1] == 1 and s not in shapes:
                shapes.append(s)
        lines.append(f"{model} b{opts.batch}: {len(shapes)} distinct depthwise convolutions")
        for s in shapes:
            x = torch.randn(s["x"], device="cuda", dtype=bf16).contiguous(memory_format=cl)
            w = (torch.randn(s["w"], device="cuda") / 3).to(bf16).contiguous(memory_format=cl)
            args = (s["stride"], s["padding"], s["dilation"])

            def cudnn(x: torch.Tensor = x, w: torch.Tensor = w, args: Any = args, g: int = s["groups"]) -> Any:
                return F.conv2d(x, w, None, *args, g)

            torch.cuda.synchronize()
            t0 = time.perf_counter()
            want = cudnn()
            torch.cuda.synchronize()
            first = time.perf_counter() - t0
            problem = triton_conv.problem_of_tensors(x, w, None, *args, groups=s["groups"])
            convs = [triton_conv.TritonConv(problem, c) for c in triton_conv.configs(problem)]
            compile_in_parallel([c.warmup_job(x, w, None) for c in convs])
            ok = []
            for c in convs:
                got = c(x, w)
                err = ((got.float() - want.float()).norm() / want.float().norm()).item()
                if err < 1e-2:
                    ok.append(c)
            times: dict[int, list[float]] = {k: [] for k in range(len(ok) + 1)}
            for _ in range(ROUNDS):
                times[0].append(bench_ms(cudnn))
                for k, c in enumerate(ok, 1):
                    times[k].append(bench_ms(lambda c=c: c(x, w)))
            med = {k: statistics.median(v) for k, v in times.items()}
            best = min(range(1, len(ok) + 1), key=lambda k: med[k]) if ok else None
            out_numel = problem.m * problem.out_shape[1]
            floor = (x.numel() + out_numel) * 2 / (opts.copy_tbs * 1e9)   # ms
            totals["cudnn"] += med[0]
            totals["floor"] += floor
            if best is not None:
                totals["ours"] += med[best]
            cfg = ok[best - 1].config if best is not None else None
            lines.append(
                f"  x {s['x']} k{s['w'][2]} s{s['stride'][0]}: cuDNN {med[0] * 1e3:7.1f} us (first call "
                f"{first * 1e3:6.1f} ms), ours {med[best] * 1e3 if best else float('nan'):7.1f} us "
                f"({cfg and (cfg['BLOCK_M'], cfg['BLOCK_N'], cfg['num_warps'])}; "
                f"{len(ok)}/{len(convs)} configs agree), "
                f"floor {floor * 1e3:6.1f} us, cuDNN/ours {med[0] / med[best] if best else float('nan'):.2f}x")
            print(lines[-1], flush=True)
    lines.append(f"sum over shapes: cuDNN {totals['cudnn'] * 1e3:.1f} us, ours {totals['ours'] * 1e3:.1f} us, "
                 f"floor {totals['floor'] * 1e3:.1f} us")
    print(lines[-1])
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, f"depthwise_conv_{time.strftime('%Y%m%d_%H%M')}.txt"), "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
