"""`fusegraph demo`: build a transformer block and a conv block through the Graph API, run them,
check them against eager PyTorch, and print the graph, the plan, its explain report and the result.

On a GPU it uses bf16 at moderate sizes and times each call; on a CPU it runs small sizes in float32
and says which figures need a GPU instead of printing any."""

from __future__ import annotations

import argparse
import contextlib
import os
import time
import traceback
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

import fusegraph as fg

from ..ir import dtypes
from .demo_blocks import CONV_OPS, SIZES, TRANSFORMER_OPS, DemoBlock, conv_block, transformer_block

# ||fusegraph - eager float32|| / ||eager float32|| limits for a whole block, by the demo's dtype.
# float32 on a GPU allows for TF32 in generated matmuls; bf16/fp16 for rounding between kernels.
BLOCK_TOLERANCE = {
    ("float64", "cpu"): 1e-8, ("float64", "cuda"): 1e-8,
    ("float32", "cpu"): 1e-4, ("float32", "cuda"): 5e-3,
    ("float16", "cpu"): 1e-2, ("float16", "cuda"): 1e-2,
    ("bfloat16", "cpu"): 3e-2, ("bfloat16", "cuda"): 3e-2,
}
GPU_ONLY_FIGURES = ("time per call (device time and per-call latency, CUDA events, median)",
                    "speed-up over eager PyTorch", "% of the hardware floor")


@dataclass
class BlockResult:
    name: str
    ok: bool
    error: float | None = None            # relative-norm error of fusegraph against eager in float32
    eager_error: float | None = None      # the same for eager PyTorch in the demo's dtype, for scale
    tolerance: float = 0.0
    kernels: Counter[str] = field(default_factory=Counter)
    graph_ops: int = 0
    build_s: float = 0.0
    floor_ms: float | None = None         # sum of the kernels' floors on this GPU (cost model)
    device_ms: float | None = None        # steady state per call (CUDA-graph replay or back-to-back)
    latency_ms: float | None = None       # events around one call
    eager_device_ms: float | None = None
    eager_latency_ms: float | None = None
    failure: str = ""


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; inf when out has non-finite values."""
    out64, ref64 = out.detach().double().cpu(), ref.detach().double().cpu()
    if not torch.isfinite(out64).all():
        return float("inf")
    denom = ref64.norm().item()
    return (out64 - ref64).norm().item() / (denom if denom > 0 else 1.0)


@contextlib.contextmanager
def exact_float32() -> Iterator[None]:
    """No TF32 in eager matmuls and convolutions (cuDNN allows it by default), for the accurate answer."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def missing_ops(names: tuple[str, ...]) -> list[str]:
    return [n for n in names if not callable(getattr(fg.Graph, n, None))]


def _section(title: str) -> None:
    print(f"\n-- {title} --")


