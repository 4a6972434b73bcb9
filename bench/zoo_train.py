"""Training steps of the zoo's GPT-2-124M and ResNet-50 (bench/zoo.py --train): one optimizer step
(forward + backward + AdamW) under bf16 autocast with fp32 master weights, eager vs torch.compile
(Inductor, default) vs fusegraph; the model is compiled, the (fused) AdamW step runs eagerly in all three.

    python bench/zoo.py --train [--quick] [--only hf_gpt2 tv_resnet50]      # on the H200
    python bench/zoo.py --train --cpu-smoke                                   # tiny configs on CPU

Correctness first: the loss and every parameter gradient of the first step (same weights, same batch),
judged against an fp32 eager step: fusegraph fails when its error exceeds 2x eager-bf16-autocast's own
error + 5e-3 (bench/torch_backend_gpu.py's rule); fp32 runs (CPU) against an fp64 step, 2x eager-fp32's
error + 1e-4. Step time: events around each step, median of N
steps after warm-up. Compile time: torch.compile's first step; fusegraph's first forward + backward (the
correctness check's, which compiles it; its first timed step then runs compiled graphs). Peak memory
(CUDA): torch.cuda.max_memory_allocated over the steps after the first (weights, gradients, AdamW state and
the step's own tensors, the same model for all three; fusegraph's plans are freed before torch.compile runs).
MFU (GPT-2): 6 * parameters * tokens / step time / 989 TFLOP/s (H100/H200 SXM dense bf16 peak;
parameters counted once with the tied embedding, position embeddings included; attention FLOPs not
counted).
"""

from __future__ import annotations

import argparse
import copy
import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch_backend_gpu import LOW_TOL, rel_err
from zoo import Results, lowering, sync
from zoo_models import ZooModel, available, get

import fusegraph as fg

PEAK_BF16_TFLOPS = 989.0
# model -> (batch, description); GPT-2 as in BENCHMARKS.md (16 x 1024 tokens)
TRAIN_MODELS = {"hf_gpt2": 16, "tv_resnet50": 64}


def first_step_grads(m: ZooModel, model: torch.nn.Module, fwd: Callable[..., Any], inputs: tuple[Any, ...],
                     target: Any, autocast: bool, dev: str) -> list[torch.Tensor]:
    """Loss and parameter gradients of one forward + backward (no optimizer step)."""
    model.zero_grad(set_to_none=True)
    with torch.autocast(dev, dtype=torch.bfloat16, enabled=autocast):
        out = fwd(*inputs)
    loss = m.loss(out, target)
    loss.backward()
    grads = [loss.detach().float().reshape(1)]
    grads += [p.grad.detach().float().clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    return grads


def make_step(m: ZooModel, model: torch.nn.Module, fwd: Callable[..., Any], inputs: tuple[Any, ...], target: Any,
              autocast: bool, dev: str) -> Callable[[], torch.Tensor]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=dev == "cuda")

    def step() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=autocast):
            out = fwd(*inputs)
        loss = m.loss(out, target)
        loss.backward()
        opt.step()
        return loss
    return step


def step_times_ms(step: Callable[[], Any], steps: int, dev: str) -> tuple[float, float, float | None]:
    """(first step's seconds, median step ms over `steps` after 2 warm-up steps, peak MiB allocated
    over those later steps: weights, gradients, optimizer state and the step's own memory; CUDA only)."""
    t0 = time.perf_counter()
    step()
    sync(dev)
    first = time.perf_counter() - t0
    if dev == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for _ in range(2):
        step()
    times = []
    for _ in range(steps):
        if dev == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            step()
            times.append((time.perf_counter() - t) * 1e3)
    peak = torch.cuda.max_memory_allocated() / 2**20 if dev == "cuda" else None
    return first, statistics.median(times), peak


