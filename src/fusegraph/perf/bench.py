"""`fusegraph bench`: the BENCHMARKS.md suite side by side in one process.

Per workload: a correctness check of every implementation against the reference executor on
fresh random data (fusegraph failing it fails the workload); then, on a GPU, device time (CUDA-
graph replay of 100 calls, or 100 back-to-back calls between events; median of 5) and per-call
latency (events around one call, median of 50) for eager, torch.compile, fusegraph (and JAX in a
subprocess); % of the floor from the calibrated ceilings; compile times cold and warm. Results go
to a JSON file with versions and a markdown table.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

import torch

from ..errors import UnsupportedError
from ..settings import override
from .calibrate import effective_spec, versions, write_json_atomic
from .devices import DeviceSpec
from .timing import call_latency, device_time, host_seconds
from .workloads import Workload, select

IMPLEMENTATIONS = ("eager", "inductor", "inductor-max", "fusegraph", "jax", "cudnn")
# ||out - reference|| / ||reference|| limits by output dtype.
TOLERANCE = {torch.float64: 1e-8, torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}


@dataclass
class ImplResult:
    error: float | None = None           # worst relative error over outputs vs the reference
    ok: bool | None = None
    device_ms: float | None = None
    device_method: str = ""
    latency_ms: float | None = None
    compile_cold_s: float | None = None
    compile_warm_s: float | None = None
    pct_of_floor: float | None = None
    note: str = ""


@dataclass
class WorkloadResult:
    name: str
    suite: str
    dims: dict[str, int]
    min_bytes: int
    flops: int
    floor_ms: float
    status: str = "ok"                    # ok | failed | skipped
    note: str = ""
    impls: dict[str, ImplResult] = field(default_factory=dict)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out64, ref64 = out.detach().double().cpu(), ref.detach().double().cpu()
    if out64.shape != ref64.shape or not torch.isfinite(out64).all():
        return float("inf")
    denom = ref64.norm().item()
    return (out64 - ref64).norm().item() / (denom if denom > 0 else 1.0)


def check_outputs(outs: Sequence[torch.Tensor], refs: Sequence[torch.Tensor]) -> tuple[float, bool]:
    """(worst relative error, within tolerance) over the outputs; integer outputs must be equal."""
    if len(outs) != len(refs):
        return float("inf"), False
    worst, ok = 0.0, True
    for out, ref in zip(outs, refs, strict=True):
        if not out.dtype.is_floating_point:
            same = out.shape == ref.shape and torch.equal(out.cpu(), ref.to(out.dtype).cpu())
            worst, ok = (worst if same else float("inf")), ok and same
            continue
        err = rel_err(out, ref)
        worst = max(worst, err)
        limit = max(TOLERANCE.get(out.dtype, 1e-4), TOLERANCE.get(ref.dtype, 1e-4))  # the coarser dtype decides
        ok = ok and err <= limit
    return worst, ok


def _as_tuple(value: Any) -> tuple[torch.Tensor, ...]:
    return tuple(value) if isinstance(value, list | tuple) else (value,)


class Progress:
    """One line on stderr: [###-----] 3/8 softmax: timing inductor."""

    def __init__(self, total: int, stream: TextIO | None = None, enabled: bool = True) -> None:
        self.total, self.done, self.stream, self.enabled = total, 0, stream or sys.stderr, enabled
        self.started = time.perf_counter()

    def update(self, label: str) -> None:
        if not self.enabled:
            return
        width = 24
        filled = int(width * self.done / max(self.total, 1))
        line = (f"\r[{'#' * filled}{'-' * (width - filled)}] {self.done}/{self.total} {label[:60]:<60} "
                f"{time.perf_counter() - self.started:6.1f}s")
        self.stream.write(line)
        self.stream.flush()

    def step(self, label: str) -> None:
        self.done += 1
        self.update(label)

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()


# ---- implementations: each returns (callable on the inputs, compile note) ----

def _compile(fn: Callable[..., Any], mode: str | None) -> Callable[..., Any]:
    return torch.compile(fn, mode=mode) if mode else torch.compile(fn)


def _fusegraph_impl(workload: Workload, dims: dict[str, int], device: str) -> Callable[..., Any]:
    plan = workload.graph(dims).build(device=device)
    return lambda *xs: plan.run(list(xs))


def _cudnn_impl(workload: Workload) -> Callable[..., Any]:
    """The cuDNN frontend through torch where torch exposes it (cuDNN attention); otherwise not wired."""
    if workload.name != "sdpa":
        raise UnsupportedError("no cuDNN-frontend twin for this workload (eager conv already runs cuDNN)")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Any:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    return run


def applies(impl: str, workload: Workload) -> bool:
    """Which comparisons are meaningful: max-autotune on GEMM workloads, cuDNN on conv/attention."""
    if impl == "inductor-max":
        return workload.gemm
    if impl == "cudnn":
        return workload.name in ("sdpa", "conv_bias_relu")
    return True


def make_impl(name: str, workload: Workload, dims: dict[str, int], device: str) -> Callable[..., Any]:
    if name == "eager":
        return workload.eager
    if name == "inductor":
        return _compile(workload.eager, None)
    if name == "inductor-max":
        if not workload.gemm:
            raise UnsupportedError("max-autotune is compared on GEMM workloads only")
        return _compile(workload.eager, "max-autotune-no-cudagraphs")
    if name == "fusegraph":
        return _fusegraph_impl(workload, dims, device)
    if name == "cudnn":
        return _cudnn_impl(workload)
    raise UnsupportedError(f"unknown implementation {name!r}; known: {', '.join(IMPLEMENTATIONS)}")


def floor_ms(workload: Workload, dims: dict[str, int], spec: DeviceSpec) -> float:
    bytes_s = workload.min_bytes(dims) / spec.bandwidth
    flops_s = workload.flops(dims) / spec.rate("bf16") if workload.flops(dims) else 0.0
    return max(bytes_s, flops_s) * 1e3


def run_workload(workload: Workload, compare: Sequence[str], shapes: str, device: str, spec: DeviceSpec,
                 progress: Progress, timed: bool | None = None) -> WorkloadResult:
    dims = dict(workload.shapes[shapes])
    result = WorkloadResult(workload.name, workload.suite, dims, workload.min_bytes(dims), workload.flops(dims),
                            floor_ms(workload, dims, spec))
    missing = workload.missing()
    if missing:
        result.status, result.note = "skipped", missing
        return result
    timed = device == "cuda" if timed is None else timed
    impl_names = ["fusegraph"] + [c for c in compare if c not in ("fusegraph", "jax") and applies(c, workload)]
    if not timed:  # torch.compile on CPU measures nothing we report; correctness is eager vs fusegraph
        impl_names = [n for n in impl_names if n in ("fusegraph", "eager")]
    impls: dict[str, Callable[..., Any]] = {}
    for name in impl_names:
        progress.update(f"{workload.name}: building {name}")
        res = result.impls.setdefault(name, ImplResult())
        try:
            t0 = time.perf_counter()
            impls[name] = make_impl(name, workload, dims, device)
            res.compile_cold_s = time.perf_counter() - t0  # build only; the first call is added below
        except Exception as err:
            res.note = f"{type(err).__name__}: {err}"
            if name == "fusegraph":
                result.status, result.note = "failed", f"fusegraph build failed: {res.note}"
                return result
    # correctness first, on fresh random data, against the reference executor
    progress.update(f"{workload.name}: correctness")
    import fusegraph as fg

    inputs = workload.make_inputs(dims, device)
    refs = _as_tuple(fg.reference(workload.graph(dims))(*inputs))
    for name, fn in list(impls.items()):
        res = result.impls[name]
        try:
            t_first = host_seconds(functools.partial(fn, *inputs))  # first call: compiles for torch.compile
            outs = _as_tuple(fn(*inputs))
            res.error, res.ok = check_outputs(outs, refs)
            if res.compile_cold_s is not None:
                res.compile_cold_s += t_first
        except Exception as err:
            res.ok, res.note = False, f"{type(err).__name__}: {str(err)[:300]}"
        if not res.ok:
            impls.pop(name)
            if name == "fusegraph":
                result.status = "failed"
                result.note = f"fusegraph output differs from the reference (rel err {res.error})" \
                    if not res.note else f"fusegraph failed: {res.note}"
                return result
            res.note = res.note or f"wrong result (rel err {res.error:.2e}); not timed"
    if not timed:
        result.note = "correctness only: timings need a GPU"
        return result
    for name, fn in impls.items():
        res = result.impls[name]
        progress.update(f"{workload.name}: timing {name}")
        fresh = workload.make_inputs(dims, device)
        try:
            dt = device_time(functools.partial(fn, *fresh), calls=100, repeats=5, graph=True)
            res.device_ms, res.device_method = dt.ms, dt.method
            res.latency_ms = call_latency(functools.partial(fn, *fresh), repeats=50).ms
            res.pct_of_floor = 100.0 * result.floor_ms / dt.ms if dt.ms else None
        except Exception as err:
            res.note = f"timing failed: {type(err).__name__}: {str(err)[:300]}"
    for name in impls:  # after all timings: a warm compile resets torch.compile's in-memory state
        progress.update(f"{workload.name}: warm compile {name}")
        try:
            result.impls[name].compile_warm_s = _warm_compile_s(name, workload, dims, device, inputs)
        except Exception as err:
            result.impls[name].note += f" warm compile failed: {type(err).__name__}: {str(err)[:200]}"
    if "jax" in compare:
        progress.update(f"{workload.name}: jax (subprocess)")
        result.impls["jax"] = run_jax_twin(workload, dims, result.floor_ms)
    return result


def _warm_compile_s(name: str, workload: Workload, dims: dict[str, int], device: str,
                    inputs: Sequence[torch.Tensor]) -> float | None:
    """Build and first call again, with the on-disk caches warm."""
    if name == "fusegraph":
        return host_seconds(lambda: _fusegraph_impl(workload, dims, device)(*inputs))
    if name.startswith("inductor"):
        torch._dynamo.reset()
        fn = make_impl(name, workload, dims, device)
        return host_seconds(lambda: fn(*inputs))
    return None


def run_jax_twin(workload: Workload, dims: dict[str, int], floor: float) -> ImplResult:
    """The workload's JAX twin in a subprocess (JAX and torch do not share a process well)."""
    if not workload.jax_twin:
        return ImplResult(note="no JAX twin for this workload")
    cmd = [sys.executable, "-m", "fusegraph.perf.jax_twins", workload.name, json.dumps(dims)]
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # hand cached blocks back so the JAX process finds memory
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    except subprocess.TimeoutExpired:
        return ImplResult(note="JAX twin timed out")
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return ImplResult(note=f"JAX twin failed: {(proc.stderr or proc.stdout).strip().splitlines()[-1:]}")
    data = json.loads(lines[-1])
    res = ImplResult(device_ms=data.get("device_ms"), device_method=data.get("method", ""),
                     latency_ms=data.get("latency_ms"), compile_cold_s=data.get("compile_s"),
                     note=data.get("note", ""))
    res.pct_of_floor = 100.0 * floor / res.device_ms if res.device_ms else None
    return res


def run_bench(suites: str = "memory", compare: Sequence[str] = ("eager", "inductor"), shapes: str = "full",
              out_dir: str | Path = "bench/results", device: str | None = None, show_progress: bool = True,
              spec: DeviceSpec | None = None) -> dict[str, Any]:
    """Run the suite; returns the record written to `out_dir` (JSON + markdown)."""
    unknown = [c for c in compare if c not in IMPLEMENTATIONS]
    if unknown:
        raise UnsupportedError(f"unknown --compare entries {', '.join(unknown)}; known: {', '.join(IMPLEMENTATIONS)}")
    if shapes not in ("small", "full"):
        raise UnsupportedError(f"--shapes must be small or full, got {shapes!r}")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device != "cuda" and shapes == "full":
        raise UnsupportedError("full shapes need a GPU; on CPU run `fusegraph bench --shapes small` "
                               "(correctness only)")
    spec = spec or effective_spec()
    workloads = select(suites)
    progress = Progress(len(workloads), enabled=show_progress)
    results: list[WorkloadResult] = []
    with cold_caches(device == "cuda"):
        for w in workloads:
            torch.manual_seed(len(results) + 1)
            results.append(run_workload(w, compare, shapes, device, spec, progress))
            progress.step(f"{w.name}: {results[-1].status}")
    progress.close()
    record = {"command": "fusegraph bench " + " ".join(sys.argv[2:]) if sys.argv[1:2] == ["bench"] else "",
              "suites": suites, "compare": list(compare), "shapes": shapes, "device": device,
              "versions": versions(), "spec": spec.to_json(),
              "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "timed": device == "cuda", "results": [asdict(r) for r in results]}
    out = Path(out_dir)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    write_json_atomic(out / f"bench-{stamp}.json", record)
    table = markdown_table(record)
    (out / f"bench-{stamp}.md").write_text(table + "\n")
    record["files"] = [str(out / f"bench-{stamp}.json"), str(out / f"bench-{stamp}.md")]
    return record


@contextlib.contextmanager
def cold_caches(enabled: bool) -> Iterator[None]:
    """Fresh, empty compile caches (fusegraph, Inductor, Triton) for the run, so a workload's first
    call measures a cold compile and its second build a warm one."""
    if not enabled:
        yield
        return
    keys = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")
    saved = {k: os.environ.get(k) for k in keys}
    with tempfile.TemporaryDirectory(prefix="fusegraph-bench-") as tmp:
        for k in keys:
            os.environ[k] = os.path.join(tmp, k.lower())
        try:
            with override(cache_dir=os.path.join(tmp, "fusegraph")):
                yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def markdown_table(record: dict[str, Any]) -> str:
    v = record["versions"]
    head = (f"fusegraph bench ({record['shapes']} shapes, {record['device']}): GPU {v['gpu']}, torch {v['torch']}, "
            f"triton {v['triton']}, CUDA {v['cuda']}, cuDNN {v['cudnn']}, fusegraph {v['fusegraph']}; "
            f"ceilings: {record['spec']['name']} "
            f"({'measured: ' + ', '.join(record['spec']['measured']) if record['spec']['measured'] else 'datasheet'})")
    impls = [i for i in ("fusegraph", "eager", "inductor", "inductor-max", "jax", "cudnn")
             if any(i in r["impls"] for r in record["results"])]
    lines = [head, ""]
    if record["timed"]:
        cols = " | ".join(f"{i} ms (% floor)" for i in impls)
        lines += [f"| workload | status | floor ms | {cols} | fusegraph speedup vs eager / inductor | "
                  "fusegraph latency ms | fusegraph compile cold / warm s |",
                  "|" + "---|" * (6 + len(impls))]
    else:
        cols = " | ".join(f"{i} rel err" for i in impls)
        lines += [f"| workload | status | {cols} | note |", "|" + "---|" * (3 + len(impls))]
    for r in record["results"]:
        cells = []
        for i in impls:
            res = r["impls"].get(i)
            if res is None:
                cells.append("")
            elif record["timed"]:
                cells.append("-" if res["device_ms"] is None else
                             f"{res['device_ms']:.4f} ({res['pct_of_floor'] or 0:.0f}%)")
            else:
                cells.append("-" if res["error"] is None else f"{res['error']:.1e}" + ("" if res["ok"] else " FAIL"))
        if record["timed"]:
            fg_res = r["impls"].get("fusegraph") or {}
            fg_ms = fg_res.get("device_ms")
            ratios = []
            for other in ("eager", "inductor"):
                o = (r["impls"].get(other) or {}).get("device_ms")
                ratios.append(f"{o / fg_ms:.2f}x" if o and fg_ms else "-")
            lat = fg_res.get("latency_ms")
            comp = f"{fg_res.get('compile_cold_s') or 0:.2f} / {fg_res.get('compile_warm_s') or 0:.2f}"
            lines.append(f"| {r['name']} | {r['status']} | {r['floor_ms']:.4f} | {' | '.join(cells)} | "
                         f"{' / '.join(ratios)} | {'-' if lat is None else f'{lat:.4f}'} | {comp} |")
        else:
            lines.append(f"| {r['name']} | {r['status']} | {' | '.join(cells)} | {r['note']} |")
    notes = [f"- {r['name']}: {r['note']}" for r in record["results"] if r["note"] and record["timed"]]
    notes += [f"- {r['name']} / {i}: {res['note']}" for r in record["results"] for i, res in r["impls"].items()
              if res.get("note")]
    return "\n".join(lines + (["", *notes] if notes else []))
