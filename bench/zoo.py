"""The model zoo benchmark (issue 5 step 6): every model of bench/zoo_models.py through eager PyTorch,
torch.compile (Inductor, default mode) and fusegraph (torch.compile backend), inference.

    python bench/zoo.py --list
    # on the H200, one 10-minute call each (k = 1, 2: 462 and 479 s in bf16, twenty-third session);
    # rows past the budget are listed as skipped:
    python bench/zoo.py --dtypes bfloat16 --no-warm --part k/2 --budget-s 545
    python bench/zoo.py --dtypes float32 --no-warm --part k/4 --budget-s 520
    python bench/zoo.py --only tv_resnet50 hf_gpt2 --dtypes bfloat16          # with the warm recompiles
    python bench/zoo.py --dtypes bfloat16 --warm process --part k/4  # warm = a new process on the same caches
    python bench/zoo.py --only tv_resnet50 hf_gpt2 --dtypes bfloat16 --quick
    python bench/zoo.py --train                             # GPT-2-124M and ResNet-50 training steps (zoo_train.py)
    TRITON_INTERPRET=1 python bench/zoo.py --cpu-smoke      # tiny configs on CPU, float32, no Inductor
    python bench/zoo.py --cpu-smoke --lowering reference    # the same through the reference lowering (faster)
    python bench/zoo.py --minilm                            # the real-weight model on CPU (fp32, vs eager)
    # the real-weight model on the GPU: export its weights in fp16 here (44 MiB), carry the folder, point to it
    python bench/zoo_minilm.py --export-fp16 build/minilm_fp16
    ZOO_MINILM_DIR=build/minilm_fp16 python bench/zoo.py --only st_all_minilm_l6_v2     # (carry build/minilm_fp16)

Per model and dtype (GPU: float32 with TF32 off on both sides, and bfloat16):
- correctness: float32 by relative norm error vs eager (<= 1e-4); bfloat16 against an fp32 reference of
  the same weights and inputs, failing only beyond 2x eager-bf16's own error + 5e-3 (the rule and helpers
  of bench/torch_backend_gpu.py, imported);
- speed: device time = N back-to-back calls between two CUDA events, median of 5 (ms per call), and
  per-call latency = events around one call, median of 20 (BENCHMARKS.md protocol);
- compile time: cold = first call of a fresh compile in this process (empty Inductor/Triton caches only if
  the machine is fresh); warm = the same model compiled again in-process after torch._dynamo.reset() (the
  on-disk tuning cache and Triton's kernel cache are warm), or with --warm process its first call in a
  new process on the same caches (what a user's second run pays; one process per implementation);
- peak memory (inference, no_grad): max_memory_allocated over one call minus what was allocated before it
  (weights and inputs), for eager, Inductor and fusegraph;
- fallbacks: ops fusegraph left to torch (names, with why) and the count of eager ATen op instances.
Results: JSON lines and a markdown table in $OUT (when set) and bench/results/. A model that loses the
CUDA context (a device-side assert poisons every later CUDA call) is recorded as failed, and the rows left
run in a fresh process (os.execv) that appends to the same results within the remaining --budget-s.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from torch_backend_gpu import LOW_TOL, TOL, kernel_summary, rel_err
from zoo_models import MODELS, ZooModel, available

import fusegraph as fg
from fusegraph.frontends.torch_partition import FallbackWarning
from fusegraph.settings import override

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def sync(dev: str) -> None:
    if dev == "cuda":
        torch.cuda.synchronize()


def device_time_ms(fn: Callable[[], Any], calls: int, reps: int = 5) -> float:
    """Median over `reps` of (time of `calls` back-to-back calls between two CUDA events) / calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def latency_ms(fn: Callable[[], Any], calls: int = 20) -> float:
    """Median of events around one call each (what a user's loop sees, host overhead included)."""
    times = []
    for _ in range(calls):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def cpu_time_ms(fn: Callable[[], Any], calls: int = 3) -> float:
    fn()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def first_call_s(fn: Callable[[], Any], dev: str) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    sync(dev)
    return time.perf_counter() - t0, out


