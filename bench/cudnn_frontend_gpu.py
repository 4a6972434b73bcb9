"""cuDNN frontend candidates and the layout pass on the GPU (one run, < 4 minutes on an H200).

  conv_bias_relu  relu(conv2d(x, w, b, padding=1)), NHWC 128x256x56x56, 256 filters 3x3 (bf16; the
                  workload of bench/bench_compute_gpu.py): our cuDNN frontend plan (conv + bias + relu
                  in one Graph API plan) checked against torch, timed against torch conv + bias + relu
                  (eager, channels-last), torch.cudnn_convolution_relu, torch.compile, and the
                  fusegraph plan (which autotunes the frontend plan against torch conv + our epilogue)
  sdpa_causal     cuDNN frontend SDPA causal forward, B4 H16 S4096 D128 bf16, TFLOP/s vs torch SDPA's
                  cuDNN, FlashAttention and efficient backends (FLOPs = 4*B*H*S*S*D / 2)
  sdpa_causal_bwd the same shape's backward: our frontend candidate (forward with statistics, then the
                  backward plan) vs torch SDPA forward + backward per backend (both recompute the forward)
  basic_block     resnet basic block (conv-bn-relu-conv-bn-add-relu, fp16, NCHW user tensors
                  32x64x56x56): fusegraph with the layout pass (auto: NHWC inside) vs conv_layout=NCHW,
                  and vs eager torch NCHW / channels-last

The cuDNN frontend is optional: install its wheels first (the lead's command prepends
`python3 -m pip install ... --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:src`).
Results: JSON in $OUT/cudnn_frontend_gpu.json (else bench/results/), a summary on stdout.

    PYTHONPATH=/tmp/site:src python bench/cudnn_frontend_gpu.py [--small]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

import fusegraph as fg
from fusegraph.backends import cudnn_frontend
from fusegraph.settings import override

BF16, FP16 = torch.bfloat16, torch.float16
CL = torch.channels_last


def device_ms(fn: Callable[[], Any]) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out64, ref64 = out.double(), ref.double()
    if not torch.isfinite(out64).all():
        return float("inf")
    return ((out64 - ref64).norm() / ref64.norm().clamp(min=1e-30)).item()


def versions() -> dict[str, Any]:
    info: dict[str, Any] = {"torch": torch.__version__, "cudnn (torch)": torch.backends.cudnn.version(),
                            "gpu": torch.cuda.get_device_name(), "python": sys.version.split()[0]}
    try:
        import cudnn

        info["cudnn_frontend"] = cudnn.__version__
        info["cudnn (frontend backend)"] = cudnn.backend_version()
    except Exception as err:
        info["cudnn_frontend"] = f"unavailable: {type(err).__name__}: {err}"
    info["frontend_unavailable_reason"] = cudnn_frontend.unavailable("cuda")
    return info


def _conv_graph(n: int, c: int, hw: int, kf: int) -> fg.Graph:
    g = fg.Graph(name="conv_bias_relu", compute_dtype="float32")
    x = g.tensor((n, c, hw, hw), dtype="bfloat16", name="x", layout="NHWC")
    w = g.tensor((kf, c, 3, 3), dtype="bfloat16", name="w")
    b = g.tensor((kf,), dtype="bfloat16", name="b")
    g.relu(g.conv2d(x, w, b, padding=1)).set_output()
    return g


def bench_conv_bias_relu(small: bool) -> dict[str, Any]:
    n, c, hw, kf = (16, 64, 28, 64) if small else (128, 256, 56, 256)
    x = torch.randn(n, c, hw, hw, device="cuda", dtype=BF16).contiguous(memory_format=CL)
    w = (torch.randn(kf, c, 3, 3, device="cuda", dtype=BF16) / (9 * c) ** 0.5).contiguous(memory_format=CL)
    b = torch.randn(kf, device="cuda", dtype=BF16)
    ref = F.relu(F.conv2d(x.float(), w.float(), b.float(), padding=1))
    flops = 2 * n * kf * hw * hw * c * 9
    row: dict[str, Any] = {"workload": "conv_bias_relu", "shape": f"NHWC {n}x{c}x{hw}x{hw}, K={kf} 3x3 bf16",
                           "ms": {}, "rel_err": {}, "notes": {}}

    def eager(a: torch.Tensor, p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        return F.relu(F.conv2d(a, p, q, padding=1))

    runs: dict[str, Callable[[], Any]] = {"torch eager conv+bias+relu": lambda: eager(x, w, b)}
    if hasattr(torch, "cudnn_convolution_relu"):
        runs["torch.cudnn_convolution_relu"] = lambda: torch.cudnn_convolution_relu(x, w, b, (1, 1), (1, 1),
                                                                                    (1, 1), 1)
    g = _conv_graph(n, c, hw, kf)
    node = next(nd for nd in g.to_ir().nodes if nd.op == "conv2d")
    relu = next(nd for nd in g.to_ir().nodes if nd.op == "relu")
    start = time.perf_counter()
    with override(debug=1):   # prints why the frontend plan is not offered, if it is not
        fe = cudnn_frontend.conv_candidate(node, [relu], relu.spec.memory_strides, "cuda", "conv_bias_relu")
    row["notes"]["frontend_build_s"] = round(time.perf_counter() - start, 3)
    if fe is not None:
        runs["fusegraph cuDNN frontend plan"] = lambda: fe([x, w, b])
    else:
        row["notes"]["frontend"] = "not offered (see the [fusegraph] line above)"
    start = time.perf_counter()
    plan = g.build(device="cuda")
    row["notes"]["fusegraph_build_s"] = round(time.perf_counter() - start, 3)
    row["notes"]["fusegraph_kernels"] = [{"name": k.name, "backend": k.backend, "config": k.config,
                                          "tuning": k.tuning, "note": k.note,
                                          "source_head": (k.source or "").splitlines()[:1]} for k in plan.kernels]
    runs["fusegraph plan (autotuned)"] = lambda: plan(x, w, b)
    compiled = torch.compile(eager)
    start = time.perf_counter()
    compiled(x, w, b)
    torch.cuda.synchronize()
    row["notes"]["torch_compile_first_call_s"] = round(time.perf_counter() - start, 2)
    runs["torch.compile"] = lambda: compiled(x, w, b)
    for label, fn in runs.items():
        out = fn()
        out = out[0] if isinstance(out, list | tuple) else out
        row["rel_err"][label] = rel_err(out.float(), ref)
        row["ms"][label] = device_ms(fn)
    row["tflops"] = {k: flops / v / 1e9 for k, v in row["ms"].items()}
    row["ok"] = all(e <= 2e-2 for e in row["rel_err"].values())
    base = row["ms"].get("fusegraph cuDNN frontend plan")
    if base:
        row["frontend_speedup_vs"] = {k: v / base for k, v in row["ms"].items() if k != "fusegraph cuDNN frontend plan"}
    return row


def bench_sdpa_causal(small: bool) -> dict[str, Any]:
    bsz, h, s, d = (2, 8, 1024, 128) if small else (4, 16, 4096, 128)
    q, k, v = (torch.randn(bsz, h, s, d, device="cuda", dtype=BF16) for _ in range(3))
    flops = 4 * bsz * h * s * s * d / 2
    row: dict[str, Any] = {"workload": "sdpa_causal_fwd", "shape": f"B{bsz} H{h} S{s} D{d} bf16 causal",
                           "ms": {}, "rel_err": {}, "notes": {}}
    with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.FLASH_ATTENTION]):
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True).float()
    g = fg.Graph(name="sdpa")
    qs, ks, vs = (g.tensor((bsz, h, s, d), dtype="bfloat16", name=nm) for nm in "qkv")
    g.scaled_dot_product_attention(qs, ks, vs, is_causal=True).set_output()
    node = next(nd for nd in g.to_ir().nodes if nd.op == "scaled_dot_product_attention")
    from fusegraph.backends.attention_kernel import attention_problem

    runs: dict[str, Callable[[], Any]] = {}
    start = time.perf_counter()
    with override(debug=1):
        fe = cudnn_frontend.sdpa_candidate(node, attention_problem(node), "cuda", "sdpa_causal")
    row["notes"]["frontend_build_s"] = round(time.perf_counter() - start, 3)
    if fe is not None:
        runs["cuDNN frontend SDPA (ours)"] = lambda: fe([q, k, v])
    from torch.nn.attention import SDPBackend, sdpa_kernel

    for label, backend in (("torch SDPA cudnn", SDPBackend.CUDNN_ATTENTION),
                           ("torch SDPA flash", SDPBackend.FLASH_ATTENTION),
                           ("torch SDPA efficient", SDPBackend.EFFICIENT_ATTENTION)):
        def run(backend: Any = backend) -> torch.Tensor:
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        runs[label] = run
    for label, fn in runs.items():
        try:
            out = fn()
            out = out[0] if isinstance(out, list) else out
            row["rel_err"][label] = rel_err(out.float(), ref)
            row["ms"][label] = device_ms(fn)
        except Exception as err:
            row["notes"][label] = f"{type(err).__name__}: {str(err)[:200]}"
    row["tflops"] = {k: flops / v / 1e9 for k, v in row["ms"].items()}
    row["ok"] = all(e <= 2e-2 for e in row["rel_err"].values())
    return row


def bench_sdpa_causal_bwd(small: bool) -> dict[str, Any]:
    bsz, h, s, d = (2, 8, 1024, 128) if small else (4, 16, 4096, 128)
    q, k, v, dy = (torch.randn(bsz, h, s, d, device="cuda", dtype=BF16) for _ in range(4))
    flops = 2.5 * 4 * bsz * h * s * s * d / 2
    row: dict[str, Any] = {"workload": "sdpa_causal_bwd", "shape": f"B{bsz} H{h} S{s} D{d} bf16 causal",
                           "ms": {}, "rel_err": {}, "notes": {}}
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from fusegraph.backends.attention_kernel import attention_problem

    def torch_bwd(backend: Any) -> Callable[[], Any]:
        def run() -> tuple[torch.Tensor, ...]:
            qg, kg, vg = (t.detach().requires_grad_(True) for t in (q, k, v))
            with sdpa_kernel([backend]):
                out = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True)
            return torch.autograd.grad(out, (qg, kg, vg), dy)
        return run

    ref = [t.float() for t in torch_bwd(SDPBackend.FLASH_ATTENTION)()]
    g = fg.Graph(name="sdpa_bwd")
    dys, qs, ks, vs, os_ = (g.tensor((bsz, h, s, d), dtype="bfloat16", name=nm) for nm in ("dy", "q", "k", "v", "o"))
    g.sdpa_backward(dys, qs, ks, vs, os_, is_causal=True)[0].set_output()
    node = next(nd for nd in g.to_ir().nodes if nd.op == "sdpa_backward")
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    runs: dict[str, Callable[[], Any]] = {}
    start = time.perf_counter()
    with override(debug=1):
        fe = cudnn_frontend.sdpa_candidate(node, attention_problem(node), "cuda", "sdpa_causal_bwd")
    row["notes"]["frontend_build_s"] = round(time.perf_counter() - start, 3)
    if fe is not None:
        runs["cuDNN frontend SDPA bwd (ours, fwd recompute + bwd)"] = lambda: fe([dy, q, k, v, o])[0]
    for label, backend in (("torch SDPA cudnn (fwd + bwd)", SDPBackend.CUDNN_ATTENTION),
                           ("torch SDPA flash (fwd + bwd)", SDPBackend.FLASH_ATTENTION),
                           ("torch SDPA efficient (fwd + bwd)", SDPBackend.EFFICIENT_ATTENTION)):
        runs[label] = torch_bwd(backend)
    for label, fn in runs.items():
        try:
            got = fn()
            row["rel_err"][label] = max(rel_err(a.float(), b) for a, b in zip(got, ref, strict=True))
            row["ms"][label] = device_ms(fn)
        except Exception as err:
            row["notes"][label] = f"{type(err).__name__}: {str(err)[:200]}"
    row["tflops_bwd_flops_over_fwd_plus_bwd_time"] = {k: flops / v / 1e9 for k, v in row["ms"].items()}
    row["ok"] = all(e <= 2e-2 for e in row["rel_err"].values())
    return row


def bench_basic_block(small: bool) -> dict[str, Any]:
    n, c, hw = (8, 32, 28) if small else (32, 64, 56)
    g = fg.Graph(name="basic_block", compute_dtype="float32")
    x = g.tensor((n, c, hw, hw), dtype="float16", name="x")
    w1, w2 = (g.tensor((c, c, 3, 3), dtype="float16", name=nm) for nm in ("w1", "w2"))
    params = [g.tensor((c,), dtype="float32", name=f"{p}{i}") for i in (1, 2) for p in ("rm", "rv", "gw", "gb")]

    def bn(t: Any, i: int) -> Any:
        rm, rv, gw, gb = params[4 * i: 4 * i + 4]
        return g.batch_norm(t, rm, rv, weight=gw, bias=gb, training=False)

    h1 = g.relu(bn(g.conv2d(x, w1, padding=1), 0))
    g.relu(g.add(bn(g.conv2d(h1, w2, padding=1), 1), x)).set_output()
    feeds = [torch.randn(n, c, hw, hw, device="cuda", dtype=FP16),
             (torch.randn(c, c, 3, 3, device="cuda", dtype=FP16) / (9 * c) ** 0.5),
             (torch.randn(c, c, 3, 3, device="cuda", dtype=FP16) / (9 * c) ** 0.5)]
    for _ in (1, 2):
        feeds += [torch.randn(c, device="cuda") * 0.1, torch.rand(c, device="cuda") + 0.5,
                  torch.randn(c, device="cuda"), torch.randn(c, device="cuda")]
    ref = fg.reference(g)(*feeds).float()
    row: dict[str, Any] = {"workload": "basic_block", "shape": f"NCHW {n}x{c}x{hw}x{hw} fp16", "ms": {},
                           "rel_err": {}, "notes": {}}
    with override(debug=1):
        auto = g.build(device="cuda")
    nchw = g.build(device="cuda", conv_layout="NCHW")
    row["notes"]["layout_copies_auto"] = sum(1 for nd in auto.graph.nodes if nd.op == "to_layout")
    row["notes"]["kernels_auto"] = [f"{k.name} ({k.backend})" for k in auto.kernels]

    def eager(a: torch.Tensor, p: torch.Tensor, q: torch.Tensor, *bnp: torch.Tensor) -> torch.Tensor:
        t = F.relu(F.batch_norm(F.conv2d(a, p, padding=1).float(), bnp[0], bnp[1], bnp[2], bnp[3]).half())
        t = F.batch_norm(F.conv2d(t, q, padding=1).float(), bnp[4], bnp[5], bnp[6], bnp[7]).half()
        return F.relu(t + a)

    cl_feeds = [feeds[0].contiguous(memory_format=CL), feeds[1].contiguous(memory_format=CL),
                feeds[2].contiguous(memory_format=CL), *feeds[3:]]
    runs = {"fusegraph layout auto (NHWC inside)": lambda: auto(*feeds),
            "fusegraph conv_layout=NCHW": lambda: nchw(*feeds),
            "torch eager NCHW": lambda: eager(*feeds),
            "torch eager channels-last": lambda: eager(*cl_feeds)}
    for label, fn in runs.items():
        row["rel_err"][label] = rel_err(fn().float(), ref)
        row["ms"][label] = device_ms(fn)
    row["ok"] = all(e <= 1e-2 for e in row["rel_err"].values())
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="small shapes (a quick check)")
    parser.add_argument("--only", default="conv_bias_relu,sdpa_causal,sdpa_causal_bwd,basic_block")
    args = parser.parse_args()
    torch.manual_seed(0)
    result: dict[str, Any] = {"versions": versions(), "rows": []}
    print(json.dumps(result["versions"], indent=1), flush=True)
    benches = {"conv_bias_relu": bench_conv_bias_relu, "sdpa_causal": bench_sdpa_causal,
               "sdpa_causal_bwd": bench_sdpa_causal_bwd, "basic_block": bench_basic_block}
    for name in args.only.split(","):
        start = time.perf_counter()
        try:
            row = benches[name](args.small)
        except Exception as err:
            row = {"workload": name, "ok": False, "error": f"{type(err).__name__}: {err}",
                   "traceback": traceback.format_exc()[-3000:]}
        row["wall_s"] = round(time.perf_counter() - start, 1)
        result["rows"].append(row)
        print(json.dumps(row, indent=1, default=str), flush=True)
    out_dir = os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "cudnn_frontend_gpu.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(f"wrote {path}")
    for row in result["rows"]:
        ms = row.get("ms", {})
        print(f"{row['workload']:16s} ok={row.get('ok')} " + "  ".join(f"{k}: {v:.3f} ms" for k, v in ms.items()))


if __name__ == "__main__":
    main()