def run_block(block: DemoBlock, device: str, dtype: str, args: argparse.Namespace) -> BlockResult:
    """Build, print, run, check and (on a GPU) time one block."""
    from ..perf.explain import analyze_plan

    result = BlockResult(block.name, ok=False, tolerance=BLOCK_TOLERANCE[(dtype, device)])
    print(f"\n== {block.name}: {block.description} ==")
    start = time.perf_counter()
    try:
        plan = block.graph.build(device=device)
    except Exception as err:
        result.failure = f"build failed: {type(err).__name__}: {err}"
        traceback.print_exc()
        return result
    result.build_s = time.perf_counter() - start
    result.kernels = Counter(k.kind for k in plan.kernels)
    result.graph_ops = sum(1 for n in plan.graph.nodes if n.op not in ("input", "constant", "scalar"))
    if not args.quiet:
        _section("graph after passes")
        print(plan.graph)
        _section("plan (kernels: kind, backend, ops fused)")
        print(plan)

    try:
        out = plan.execute(block.feeds)[block.output]
        report = analyze_plan(plan, inputs=block.feeds)   # what plan.explain() prints, on the demo's inputs
    except Exception as err:
        result.failure = f"execute failed: {type(err).__name__}: {err}"
        traceback.print_exc()
        return result
    if not args.quiet:
        _section("plan.explain()")
        print(report.to_text())
    truth_dtype = torch.float64 if dtype == "float64" else torch.float32
    with exact_float32():
        truth = block.eager_in(truth_dtype)
    result.error = rel_err(out, truth)
    result.eager_error = rel_err(block.eager_in(dtypes.to_torch(dtype)), truth)
    result.ok = result.error <= result.tolerance
    if not result.ok:
        result.failure = (f"fusegraph differs from eager PyTorch: relative error {result.error:.2e} > "
                          f"tolerance {result.tolerance:.0e}")
    floor_source = ""
    if device == "cuda":
        try:
            _time_on_gpu(block, plan, result, args.reps)
        except Exception as err:
            result.ok = False
            result.failure = f"timing failed: {type(err).__name__}: {err}"
            traceback.print_exc()
        result.floor_ms = report.total_floor_s * 1e3
        floor_source = f"{report.spec.name}, {'measured' if report.spec.measured else 'datasheet'} ceilings"

    _section("result")
    kinds = ", ".join(f"{kind} {count}" for kind, count in sorted(result.kernels.items()))
    print(f"kernels: {sum(result.kernels.values())} ({kinds}) for {result.graph_ops} ops after passes; "
          f"build {result.build_s:.2f} s")
    print(f"error vs eager PyTorch in {dtypes.canonical(truth_dtype)}: fusegraph {result.error:.2e}, "
          f"eager {dtype} {result.eager_error:.2e} (tolerance {result.tolerance:.0e}) -> "
          f"{'OK' if result.ok else 'FAILED'}")
    if result.device_ms is not None and result.latency_ms is not None:
        assert result.eager_device_ms is not None and result.eager_latency_ms is not None
        print(f"device time per call (steady state, median): fusegraph {result.device_ms:.4f} ms, "
              f"eager PyTorch {result.eager_device_ms:.4f} ms, speed-up "
              f"{result.eager_device_ms / result.device_ms:.2f}x")
        print(f"latency of one call (CUDA events, median of {args.reps}): fusegraph {result.latency_ms:.4f} ms, "
              f"eager PyTorch {result.eager_latency_ms:.4f} ms, speed-up "
              f"{result.eager_latency_ms / result.latency_ms:.2f}x")
        if result.floor_ms:
            print(f"floor (sum of kernel floors, {floor_source}): {result.floor_ms:.4f} ms; fusegraph at "
                  f"{100 * result.floor_ms / result.device_ms:.0f}% of it")
    return result


def _time_on_gpu(block: DemoBlock, plan: Any, result: BlockResult, reps: int) -> None:
    """Both timings of the benchmark protocol, for the plan and for eager PyTorch in the same dtype."""
    from ..perf.timing import call_latency, device_time

    positional = list(block.feeds.values())
    named = block.named_tensors

    def run_plan() -> Any:
        return plan(*positional)

    def run_eager() -> Any:
        return block.eager(named)

    with torch.no_grad():
        result.device_ms = device_time(run_plan).ms
        result.latency_ms = call_latency(run_plan, repeats=reps).ms
        result.eager_device_ms = device_time(run_eager).ms
        result.eager_latency_ms = call_latency(run_eager, repeats=reps).ms