@contextlib.contextmanager
def lowering(kind: str) -> Iterator[None]:
    """'triton' (generated kernels; on CPU under TRITON_INTERPRET=1) or 'reference' (reference lowering)."""
    if kind == "reference":
        with override(use_triton=False):
            yield
    else:
        yield


def randomize_zero_weights(model: torch.nn.Module, seed: int = 0) -> list[str]:
    """Weights (2+ dims) initialized to all zeros get random values (std 0.02): timm zero-initializes
    some classifier heads (MLP-Mixer), whose output is then identically zero and a comparison with
    eager proves nothing. Returns the names changed."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    changed = []
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.is_floating_point() and p.dim() >= 2 and p.numel() and not p.any():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
                changed.append(name)
    return changed


def check(got: torch.Tensor, ref: torch.Tensor, ref32: torch.Tensor | None, dtype: torch.dtype) -> dict[str, Any]:
    """float32: rel err vs eager <= TOL; low precision: vs the fp32 reference, within 2x eager's + LOW_TOL.
    An all-zero reference output fails: it cannot tell a right result from a wrong one."""
    if not ref.float().abs().sum().item():
        return {"rel_err_vs_eager": float("nan"), "ok": False, "degenerate": "eager's output is all zeros"}
    row: dict[str, Any] = {"rel_err_vs_eager": rel_err(got.float(), ref.float())}
    if ref32 is None:
        row["ok"] = bool(row["rel_err_vs_eager"] <= TOL.get(dtype, 1e-4))
        return row
    ours, eager = rel_err(got.float(), ref32), rel_err(ref.float(), ref32)
    row.update(err_vs_fp32_ours=ours, err_vs_fp32_eager=eager, ok=bool(ours <= 2 * eager + LOW_TOL))
    return row


def memory_baseline(dev: str) -> int:
    """Allocated bytes now (after freeing what is no longer referenced): what a variant's peak is measured from."""
    if dev != "cuda":
        return 0
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated()


def measure(row: dict[str, Any], who: str, fn: Callable[[], Any], baseline: int, dev: str, quick: bool) -> None:
    """Device time, per-call latency and steady-state peak memory of a warmed-up `fn` into row[who_*].
    Peak = max allocated during one call minus `baseline` (taken before the variant was built, so the
    buffers and CUDA-graph pools it keeps count)."""
    if dev != "cuda":
        row[f"{who}_ms"] = cpu_time_ms(fn, 1 if who != "eager" else 3)
        return
    row[f"{who}_ms"] = device_time_ms(fn, 5 if quick else 20)
    row[f"{who}_latency_ms"] = latency_ms(fn)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    row[f"{who}_peak_mb"] = round((torch.cuda.max_memory_allocated() - baseline) / 2**20, 1)
    del out


