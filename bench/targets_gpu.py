"""Issue 5's headline targets on the GPU, each side by side with torch.compile in one run:

  resnet50       torchvision ResNet-50 (random weights, eval, no_grad) inference, batch 128, bf16 weights and
                 inputs, channels_last and NCHW                                target: >= 1.6x torch.compile
  resnet50_fp32  the same in fp32: TF32 on (channels_last, NCHW) and TF32 off (channels_last)
  gpt2_train     GPT-2 124M (transformers GPT2LMHeadModel(GPT2Config()), dropout 0) training step, batch 8 x
                 1024: fp32 weights, forward under torch.autocast(bf16) (what nanoGPT and most torch.compile
                 users do), loss in fp32, backward, fused AdamW step      target: >= 1.25x torch.compile, MFU
  llama_decode   Llama decoder block decode step, batch 1, static KV cache of 2048 positions updated with
                 index_copy_ (gpt-fast style, bench/llama_blocks.py), d4096 32/8 heads ffn 11008, bf16
                 target: fusegraph reduce-overhead >= 2x torch.compile(mode="reduce-overhead")

Each implementation: correctness first (vs the same model in fp32 with TF32 off, run eagerly, on fresh random
data; an implementation is ok when its error is <= 2x eager's in the same precision + a tolerance), then
compile time (first call, on fresh empty fusegraph/Triton/Inductor caches unless --keep-caches; warm = again
after torch._dynamo.reset(), with those caches filled), device time (N
back-to-back calls between CUDA events, median of 5: what a loop sees at steady state), per-call latency
(events around one call with the GPU idle before it, median), peak memory (torch.cuda.max_memory_allocated
during one call; "own" = that minus what was allocated before the implementation was built, so the rows
run before it in the same process do not count). Implementations: eager, torch.compile (default;
max-autotune-no-cudagraphs with --max-autotune), fusegraph through torch.compile(backend=fusegraph)
(fg.compile). Results: JSON + markdown in $OUT (else bench/results/).

    python bench/targets_gpu.py --only resnet50            # each --only group fits one 10-minute GPU call
    python bench/targets_gpu.py --only gpt2_train --quick
    TRITON_INTERPRET=1 python bench/targets_gpu.py --cpu-smoke   # tiny configs on CPU: eager vs fusegraph
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

import fusegraph as fg
from fusegraph.perf.timing import call_latency, device_time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_compute_gpu import rel_err
from llama_blocks import LlamaDecodeBlock, LlamaSize
from torch_backend_gpu import LOW_TOL, kernel_summary

FP32_TOL = 1e-4  # strict fp32 (TF32 off) vs the fp32 reference


@dataclass
class Settings:
    device: str = "cuda"
    cpu: bool = False
    quick: bool = False
    max_autotune: bool = False
    warm_compile: bool = True
    fg_mode: str = "default"
    variants: str = ""            # comma-separated substrings selecting ResNet variants ("" = the group's all)
    gpt2_batch: int = 8
    deadline: float = float("inf")  # perf_counter time after which implementations are skipped (--budget-s)
    progress: str = ""            # JSON-lines file each measured row is appended to as soon as it exists
    context: str = ""             # the target/variant being measured, written with each progress row
    profile_compile: str = ""     # with --profile-compile: the file fusegraph compiles' cProfile stats go to
    inductor: bool = False        # --cpu-smoke --inductor: the torch.compile rows too (checks this script)


S = Settings()


# ---------------------------------------------------------------------------------------- measuring

def sync() -> None:
    if S.device == "cuda":
        torch.cuda.synchronize()


def first_call_s(fn: Callable[[], Any]) -> float:
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def allocated_mb() -> float:
    """MiB allocated now, after a collection (NaN off CUDA): what the rows before this one left
    behind, when taken before an implementation is built."""
    if S.device != "cuda":
        return float("nan")
    gc.collect()
    sync()
    return torch.cuda.memory_allocated() / 2**20


def peak_memory_mb(fn: Callable[[], Any]) -> tuple[float, float]:
    """(peak allocated during one call, peak minus what was allocated before it), MiB."""
    if S.device != "cuda":
        fn()
        return float("nan"), float("nan")
    sync()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    sync()
    peak = torch.cuda.max_memory_allocated()
    return peak / 2**20, (peak - before) / 2**20


def timings(fn: Callable[[], Any], latency_repeats: int = 50) -> dict[str, float]:
    """Device time (N back-to-back calls between events, median of 5; N ~ 0.3 s of work) and per-call
    latency (events around one call, median), plus host wall time per synchronized call."""
    if S.device != "cuda":  # CPU smoke: one wall-clock call
        return {"device_ms": first_call_s(fn) * 1e3, "latency_ms": float("nan"), "host_ms": float("nan")}
    one = call_latency(fn, repeats=5).ms
    calls = max(3, min(100, int(300 / max(one, 1e-3))))
    dev = device_time(fn, calls=calls, repeats=5, graph=False)
    lat = call_latency(fn, repeats=latency_repeats)
    host = []
    for _ in range(min(latency_repeats, 20)):
        host.append(first_call_s(fn) * 1e3)
    return {"device_ms": dev.ms, "device_calls": calls, "latency_ms": lat.ms, "host_ms": statistics.median(host)}


@dataclass
class Impl:
    """One implementation of a target: `make` returns the callable to time (compiling lazily at its
    first call) and `check` returns the outputs to compare with the reference."""

    name: str
    make: Callable[[], Callable[[], Any]]
    compiled: bool = True


def profiled_first_call(fn: Callable[[], Any], name: str, rows: int = 40) -> float:
    """first_call_s under cProfile; the functions by cumulative and by own time go to S.profile_compile."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    seconds = first_call_s(fn)
    profiler.disable()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("cumulative").print_stats(rows)
    stats.sort_stats("tottime").print_stats(rows)
    with open(S.profile_compile, "a") as f:
        f.write(f"== {S.context}: {name} first call (compile) {seconds:.1f} s under cProfile\n{out.getvalue()}\n")
    return seconds


