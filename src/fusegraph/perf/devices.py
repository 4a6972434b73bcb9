"""Device specs: the physical limits a kernel is measured against.

Datasheet values for the GPUs we know (dense rates; `sparse` holds the 2:4-sparse rates), a
parser for custom specs given on the command line (`--bandwidth 8TB/s --bf16 2.2PF`), and the
mapping from the present GPU's name to its spec. Measured ceilings (`fusegraph calibrate`)
replace datasheet values through `fusegraph.perf.calibrate.effective_spec`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from ..errors import FusegraphError

# Peak-rate keys: dtype classes of the units that do the work.
RATE_KEYS = ("fp32", "tf32", "bf16", "fp16", "fp8", "int8")


class DeviceSpecError(FusegraphError):
    """A device spec that cannot be used: unknown name, missing or nonsensical numbers."""


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    bandwidth: float                  # bytes/s of device memory (read + write counted together)
    l2_bytes: int
    sms: int
    clock_ghz: float                  # boost clock
    peak: Mapping[str, float]         # FLOP/s (OP/s for int8), dense; fp32 = CUDA cores, others tensor cores
    sparse: Mapping[str, float] = field(default_factory=dict)  # 2:4 structured-sparse rates
    # Launch costs are host/driver properties more than chip ones: defaults are the H200 figures of
    # BENCHMARKS.md (graph replay ~0.7 us per kernel; a Triton launch from Python 12.6 us) for every device.
    launch_us: float = 0.7            # per-kernel launch gap inside a CUDA graph replay / busy stream
    host_launch_us: float = 12.6      # per-kernel cost of a launch from Python (Triton JIT / torch op)
    source: str = ""                  # where the numbers come from
    measured: tuple[str, ...] = ()    # which fields were replaced by `fusegraph calibrate`

    def rate(self, key: str) -> float:
        """Peak FLOP/s for a rate key; missing rates raise DeviceSpecError naming the key."""
        value = self.peak.get(key)
        if value is None or value <= 0:
            raise DeviceSpecError(f"device {self.name} has no peak rate for {key}; it has "
                                  f"{', '.join(k for k, v in self.peak.items() if v) or 'none'}")
        return float(value)

    def has_rate(self, key: str) -> bool:
        return bool(self.peak.get(key))

    def scaled(self, name: str, bandwidth: float = 1.0, tensor: float = 1.0, l2: float = 1.0,
               launch: float = 1.0) -> DeviceSpec:
        """This spec with bandwidth / tensor-core rates / L2 / launch overhead multiplied."""
        peak = {k: (v * tensor if k != "fp32" else v) for k, v in self.peak.items()}
        return replace(self, name=name, bandwidth=self.bandwidth * bandwidth, l2_bytes=int(self.l2_bytes * l2),
                       peak=peak, launch_us=self.launch_us * launch, host_launch_us=self.host_launch_us * launch)

    def summary(self) -> str:
        rates = ", ".join(f"{k} {fmt_rate(v)}" for k, v in self.peak.items() if v)
        tag = f" [measured: {', '.join(self.measured)}]" if self.measured else ""
        return (f"{self.name}: {fmt_bandwidth(self.bandwidth)}, L2 {self.l2_bytes / 2**20:.0f} MiB, "
                f"{self.sms} SMs @ {self.clock_ghz:.2f} GHz, {rates}; launch {self.launch_us:.1f} us{tag}")

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "bandwidth": self.bandwidth, "l2_bytes": self.l2_bytes, "sms": self.sms,
                "clock_ghz": self.clock_ghz, "peak": dict(self.peak), "sparse": dict(self.sparse),
                "launch_us": self.launch_us, "host_launch_us": self.host_launch_us, "source": self.source,
                "measured": list(self.measured)}


T, P = 1e12, 1e15
MB = 2**20

DEVICES: dict[str, DeviceSpec] = {
    "H100": DeviceSpec(
        "H100", 3.35e12, 50 * MB, 132, 1.98,
        {"fp32": 67 * T, "tf32": 494.7 * T, "bf16": 989.4 * T, "fp16": 989.4 * T, "fp8": 1978.9 * T,
         "int8": 1978.9 * T},
        {"tf32": 989.4 * T, "bf16": 1978.9 * T, "fp16": 1978.9 * T, "fp8": 3957.8 * T, "int8": 3957.8 * T},
        source="NVIDIA H100 Tensor Core GPU datasheet (H100 SXM5 80GB column); L2 and SMs from the "
               "NVIDIA H100 (Hopper) architecture whitepaper; launch costs: H200 defaults"),
    "H200": DeviceSpec(
        "H200", 4.8e12, 50 * MB, 132, 1.98,
        {"fp32": 67 * T, "tf32": 494.7 * T, "bf16": 989.4 * T, "fp16": 989.4 * T, "fp8": 1978.9 * T,
         "int8": 1978.9 * T},
        {"tf32": 989.4 * T, "bf16": 1978.9 * T, "fp16": 1978.9 * T, "fp8": 3957.8 * T, "int8": 3957.8 * T},
        source="NVIDIA H200 Tensor Core GPU datasheet (H200 SXM column; sparse figures halved for dense); "
               "L2 and SMs as GH100 (Hopper whitepaper); launch costs: H200 defaults"),
    "A100": DeviceSpec(
        "A100", 2.039e12, 40 * MB, 108, 1.41,
        {"fp32": 19.5 * T, "tf32": 156 * T, "bf16": 312 * T, "fp16": 312 * T, "int8": 624 * T},
        {"tf32": 312 * T, "bf16": 624 * T, "fp16": 624 * T, "int8": 1248 * T},
        source="NVIDIA A100 Tensor Core GPU datasheet (A100 80GB SXM column); L2 and SMs from the NVIDIA "
               "A100 (Ampere) architecture whitepaper; no fp8 units; launch costs: H200 defaults"),
    "B200": DeviceSpec(
        "B200", 8.0e12, 126 * MB, 148, 1.965,
        {"fp32": 75 * T, "tf32": 1.1 * P, "bf16": 2.25 * P, "fp16": 2.25 * P, "fp8": 4.5 * P, "int8": 4.5 * P},
        {"tf32": 2.2 * P, "bf16": 4.5 * P, "fp16": 4.5 * P, "fp8": 9 * P, "int8": 9 * P},
        source="NVIDIA HGX B200 datasheet (per GPU: 1/8 of the 8-GPU figures, dense = sparse / 2); SM count, "
               "clock and L2 from public Blackwell reports (not in the datasheet); launch costs: H200 defaults"),
    "L40S": DeviceSpec(
        "L40S", 864e9, 96 * MB, 142, 2.52,
        {"fp32": 91.6 * T, "tf32": 183 * T, "bf16": 362.05 * T, "fp16": 362.05 * T, "fp8": 733 * T,
         "int8": 733 * T},
        {"tf32": 366 * T, "bf16": 733 * T, "fp16": 733 * T, "fp8": 1466 * T, "int8": 1466 * T},
        source="NVIDIA L40S GPU datasheet; L2 and SMs from the NVIDIA Ada Lovelace architecture whitepaper "
               "(AD102); launch costs: H200 defaults"),
    "RTX4090": DeviceSpec(
        "RTX4090", 1.008e12, 72 * MB, 128, 2.52,
        {"fp32": 82.6 * T, "tf32": 82.6 * T, "bf16": 165.2 * T, "fp16": 165.2 * T, "fp8": 330.3 * T,
         "int8": 660.6 * T},
        {"tf32": 165.2 * T, "bf16": 330.3 * T, "fp16": 330.3 * T, "fp8": 660.6 * T, "int8": 1321.2 * T},
        source="NVIDIA Ada Lovelace GPU architecture whitepaper, GeForce RTX 4090 column (tensor rates "
               "with FP32 accumulate); launch costs: H200 defaults"),
}

# Names people type or torch.cuda.get_device_name returns -> spec key. Checked in order.
_NAME_PATTERNS: tuple[tuple[str, str], ...] = (
    (r"h200", "H200"), (r"h100", "H100"), (r"gh200", "H200"), (r"a100", "A100"), (r"b200", "B200"),
    (r"l40s", "L40S"), (r"4090", "RTX4090"),
)


def known_names() -> list[str]:
    return list(DEVICES)


def get_device(name: str) -> DeviceSpec:
    """A known device by name (case-insensitive; 'NVIDIA H200', 'h200', 'rtx 4090' all work)."""
    key = _match(name)
    if key is None:
        raise DeviceSpecError(f"unknown device {name!r}; known devices: {', '.join(known_names())} "
                              "(or give a custom spec: --bandwidth 8TB/s --bf16 2.2PF ...)")
    return DEVICES[key]


def _match(name: str) -> str | None:
    text = name.strip().lower().replace(" ", "").replace("-", "")
    for key in DEVICES:
        if text == key.lower():
            return key
    for pattern, key in _NAME_PATTERNS:
        if re.search(pattern, text):
            return key
    return None


def detect_device() -> DeviceSpec | None:
    """The datasheet spec of the present GPU, or None without a GPU or for a GPU we do not know."""
    import torch

    if not torch.cuda.is_available():
        return None
    key = _match(torch.cuda.get_device_name())
    return DEVICES[key] if key else None


# ---- custom specs from strings ----

_PREFIX = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "p": 1e15, "e": 1e18}
_QUANTITY = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmgtpe]?)([a-z/]*)\s*$", re.IGNORECASE)


def parse_quantity(text: str | float | int, field_name: str, unit: str) -> float:
    """'8TB/s' -> 8e12, '2.2PF' -> 2.2e15, '50MB' -> 5e7 (decimal prefixes; 'MiB' binary).

    `unit` is what the field measures: 'B/s', 'FLOP/s', 'B', 'us' or '' (a plain number).
    Raises DeviceSpecError naming the field for anything missing, unparsable, zero or negative.
    """
    if isinstance(text, int | float) and not isinstance(text, bool):
        value = float(text)
    else:
        raw = str(text).strip() if text is not None else ""
        if not raw:
            raise DeviceSpecError(f"{field_name}: missing value (expected e.g. {_example(unit)})")
        binary = re.match(r"^(.*?)([kmgtp])i(b.*)$", raw, re.IGNORECASE)
        scale_binary = None
        if binary:
            raw = binary.group(1) + binary.group(3)
            scale_binary = 1024.0 ** ("kmgtp".index(binary.group(2).lower()) + 1)
        m = _QUANTITY.match(raw)
        if not m or raw.startswith("-"):
            raise DeviceSpecError(f"{field_name}: cannot read {text!r} as a positive quantity in {unit or 'units'}"
                                  f" (expected e.g. {_example(unit)})")
        number, prefix, suffix = float(m.group(1)), m.group(2).lower(), m.group(3).lower()
        if prefix == "m" and unit == "us" and suffix == "s":  # 'ms' for a time
            value = number * 1e3
        elif unit == "us" and suffix in ("us", "") and prefix == "":
            value = number
        else:
            if not _suffix_ok(suffix, unit):
                raise DeviceSpecError(f"{field_name}: unit {m.group(2) + m.group(3)!r} does not fit a quantity in "
                                      f"{unit} (expected e.g. {_example(unit)})")
            value = number * (scale_binary if scale_binary else _PREFIX[prefix])
    if not math.isfinite(value) or value <= 0:
        raise DeviceSpecError(f"{field_name}: must be a positive number, got {text!r}")
    return value


def _suffix_ok(suffix: str, unit: str) -> bool:
    allowed = {"B/s": ("b/s", "bps", "b", ""), "FLOP/s": ("f", "flops", "flop/s", "flop", "ops", "op/s", ""),
               "B": ("b", ""), "": ("",)}
    return suffix in allowed.get(unit, ("",))


def _example(unit: str) -> str:
    return {"B/s": "'8TB/s'", "FLOP/s": "'2.2PF' or '989TFLOPS'", "B": "'50MB'", "us": "'2us'"}.get(unit, "'132'")


def custom_spec(name: str = "custom", base: DeviceSpec | None = None, **fields: Any) -> DeviceSpec:
    """A spec from strings, e.g. custom_spec(bandwidth='8TB/s', bf16='2.2PF').

    Without `base`, `bandwidth` and at least one peak rate are required; every given field must be a
    positive quantity. With `base`, the given fields replace the base's.
    Fields: bandwidth, l2, sms, clock_ghz, launch_us, host_launch_us, and the rate keys (fp32, tf32,
    bf16, fp16, fp8, int8). bf16 and fp16 stand in for each other when only one is given.
    """
    given = {k: v for k, v in fields.items() if v is not None}
    unknown = sorted(set(given) - {"bandwidth", "l2", "sms", "clock_ghz", "launch_us", "host_launch_us",
                                   *RATE_KEYS})
    if unknown:
        raise DeviceSpecError(f"unknown spec field(s) {', '.join(unknown)}; known: bandwidth, l2, sms, clock_ghz, "
                              f"launch_us, host_launch_us, {', '.join(RATE_KEYS)}")
    if base is None:
        if "bandwidth" not in given:
            raise DeviceSpecError("bandwidth: missing (a custom device needs --bandwidth, e.g. --bandwidth 8TB/s)")
        if not any(k in given for k in RATE_KEYS):
            raise DeviceSpecError(f"peak rate: missing (give at least one of {', '.join('--' + k for k in RATE_KEYS)},"
                                  " e.g. --bf16 2.2PF)")
    peak = dict(base.peak) if base else {}
    for key in RATE_KEYS:
        if key in given:
            peak[key] = parse_quantity(given[key], key, "FLOP/s")
    if "bf16" in peak and "fp16" not in peak:
        peak["fp16"] = peak["bf16"]
    if "fp16" in peak and "bf16" not in peak:
        peak["bf16"] = peak["fp16"]
    if "fp32" not in peak:  # CUDA-core rate unknown: assume tensor-free work runs at 1/15 of bf16, as on Hopper
        peak["fp32"] = peak.get("bf16", max(peak.values())) / 15.0
    bandwidth = parse_quantity(given["bandwidth"], "bandwidth", "B/s") if "bandwidth" in given else base.bandwidth  # type: ignore[union-attr]
    l2 = parse_quantity(given["l2"], "l2", "B") if "l2" in given else (base.l2_bytes if base else 50 * MB)
    sms = parse_quantity(given["sms"], "sms", "") if "sms" in given else (base.sms if base else 132)
    clock = parse_quantity(given["clock_ghz"], "clock_ghz", "") if "clock_ghz" in given else \
        (base.clock_ghz if base else 1.98)
    launch = parse_quantity(given["launch_us"], "launch_us", "us") if "launch_us" in given else \
        (base.launch_us if base else 0.7)
    host = parse_quantity(given["host_launch_us"], "host_launch_us", "us") if "host_launch_us" in given else \
        (base.host_launch_us if base else 12.6)
    note = "custom spec: " + ", ".join(f"{k}={v}" for k, v in given.items())
    return DeviceSpec(name, bandwidth, int(l2), int(sms), clock, peak, dict(base.sparse) if base else {},
                      launch, host, source=(base.source + "; " if base else "") + note,
                      measured=base.measured if base else ())


def fmt_bandwidth(bps: float) -> str:
    return f"{bps / 1e12:.2f} TB/s" if bps >= 1e12 else f"{bps / 1e9:.0f} GB/s"


def fmt_rate(flops: float) -> str:
    return f"{flops / 1e15:.2f} PF/s" if flops >= 1e15 else f"{flops / 1e12:.1f} TF/s"