def run_model(m: ZooModel, dtype: torch.dtype, args: argparse.Namespace) -> dict[str, Any]:
    dev = "cpu" if args.cpu_smoke else "cuda"
    size = "tiny" if args.cpu_smoke else "full"
    batch = args.batch or (None if not args.quick else max(1, m.batch // 4))
    row: dict[str, Any] = {"model": m.name, "family": m.family, "library": m.library,
                           "dtype": str(dtype).replace("torch.", ""), "size": size}
    model = m.build(size).eval()
    row["randomized_zero_weights"] = randomize_zero_weights(model)
    model = model.to(dev)
    row["params_m"] = round(sum(p.numel() for p in model.parameters()) / 1e6, 2)
    ex = m.example(batch, torch.float32, dev, size)
    row["batch"] = int(ex.inputs[0].shape[0])
    ref32 = None
    with torch.no_grad():
        if dtype != torch.float32:
            ref32 = model(*ex.inputs).float()
            model = model.to(dtype)
        inputs = tuple(x.to(dtype) if x.is_floating_point() else x for x in ex.inputs)

        def eager() -> Any:
            return model(*inputs)

        ref = eager()
        measure(row, "eager", eager, memory_baseline(dev), dev, args.quick)

        torch._dynamo.reset()
        baseline = memory_baseline(dev)
        compiled = fg.compile(model)
        with warnings.catch_warnings(record=True) as caught, lowering(args.lowering):
            warnings.simplefilter("always", FallbackWarning)
            row["fusegraph_compile_cold_s"], got = first_call_s(lambda: compiled(*inputs), dev)
            row.update(check(got, ref, ref32, dtype))
            del got
            report = compiled.fusegraph_report
            row["fallback_ops"] = report.fallback_ops
            row["eager_op_count"] = sum(sum(g.fallbacks.values()) for g in report.graphs)
            row["kernels"] = {k: {"kernels": v["kernels"], "layout_only": v["layout_only"],
                                  "partitions": v["partitions"], "eager_partitions": v["eager_partitions"]}
                              for k, v in kernel_summary(report).items()}
            row["fallback_warnings"] = [str(w.message)[:300] for w in caught
                                        if issubclass(w.category, FallbackWarning)]
            measure(row, "fusegraph", lambda: compiled(*inputs), baseline, dev, args.quick)
            compiled = None  # free its Plans before the warm recompile
            if not args.no_warm and args.warm == "inprocess":
                torch._dynamo.reset()
                again = fg.compile(model)
                row["fusegraph_compile_warm_s"], _ = first_call_s(lambda: again(*inputs), dev)
                del again, _
        if not args.no_inductor:
            torch._dynamo.reset()
            baseline = memory_baseline(dev)
            by_inductor = torch.compile(model)
            row["inductor_compile_cold_s"], got = first_call_s(lambda: by_inductor(*inputs), dev)
            row["inductor_check"] = check(got, ref, ref32, dtype)
            del got
            measure(row, "inductor", lambda: by_inductor(*inputs), baseline, dev, args.quick)
            by_inductor = None
            if not args.no_warm and args.warm == "inprocess":
                torch._dynamo.reset()
                again = torch.compile(model)
                row["inductor_compile_warm_s"], _ = first_call_s(lambda: again(*inputs), dev)
                del again, _
            row["speedup_vs_inductor"] = row["inductor_ms"] / row["fusegraph_ms"]
        row["speedup_vs_eager"] = row["eager_ms"] / row["fusegraph_ms"]
    torch._dynamo.reset()
    if not args.no_warm and args.warm == "process":
        for impl in ("fusegraph",) + (() if args.no_inductor else ("inductor",)):
            row[f"{impl}_compile_warm_s"] = warm_in_new_process(m, dtype, args, impl)
    return row


def warm_in_new_process(m: ZooModel, dtype: torch.dtype, args: argparse.Namespace, impl: str) -> float | str:
    """The first call's seconds of `impl` compiling the same model in a new process on this process's
    caches (what a user's second run pays), or why it could not be measured."""
    import subprocess

    cmd = [sys.executable, os.path.abspath(__file__), "--warm-child", impl, "--only", m.name,
           "--dtypes", str(dtype).replace("torch.", ""), "--lowering", args.lowering]
    cmd += ["--cpu-smoke"] * bool(args.cpu_smoke) + ["--quick"] * bool(args.quick)
    cmd += ["--batch", str(args.batch)] if args.batch else []
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        return "timed out (600 s)"
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode != 0 or not lines:
        return f"failed (rc {done.returncode}): {done.stderr.strip().splitlines()[-1:] or ''}"[:300]
    return float(json.loads(lines[-1])["first_call_s"])


def warm_child(args: argparse.Namespace) -> int:
    """--warm-child IMPL: build the one model of --only as run_model does, compile it with IMPL, print
    the first call's seconds as JSON (run by warm_in_new_process)."""
    (m,) = select(args)
    dtype = getattr(torch, (args.dtypes or ["float32"])[0])
    dev = "cpu" if args.cpu_smoke else "cuda"
    size = "tiny" if args.cpu_smoke else "full"
    batch = args.batch or (None if not args.quick else max(1, m.batch // 4))
    model = m.build(size).eval().to(dev).to(dtype)
    ex = m.example(batch, torch.float32, dev, size)
    inputs = tuple(x.to(dtype) if x.is_floating_point() else x for x in ex.inputs)
    compiled = fg.compile(model) if args.warm_child == "fusegraph" else torch.compile(model)
    with torch.no_grad(), lowering(args.lowering):
        seconds, _ = first_call_s(lambda: compiled(*inputs), dev)
    print(json.dumps({"impl": args.warm_child, "model": m.name, "first_call_s": seconds}))
    return 0


def versions() -> dict[str, Any]:
    import triton
    info: dict[str, Any] = {"torch": torch.__version__, "triton": triton.__version__}
    if torch.cuda.is_available():
        info.update(gpu=torch.cuda.get_device_name(), cudnn=torch.backends.cudnn.version())
    for lib in ("torchvision", "timm", "transformers"):
        with contextlib.suppress(Exception):
            info[lib] = __import__(lib).__version__
    return info


def select(args: argparse.Namespace) -> list[ZooModel]:
    by_name = {m.name: m for m in MODELS}
    # --only runs the models in the order given (the first ones run before a --budget-s cut)
    models = [by_name[n] for n in dict.fromkeys(args.only) if n in by_name] if args.only else list(MODELS)
    unknown = sorted(set(args.only or ()) - {m.name for m in MODELS})
    if unknown:
        raise SystemExit(f"unknown model(s): {', '.join(unknown)}; see --list")
    if args.part:
        k, n = (int(v) for v in args.part.split("/"))
        models = models[k - 1::n]
    return models


def fmt(v: Any, spec: str = ".3f") -> str:
    return format(v, spec) if isinstance(v, int | float) else "-"


def markdown(rows: list[dict[str, Any]], header: str) -> str:
    lines = [header, "", "| model | dtype | ok | err (vs eager; bf16: ours/eager vs fp32) | eager ms | inductor ms "
             "| fusegraph ms | vs inductor | vs eager | compile cold s (ind/fg) | warm s (ind/fg) "
             "| peak MB (eager/ind/fg) | eager ops | fallback ops |", "|" + "---|" * 14]
    for r in rows:
        if "error" in r or "skipped" in r:
            why = r.get("error") or r.get("skipped")
            lines.append(f"| {r['model']} | {r.get('dtype', '-')} | {'ERROR' if 'error' in r else 'skipped'} "
                         f"| {str(why)[:120]} |" + " |" * 10)
            continue
        err = (f"{r['err_vs_fp32_ours']:.1e}/{r['err_vs_fp32_eager']:.1e}" if "err_vs_fp32_ours" in r
               else f"{r['rel_err_vs_eager']:.1e}")
        lines.append(
            f"| {r['model']} | {r['dtype']} | {r['ok']} | {err} | {fmt(r.get('eager_ms'))} | "
            f"{fmt(r.get('inductor_ms'))} | {fmt(r.get('fusegraph_ms'))} | "
            f"{fmt(r.get('speedup_vs_inductor'), '.2f')} | "
            f"{fmt(r.get('speedup_vs_eager'), '.2f')} | {fmt(r.get('inductor_compile_cold_s'), '.1f')}/"
            f"{fmt(r.get('fusegraph_compile_cold_s'), '.1f')} | {fmt(r.get('inductor_compile_warm_s'), '.1f')}/"
            f"{fmt(r.get('fusegraph_compile_warm_s'), '.1f')} | {fmt(r.get('eager_peak_mb'), '.0f')}/"
            f"{fmt(r.get('inductor_peak_mb'), '.0f')}/{fmt(r.get('fusegraph_peak_mb'), '.0f')} | "
            f"{r['eager_op_count']} | {', '.join(op.replace('aten.', '') for op in r['fallback_ops']) or '-'} |")
    ratios = [r["speedup_vs_inductor"] for r in rows if r.get("speedup_vs_inductor")]
    if ratios:
        geo = statistics.geometric_mean(ratios)
        lines.append(f"\ngeomean fusegraph speedup vs torch.compile over {len(ratios)} rows: {geo:.3f}")
    failures = [f"{r['model']}/{r.get('dtype')}" for r in rows if not r.get("ok") and "skipped" not in r]
    lines.append(f"correctness failures or errors: {', '.join(failures) or 'none'}")
    return "\n".join(lines)


class Results:
    """Rows written as they come (JSON lines in $OUT and bench/results/: a run cut off by its time limit keeps
    what it measured), the markdown table at the end."""

    def __init__(self, tag: str, stem: str | None = None) -> None:
        self.rows: list[dict[str, Any]] = []
        self.stem = stem or f"zoo-{tag}-{time.strftime('%Y%m%d-%H%M%S')}"
        self.folders = [f for f in (os.environ.get("OUT"), RESULTS_DIR) if f]
        for folder in self.folders:
            os.makedirs(folder, exist_ok=True)
        if stem:   # a resumed run (after a lost CUDA context): the rows measured before it
            path = os.path.join(self.folders[0], stem + ".jsonl")
            if os.path.exists(path):
                with open(path) as f:
                    self.rows = [json.loads(line) for line in f if line.strip()]

    def add(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        print(json.dumps(row), flush=True)
        for folder in self.folders:
            with open(os.path.join(folder, self.stem + ".jsonl"), "a") as f:
                f.write(json.dumps(row) + "\n")

    def finish(self, header: str, table: Callable[[list[dict[str, Any]], str], str] | None = None) -> None:
        text = (table or markdown)(self.rows, header)
        print("\n" + text)
        for folder in self.folders:
            with open(os.path.join(folder, self.stem + ".md"), "w") as f:
                f.write(text + "\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--list", action="store_true", help="list the models and whether each can be built here")
    p.add_argument("--only", nargs="*", default=None, help="model names (see --list), run in this order")
    p.add_argument("--dtypes", nargs="*", default=None, help="default: float32 bfloat16 (GPU), float32 (CPU)")
    p.add_argument("--quick", action="store_true", help="batch / 4 and fewer timed calls")
    p.add_argument("--batch", type=int, default=None, help="override every model's batch")
    p.add_argument("--part", default=None, help="k/n: run every n-th model starting at the k-th (1-based)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="stop before starting a model that would not finish within this many seconds")
    p.add_argument("--no-inductor", action="store_true", help="skip torch.compile (Inductor)")
    p.add_argument("--no-warm", action="store_true", help="skip the warm recompiles")
    p.add_argument("--warm", choices=("inprocess", "process"), default="inprocess",
                   help="warm compile: the model compiled again in this process after torch._dynamo.reset(), or "
                        "in a new process on the same caches (a user's second run)")
    p.add_argument("--warm-child", default=None, help=argparse.SUPPRESS)   # fusegraph | inductor (--warm process)
    p.add_argument("--inductor", action="store_true",
                   help="with --cpu-smoke: also Inductor and the warm recompiles (checks the whole script on CPU)")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny configs on CPU, float32, no Inductor")
    p.add_argument("--lowering", choices=("triton", "reference"), default="triton",
                   help="CPU: generated kernels under TRITON_INTERPRET=1, or the reference lowering")
    p.add_argument("--train", action="store_true", help="GPT-2-124M and ResNet-50 training steps (zoo_train.py)")
    p.add_argument("--minilm", action="store_true", help="the real-weight model on CPU, fp32, vs eager")
    p.add_argument("--resume", default=None, help=argparse.SUPPRESS)   # the results stem a restarted run appends to
    p.add_argument("--todo", nargs="*", default=None, help=argparse.SUPPRESS)   # model/dtype pairs left to run
    return p.parse_args(argv)


def cuda_usable() -> bool:
    """False when the CUDA context is lost (a device-side assert poisons every later CUDA call)."""
    try:
        torch.cuda.synchronize()
        return float(torch.ones(1, device="cuda").sum().item()) == 1.0
    except Exception:  # the error of the lost context itself
        return False


def restart_argv(argv: list[str], left: list[tuple[str, str]], stem: str, budget_left: float | None) -> list[str]:
    """The command line of a fresh process that runs the `left` (model, dtype) pairs and appends to `stem`:
    the original options without the model selection, budget and earlier resume state."""
    drop_with_values = {"--only", "--part", "--budget-s", "--resume", "--todo", "--dtypes"}
    kept: list[str] = []
    skipping = False
    for arg in argv:
        if arg.startswith("--"):
            name = arg.split("=", 1)[0]
            skipping = name in drop_with_values and "=" not in arg
            if name in drop_with_values:
                continue
        elif skipping:
            continue
        kept.append(arg)
    kept += ["--resume", stem, "--todo", *[f"{m}/{d}" for m, d in left]]
    if budget_left is not None:
        kept += ["--budget-s", f"{max(budget_left, 1.0):.0f}"]
    return kept


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list:
        for m in MODELS:
            print(f"{m.name:30s} {m.family:9s} {m.library:22s} batch {m.batch:3d}  "
                  f"{available(m) or 'ok'}  {m.note}")
        return 0
    if args.train:
        from zoo_train import main as train_main
        return train_main(args)
    if args.minilm:
        from zoo_minilm import main as minilm_main
        return minilm_main()
    if args.warm_child:
        return warm_child(args)
    if args.cpu_smoke and not args.inductor:
        args.no_inductor, args.no_warm = True, args.warm != "process"
    if not args.cpu_smoke and not torch.cuda.is_available():
        raise SystemExit("no GPU: use --cpu-smoke (tiny configs on CPU)")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dtypes = [getattr(torch, d) for d in (args.dtypes or (["float32"] if args.cpu_smoke else ["float32", "bfloat16"]))]
    start, longest = time.perf_counter(), 0.0
    tag = "cpu-smoke" if args.cpu_smoke else ("gpu" + (f"-part{args.part.replace('/', 'of')}" if args.part else ""))
    results = Results(tag, args.resume)
    rows = results.rows
    if args.todo is not None:   # a restarted run: exactly the pairs the lost process had left
        by_name = {m.name: m for m in MODELS}
        todo = [(by_name[name], getattr(torch, d)) for name, d in (pair.split("/") for pair in args.todo)]
    else:
        todo = [(m, d) for m in select(args) for d in dtypes]
    for i, (m, dtype) in enumerate(todo):
        base = {"model": m.name, "dtype": str(dtype).replace("torch.", "")}
        elapsed = time.perf_counter() - start
        if args.budget_s and elapsed + 1.2 * longest > args.budget_s:
            left = [f"{n.name}/{str(d).replace('torch.', '')}" for n, d in todo[i:]]
            print(f"budget: stopping after {elapsed:.0f} s (longest model {longest:.0f} s); not run: {', '.join(left)}")
            for n, d in todo[i:]:
                results.add({"model": n.name, "dtype": str(d).replace("torch.", ""), "skipped": "time budget"})
            break
        missing = available(m)
        if missing:
            results.add({**base, "skipped": missing})
            continue
        if m.real_weights and not args.cpu_smoke and not os.environ.get("ZOO_MINILM_DIR"):
            results.add({**base, "skipped": "real-weight model: checked on CPU (bench/zoo.py --minilm); "
                         "to run it here carry an export (zoo_minilm.py --export-fp16 DIR) and set ZOO_MINILM_DIR"})
            continue
        t0 = time.perf_counter()
        try:
            row = run_model(m, dtype, args)
        except Exception as err:  # the backend must never raise; a raise here is a bug to report
            row = {**base, "ok": False, "error": f"{type(err).__name__}: {err}"[:600],
                   "traceback": traceback.format_exc()[-2000:]}
            torch._dynamo.reset()
        row["wall_s"] = round(time.perf_counter() - t0, 1)
        longest = max(longest, row["wall_s"])
        results.add(row)
        pairs_left = [(n.name, str(d).replace("torch.", "")) for n, d in todo[i + 1:]]
        if not row.get("ok", True) and not args.cpu_smoke and pairs_left and not cuda_usable():
            budget = None if args.budget_s is None else args.budget_s - (time.perf_counter() - start)
            argv_now = restart_argv(sys.argv[1:], pairs_left, results.stem, budget)
            print(f"CUDA context lost after {m.name}: the {len(pairs_left)} row(s) left run in a fresh process",
                  flush=True)
            os.execv(sys.executable, [sys.executable, os.path.abspath(__file__), *argv_now])
        if not args.cpu_smoke:
            torch.cuda.empty_cache()
    info = versions()
    header = (f"## zoo {tag}: {' '.join(sys.argv[1:])}\n\n" + ", ".join(f"{k} {v}" for k, v in info.items()) +
              ("; lowering " + args.lowering if args.cpu_smoke else "; TF32 off") +
              ("; warm compile = the first call in a new process on the same caches" if args.warm == "process"
               else "; warm compile = in-process recompile after torch._dynamo.reset()"))
    results.finish(header)
    return 0 if all(r.get("ok") or "skipped" in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