def run_impls(impls: list[Impl], check: Callable[[Callable[[], Any]], list[torch.Tensor]],
              reference: list[torch.Tensor], tol: float, flops: float | None = None) -> list[dict[str, Any]]:
    """Measure each implementation; the error rule is relative to eager's (the first impl)."""
    rows: list[dict[str, Any]] = []
    eager_err = None
    for impl in impls:
        row: dict[str, Any] = {"impl": impl.name}
        if time.perf_counter() > S.deadline:
            row.update(ok=False, error="skipped: past --budget-s (rerun this group with --variants or --quick)")
            rows.append(row)
            continue
        try:
            if impl.compiled:
                torch._dynamo.reset()
            base_mb = allocated_mb()   # model, inputs and what earlier rows still hold
            fn = impl.make()
            got: list[torch.Tensor] = []
            if S.profile_compile and impl.name.startswith("fusegraph"):
                row["compile_s"] = profiled_first_call(lambda: got.extend(check(fn)), impl.name)
            else:
                row["compile_s"] = first_call_s(lambda: got.extend(check(fn)))
            errs = [rel_err(g, r) for g, r in zip(got, reference, strict=True)]
            row["rel_err"] = max(errs)
            row["worst_output"] = errs.index(row["rel_err"])
            if eager_err is None:
                eager_err = row["rel_err"]
            row["limit"] = 2 * eager_err + tol
            row["ok"] = row["rel_err"] <= row["limit"]
            row.update(timings(fn, latency_repeats=20 if S.quick else 50))
            row["peak_mb"], row["peak_extra_mb"] = peak_memory_mb(fn)
            # this implementation's own peak: above what was allocated before it was built (its plans,
            # caches and captured pools count; the previous rows' leftovers do not)
            row["peak_own_mb"] = row["peak_mb"] - base_mb
            if flops:
                row["tflops"] = flops / row["device_ms"] / 1e9
            report = getattr(fn, "fusegraph_report", None) or getattr(getattr(fn, "func", None),
                                                                      "fusegraph_report", None)
            if report is not None:
                row["fallback_ops"] = report.fallback_ops
                row["kernels"] = {k: {"kernels": v["kernels"], "eager_ops": v["eager_ops"],
                                      "partitions": v["partitions"], "eager_partitions": v["eager_partitions"]}
                                  for k, v in kernel_summary(report).items()}
            if impl.compiled and S.warm_compile and not S.cpu and time.perf_counter() < S.deadline - 90:
                torch._dynamo.reset()
                fresh = impl.make()
                row["compile_warm_s"] = first_call_s(lambda: check(fresh))
                fresh = None
            fn, got = None, []   # the next row's base then holds none of this one
        except Exception as err:  # one implementation failing does not stop the others
            traceback.print_exc()
            row.update(ok=False, error=f"{type(err).__name__}: {str(err)[:400]}")
        print("   ", json.dumps({k: v for k, v in row.items() if k != "kernels"}, default=str), flush=True)
        rows.append(row)
        if S.progress:
            with open(S.progress, "a") as f:
                f.write(json.dumps({"context": S.context, **row}, default=str) + "\n")
    return rows