def train_case(name: str, args: argparse.Namespace) -> dict[str, Any]:
    dev = "cpu" if args.cpu_smoke else "cuda"
    size = "tiny" if args.cpu_smoke else "full"
    m = get(name)
    batch = args.batch or (4 if args.cpu_smoke else (TRAIN_MODELS[name] // (4 if args.quick else 1)))
    autocast = not args.cpu_smoke  # CPU: fp32 (the interpreter's bf16 dot is wrong)
    row: dict[str, Any] = {"model": name, "mode": "train", "batch": batch,
                           "autocast": "bfloat16" if autocast else "off",
                           "optimizer": "AdamW (fused)" if dev == "cuda" else "AdamW"}
    model = m.build(size).to(dev).train()
    ex = m.example(batch, torch.float32, dev, size)
    params = sum(p.numel() for p in model.parameters())
    row["params_m"] = round(params / 1e6, 2)
    state = {k: v.clone() for k, v in model.state_dict().items()}

    if autocast:  # the reference: the same step in fp32
        ref = first_step_grads(m, model, model, ex.inputs, ex.target, False, dev)
    else:  # fp32 runs: the same step in fp64 (BN over a batch of 2 at 1x1 is ill-conditioned: fp32 eager is off too)
        model64 = copy.deepcopy(model).double()
        inputs64 = tuple(x.double() if x.is_floating_point() else x for x in ex.inputs)
        ref = first_step_grads(m, model64, model64, inputs64, ex.target, False, dev)
        del model64
    model.load_state_dict(state)
    eager = first_step_grads(m, model, model, ex.inputs, ex.target, autocast, dev)
    model.load_state_dict(state)
    torch._dynamo.reset()
    compiled = fg.compile(model)
    t0 = time.perf_counter()
    ours = first_step_grads(m, model, compiled, ex.inputs, ex.target, autocast, dev)
    sync(dev)
    row["fusegraph_compile_s"] = round(time.perf_counter() - t0, 1)
    row["fallback_ops"] = compiled.fusegraph_report.fallback_ops
    row["eager_op_count"] = sum(sum(g.fallbacks.values()) for g in compiled.fusegraph_report.graphs)
    model.load_state_dict(state)
    names = ["loss"] + [n for n, p in model.named_parameters() if p.requires_grad]
    tol = LOW_TOL if autocast else 1e-4
    ratios = [rel_err(o, r) / (2 * rel_err(e, r) + tol) for o, e, r in zip(ours, eager, ref, strict=True)]
    worst = ratios.index(max(ratios))
    row.update(ok=max(ratios) <= 1.0, worst=names[worst], reference="fp32" if autocast else "fp64",
               worst_err_vs_reference={"ours": rel_err(ours[worst], ref[worst]),
                                       "eager": rel_err(eager[worst], ref[worst])},
               max_rel_err_vs_eager=max(rel_err(o, e) for o, e in zip(ours, eager, strict=True)))

    steps = 3 if args.cpu_smoke else (5 if args.quick else 10)
    _, row["eager_step_ms"], row["eager_peak_mib"] = step_times_ms(
        make_step(m, model, model, ex.inputs, ex.target, autocast, dev), steps, dev)
    model.load_state_dict(state)
    row["fusegraph_first_step_s"], row["fusegraph_step_ms"], row["fusegraph_peak_mib"] = step_times_ms(
        make_step(m, model, compiled, ex.inputs, ex.target, autocast, dev), steps, dev)
    if not args.cpu_smoke and not args.no_inductor:
        del compiled   # its plans' buffers (CUDA graph pools) are not torch.compile's peak
        model.load_state_dict(state)
        torch._dynamo.reset()
        gc.collect()
        torch.cuda.empty_cache()
        by_inductor = torch.compile(model)
        row["inductor_first_step_s"], row["inductor_step_ms"], row["inductor_peak_mib"] = step_times_ms(
            make_step(m, model, by_inductor, ex.inputs, ex.target, autocast, dev), steps, dev)
        row["speedup_vs_inductor"] = row["inductor_step_ms"] / row["fusegraph_step_ms"]
    row["speedup_vs_eager"] = row["eager_step_ms"] / row["fusegraph_step_ms"]
    if m.loss_kind == "lm":
        tokens = ex.inputs[0].numel()
        row["tokens"] = tokens
        for who in ("eager", "inductor", "fusegraph"):
            if f"{who}_step_ms" in row:
                tflops = 6 * params * tokens / (row[f"{who}_step_ms"] * 1e-3) / 1e12
                row[f"{who}_tflops"] = round(tflops, 1)
                row[f"{who}_mfu"] = round(tflops / PEAK_BF16_TFLOPS, 4)
        row["mfu_peak_tflops"] = PEAK_BF16_TFLOPS
    torch._dynamo.reset()
    return row


def markdown_train(rows: list[dict[str, Any]], header: str) -> str:
    lines = [header, "", "| model | batch | ok (worst) | eager ms | inductor ms | fusegraph ms | vs inductor "
             "| vs eager | compile s (ind/fg) | peak MiB eager/ind/fg | MFU eager/ind/fg | fallback ops |",
             "|" + "---|" * 12]
    for r in rows:
        if "error" in r or "skipped" in r:
            lines.append(f"| {r['model']} | | {'ERROR' if 'error' in r else 'skipped'}: "
                         f"{str(r.get('error') or r.get('skipped'))[:120]} |" + " |" * 9)
            continue

        def f(key: str, spec: str = ".2f", row: dict[str, Any] = r) -> str:
            return format(row[key], spec) if isinstance(row.get(key), int | float) else "-"
        mfu = "/".join(f(f"{w}_mfu", ".1%") for w in ("eager", "inductor", "fusegraph")) if "tokens" in r else "-"
        peak = "/".join(f(f"{w}_peak_mib", ".0f") for w in ("eager", "inductor", "fusegraph"))
        lines.append(f"| {r['model']} | {r['batch']} | {r['ok']} ({r['worst']}) | {f('eager_step_ms')} | "
                     f"{f('inductor_step_ms')} | {f('fusegraph_step_ms')} | {f('speedup_vs_inductor')} | "
                     f"{f('speedup_vs_eager')} | {f('inductor_first_step_s', '.1f')}/"
                     f"{f('fusegraph_compile_s', '.1f')} | {peak} | {mfu} | "
                     f"{', '.join(o.replace('aten.', '') for o in r['fallback_ops']) or '-'} |")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    if not args.cpu_smoke and not torch.cuda.is_available():
        raise SystemExit("no GPU: use --train --cpu-smoke")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    tag = "train-cpu-smoke" if args.cpu_smoke else "train-gpu"
    results = Results(tag)
    rows = results.rows
    start = time.perf_counter()
    for name in TRAIN_MODELS:
        if args.only and name not in args.only:
            continue
        if args.budget_s and rows and time.perf_counter() - start > args.budget_s / 2:
            results.add({"model": name, "skipped": "time budget"})
            continue
        missing = available(get(name))
        if missing:
            results.add({"model": name, "skipped": missing})
            continue
        try:
            with lowering(args.lowering):
                row = train_case(name, args)
        except Exception as err:  # a raise is a bug to report, not a crash of the run
            row = {"model": name, "ok": False, "error": f"{type(err).__name__}: {err}"[:600]}
            torch._dynamo.reset()
        results.add(row)
    from zoo import versions
    header = f"## zoo {tag}\n\n" + ", ".join(f"{k} {v}" for k, v in versions().items())
    results.finish(header, markdown_train)
    return 0 if all(r.get("ok") or "skipped" in r for r in rows) else 1
