"""Narrow-input-channel convolutions (network stems, patch embeddings): torch/cuDNN against our
tuned Triton implicit-GEMM conv (src/fusegraph/backends/triton_conv.py), on the GPU.

Cases (bf16, channels-last operands and result):
    resnet50_stem      b128 3->64  7x7 stride 2 pad 3, 224x224   (cuDNN 0.88 ms on the H200, floor ~0.05)
    effnet_stem        b128 3->32  3x3 stride 2 pad 1, 224x224   (EfficientNet / MobileNet stems)
    convnext_patch     b64  3->96  4x4 stride 4,       224x224   (ConvNeXt patchify)
    swin_patch         b64  3->128 4x4 stride 4,       224x224   (Swin patch embedding)
Per case: device time (fusegraph.perf.timing.device_time: steady state, CUDA-graph replay) and the
autotuner's protocol (tune.bench_ms: L2 flushed before each call) of F.conv2d (cuDNN) and of our
kernel with its tuned config; the relative norm error of ours against F.conv2d (limit 2e-2 for
bf16), the cost-model floor, and the speedup. Then the ResNet stem with bias + relu built as a
fusegraph plan (NHWC input): which candidate the ConvGroup's autotuner chose (triton_conv vs cuDNN
and the cuDNN fused candidates), the plan's time next to torch's conv + bias + relu.

    PYTHONPATH=src python bench/stem_conv_gpu.py               # H200: tunes ~12 configs per case, ~1-2 min
    PYTHONPATH=src FUSEGRAPH_DEBUG=2 python bench/stem_conv_gpu.py     # also every config's timing
    TRITON_INTERPRET=1 PYTHONPATH=src python bench/stem_conv_gpu.py --cpu-smoke   # tiny shapes, fp16, CPU
The table goes to stdout and is appended to $OUT/stem_conv.txt when OUT is set.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

OUT_NAME = "stem_conv.txt"
BF16_LIMIT = 2e-2


@dataclass(frozen=True)
class Case:
    name: str
    batch: int
    c_in: int
    c_out: int
    size: int
    kernel: int
    stride: int
    padding: int


CASES = (
    Case("resnet50_stem", 128, 3, 64, 224, 7, 2, 3),
    Case("effnet_stem", 128, 3, 32, 224, 3, 2, 1),
    Case("convnext_patch", 64, 3, 96, 224, 4, 4, 0),
    Case("swin_patch", 64, 3, 128, 224, 4, 4, 0),
)
SMOKE_CASES = (
    Case("stem_smoke", 2, 3, 16, 20, 7, 2, 3),
    Case("patch_smoke", 2, 3, 24, 16, 4, 4, 0),
)


def operands(case: Case, dtype: torch.dtype, device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(case.batch, case.c_in, case.size, case.size, generator=gen)
    w = torch.randn(case.c_out, case.c_in, case.kernel, case.kernel, generator=gen) / (
        case.c_in * case.kernel * case.kernel) ** 0.5
    b = torch.randn(case.c_out, generator=gen)
    cl = torch.channels_last
    return (x.to(device, dtype).contiguous(memory_format=cl), w.to(device, dtype).contiguous(memory_format=cl),
            b.to(device, dtype))


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    g, w = got.double(), want.double()
    return float((g - w).norm() / w.norm().clamp(min=1e-30))


def timer(device: str) -> Callable[[Callable[[], Any]], tuple[float, float]]:
    """fn -> (device-time ms, L2-flushed ms); host clock for both off the GPU."""
    from fusegraph.tune import bench_ms

    def measure(fn: Callable[[], Any]) -> tuple[float, float]:
        if device.startswith("cuda"):
            from fusegraph.perf.timing import device_time
            return device_time(fn).ms, bench_ms(fn)
        ms = bench_ms(fn)
        return ms, ms

    return measure


def conv_row(case: Case, dtype: torch.dtype, device: str) -> tuple[str, bool]:
    """One table line for `case`, and whether ours matched F.conv2d."""
    from fusegraph.backends import triton_conv

    x, w, _ = operands(case, dtype, device)
    stride, padding = (case.stride, case.stride), (case.padding, case.padding)
    problem = triton_conv.problem_of_tensors(x, w, None, stride, padding, (1, 1))
    t0 = time.perf_counter()
    ours, tuning = triton_conv.tuned(problem, device)
    tune_s = time.perf_counter() - t0
    want = F.conv2d(x, w, stride=case.stride, padding=case.padding)
    got = ours(x, w)
    assert got.stride() == want.stride() or not device.startswith("cuda"), (got.stride(), want.stride())
    err = rel_err(got, want)
    limit = BF16_LIMIT if dtype == torch.bfloat16 else 5e-3
    measure = timer(device)
    torch_dev, torch_flushed = measure(lambda: F.conv2d(x, w, stride=case.stride, padding=case.padding))
    ours_dev, ours_flushed = measure(lambda: ours(x, w))
    floor = triton_conv.floor_ms(problem)
    cfg = ours.config
    tile = f"{cfg['BLOCK_M']}x{cfg['BLOCK_N']}x{cfg['BLOCK_K']} w{cfg['num_warps']} s{cfg['num_stages']}"
    shape = f"b{case.batch} {case.c_in}->{case.c_out} {case.kernel}x{case.kernel}/{case.stride} p{case.padding}"
    line = (f"{case.name:15s} {shape:24s} {torch_dev:8.4f} {torch_flushed:8.4f} {ours_dev:8.4f} {ours_flushed:8.4f} "
            f"{torch_dev / ours_dev:6.2f}x {'-' if floor is None else f'{floor:.4f}':>7s} {err:8.1e}"
            f"{'' if err <= limit else ' FAIL'}  {tile} ({tuning['source']}, {tune_s:.1f} s)")
    return line, err <= limit


def fused_lines(case: Case, dtype: torch.dtype, device: str) -> list[str]:
    """conv + bias + relu: torch's two calls, cuDNN's fused call, and our kernel with bias and relu in
    its store (the tile config tuned for the plain conv)."""
    from fusegraph.backends import triton_conv

    x, w, b = operands(case, dtype, device)
    stride, padding = (case.stride, case.stride), (case.padding, case.padding)
    plain, _ = triton_conv.tuned(triton_conv.problem_of_tensors(x, w, None, stride, padding, (1, 1)), device)
    problem = triton_conv.problem_of_tensors(x, w, b, stride, padding, (1, 1))
    ours = triton_conv.TritonConv(problem, plain.config, triton_conv.EpilogueForm(activation="relu"))
    want = torch.relu(F.conv2d(x, w, b, stride=case.stride, padding=case.padding))
    err = rel_err(ours(x, w, b), want)
    measure = timer(device)
    calls: dict[str, Callable[[], Any]] = {
        "torch conv+relu": lambda: torch.relu(F.conv2d(x, w, b, stride=case.stride, padding=case.padding)),
        "ours fused": lambda: ours(x, w, b)}
    if device.startswith("cuda") and hasattr(torch, "cudnn_convolution_relu"):
        calls["cudnn_convolution_relu"] = lambda: torch.cudnn_convolution_relu(x, w, b, stride, padding, (1, 1), 1)
    times = {k: measure(fn)[0] for k, fn in calls.items()}
    return [f"{case.name} + bias + relu: " + ", ".join(f"{k} {ms:.4f} ms" for k, ms in times.items())
            + f"; ours rel err {err:.1e}" + ("" if err <= BF16_LIMIT else " FAIL")]


def plan_lines(case: Case, dtype: torch.dtype, device: str) -> list[str]:
    """conv + bias + relu as a fusegraph plan (NHWC input): the chosen candidate and its time."""
    import fusegraph as fg

    x, w, b = operands(case, dtype, device)
    name = {torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]
    g = fg.Graph(name=f"{case.name}_bias_relu", compute_dtype="float32")
    xs = g.tensor(tuple(x.shape), dtype=name, name="x", layout="NHWC")
    ws, bs = g.tensor(tuple(w.shape), dtype=name, name="w"), g.tensor((case.c_out,), dtype=name, name="b")
    y = g.relu(g.conv2d(xs, ws, bs, stride=case.stride, padding=case.padding))
    y.set_output()
    plan = g.build(device=device)
    feeds = {xs: x, ws: w, bs: b}
    got = plan.execute(feeds)[y]
    want = torch.relu(F.conv2d(x, w, b, stride=case.stride, padding=case.padding))
    measure = timer(device)
    plan_dev, _ = measure(lambda: plan.execute(feeds))
    torch_dev, _ = measure(lambda: torch.relu(F.conv2d(x, w, b, stride=case.stride, padding=case.padding)))
    lines = [f"plan {g.name}: {plan_dev:.4f} ms (torch conv+relu {torch_dev:.4f} ms), rel err "
             f"{rel_err(got, want):.1e}"]
    for k in plan.kernels:
        lines.append(f"  {k.name}: kind {k.kind}, backend {k.backend}, config {k.config}, tuning {k.tuning}")
        if k.note:
            lines.append(f"    note: {k.note}")
        lines.append(f"    source: {k.source.splitlines()[0] if k.source else ''}")
    return lines


def emit(text: str) -> None:
    print(text, flush=True)
    out = os.environ.get("OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, OUT_NAME), "a") as f:
            f.write(text + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny shapes, fp16, under the interpreter")
    parser.add_argument("--no-plan", action="store_true", help="skip the fusegraph plan of the stem")
    args = parser.parse_args()
    smoke = args.cpu_smoke or not torch.cuda.is_available()
    device, dtype = ("cpu", torch.float16) if smoke else ("cuda", torch.bfloat16)
    cases = SMOKE_CASES if smoke else CASES
    header = (f"{'case':15s} {'shape':24s} {'cudnn':>8s} {'flushed':>8s} {'triton':>8s} {'flushed':>8s} "
              f"{'speedup':>7s} {'floor':>7s} {'rel err':>8s}  config")
    gpu = torch.cuda.get_device_name() if not smoke else "CPU (interpreter smoke run)"
    emit(f"== stem convolutions, {gpu}, {str(dtype).replace('torch.', '')}, channels-last; ms per call ==")
    emit(header)
    ok = True
    for case in cases:
        line, matched = conv_row(case, dtype, device)
        ok &= matched
        emit(line)
    emit("\n".join(fused_lines(cases[0], dtype, device)))
    if not args.no_plan:
        emit("\n".join(plan_lines(cases[0], dtype, device)))
    if not ok:
        raise SystemExit("our Triton conv disagreed with F.conv2d beyond the tolerance (FAIL rows)")


if __name__ == "__main__":
    main()
