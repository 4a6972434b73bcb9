"""Seeded random numbers as a pure function of (seed, index), and dropout built on them.

`rand_uniform(shape, seed, offset)` is NOT a stateful generator: its value at the row-major
linear index i of `shape` is

    key = fmix32((seed * 0x9E3779B9 + 0x632BE5AB) mod 2**32)      # per node, computed in Python
    h   = fmix32((((i + offset) * 0x9E3779B1) mod 2**32) XOR key)
    u   = (h >> 8) * 2**-24                                         # in [0, 1), exact in float32

where fmix32 is murmur3's 32-bit finalizer (all arithmetic on uint32 with wraparound):

    h ^= h >> 16; h *= 0x85EBCA6B; h ^= h >> 13; h *= 0xC2B2AE35; h ^= h >> 16

so the reference (torch, int64 masked to 32 bits) and generated Triton code agree bit for bit.
The odd multiplier spreads neighbouring indices before the key is mixed in, so that two seeds'
streams are not simple permutations (XOR by key1 ^ key2) of each other; every step is a
bijection on uint32, so one stream never repeats a value at two indices < 2**32.
Being pure, rand_uniform needs no RANDOM property: CSE may merge nodes with equal
(shape, seed, offset), which then are equal values. Use different seeds or offsets for
independent streams. numel + offset must stay <= 2**32 (indices would wrap and repeat).

Triton hook contract: `triton(args, attrs)` takes ONE argument, the name of a variable holding
the row-major linear index over attrs["shape"] (the logical index, not a memory offset; int32
or int64), and returns a float32 expression (`extra["needs_linear_index"]`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..errors import InvalidValueError, ShapeError
from ..ir.emit import Emitter, user_source_line
from ..ir.node import Attrs, Node
from ..ir.registry import COMPOSITE, POINTWISE, Cost, define
from ..ir.spec import TensorSpec
from . import _rules as R
from .reduce import downcast, upcast

MASK32 = 0xFFFFFFFF
FMIX_C1 = 0x85EBCA6B
FMIX_C2 = 0xC2B2AE35
SEED_MULTIPLIER = 0x9E3779B9
SEED_SALT = 0x632BE5AB
INDEX_MULTIPLIER = 0x9E3779B1
TWO_POW_MINUS_24 = 2.0 ** -24


def fmix32(h: int) -> int:
    """murmur3's 32-bit finalizer on a Python int."""
    h &= MASK32
    h ^= h >> 16
    h = (h * FMIX_C1) & MASK32
    h ^= h >> 13
    h = (h * FMIX_C2) & MASK32
    h ^= h >> 16
    return h


def seed_key(seed: int) -> int:
    return fmix32((seed * SEED_MULTIPLIER + SEED_SALT) & MASK32)


def _mul32(h: torch.Tensor, c: int) -> torch.Tensor:
    """(h * c) mod 2**32 for 0 <= h < 2**32 without int64 overflow: split c into 16-bit halves."""
    lo, hi = c & 0xFFFF, c >> 16
    return (h * lo + (((h * hi) & 0xFFFF) << 16)) & MASK32


