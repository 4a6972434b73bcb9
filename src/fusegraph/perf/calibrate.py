"""`fusegraph calibrate`: measure the real ceilings of the present GPU and cache them.

Copy bandwidth with a Triton copy kernel (bytes read + written; not a captured memcpy, which a
CUDA graph may route to the copy engine), GEMM rates with torch.matmul (and torch._scaled_mm
for fp8) on 8192^3 random operands, and launch overheads (an empty kernel launched from Python,
and replayed inside a CUDA graph). Every report then uses the measured values in place of the
datasheet's (`effective_spec`).
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from ..errors import UnsupportedError
from ..settings import settings
from .devices import DeviceSpec, custom_spec, detect_device, get_device
from .timing import device_time

GEMM_SIZE = 8192
COPY_BYTES = 2**30


def _cache_path(gpu_name: str) -> Path:
    slug = re.sub(r"[^a-z0-9]+", "_", gpu_name.lower()).strip("_") or "gpu"
    return Path(settings.cache_dir) / "calibration" / f"{slug}.json"


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON so a reader never sees half a file: a temp file in the same folder, then rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2, sort_keys=True)
            f.write("\n")
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; results are meant to be shared and committed
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def versions() -> dict[str, str]:
    import fusegraph

    info = {"torch": torch.__version__, "fusegraph": fusegraph.__version__, "cuda": str(torch.version.cuda),
            "cudnn": str(torch.backends.cudnn.version()) if torch.backends.cudnn.is_available() else "none",
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none"}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = "none"
    return info


# ---- measurements ----

COPY_SHAPES = ((4096, 4), (4096, 8), (8192, 8), (16384, 16))  # (BLOCK, num_warps)


def measure_copy_bandwidth(nbytes: int = COPY_BYTES) -> float:
    """Bytes/s of a Triton copy kernel over `nbytes` (read + write counted): the best median (5 x 20
    calls) over a few block/warp shapes, since a ceiling is what the best plain copy reaches."""
    from ._kernels import copy_kernel

    n = nbytes // 4
    src = torch.randn(n, device="cuda", dtype=torch.float32)
    dst = torch.empty_like(src)
    best = 0.0
    for block, warps in COPY_SHAPES:
        grid = (triton_cdiv(n, block),)

        def run(block: int = block, warps: int = warps, grid: tuple[int] = grid) -> None:
            copy_kernel[grid](src, dst, n, BLOCK=block, num_warps=warps)

        dst.fill_(float("nan"))
        run()
        torch.cuda.synchronize()
        if not torch.equal(src, dst):
            raise RuntimeError("calibration copy kernel produced a wrong result")
        t = device_time(run, calls=20, repeats=5, graph=False)
        best = max(best, 2 * n * 4 / (t.ms * 1e-3))
    return best


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def measure_gemm(dtype: torch.dtype, size: int = GEMM_SIZE) -> float:
    """FLOP/s of torch.matmul on size^3 random operands (fp32 runs as tf32 here), median."""
    a = torch.randn(size, size, device="cuda").to(dtype)
    b = torch.randn(size, size, device="cuda").to(dtype)
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        t = device_time(lambda: torch.matmul(a, b), calls=10, repeats=5, graph=False)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    return 2 * size**3 / (t.ms * 1e-3)


def measure_fp8_gemm(size: int = GEMM_SIZE) -> float | None:
    """FLOP/s of torch._scaled_mm (e4m3, tensorwise scales, bf16 out), or None where unavailable."""
    if not hasattr(torch, "_scaled_mm") or torch.cuda.get_device_capability() < (8, 9):
        return None
    a = torch.randn(size, size, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(size, size, device="cuda").to(torch.float8_e4m3fn).t()  # column-major, as cuBLASLt wants
    one = torch.ones((), device="cuda")
    try:
        t = device_time(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
                        calls=10, repeats=5, graph=False)
    except RuntimeError:
        return None
    return 2 * size**3 / (t.ms * 1e-3)


def measure_launch() -> tuple[float, float]:
    """(us per empty kernel replayed inside a CUDA graph, us per empty kernel launched from Python)."""
    from ._kernels import empty_kernel

    buf = torch.empty(1, device="cuda")

    def launch() -> None:
        empty_kernel[(1,)](buf)

    host = device_time(launch, calls=1000, repeats=5, graph=False)  # host-bound: the launch path's cost
    graphed = device_time(launch, calls=100, repeats=5, graph=True)
    return graphed.ms * 1e3, host.ms * 1e3


def calibrate(verbose: bool = True) -> dict[str, Any]:
    """Measure every ceiling of the present GPU; returns (and caches) the record."""
    if not torch.cuda.is_available():
        raise UnsupportedError("calibrate needs an NVIDIA GPU, and torch sees none (torch.cuda.is_available() "
                               "is False); the datasheet specs stay in use")
    name = torch.cuda.get_device_name()
    say = print if verbose else (lambda *a, **k: None)
    say(f"calibrating {name} ...")
    measured: dict[str, float] = {}
    steps: list[tuple[str, Any]] = [
        ("bandwidth", measure_copy_bandwidth),
        ("bf16", lambda: measure_gemm(torch.bfloat16)),
        ("fp16", lambda: measure_gemm(torch.float16)),
        ("tf32", lambda: measure_gemm(torch.float32)),
        ("fp8", measure_fp8_gemm),
    ]
    for key, fn in steps:
        t0 = time.perf_counter()
        value = fn()
        if value is not None:
            measured[key] = float(value)
            unit = "B/s" if key == "bandwidth" else "FLOP/s"
            say(f"  {key:<10} {value / 1e12:9.1f} T{unit}   ({time.perf_counter() - t0:.1f} s)")
        else:
            say(f"  {key:<10} not available on this GPU / torch")
    graphed, host = measure_launch()
    measured["launch_us"], measured["host_launch_us"] = graphed, host
    say(f"  launch     {graphed:9.2f} us per kernel in a CUDA graph, {host:.2f} us per launch from Python")
    record = {"gpu": name, "measured": measured, "versions": versions(),
              "method": "median of 5 event-timed batches after warm-up; copy via Triton kernel, 1 GiB, "
                        f"read+write; GEMM {GEMM_SIZE}^3 random operands (torch.matmul, torch._scaled_mm)",
              "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    path = _cache_path(name)
    write_json_atomic(path, record)
    say(f"cached in {path}")
    return record


def load_calibration(gpu_name: str) -> dict[str, Any] | None:
    path = _cache_path(gpu_name)
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("measured"), dict) else None


def apply_calibration(spec: DeviceSpec, record: dict[str, Any]) -> DeviceSpec:
    """The spec with every measured ceiling in place of its datasheet value."""
    m = record["measured"]
    peak = dict(spec.peak)
    for key in ("bf16", "fp16", "tf32", "fp8"):
        if key in m:
            peak[key] = float(m[key])
    fields = [k for k in ("bandwidth", "bf16", "fp16", "tf32", "fp8", "launch_us", "host_launch_us") if k in m]
    return replace(spec, bandwidth=float(m.get("bandwidth", spec.bandwidth)), peak=peak,
                   launch_us=float(m.get("launch_us", spec.launch_us)),
                   host_launch_us=float(m.get("host_launch_us", spec.host_launch_us)),
                   source=spec.source + f"; measured by fusegraph calibrate on {record.get('gpu')} "
                                        f"({record.get('time', '?')})",
                   measured=tuple(fields))


def effective_spec(spec: DeviceSpec | str | None = None, use_calibration: bool = True) -> DeviceSpec:
    """The spec reports use: the given one (a name or a DeviceSpec) or the present GPU's, else H200;
    with the cached measurements of that GPU model in place of datasheet values."""
    if isinstance(spec, str):
        spec = get_device(spec)
    if spec is None:
        spec = detect_device()
        if spec is None and torch.cuda.is_available():  # a GPU we have no datasheet for: measured only
            record = load_calibration(torch.cuda.get_device_name())
            if record and "bandwidth" in record["measured"] and "bf16" in record["measured"]:
                m = record["measured"]
                return apply_calibration(custom_spec(torch.cuda.get_device_name(), bandwidth=m["bandwidth"],
                                                     bf16=m["bf16"]), record)
        spec = spec or get_device("H200")
    if not use_calibration or spec.measured:
        return spec
    record = _calibration_for(spec)
    return apply_calibration(spec, record) if record else spec


def _calibration_for(spec: DeviceSpec) -> dict[str, Any] | None:
    """A cached calibration of a GPU of this model (matched by the spec's name)."""
    folder = Path(settings.cache_dir) / "calibration"
    if not folder.is_dir():
        return None
    from .devices import _match

    candidates = []
    for path in sorted(folder.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(data, dict) and isinstance(data.get("measured"), dict) and \
                _match(str(data.get("gpu", ""))) == spec.name:
            candidates.append(data)
    return max(candidates, key=lambda d: str(d.get("time", ""))) if candidates else None
