"""Dtype names, their torch equivalents, sizes and promotion."""

from __future__ import annotations

import torch

from ..errors import DTypeError

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_ALIASES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "fp64": "float64",
            "half": "float16", "float": "float32", "double": "float64", "long": "int64",
            "int": "int32", "fp8_e4m3": "float8_e4m3fn", "float8_e4m3": "float8_e4m3fn",
            "fp8_e5m2": "float8_e5m2"}
FROM_TORCH: dict[torch.dtype, str] = {v: k for k, v in TORCH_DTYPES.items()}

FLOATS = frozenset({"float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"})
FP8 = frozenset({"float8_e4m3fn", "float8_e5m2"})
INTS = frozenset({"int64", "int32", "int16", "int8", "uint8"})


def canonical(dtype: str | torch.dtype) -> str:
    """The canonical name of a dtype given as a string or a torch.dtype."""
    if isinstance(dtype, torch.dtype):
        if dtype not in FROM_TORCH:
            raise DTypeError(f"dtype {dtype} is not supported; supported: {', '.join(TORCH_DTYPES)}")
        return FROM_TORCH[dtype]
    name = str(dtype).replace("torch.", "")
    name = _ALIASES.get(name, name)
    if name not in TORCH_DTYPES:
        raise DTypeError(f"unknown dtype {dtype!r}; known: {', '.join(TORCH_DTYPES)}")
    return name


def to_torch(dtype: str) -> torch.dtype:
    return TORCH_DTYPES[canonical(dtype)]


def itemsize(dtype: str) -> int:
    return torch.empty((), dtype=to_torch(dtype)).element_size()


def is_float(dtype: str) -> bool:
    return dtype in FLOATS


def is_int(dtype: str) -> bool:
    return dtype in INTS


def promote(*dtypes: str) -> str:
    """torch's type promotion between tensors of these dtypes."""
    out = to_torch(dtypes[0])
    for d in dtypes[1:]:
        out = torch.promote_types(out, to_torch(d))
    return FROM_TORCH[out]
