"""The fused cuDNN-frontend conv epilogue (backends/cudnn_conv_epilogue.py) on the GPU, then ResNet-50.

Part 1, conv + BatchNorm (+ residual) + ReLU blocks at ResNet-50 shapes, bf16 NHWC, built with the
Graph API: the fused frontend candidate (conv -> mul(scale) -> add(shift) [-> add(residual)] -> relu as
one Graph API plan), cuDNN conv + our generated epilogue (the candidate it competes with), the whole
fusegraph plan (which autotunes between them), torch eager and torch.compile: relative error against
an fp32 reference and device time each.
Part 2, torchvision ResNet-50 inference batch 128 bf16 channels-last through fg.compile with
FUSEGRAPH_DEBUG=1 (why a conv's frontend plan is not offered), which candidate each convolution kernel
chose, how often each fused launch folded its per-channel vectors, and the time against torch.compile.

    pip install --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site:src python bench/check_cudnn_conv_epilogue_gpu.py [--small] [--skip-resnet]

Text to stdout and $OUT/check_cudnn_conv_epilogue.txt when OUT is set.
"""

from __future__ import annotations

import argparse
import copy
import io
import os
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

import fusegraph as fg
from fusegraph.backends import conv_kernel, cudnn_frontend
from fusegraph.backends import cudnn_conv_epilogue as cce
from fusegraph.fusion.epilogue import ConvGroup, claim_epilogues
from fusegraph.fusion.partition import partition_graph
from fusegraph.settings import override

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

BF16, CL = torch.bfloat16, torch.channels_last
# name, batch, in channels, spatial, out channels, kernel, stride, residual ("", "add", "downsample")
BLOCKS = [
    ("1x1 256->64 56x56 +bn+relu", 128, 256, 56, 64, 1, 1, ""),
    ("3x3 64->64 56x56 +bn+relu", 128, 64, 56, 64, 3, 1, ""),
    ("1x1 128->512 28x28 +bn+add+relu", 128, 128, 28, 512, 1, 1, "add"),
    ("1x1 128->512 28x28 +bn + bn(downsample)+relu", 128, 128, 28, 512, 1, 1, "downsample"),
    ("3x3 128->128 56x56 stride 2 +bn+relu", 128, 128, 56, 128, 3, 2, ""),
]
SMALL = [(name, 8, c, hw, k, r, s, res) for name, _, c, hw, k, r, s, res in BLOCKS]


class Tee(io.TextIOBase):
    def __init__(self, *streams: Any) -> None:
        self.streams = streams

    def write(self, text: str) -> int:
        for s in self.streams:
            s.write(text)
            s.flush()
        return len(text)


def device_ms(fn: Callable[[], Any]) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