def _fmix32_torch(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = _mul32(h, FMIX_C1)
    h = h ^ (h >> 13)
    h = _mul32(h, FMIX_C2)
    return h ^ (h >> 16)


def hash_uniform(linear_index: torch.Tensor, seed: int, offset: int = 0) -> torch.Tensor:
    """The documented hash, in torch: uniform float32 in [0, 1) at each linear index."""
    i = (linear_index.to(torch.int64) + offset) & MASK32
    h = _fmix32_torch(_mul32(i, INDEX_MULTIPLIER) ^ seed_key(seed))
    return (h >> 8).to(torch.float32) * TWO_POW_MINUS_24


def _fmix32_expr(h: str) -> str:
    h = f"({h} ^ ({h} >> 16))"
    h = f"({h} * {FMIX_C1})"
    h = f"({h} ^ ({h} >> 13))"
    h = f"({h} * {FMIX_C2})"
    return f"({h} ^ ({h} >> 16))"


def hash_uniform_triton(index_var: str, seed: int, offset: int = 0) -> str:
    """The same hash as a Triton expression over `index_var` (offset + index < 2**32)."""
    spread = f"((({index_var}).to(tl.uint32) + {offset}).to(tl.uint32) * {INDEX_MULTIPLIER})"
    base = f"({spread} ^ {seed_key(seed)})"
    return f"(({_fmix32_expr(base)} >> 8).to(tl.float32) * {TWO_POW_MINUS_24!r})"


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _check_stream(shape: tuple[int, ...], seed: Any, offset: Any) -> None:
    if not isinstance(seed, int) or not 0 <= seed <= MASK32:
        raise InvalidValueError(f"seed must be an int in [0, 2**32), got {seed!r}")
    if not isinstance(offset, int) or offset < 0:
        raise InvalidValueError(f"offset must be a non-negative int, got {offset!r}")
    numel = _numel(shape)
    if numel + offset > 2 ** 32:
        raise ShapeError(f"rand_uniform of {numel} elements at offset {offset} exceeds the 2**32 "
                         "indices of one stream; split it and use another seed")


def _rand_infer(specs: Sequence[TensorSpec], a: Attrs) -> TensorSpec:
    shape = tuple(a["shape"])
    if any((not isinstance(s, int)) or s < 0 for s in shape):
        raise ShapeError(f"rand_uniform shape must be non-negative ints, got {shape}")
    _check_stream(shape, a["seed"], a.get("offset", 0))
    return TensorSpec(shape, "float32")


def _rand_ref(xs: list[torch.Tensor], a: Any) -> torch.Tensor:
    shape = tuple(a["shape"])
    index = torch.arange(_numel(shape), dtype=torch.int64).view(shape)
    return hash_uniform(index, a["seed"], a.get("offset", 0))


define("rand_uniform", _rand_infer, _rand_ref, num_inputs=(0, 0), props={POINTWISE},
       flops_per_element=1,
       triton=lambda args, a: hash_uniform_triton(args[0], a["seed"], a.get("offset", 0)),
       extra={"needs_linear_index": True, "generator": True},
       doc="Uniform [0, 1) float32 from a counter-based hash of (seed, offset + linear index); "
           "deterministic. Triton hook: args[0] is the row-major linear index over attrs['shape'].")


# ---- dropout ----

def _check_p(p: Any, where: str = "") -> float:
    if isinstance(p, bool) or not isinstance(p, int | float) or not 0.0 <= float(p) <= 1.0:
        raise InvalidValueError(f"{where}dropout probability p must be in [0, 1], got {p!r}")
    return float(p)


def _dropout_infer(specs: Sequence[TensorSpec], a: Attrs) -> TensorSpec:
    R.require_float(specs[0])
    _check_p(a["p"])
    _check_stream(specs[0].shape, a["seed"], a.get("offset", 0))
    return specs[0].with_(strides=None)


def _keep_scale(p: float) -> float:
    return 0.0 if p >= 1.0 else 1.0 / (1.0 - p)


def _dropout_ref(xs: list[torch.Tensor], a: Any) -> torch.Tensor:
    x = xs[0]
    index = torch.arange(x.numel(), dtype=torch.int64, device=x.device).view(x.shape)
    u = hash_uniform(index, a["seed"], a.get("offset", 0))
    p = float(a["p"])
    return torch.where(u >= p, x * _keep_scale(p), torch.zeros((), dtype=x.dtype, device=x.device))


def _dropout_dec(e: Emitter, xs: list[Node], a: Attrs, cd: str) -> Node:
    x = upcast(e, xs[0], cd)
    p = float(a["p"])
    u = e.op("rand_uniform", shape=x.shape, seed=a["seed"], offset=a.get("offset", 0))
    keep = e.op("ge", u, p)
    y = e.op("where", keep, e.op("mul", x, _keep_scale(p)), e.scalar(0.0, x.dtype))
    return downcast(e, y, xs[0].dtype)


def _dropout_cost(ins: Sequence[TensorSpec], outs: Sequence[TensorSpec], a: Attrs) -> Cost:
    return Cost(ins[0].nbytes + outs[0].nbytes, 3 * ins[0].numel)


define("dropout", _dropout_infer, _dropout_ref, props={COMPOSITE}, cost_fn=_dropout_cost,
       decompose=_dropout_dec,
       doc="Training dropout: keeps x / (1 - p) where rand_uniform(x.shape, seed, offset) >= p. Its "
           "backward is dropout of the gradient with the same (p, seed, offset).")


class RandomMethods:
    def _apply(self, op: str, *operands: Any, name: str | None = None, **attrs: Any) -> Any:
        raise NotImplementedError

    def rand_uniform(self, shape: Sequence[int], seed: int = 0, offset: int = 0, name: str | None = None) -> Any:
        """Deterministic uniform [0, 1) float32 values from (seed, offset + linear index)."""
        return self._apply("rand_uniform", shape=tuple(shape), seed=seed, offset=offset, name=name)

    def dropout(self, input: Any, p: float = 0.5, training: bool = True, inplace: bool = False, *,
                seed: int = 0, offset: int = 0, name: str | None = None) -> Any:
        """F.dropout, seeded: the same (seed, offset) drops the same elements in every backend.
        `inplace` is accepted for signature compatibility (graphs are functional)."""
        if not training:  # no node is made; the check still names the op and the user's line
            _check_p(p, f"op dropout (at {user_source_line()}): ")
            return input
        return self._apply("dropout", input, p=p, seed=seed, offset=offset, name=name)