def torch_compile_impls(make_module: Callable[[], Any], call: Callable[[Any], Any]) -> list[Impl]:
    """Eager, torch.compile (+ max-autotune-no-cudagraphs with --max-autotune; none on the CPU smoke run),
    fusegraph (fg.compile in --fg-mode), each on a fresh copy of the module."""
    def compiled_by(compile_fn: Callable[[Any], Any] | None) -> Callable[[], Callable[[], Any]]:
        def make() -> Callable[[], Any]:
            module = make_module()
            return _bind(call, compile_fn(module) if compile_fn else module)
        return make

    impls = [Impl("eager", compiled_by(None), compiled=False)]
    if not S.cpu or S.inductor:
        impls.append(Impl("torch.compile", compiled_by(torch.compile)))
        if S.max_autotune:
            impls.append(Impl("torch.compile max-autotune-no-cudagraphs",
                              compiled_by(lambda m: torch.compile(m, mode="max-autotune-no-cudagraphs"))))
    label = "fusegraph" if S.fg_mode == "default" else f"fusegraph {S.fg_mode}"
    impls.append(Impl(label, compiled_by(lambda m: fg.compile(m, mode=S.fg_mode))))
    return impls


def _bind(call: Callable[[Any], Any], module: Any) -> Callable[[], Any]:
    """A zero-argument callable running `call(module)` that keeps the compile report reachable."""
    def run() -> Any:
        return call(module)
    run.fusegraph_report = getattr(module, "fusegraph_report", None)  # type: ignore[attr-defined]
    return run


def versions() -> dict[str, Any]:
    import platform

    import triton

    info = {"torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
            "cudnn": torch.backends.cudnn.version(), "fusegraph": getattr(fg, "__version__", "?")}
    if S.device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
    return info


def set_tf32(on: bool) -> None:
    torch.backends.cuda.matmul.allow_tf32 = on
    torch.backends.cudnn.allow_tf32 = on


# ---------------------------------------------------------------------------------------- ResNet-50

def resnet50(size: str) -> nn.Module:
    """torchvision ResNet-50 through the model zoo (bench/zoo_models.py) when it is there."""
    try:
        from zoo_models import get
        return get("tv_resnet50").build(size)
    except (ImportError, KeyError):
        from torchvision.models import resnet
        torch.manual_seed(0)
        if size == "full":
            return resnet.resnet50()
        return resnet.ResNet(resnet.Bottleneck, [1, 1, 1, 1], num_classes=10, width_per_group=16)


