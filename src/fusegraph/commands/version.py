"""`fusegraph version`: the versions of everything a result depends on, as text or JSON."""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import platform
from typing import Any


def _distribution_version(*names: str) -> str | None:
    """The installed version of the first distribution found among `names`, else None."""
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _gpus() -> list[dict[str, Any]]:
    import torch

    if not torch.cuda.is_available():
        return []
    gpus = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        gpus.append({
            "index": index,
            "name": props.name,
            "compute_capability": f"{props.major}.{props.minor}",
            "memory_gib": round(props.total_memory / 2**30, 1),
            "multiprocessors": props.multi_processor_count,
        })
    return gpus


def collect_versions() -> dict[str, Any]:
    """Versions of fusegraph, Python, torch, triton, numpy, CUDA, cuDNN, the GPUs and optional peers.

    A missing optional package is None; the key is always there so JSON consumers can rely on it."""
    import numpy
    import torch

    import fusegraph

    try:
        import triton
        triton_version: str | None = triton.__version__
    except ImportError:
        triton_version = None
    cudnn_version = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return {
        "fusegraph": fusegraph.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "triton": triton_version,
        "numpy": numpy.__version__,
        "cuda": torch.version.cuda,
        "cudnn": cudnn_version,
        "gpus": _gpus(),
        # optional peers: reported from package metadata, never imported (jax would grab the GPU).
        "nvidia-cudnn-frontend": _distribution_version("nvidia-cudnn-frontend"),
        "jax": _distribution_version("jax") if importlib.util.find_spec("jax") else None,
        "jaxlib": _distribution_version("jaxlib") if importlib.util.find_spec("jaxlib") else None,
    }


def format_versions(info: dict[str, Any]) -> str:
    rows: list[tuple[str, str]] = []
    for key in ("fusegraph", "python", "platform", "torch", "triton", "numpy"):
        rows.append((key, str(info[key])))
    rows.append(("cuda", info["cuda"] or "none (CPU build of torch)"))
    rows.append(("cudnn", str(info["cudnn"]) if info["cudnn"] is not None else "none"))
    if info["gpus"]:
        for gpu in info["gpus"]:
            rows.append((f"gpu {gpu['index']}", f"{gpu['name']} (compute capability {gpu['compute_capability']}, "
                         f"{gpu['memory_gib']} GiB, {gpu['multiprocessors']} SMs)"))
    else:
        rows.append(("gpu", "no GPU"))
    for key in ("nvidia-cudnn-frontend", "jax", "jaxlib"):
        rows.append((key, info[key] or "not installed"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def run_version(args: argparse.Namespace) -> int:
    info = collect_versions()
    print(json.dumps(info, indent=2) if args.json else format_versions(info))
    return 0


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser("version", help="print the versions of fusegraph, torch, triton, CUDA, cuDNN, "
                                   "the GPU", description="Print the versions a result depends on.")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.set_defaults(func=run_version)