def _defaults(args: argparse.Namespace) -> tuple[str, str, str]:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda"):
        raise SystemExit(f"fusegraph demo: --device must be cpu or cuda, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("fusegraph demo: --device cuda asked for, but torch sees no GPU")
    size = args.size or ("medium" if device == "cuda" else "small")
    dtype = dtypes.canonical(args.dtype or ("bfloat16" if device == "cuda" else "float32"))
    if (dtype, device) not in BLOCK_TOLERANCE:
        raise SystemExit(f"fusegraph demo: --dtype must be one of float64, float32, float16, bfloat16; got {dtype}")
    return device, size, dtype


def run_demo(args: argparse.Namespace) -> int:
    device, size, dtype = _defaults(args)
    interpret = os.environ.get("TRITON_INTERPRET", "") not in ("", "0")
    transformer_size, conv_size = SIZES[size]
    print(f"fusegraph {fg.__version__} demo: device {device}, dtype {dtype}, size {size}, torch {torch.__version__}")
    if device == "cuda":
        print(f"GPU: {torch.cuda.get_device_name()} (compute capability "
              f"{'.'.join(map(str, torch.cuda.get_device_capability()))})")
    else:
        print("no GPU: generated Triton kernels run " + ("under Triton's interpreter (TRITON_INTERPRET=1)"
              if interpret else "through the reference lowering (set TRITON_INTERPRET=1 to run them)"))
        if interpret and dtype == "bfloat16":
            print("warning: under TRITON_INTERPRET=1 tl.dot on bfloat16 gives wrong results; use --dtype float32")

    wanted = ("transformer", "conv") if args.block == "all" else (args.block,)
    needed = {"transformer": TRANSFORMER_OPS, "conv": CONV_OPS}
    absent = sorted({op for name in wanted for op in missing_ops(needed[name])})
    if absent:
        print(f"fusegraph demo: this build of fusegraph lacks the Graph API ops {', '.join(absent)}; "
              "the demo cannot run")
        return 2

    torch_dtype = dtypes.to_torch(dtype)
    results = []
    for name in wanted:
        if name == "transformer":
            block = transformer_block(transformer_size, torch_dtype, device, seed=args.seed,
                                      second_norm=args.norm, gelu_approximate=args.gelu)
        else:
            block = conv_block(conv_size, torch_dtype, device, seed=args.seed + 1, layout=args.layout)
        results.append(run_block(block, device, dtype, args))

    print("\n== summary ==")
    for r in results:
        status = "OK" if r.ok else f"FAILED ({r.failure})"
        err = f"error {r.error:.2e}" if r.error is not None else "no result"
        timing = f", {r.device_ms:.4f} ms per call" if r.device_ms is not None else ""
        print(f"{r.name:<12} {sum(r.kernels.values()):>3} kernels, {err}{timing}: {status}")
    if device != "cuda":
        print("needs a GPU (not measured here, so not shown): " + "; ".join(GPU_ONLY_FIGURES) + ".")
    return 0 if all(r.ok for r in results) else 1


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "demo", help="build, run and check a transformer block and a conv block",
        description="Build a pre-norm transformer block and a conv block through the Graph API, run them, "
                    "check them against eager PyTorch, and print the graph, the plan and the result. "
                    "Exits non-zero when a result is wrong.")
    parser.add_argument("--size", choices=sorted(SIZES), default=None,
                        help="problem sizes (default: medium on a GPU, small on a CPU)")
    parser.add_argument("--dtype", default=None,
                        help="float32, bfloat16, float16 or float64 (default: bfloat16 on a GPU, float32 on a CPU)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when a GPU is present)")
    parser.add_argument("--block", choices=("all", "transformer", "conv"), default="all", help="which block to run")
    parser.add_argument("--layout", choices=("NHWC", "NCHW"), default="NHWC", help="conv block layout")
    parser.add_argument("--norm", choices=("layernorm", "rmsnorm"), default="layernorm",
                        help="the transformer's second normalization")
    parser.add_argument("--gelu", choices=("none", "tanh"), default="none", help="gelu approximation")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights and inputs")
    parser.add_argument("--reps", type=int, default=50, help="timed calls per measurement on a GPU")
    parser.add_argument("--quiet", action="store_true", help="print only the results, not graphs and plans")
    parser.set_defaults(func=run_demo)