def host_us(fn: Callable[[], Any], calls: int = 50) -> float:
    """Host time per call to enqueue `fn` (no synchronization between calls)."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out64, ref64 = out.double(), ref.double()
    if not torch.isfinite(out64).all():
        return float("inf")
    return ((out64 - ref64).norm() / ref64.norm().clamp(min=1e-30)).item()


def block_graph(n: int, c: int, hw: int, k: int, r: int, s: int, residual: str) -> fg.Graph:
    g = fg.Graph(name="conv_bn_block", compute_dtype="float32")
    x = g.tensor((n, c, hw, hw), dtype="bfloat16", name="x", layout="NHWC")
    w = g.tensor((k, c, r, r), dtype="bfloat16", name="w", layout="NHWC")   # channels-last, as the data
    bn = [g.tensor((k,), dtype="bfloat16", name=nm) for nm in ("mean", "var", "gamma", "beta")]
    y = g.batch_norm(g.conv2d(x, w, stride=s, padding=r // 2), *bn, eps=1e-5)
    out_hw = (hw + 2 * (r // 2) - r) // s + 1
    if residual == "add":
        y = g.add(y, g.tensor((n, k, out_hw, out_hw), dtype="bfloat16", name="res", layout="NHWC"))
    elif residual == "downsample":
        z = g.tensor((n, k, out_hw, out_hw), dtype="bfloat16", name="res", layout="NHWC")
        bn2 = [g.tensor((k,), dtype="bfloat16", name=nm + "2") for nm in ("mean", "var", "gamma", "beta")]
        y = g.add(y, g.batch_norm(z, *bn2, eps=1e-5))
    g.relu(y).set_output()
    return g


def block_data(n: int, c: int, hw: int, k: int, r: int, s: int, residual: str) -> dict[str, torch.Tensor]:
    out_hw = (hw + 2 * (r // 2) - r) // s + 1
    dev = "cuda"
    data = {"x": torch.randn(n, c, hw, hw, device=dev, dtype=BF16).contiguous(memory_format=CL),
            "w": (torch.randn(k, c, r, r, device=dev, dtype=BF16) / (c * r * r) ** 0.5).contiguous(memory_format=CL)}
    for suffix in ("", "2") if residual == "downsample" else ("",):
        data["mean" + suffix] = (torch.randn(k, device=dev) * 0.3).to(BF16)
        data["var" + suffix] = (torch.rand(k, device=dev) + 0.5).to(BF16)
        data["gamma" + suffix] = (torch.rand(k, device=dev) + 0.5).to(BF16)
        data["beta" + suffix] = (torch.randn(k, device=dev) * 0.3).to(BF16)
    if residual:
        data["res"] = torch.randn(n, k, out_hw, out_hw, device=dev, dtype=BF16).contiguous(memory_format=CL)
    return data


def torch_block(d: dict[str, torch.Tensor], r: int, s: int, residual: str) -> torch.Tensor:
    y = F.batch_norm(F.conv2d(d["x"], d["w"], stride=s, padding=r // 2), d["mean"], d["var"], d["gamma"],
                     d["beta"], False, 0.0, 1e-5)
    if residual == "add":
        y = y + d["res"]
    elif residual == "downsample":
        y = y + F.batch_norm(d["res"], d["mean2"], d["var2"], d["gamma2"], d["beta2"], False, 0.0, 1e-5)
    return F.relu(y)


def check_block(spec: tuple[Any, ...]) -> None:
    name, n, c, hw, k, r, s, residual = spec
    print(f"\n== {name}: NHWC {n}x{c}x{hw}x{hw} -> {k} {r}x{r} stride {s}, bf16", flush=True)
    data = block_data(n, c, hw, k, r, s, residual)
    ref = torch_block({key: v.float() for key, v in data.items()}, r, s, residual)
    g = block_graph(n, c, hw, k, r, s, residual)
    start = time.perf_counter()
    with override(debug=1):
        plan = g.build(device="cuda")
    print(f"   fusegraph build {time.perf_counter() - start:.2f} s", flush=True)
    for kern in plan.kernels:
        print(f"   plan kernel {kern.name} {kern.kind}/{kern.backend} config={kern.config} tuning={kern.tuning}"
              f" note={kern.note!r}", flush=True)
    items = claim_epilogues(partition_graph(plan.graph).items, plan.graph)
    groups = [i for i in items if isinstance(i, ConvGroup)]
    group = max(groups, key=lambda gr: len(gr.epilogue_nodes))
    missing = [nd.name for nd in group.inputs if nd.name not in data]
    if missing:
        print(f"   group inputs {missing} are not graph inputs (a layout copy?): candidates not run alone")
        return
    args = [data[nd.name] for nd in group.inputs]
    out_strides = group.outputs[0].spec.memory_strides
    runs: dict[str, Callable[[], Any]] = {}
    try:
        epi = cce.classify(group.compute, group.epilogue_nodes, group.inputs)
        print(f"   epilogue: {epi.describe()}", flush=True)
    except cce.NotServed as err:
        print(f"   epilogue not served: {err}")
    start = time.perf_counter()
    with override(debug=1):
        fused = cce.candidate(group.compute, group.epilogue_nodes, group.inputs, out_strides, "float32", "cuda",
                              "check")
    print(f"   fused candidate build {time.perf_counter() - start:.2f} s: "
          f"{'mode ' + fused.mode + ', vectors ' + str(fused.vector_dtype) if fused else 'NOT OFFERED'}", flush=True)
    if fused is not None:
        runs["fused cuDNN frontend conv+epilogue"] = lambda: fused(args)[0]
    saved = conv_kernel.library_candidates
    conv_kernel.library_candidates = lambda *a, **kw: {}    # conv + our epilogue alone
    try:
        plain = conv_kernel.conv_group_kernel(group, "plain", "float32", "cuda", {})
    finally:
        conv_kernel.library_candidates = saved
    runs["cuDNN conv + our epilogue"] = lambda: plain.launch(args)[0]
    order = [h.name for h in plan.input_handles]
    runs["fusegraph plan (autotuned)"] = lambda: plan(*[data[nm] for nm in order])
    runs["torch eager"] = lambda: torch_block(data, r, s, residual)
    compiled = torch.compile(lambda d: torch_block(d, r, s, residual))
    runs["torch.compile"] = lambda: compiled(data)
    for label, fn in runs.items():
        try:
            out = fn()
            out = out[0] if isinstance(out, list | tuple) else out
            torch.cuda.synchronize()
            error = rel_err(out.float(), ref)
            ms = device_ms(fn)
            print(f"   {label:40s} rel_err {error:.2e}  {ms:.4f} ms device, {host_us(fn):.0f} us host per call",
                  flush=True)
        except Exception as exc:  # report and continue with the next implementation
            print(f"   {label:40s} FAILED: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    if fused is not None:
        print(f"   fused launch folded its per-channel vectors {fused.folds} time(s) over all calls; ordered binding "
              f"path {fused.ordered}", flush=True)


def check_resnet50(batch: int) -> None:
    import targets_gpu as T

    from fusegraph.perf.timing import device_time

    print(f"\n== ResNet-50 inference batch {batch} bf16 channels-last", flush=True)
    base = T.resnet50("full").eval().cuda()
    x = torch.randn(batch, 3, 224, 224, device="cuda", dtype=BF16).contiguous(memory_format=CL)
    results = {}
    for label in ("torch.compile", "fusegraph"):
        torch._dynamo.reset()
        model = copy.deepcopy(base).to(dtype=BF16, memory_format=CL)  # type: ignore[call-overload]
        compiled = torch.compile(model) if label == "torch.compile" else fg.compile(model)
        start = time.perf_counter()
        with torch.no_grad(), override(debug=1 if label == "fusegraph" else 0):
            out = compiled(x)
        torch.cuda.synchronize()
        print(f"   {label}: first call (compile) {time.perf_counter() - start:.1f} s", flush=True)

        def call(compiled: Any = compiled) -> Any:
            with torch.no_grad():
                return compiled(x)
        ms = device_time(call, calls=20, repeats=3, graph=False).ms
        results[label] = (ms, out)
        print(f"   {label}: {ms:.3f} ms per call (back-to-back)", flush=True)
        if label == "fusegraph":
            conv_report(compiled)
    with torch.no_grad():
        want = copy.deepcopy(base).to(dtype=BF16, memory_format=CL)(x).float()  # type: ignore[call-overload]
    for label, (_ms, out) in results.items():
        print(f"   {label}: rel_err vs eager {rel_err(out.float(), want):.2e}", flush=True)
    if len(results) == 2:
        print(f"   speedup fusegraph vs torch.compile: {results['torch.compile'][0] / results['fusegraph'][0]:.3f}x"
              f" (target >= 1.6x)", flush=True)


def conv_report(compiled: Any) -> None:
    chosen: Counter[str] = Counter()
    for graph in compiled.fusegraph_report.graphs:
        for part in graph.partitions:
            plan = part.plan
            if plan is None:
                continue
            for kern in plan.kernels:
                if kern.kind != "convolution":
                    continue
                cand = str((kern.config or {}).get("candidate", "conv+epilogue"))
                chosen[cand] += 1
                ops = Counter(nd.op for nd in kern.nodes)
                folds = getattr(kern.launch, "folds", None)
                print(f"   {kern.name:14s} {cand:26s} ops={dict(ops)} tuning={kern.tuning}"
                      + (f" folds={folds} mode={kern.launch.mode} ordered={kern.launch.ordered}"
                         if folds is not None else ""), flush=True)
    print(f"   convolution kernels by chosen candidate: {dict(chosen)}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="batch 8 blocks")
    parser.add_argument("--skip-resnet", action="store_true")
    parser.add_argument("--resnet-batch", type=int, default=128)
    args = parser.parse_args()
    out_dir = os.environ.get("OUT")
    log = open(os.path.join(out_dir, "check_cudnn_conv_epilogue.txt"), "w") if out_dir else None  # noqa: SIM115
    if log is not None:
        sys.stdout = Tee(sys.__stdout__, log)  # type: ignore[assignment]
    print(f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, {torch.cuda.get_device_name()}")
    try:
        import cudnn
        print(f"cudnn frontend {cudnn.__version__}, backend {cudnn.backend_version()}")
    except Exception as err:
        print(f"cudnn frontend unavailable: {type(err).__name__}: {err}")
    print(f"frontend unavailable reason: {cudnn_frontend.unavailable('cuda')}")
    for spec in SMALL if args.small else BLOCKS:
        try:
            check_block(spec)
        except Exception:
            traceback.print_exc(file=sys.stdout)
    if not args.skip_resnet:
        try:
            check_resnet50(args.resnet_batch)
        except Exception:
            traceback.print_exc(file=sys.stdout)
    if log is not None:
        sys.stdout = sys.__stdout__
        log.close()


if __name__ == "__main__":
    main()
