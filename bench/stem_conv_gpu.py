"""Narrow-input-channel convolutions (network stems, patch embeddings): torch/cuDNN against our
tuned Triton implicit-GEMM conv (src/fusegraph/backends/triton_conv.py), on the GPU.

Cases (bf16, channels-last operands and result):
    resnet50_stem      b128 3->64  7x7 stride 2 pad 3, 224x224   (cuDNN 0.88 ms on the H200, floor ~0.05)
    effnet_stem        b128 3->32  3x3 stride 2 pad 1, 224x224   (EfficientNet / MobileNet stems)
    convnext_patch     b64  3->96  4x4 stride 4,       224x224   (ConvNeXt patchify)
    swin_patch         b64  3->128 4x4 stride 4,       224x224   (Swin patch embedding)
Per case: device time (fusegraph.perf.timing.device_time: steady state, CUDA-graph replay) and the
autotuner's protocol (tune.bench_ms: L2 flushed before each call) of F.conv2d (cuDNN) and of our
kernel in each variant with its best config (each variant tuned on its own configs): "direct"
(gathers from x) and "padded" (triton_conv_pad.py: one pass writes a zero-padded x_pad/w_pad, then
the conv; its time includes the pass, and the pass alone is shown); which variant the full tuning
picks (what a plan runs); each variant's relative norm error against F.conv2d (limit 2e-2 for bf16)
and cost-model floor (the padded floor counts x_pad written and read, and its padded K). Then the
loads each variant's compiled conv issues (PTX: ld.global widths, cp.async sizes), the stem + bias
+ relu with the epilogue in our store (both variants), and the stem built as a fusegraph plan (NHWC
input): which candidate the ConvGroup's autotuner chose, the plan's time next to torch's.

    PYTHONPATH=src python bench/stem_conv_gpu.py               # H200: tunes ~21 configs per case, ~2-3 min
    PYTHONPATH=src FUSEGRAPH_DEBUG=2 python bench/stem_conv_gpu.py     # also every config's timing
    TRITON_INTERPRET=1 PYTHONPATH=src python bench/stem_conv_gpu.py --cpu-smoke   # tiny shapes, fp16, CPU

With --pointwise: ResNet-50's 1x1 convolutions instead (b128, bf16, channels-last; the bottleneck's
reduce/expand convs and the stride-2 downsample projections), where only the "gemm" variant applies
(a 1x1 conv over NHWC operands is a plain GEMM: M = N*OH*OW pixels, K = C_in), against cuDNN:

    PYTHONPATH=src python bench/stem_conv_gpu.py --pointwise --no-plan

With --epilogues: ResNet-50's stem with each fused epilogue form in the store (none, bias, bias+relu,
shift+relu, scale, scale+shift+relu; the operand-pass variants fold the scale into the weight), one
fixed config per variant. With --pool-plans: the stem's tail as fg.compile'd modules, b128 bf16
channels-last (conv -> batchnorm -> relu -> max-pool, the same with a conv bias instead of the
batchnorm, batchnorm -> relu -> max-pool and relu -> max-pool on a 64x112x112 input): device time
against eager, each plan's kernels with their configs, and the kernels' profiled times.

    PYTHONPATH=src python bench/stem_conv_gpu.py --epilogues --pool-plans --no-table --no-plan

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
POINTWISE_CASES = (
    Case("r50_s1_64_64", 128, 64, 64, 56, 1, 1, 0),
    Case("r50_s1_64_256", 128, 64, 256, 56, 1, 1, 0),
    Case("r50_s1_256_64", 128, 256, 64, 56, 1, 1, 0),
    Case("r50_ds2_256_512", 128, 256, 512, 56, 1, 2, 0),
    Case("r50_s2_128_512", 128, 128, 512, 28, 1, 1, 0),
    Case("r50_s2_512_128", 128, 512, 128, 28, 1, 1, 0),
    Case("r50_s3_256_1024", 128, 256, 1024, 14, 1, 1, 0),
    Case("r50_s3_1024_256", 128, 1024, 256, 14, 1, 1, 0),
    Case("r50_s4_512_2048", 128, 512, 2048, 7, 1, 1, 0),
    Case("r50_s4_2048_512", 128, 2048, 512, 7, 1, 1, 0),
)
POINTWISE_SMOKE_CASES = (
    Case("pointwise_smoke", 2, 32, 24, 9, 1, 1, 0),
    Case("pointwise_s2_smoke", 2, 48, 16, 9, 1, 2, 0),
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


VARIANTS = ("direct", "padded", "s2d", "gemm")


def variants_of(problem: Any) -> list[str]:
    """The variants the tuner is offered for this problem, in VARIANTS order."""
    from fusegraph.backends import triton_conv

    offered = {c["VARIANT"] for c in triton_conv.configs(problem)}
    return [v for v in VARIANTS if v in offered]


def tile(config: dict[str, Any]) -> str:
    return (f"{config['BLOCK_M']}x{config['BLOCK_N']}x{config['BLOCK_K']} w{config['num_warps']} "
            f"s{config['num_stages']}")


def conv_lines(case: Case, dtype: torch.dtype, device: str) -> tuple[list[str], bool]:
    """The table lines for `case` (cuDNN, then each variant tuned on its own, then the full tuning's
    pick), and whether every variant matched F.conv2d."""
    from fusegraph.backends import triton_conv

    x, w, _ = operands(case, dtype, device)
    stride, padding = (case.stride, case.stride), (case.padding, case.padding)
    problem = triton_conv.problem_of_tensors(x, w, None, stride, padding, (1, 1))
    want = F.conv2d(x, w, stride=case.stride, padding=case.padding)
    limit = BF16_LIMIT if dtype == torch.bfloat16 else 5e-3
    measure = timer(device)
    cudnn_dev, cudnn_flushed = measure(lambda: F.conv2d(x, w, stride=case.stride, padding=case.padding))
    shape = f"b{case.batch} {case.c_in}->{case.c_out} {case.kernel}x{case.kernel}/{case.stride} p{case.padding}"
    lines = [f"{case.name:15s} {shape:24s} {'cudnn':8s} {cudnn_dev:8.4f} {cudnn_flushed:8.4f}"]
    ok = True
    best: dict[str, float] = {}
    for variant in variants_of(problem):
        t0 = time.perf_counter()
        ours, tuning = triton_conv.autotuned(problem, device, variant)
        tune_s = time.perf_counter() - t0
        got = ours(x, w)
        assert got.stride() == want.stride() or not device.startswith("cuda"), (got.stride(), want.stride())
        err = rel_err(got, want)
        ok &= err <= limit
        dev, flushed = measure(lambda: ours(x, w))
        best[variant] = dev
        floor = triton_conv.floor_ms(problem, variant)
        extra = ""
        if ours.padder is not None:
            padder = ours.padder
            pass_dev, _ = measure(lambda: padder(x, w))
            extra = f" (its operand pass {pass_dev:.4f} ms, x_pad {padder.geom.nbytes / 1e6:.1f} MB)"
        lines.append(f"{'':15s} {'':24s} {variant:8s} {dev:8.4f} {flushed:8.4f} {cudnn_dev / dev:7.2f}x "
                     f"{'-' if floor is None else f'{floor:.4f}':>7s} {err:8.1e}{'' if err <= limit else ' FAIL'}  "
                     f"{tile(ours.config)} ({tuning['source']}, {tune_s:.1f} s){extra}")
    picked, tuning = triton_conv.tuned(problem, device)
    ratio = f"; padded/direct {best['padded'] / best['direct']:.2f}" if {"padded", "direct"} <= set(best) else ""
    lines.append(f"{'':15s} {'':24s} tuned pick: {picked.variant} {tile(picked.config)} ({tuning['source']})"
                 f"{ratio}")
    return lines, ok


def ptx_loads(ptx: str) -> dict[str, int]:
    """Global loads in PTX text by kind: "ld.global.b16", "cp.async 8 B", ..."""
    import re
    from collections import Counter

    counts: Counter[str] = Counter(re.findall(r"\bld\.global[.\w]*", ptx))
    for size in re.findall(r"\bcp\.async\.c[ag]\.shared\.global[^;]*?\],\s*\[[^\]]*\],\s*(0x[0-9a-f]+|\d+)", ptx):
        counts[f"cp.async {int(size, 0)} B"] += 1
    return dict(counts)


def load_lines(case: Case, dtype: torch.dtype, device: str) -> list[str]:
    """What each variant's tuned conv loads per thread, from its compiled PTX (GPU only): the
    padded variant should show cp.async of 8 (A, C_PAD = 4 bf16) and 16 bytes (w_pad) where the
    direct one has ld.global.b16."""
    from fusegraph.backends import triton_conv

    if not device.startswith("cuda"):
        return []
    x, w, _ = operands(case, dtype, device)
    problem = triton_conv.problem_of_tensors(x, w, None, (case.stride, case.stride), (case.padding, case.padding),
                                             (1, 1))
    lines = []
    for variant in variants_of(problem):
        ours, _ = triton_conv.autotuned(problem, device, variant)
        compiled = ours.warmup_job(x, w, None)()
        counts = ptx_loads(getattr(compiled, "asm", {}).get("ptx", ""))
        lines.append(f"{case.name} {variant} {tile(ours.config)} loads in the conv's PTX: "
                     + (", ".join(f"{n} x {k}" for k, n in sorted(counts.items())) or "(no PTX)"))
    return lines


def bound_call(fn: Callable[..., Any], *args: Any) -> Callable[[], Any]:
    return lambda: fn(*args)


def fused_lines(case: Case, dtype: torch.dtype, device: str) -> list[str]:
    """conv + bias + relu: torch's two calls, cuDNN's fused call, and our kernel in each variant
    with bias and relu in its store (the variant's tile config tuned for the plain conv)."""
    from fusegraph.backends import triton_conv

    x, w, b = operands(case, dtype, device)
    stride, padding = (case.stride, case.stride), (case.padding, case.padding)
    problem = triton_conv.problem_of_tensors(x, w, b, stride, padding, (1, 1))
    want = torch.relu(F.conv2d(x, w, b, stride=case.stride, padding=case.padding))
    calls: dict[str, Callable[[], Any]] = {
        "torch conv+relu": lambda: torch.relu(F.conv2d(x, w, b, stride=case.stride, padding=case.padding))}
    if device.startswith("cuda") and hasattr(torch, "cudnn_convolution_relu"):
        calls["cudnn_convolution_relu"] = lambda: torch.cudnn_convolution_relu(x, w, b, stride, padding, (1, 1), 1)
    errs = []
    for variant in variants_of(problem):
        plain, _ = triton_conv.autotuned(triton_conv.problem_of_tensors(x, w, None, stride, padding, (1, 1)),
                                         device, variant)
        ours = triton_conv.TritonConv(problem, plain.config, triton_conv.EpilogueForm(activation="relu"))
        err = rel_err(ours(x, w, b), want)
        errs.append(f"{variant} {err:.1e}{'' if err <= BF16_LIMIT else ' FAIL'}")
        calls[f"ours fused ({variant})"] = bound_call(ours, x, w, b)
    measure = timer(device)
    times = {k: measure(fn)[0] for k, fn in calls.items()}
    return [f"{case.name} + bias + relu: " + ", ".join(f"{k} {ms:.4f} ms" for k, ms in times.items())
            + f"; ours rel err {', '.join(errs)}"]


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


def epilogue_lines(case: Case, dtype: torch.dtype, device: str) -> list[str]:
    """The stem conv with each fused epilogue form, per variant (one config each, no tuning)."""
    from fusegraph.backends import triton_conv as tc

    x, w, b = operands(case, dtype, device)
    stride, padding = (case.stride, case.stride), (case.padding, case.padding)
    vectors = {"scale": torch.rand(case.c_out, device=device) + 0.5, "shift": torch.randn(case.c_out, device=device)}
    forms = [("none", False, tc.EpilogueForm()), ("bias", True, tc.EpilogueForm()),
             ("bias+relu", True, tc.EpilogueForm(activation="relu")),
             ("shift+relu", False, tc.EpilogueForm(shift=True, activation="relu")),
             ("scale", False, tc.EpilogueForm(scale=True)),
             ("scale+shift+relu", False, tc.EpilogueForm(scale=True, shift=True, activation="relu"))]
    measure = timer(device)
    lines = [f"{case.name} with fused epilogues (ms per call, operand pass included):"]
    for variant in variants_of(tc.problem_of_tensors(x, w, None, stride, padding, (1, 1))):
        cells = []
        for name, with_bias, form in forms:
            bias = b if with_bias else None
            problem = tc.problem_of_tensors(x, w, bias, stride, padding, (1, 1))
            config = next(c for c in tc.configs(problem) if c["VARIANT"] == variant)
            conv = tc.TritonConv(problem, config, form)
            cells.append(f"{name} {measure(bound_call(conv, x, w, bias, vectors))[0]:.4f}")
        lines.append(f"  {variant:7s} {tile(config)}: " + ", ".join(cells))
    return lines


def pool_plan_lines(dtype: torch.dtype, device: str, batch: int, size: int) -> list[str]:
    """ResNet-50's stem tail as fg.compile'd modules against eager (see the module doc)."""
    import fusegraph as fg

    def module(bn: bool, bias: bool, conv: bool) -> torch.nn.Module:
        layers: list[torch.nn.Module] = [torch.nn.Conv2d(3, 64, 7, 2, 3, bias=bias)] if conv else []
        if bn:
            norm = torch.nn.BatchNorm2d(64)
            with torch.no_grad():
                norm.running_mean.uniform_(-1, 1)
                norm.running_var.uniform_(0.5, 2)
                norm.weight.uniform_(0.5, 2)
            layers.append(norm)
        seq = torch.nn.Sequential(*layers, torch.nn.ReLU(), torch.nn.MaxPool2d(3, 2, 1)).eval()
        return seq.to(device, dtype).to(memory_format=torch.channels_last)  # type: ignore[call-overload]

    cl = torch.channels_last
    image = torch.randn(batch, 3, size, size, device=device, dtype=dtype).contiguous(memory_format=cl)
    maps = torch.randn(batch, 64, size // 2, size // 2, device=device, dtype=dtype).contiguous(memory_format=cl)
    measure = timer(device)
    lines = []
    for name, model, x in [("conv_bn_relu_pool", module(True, False, True), image),
                           ("conv_bias_relu_pool", module(False, True, True), image),
                           ("bn_relu_pool", module(True, False, False), maps),
                           ("relu_pool", module(False, False, False), maps)]:
        with torch.no_grad():
            compiled = fg.compile(model)
            got, want = compiled(x), model(x)
            ours, eager = measure(lambda c=compiled, x=x: c(x))[0], measure(lambda m=model, x=x: m(x))[0]
            lines.append(f"{name:20s} fusegraph {ours:.4f} ms, eager {eager:.4f} ms, rel err {rel_err(got, want):.1e}"
                         f", strides {'equal' if got.stride() == want.stride() else 'DIFFER'}")
            for graph in compiled.fusegraph_report.graphs:
                for part in graph.partitions:
                    for k in part.plan.kernels if part.plan is not None else []:
                        lines.append(f"    {k.name} ({k.kind}/{k.backend}) config {k.config}")
            if device.startswith("cuda"):
                from torch.profiler import ProfilerActivity, profile
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(10):
                        compiled(x)
                    torch.cuda.synchronize()
                for row in prof.key_averages():
                    if row.device_time_total > 0:
                        lines.append(f"    kernel {row.key[:60]}: {row.device_time_total / row.count / 1e3:.4f} ms "
                                     f"x{row.count // 10}")
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
    parser.add_argument("--pointwise", action="store_true", help="ResNet-50's 1x1 convolutions (the gemm variant)")
    parser.add_argument("--no-table", action="store_true", help="skip the per-variant tuning table")
    parser.add_argument("--epilogues", action="store_true", help="the stem with each fused epilogue form")
    parser.add_argument("--pool-plans", action="store_true", help="the stem's conv/bn/relu/max-pool tail as plans")
    args = parser.parse_args()
    smoke = args.cpu_smoke or not torch.cuda.is_available()
    device, dtype = ("cpu", torch.float16) if smoke else ("cuda", torch.bfloat16)
    cases = {(False, False): CASES, (True, False): SMOKE_CASES, (False, True): POINTWISE_CASES,
             (True, True): POINTWISE_SMOKE_CASES}[(smoke, args.pointwise)]
    header = (f"{'case':15s} {'shape':24s} {'kernel':8s} {'ms':>8s} {'flushed':>8s} {'vs cudnn':>8s} "
              f"{'floor':>7s} {'rel err':>8s}  config")
    gpu = torch.cuda.get_device_name() if not smoke else "CPU (interpreter smoke run)"
    kind = "1x1" if args.pointwise else "stem"
    emit(f"== {kind} convolutions, {gpu}, {str(dtype).replace('torch.', '')}, channels-last; ms per call ==")
    emit(header)
    ok = True
    for case in [] if args.no_table else cases:
        lines, matched = conv_lines(case, dtype, device)
        ok &= matched
        emit("\n".join(lines))
    if not args.no_table:
        for line in load_lines(cases[0], dtype, device):
            emit(line)
        emit("\n".join(fused_lines(cases[0], dtype, device)))
    if args.epilogues:
        emit("\n".join(epilogue_lines(cases[0], dtype, device)))
    if args.pool_plans:
        emit("\n".join(pool_plan_lines(dtype, device, *((2, 16) if smoke else (128, 224)))))
    if not args.no_plan:
        emit("\n".join(plan_lines(cases[0], dtype, device)))
    if not ok:
        raise SystemExit("our Triton conv disagreed with F.conv2d beyond the tolerance (FAIL rows)")


if __name__ == "__main__":
    main()