RESNET_VARIANTS = {  # name: (dtype, channels_last, tf32)
    "bf16 channels_last": (torch.bfloat16, True, False),
    "bf16 NCHW": (torch.bfloat16, False, False),
    "fp32 TF32 on, channels_last": (torch.float32, True, True),
    "fp32 TF32 on, NCHW": (torch.float32, False, True),
    "fp32 TF32 off, channels_last": (torch.float32, True, False),
}
RESNET_GROUPS = {"resnet50": ("bf16 channels_last", "bf16 NCHW"),
                 "resnet50_fp32": ("fp32 TF32 on, channels_last", "fp32 TF32 on, NCHW",
                                   "fp32 TF32 off, channels_last")}


def resnet_group(group: str) -> list[dict[str, Any]]:
    size = "tiny" if S.cpu else "full"
    batch, res = (2, 32) if S.cpu else (32 if S.quick else 128, 224)
    variants = RESNET_GROUPS[group][:1] if S.cpu else RESNET_GROUPS[group]
    if S.variants:
        variants = tuple(v for v in variants if any(w.strip() in v for w in S.variants.split(",")))
    base = resnet50(size).eval().to(S.device)
    flops = 8.2e9 * batch if size == "full" else None  # ~4.1 GMACs per 224x224 image
    out = []
    for variant in variants:
        dtype, channels_last, tf32 = RESNET_VARIANTS[variant]
        dtype = torch.float32 if S.cpu else dtype
        fmt = torch.channels_last if channels_last else torch.contiguous_format
        x = torch.randn(batch, 3, res, res, device=S.device)
        set_tf32(False)
        with torch.no_grad():
            reference = [base(x)]
        set_tf32(tf32)

        def make_module(dtype: torch.dtype = dtype, fmt: torch.memory_format = fmt) -> nn.Module:
            return copy.deepcopy(base).to(dtype=dtype, memory_format=fmt)  # type: ignore[call-overload]

        xin = x.to(dtype=dtype).contiguous(memory_format=fmt)

        def call(m: Any, xin: torch.Tensor = xin) -> torch.Tensor:
            with torch.no_grad():
                return m(xin)

        print(f"\n== ResNet-50 {variant}, batch {batch}", flush=True)
        S.context = f"resnet50 {variant} batch {batch}"
        tol = FP32_TOL if dtype == torch.float32 and not tf32 else LOW_TOL
        rows = run_impls(torch_compile_impls(make_module, call), lambda fn: [fn()], reference, tol, flops)
        label = f"{variant} (CPU smoke: fp32, tiny ResNet-50)" if S.cpu else variant
        out.append({"target": "resnet50_inference", "variant": label, "batch": batch, "tf32": tf32,
                    "channels_last": channels_last, "dtype": str(dtype), "reference_impl": "torch.compile",
                    "goal": 1.6, "rows": rows})
        set_tf32(False)
    return out


# ---------------------------------------------------------------------------------------- GPT-2 training

