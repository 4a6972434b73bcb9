"""Turn generated Triton source into a callable @triton.jit function.

triton.jit reads its function's source with `inspect`, so the module is written to a real file
under the cache directory (named by a hash of the source) and imported from there. Triton itself
is imported lazily: TRITON_INTERPRET must be set before the first import.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import sys
import tempfile
from typing import Any

from ..settings import settings

_LOADED: dict[str, Any] = {}


def kernel_dir() -> str:
    path = os.path.join(settings.cache_dir, "kernels")
    os.makedirs(path, exist_ok=True)
    return path


_KERNEL_INDEX = re.compile(r"\bfg_k\d+_")


def shared_kernel_text(text: str) -> str:
    """`text` (a generated source, a kernel name, a tuning key) without the plan position of the kernel
    names in it: lower_fused names kernel k fg_k{k}_<ops>, so the same kernel in every layer of a model
    differs only there. Loaded and tuned under this text, identical kernels compile once and are timed
    once (GPT-2's twelve blocks: twelve copies of each block kernel)."""
    return _KERNEL_INDEX.sub("fg_", text)


def load_triton_function(source: str, name: str) -> Any:
    """The jitted function `name` defined by `source`, cached per source text up to the plan positions
    in kernel names (shared_kernel_text): identical kernels of different layers share one function, so
    Triton compiles it once (its CUDA name drops the position: fg_<ops>)."""
    source, name = shared_kernel_text(source), shared_kernel_text(name)
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    key = f"{name}_{digest}"
    if key in _LOADED:
        return _LOADED[key]
    from ..tune.precompile import wait_for_triton_warmup

    wait_for_triton_warmup()   # Triton's import and driver start may still run on their own thread
    if interpreting():
        round_like_the_gpu()
    path = os.path.join(kernel_dir(), f"fg_{key}.py")
    if not os.path.exists(path):
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(source)
        os.replace(tmp, path)  # atomic: concurrent builders never see a half-written file
    module_name = f"fusegraph_kernels.fg_{key}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    if interpreting() and hasattr(module, "libdevice"):
        setattr(module, "libdevice", _NumpyLibdevice())  # noqa: B010  (the interpreter has no libdevice)
    fn = getattr(module, name)
    _LOADED[key] = fn
    return fn


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "") not in ("", "0")


def round_like_the_gpu() -> None:
    """Triton's interpreter truncates fp32 -> bf16 casts; the GPU rounds to nearest even. Make
    the interpreter round like the hardware so CPU tests see the values the GPU produces."""
    try:
        from triton.runtime import interpreter as interp
    except ImportError:
        return
    builder = interp.InterpreterBuilder
    if getattr(builder, "_fusegraph_rne", False):
        return
    original = builder.cast_impl

    def cast_impl(self: Any, src: Any, dst_type: Any) -> Any:
        import triton.language as tl

        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return interp.TensorHandle(_bf16_bits_rne(src.data), dst_type.scalar)
        return original(self, src, dst_type)

    builder.cast_impl = cast_impl
    builder._fusegraph_rne = True


def _bf16_bits_rne(values: Any) -> Any:
    """fp32 array -> bfloat16 bit patterns (uint16), rounded to nearest even, NaN kept NaN."""
    import numpy as np

    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = ((bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16).astype(np.uint16)
    return np.where(np.isnan(values), np.uint16(0x7FC0), rounded)


class _NumpyLibdevice:
    """libdevice for Triton's interpreter: each function applied with numpy to the tile's data."""

    _NAMES = {"pow": "power", "atan2": "arctan2", "asin": "arcsin", "acos": "arccos", "atan": "arctan",
              "asinh": "arcsinh", "acosh": "arccosh", "atanh": "arctanh", "rint": "rint"}

    def __getattr__(self, name: str) -> Any:
        import numpy as np
        import triton.language as tl
        from triton.runtime.interpreter import TensorHandle

        fn = getattr(np, self._NAMES.get(name, name), None)
        if fn is None:
            if name == "erf":
                return tl.erf
            raise AttributeError(f"libdevice.{name} has no interpreter implementation")

        def call(*args: Any) -> Any:
            tensors = [a for a in args if isinstance(a, tl.tensor)]
            like = max(tensors, key=lambda t: t.handle.data.size)
            data = [a.handle.data if isinstance(a, tl.tensor) else a for a in args]
            out = np.asarray(fn(*data)).astype(like.handle.data.dtype)
            return tl.tensor(TensorHandle(out, like.dtype.scalar), like.type)

        return call
