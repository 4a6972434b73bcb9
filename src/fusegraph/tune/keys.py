"""What a tuning choice is keyed by: the kernel, its shapes and dtypes, the GPU and the library versions.

A full key is a JSON-native dict; its digest (sha256 of the canonical JSON) names the cache file.
Anything that could change which candidate is fastest belongs in it: a different torch, triton,
CUDA, cuDNN or fusegraph version is a different key, so a stale entry is simply never looked up.
"""

from __future__ import annotations

import functools
import hashlib
import json
import numbers
import platform
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .config import Config

# Bump when the layout of a cache entry or of the full key changes, or how candidates are timed
# (2: the GPU queue kept ahead of the host, tune/timing.queued_bench_ms; entries timed before
# counted host launch waits and are re-tuned).
SCHEMA_VERSION = 2

FullKey = dict[str, Any]


def canonical(value: Any, where: str = "key") -> Any:
    """`value` as JSON-native data (dicts with sorted str keys, lists, str, int, float, bool, None).

    Tuples and torch.Size become lists, torch.dtype its name, Config its values. Anything else is
    refused: a repr with a memory address would make a key that never hits again.
    """
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            raise TypeError(f"{where}: {value!r} cannot be part of a tuning key")
        return value
    if isinstance(value, Config):
        return value.to_json()
    if isinstance(value, Mapping):
        out = {}
        for k in sorted(value, key=str):
            if not isinstance(k, str):
                raise TypeError(f"{where}: key {k!r} must be a str")
            out[k] = canonical(value[k], f"{where}.{k}")
        return out
    if isinstance(value, (list, tuple)):  # torch.Size is a tuple
        return [canonical(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if _is_torch_dtype(value):
        return str(value).removeprefix("torch.")
    if isinstance(value, numbers.Integral):  # numpy integers in shapes
        return int(value)
    if isinstance(value, numbers.Real):
        return canonical(float(value), where)
    raise TypeError(f"{where}: {type(value).__name__} value {value!r} cannot be part of a tuning key; "
                    "use str, int, float, bool, None, lists, tuples, dicts or torch dtypes")


def _is_torch_dtype(value: Any) -> bool:
    import torch
    return isinstance(value, torch.dtype)


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def digest(full_key: FullKey) -> str:
    return hashlib.sha256(canonical_json(full_key).encode()).hexdigest()


def gpu_identity() -> dict[str, str] | None:
    """Name and compute capability of the current CUDA GPU, or None when there is none.

    The autotuner asks this to decide whether it can time anything; tests monkeypatch it.
    """
    import torch
    if not torch.cuda.is_available():
        return None
    index = torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(index)
    return {"name": torch.cuda.get_device_name(index), "capability": f"{major}.{minor}"}


@functools.lru_cache(maxsize=1)
def library_versions() -> dict[str, str | None]:
    """Versions of everything that changes generated code or its speed (fixed for a process)."""
    import torch
    try:
        import triton
        triton_version: str | None = triton.__version__
    except ImportError:
        triton_version = None
    try:
        cudnn = torch.backends.cudnn.version()
    except Exception:  # no cuDNN in this build
        cudnn = None
    from importlib import import_module
    fusegraph_version = getattr(import_module("fusegraph"), "__version__", None)
    return {
        "fusegraph": fusegraph_version,
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda,
        "cudnn": None if cudnn is None else str(cudnn),
        "python": platform.python_version(),
    }


def candidates_digest(candidates: Sequence[Config]) -> str:
    """Short hash of the candidate list: a choice is only valid among the candidates it was made from."""
    text = canonical_json([c.to_json() for c in candidates])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def full_key(name: str, key: Mapping[str, Any], candidates: Sequence[Config], gpu: Mapping[str, str],
             versions: Mapping[str, str | None] | None = None) -> FullKey:
    from ..codegen.compile import shared_kernel_text

    # identical kernels at different plan positions (every layer's copy) share one tuning
    return {
        "schema": SCHEMA_VERSION,
        "name": shared_kernel_text(name),
        "key": _shared(canonical(key, f"autotune key of {name}"), shared_kernel_text),
        "candidates": candidates_digest(candidates),
        "gpu": canonical(gpu, "gpu"),
        "versions": canonical(library_versions() if versions is None else versions, "versions"),
    }


def _shared(value: Any, text: Callable[[str], str]) -> Any:
    """`value` (canonical JSON-like data) with `text` applied to every string in it."""
    if isinstance(value, str):
        return text(value)
    if isinstance(value, dict):
        return {k: _shared(v, text) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_shared(v, text) for v in value)
    return value