class LMWithLoss(nn.Module):
    """A language model returning logits, with the next-token loss computed in fp32 inside the module
    (so the compiler sees the cross-entropy, as in nanoGPT)."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.lm(ids)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def gpt2(size: str) -> nn.Module:
    try:
        from zoo_models import get
        return get("hf_gpt2").build(size)
    except (ImportError, KeyError):
        from transformers import GPT2Config, GPT2LMHeadModel
        from zoo_models import TensorOutput
        torch.manual_seed(0)
        cfg: dict[str, Any] = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "use_cache": False}
        if size != "full":
            cfg.update(n_embd=32, n_layer=2, n_head=2, vocab_size=128, n_positions=64)
        return TensorOutput(GPT2LMHeadModel(GPT2Config(**cfg)), "logits")


class TrainStep:
    """One training step of `model` (compiled or not) with its own AdamW: zero grads, forward under
    autocast (when `autocast` is a dtype), backward, optimizer step."""

    def __init__(self, model: nn.Module, run: Any, ids: torch.Tensor, targets: torch.Tensor,
                 autocast: torch.dtype | None) -> None:
        self.model, self.run, self.ids, self.targets, self.autocast = model, run, ids, targets, autocast
        fused = S.device == "cuda"
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=fused)
        self.fusegraph_report = getattr(run, "fusegraph_report", None)

    def loss_and_grads(self) -> list[torch.Tensor]:
        self.opt.zero_grad(set_to_none=True)
        loss = self.forward()
        loss.backward()
        return [loss.detach().float()] + [p.grad.detach().float() for p in self.model.parameters()
                                          if p.grad is not None]

    def forward(self) -> torch.Tensor:
        if self.autocast is None:
            return self.run(self.ids, self.targets)
        with torch.autocast(S.device, dtype=self.autocast):
            return self.run(self.ids, self.targets)

    def __call__(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        self.forward().backward()
        self.opt.step()


def gpt2_group(group: str) -> list[dict[str, Any]]:
    size = "tiny" if S.cpu else "full"
    batch, seq = (2, 16) if S.cpu else (2 if S.quick else S.gpt2_batch, 1024)
    base = LMWithLoss(gpt2(size)).to(S.device)
    vocab = base.lm.model.config.vocab_size if hasattr(base.lm, "model") else 50257
    ids = torch.randint(0, vocab, (batch, seq), device=S.device)
    targets = torch.randint(0, vocab, (batch, seq), device=S.device)
    autocast = None if S.cpu else torch.bfloat16  # the CPU smoke run is fp32 (interpreter: no bf16 dots)
    set_tf32(False)
    fp32_model = copy.deepcopy(base)
    reference = TrainStep(fp32_model, fp32_model, ids, targets, None).loss_and_grads()
    n_params = sum(p.numel() for p in base.parameters())
    tokens = batch * seq
    flops = 6 * n_params * tokens

    def make(compile_fn: Callable[[nn.Module], Any] | None) -> Callable[[], Any]:
        def build() -> TrainStep:
            model = copy.deepcopy(base)
            return TrainStep(model, compile_fn(model) if compile_fn else model, ids, targets, autocast)
        return build

    impls = [Impl("eager", make(None), compiled=False)]
    if not S.cpu or S.inductor:
        impls.append(Impl("torch.compile", make(torch.compile)))
        if S.max_autotune:
            impls.append(Impl("torch.compile max-autotune-no-cudagraphs",
                              make(lambda m: torch.compile(m, mode="max-autotune-no-cudagraphs"))))
    impls.append(Impl("fusegraph" if S.fg_mode == "default" else f"fusegraph {S.fg_mode}",
                      make(lambda m: fg.compile(m, mode=S.fg_mode))))
    print(f"\n== GPT-2 training step, batch {batch} x {seq}, {n_params / 1e6:.1f}M parameters", flush=True)
    S.context = f"gpt2_train batch {batch}x{seq}"
    rows = run_impls(impls, lambda fn: fn.loss_and_grads(), reference, LOW_TOL if autocast else FP32_TOL, flops)
    peak = 989.4e12  # H200 dense bf16 (fusegraph.perf.devices)
    try:
        from fusegraph.perf.devices import get_device
        peak = get_device("H200").peak["bf16"]
    except (ImportError, AttributeError, KeyError):
        pass
    for row in rows:
        if "device_ms" in row:
            row["mfu"] = flops / (row["device_ms"] / 1e3) / peak
    variant = "fp32 weights, autocast bf16, fused AdamW" if autocast else "CPU smoke: fp32, tiny GPT-2, AdamW"
    return [{"target": "gpt2_train_step", "variant": variant, "batch": batch,
             "seq": seq, "params": n_params, "flops_per_step": flops, "peak_flops": peak,
             "mfu_rule": "6 * params * tokens / device time / H200 dense bf16 peak (attention FLOPs not counted)",
             "reference_impl": "torch.compile", "goal": 1.25, "rows": rows}]


# ---------------------------------------------------------------------------------------- Llama decode

class DecodeStep:
    """One decode step of a LlamaDecodeBlock (compiled or not) at position `pos` of its KV cache."""

    def __init__(self, block: LlamaDecodeBlock, run: Any, x: torch.Tensor, pos: torch.Tensor) -> None:
        self.block, self.run, self.x, self.pos = block, run, x, pos
        self.fusegraph_report = getattr(run, "fusegraph_report", None)

    def __call__(self) -> torch.Tensor:
        with torch.no_grad():
            return self.run(self.x, self.pos)

    def checked(self) -> list[torch.Tensor]:
        """Warm up (captures CUDA graphs), poison the cache slot being written, step once more: the
        output and the slot must both be right (an in-place cache update that is lost shows as NaN)."""
        for _ in range(3):
            self()
        p = int(self.pos[0])
        with torch.no_grad():
            self.block.k_cache[:, :, p] = float("nan")
            self.block.v_cache[:, :, p] = float("nan")
        out = self().clone()
        sync()
        return [out.float(), self.block.k_cache[:, :, p].float(), self.block.v_cache[:, :, p].float()]


def llama_decode_group(group: str) -> list[dict[str, Any]]:
    if S.cpu:
        size = LlamaSize(batch=1, seq=32, dim=64, heads=4, kv_heads=2, ffn=128)
    else:
        size = LlamaSize(batch=1, seq=2048, dim=4096, heads=32, kv_heads=8, ffn=11008)
    dtype = torch.float32 if S.cpu else torch.bfloat16
    torch.manual_seed(0)
    base = LlamaDecodeBlock(size).to(S.device)
    with torch.no_grad():  # a cache full of earlier tokens' keys and values
        base.k_cache.normal_()
        base.v_cache.normal_()
    x = torch.randn(size.batch, 1, size.dim, device=S.device)
    pos = torch.tensor([size.seq - 1], device=S.device)  # the last slot: attention reads all 2048 positions
    set_tf32(False)
    reference = DecodeStep(copy.deepcopy(base), copy.deepcopy(base), x, pos)
    reference.run = reference.block
    ref_out = reference.checked()
    xin = x.to(dtype)

    def make(compile_fn: Callable[[nn.Module], Any] | None) -> Callable[[], Any]:
        def build() -> DecodeStep:
            block = copy.deepcopy(base).to(dtype)
            return DecodeStep(block, compile_fn(block) if compile_fn else block, xin, pos)
        return build

    impls = [Impl("eager", make(None), compiled=False)]
    if not S.cpu or S.inductor:
        impls += [Impl("torch.compile", make(torch.compile)),
                  Impl("torch.compile reduce-overhead", make(lambda m: torch.compile(m, mode="reduce-overhead")))]
    impls += [Impl("fusegraph", make(fg.compile)),
              Impl("fusegraph reduce-overhead", make(lambda m: fg.compile(m, mode="reduce-overhead")))]
    weight_bytes = sum(p.numel() for p in base.parameters()) * 2
    cache_bytes = 2 * base.k_cache.numel() * 2
    print(f"\n== Llama decode step, {size}, KV cache {size.seq} positions", flush=True)
    S.context = f"llama_decode {size}"
    rows = run_impls(impls, lambda fn: fn.checked(), ref_out, LOW_TOL if dtype != torch.float32 else FP32_TOL)
    floor_ms = (weight_bytes + cache_bytes) / 4.2e12 * 1e3  # bytes / measured copy bandwidth (BENCHMARKS.md)
    return [{"target": "llama_decode_step", "variant": f"{size}, {str(dtype)[6:]}, index_copy_ KV cache", "batch": 1,
             "floor_ms": floor_ms, "min_bytes": weight_bytes + cache_bytes,
             "reference_impl": "torch.compile reduce-overhead", "compare_impl": "fusegraph reduce-overhead",
             "metric": "latency_ms", "goal": 2.0, "rows": rows}]


# ---------------------------------------------------------------------------------------- report

GROUPS: dict[str, Callable[[str], list[dict[str, Any]]]] = {
    "resnet50": resnet_group, "resnet50_fp32": resnet_group, "gpt2_train": gpt2_group,
    "llama_decode": llama_decode_group}


def markdown(results: list[dict[str, Any]], info: dict[str, Any], command: str) -> str:
    lines = [f"# Issue 5 targets ({info.get('gpu', 'cpu')}, torch {info['torch']}, triton {info['triton']}, "
             f"cuDNN {info['cudnn']})", "", f"`{command}`", ""]
    for res in results:
        ref_name = res["reference_impl"]
        metric = res.get("metric", "device_ms")
        ref = next((r for r in res["rows"] if r["impl"] == ref_name and metric in r), None)
        eager = next((r for r in res["rows"] if r["impl"] == "eager" and metric in r), None)
        lines += [f"## {res['target']}: {res['variant']} (batch {res['batch']})", "",
                  f"goal: {res.get('compare_impl', 'fusegraph')} >= {res['goal']}x {ref_name} ({metric})", "",
                  f"| impl | ok | rel err (limit) | device ms | latency ms | x {ref_name} | x eager | compile s "
                  "(warm) | peak MiB (own) | fallbacks | MFU |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in res["rows"]:
            if "error" in r:
                lines.append(f"| {r['impl']} | ERROR | {r['error'][:120]} | | | | | | | | |")
                continue
            vs_ref = f"{ref[metric] / r[metric]:.2f}" if ref and metric in r else "-"
            vs_eager = f"{eager[metric] / r[metric]:.2f}" if eager and metric in r else "-"
            fallbacks = ", ".join(r.get("fallback_ops", {})) or "-" if "fallback_ops" in r else ""
            mfu = f"{100 * r['mfu']:.1f}%" if "mfu" in r else ""
            lines.append(f"| {r['impl']} | {r.get('ok')} | {r.get('rel_err', float('nan')):.1e} "
                         f"({r.get('limit', float('nan')):.1e}) | {r.get('device_ms', float('nan')):.3f} | "
                         f"{r.get('latency_ms', float('nan')):.3f} | {vs_ref} | {vs_eager} | "
                         f"{r.get('compile_s', float('nan')):.1f} ({r.get('compile_warm_s', float('nan')):.1f}) | "
                         f"{r.get('peak_mb', float('nan')):.0f} ({r.get('peak_own_mb', float('nan')):.0f}) | "
                         f"{fallbacks} | {mfu} |")
        lines.append("")
    return "\n".join(lines)


def fresh_caches() -> str:
    """Point fusegraph's, Triton's and Inductor's on-disk caches at new empty folders (read from the
    environment when first used): compile times are then cold, not warm from an earlier run on the same
    machine (seen: torch.compile's GPT-2 compile at 4.7 s with its FX-graph cache from an earlier run,
    26.9 s without). Returns the folder."""
    import tempfile
    root = tempfile.mkdtemp(prefix="targets_caches_")
    for var, sub in (("FUSEGRAPH_CACHE_DIR", "fusegraph"), ("TRITON_CACHE_DIR", "triton"),
                     ("TORCHINDUCTOR_CACHE_DIR", "inductor")):
        os.environ[var] = os.path.join(root, sub)
    return root


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="resnet50,gpt2_train,llama_decode",
                        help=f"comma-separated groups: {', '.join(GROUPS)} (one group per 10-minute GPU call)")
    parser.add_argument("--quick", action="store_true", help="smaller batches, no warm-compile timing")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="tiny configs on CPU in fp32: eager vs fusegraph only (run under TRITON_INTERPRET=1)")
    parser.add_argument("--max-autotune", action="store_true",
                        help="also torch.compile mode=max-autotune-no-cudagraphs (ResNet-50: ~5 min of compile)")
    parser.add_argument("--no-warm-compile", action="store_true", help="skip the warm-cache compile timing")
    parser.add_argument("--keep-caches", action="store_true",
                        help="use the machine's fusegraph, Triton and Inductor caches as they are (default: fresh "
                             "empty ones for this run, so the first compile of each workload is cold for both "
                             "compilers; a second variant of a workload in the same run still finds kernels the "
                             "first compiled)")
    parser.add_argument("--profile-compile", action="store_true",
                        help="cProfile each fusegraph compile (first call) into <results stem>_compile_profile.txt")
    parser.add_argument("--fg-mode", default="default", help="fg.compile mode for the fusegraph rows")
    parser.add_argument("--variants", default="", help="ResNet variants to run: comma-separated substrings of "
                        f"{'; '.join(RESNET_VARIANTS)}")
    parser.add_argument("--inductor", action="store_true", help="with --cpu-smoke: torch.compile rows too")
    parser.add_argument("--gpt2-batch", type=int, default=8, help="GPT-2 batch (BENCHMARKS.md uses 16)")
    parser.add_argument("--budget-s", type=float, default=540.0,
                        help="skip implementations not started within this many seconds (default 540: the JSON "
                             "and table are still written inside one 10-minute GPU call)")
    args = parser.parse_args()
    S.cpu, S.quick, S.max_autotune, S.fg_mode = args.cpu_smoke, args.quick, args.max_autotune, args.fg_mode
    S.variants, S.gpt2_batch, S.inductor = args.variants, args.gpt2_batch, args.inductor
    S.deadline = time.perf_counter() + args.budget_s
    S.device = "cpu" if args.cpu_smoke else "cuda"
    S.warm_compile = not (args.quick or args.no_warm_compile)
    if not args.keep_caches:
        fresh_caches()
    if not S.cpu and not torch.cuda.is_available():
        print("needs a CUDA GPU (or --cpu-smoke)")
        return 2
    info = versions()
    print(info, flush=True)
    out_dir = os.environ.get("OUT") or ("/tmp" if S.cpu else os.path.join(os.path.dirname(__file__), "results"))
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(out_dir, f"targets_{'cpu_' if S.cpu else ''}{time.strftime('%Y%m%d_%H%M%S')}")
    S.progress = stem + "_progress.jsonl"
    S.profile_compile = stem + "_compile_profile.txt" if args.profile_compile else ""
    results: list[dict[str, Any]] = []
    for group in [g.strip() for g in args.only.split(",") if g.strip()]:
        start = time.perf_counter()
        try:
            results += GROUPS[group](group)
        except Exception as err:  # a group that cannot even be set up is recorded, the others still run
            traceback.print_exc()
            results.append({"target": group, "variant": "setup", "batch": 0, "reference_impl": "-", "goal": 0,
                            "rows": [{"impl": "setup", "ok": False, "error": f"{type(err).__name__}: {err}"}]})
        print(f"[{group}: {time.perf_counter() - start:.0f} s]", flush=True)
    command = "python bench/targets_gpu.py " + " ".join(sys.argv[1:])
    table = markdown(results, info, command)
    print("\n" + table)
    with open(stem + ".json", "w") as f:
        json.dump({"versions": info, "command": command, "results": results}, f, indent=1, default=str)
    with open(stem + ".md", "w") as f:
        f.write(table + "\n")
    if os.path.exists(S.progress):  # the rows are all in the JSON now
        os.remove(S.progress)
    print(f"wrote {stem}.json and .md")
    return 0 if all(r.get("ok") for res in results for r in res["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
