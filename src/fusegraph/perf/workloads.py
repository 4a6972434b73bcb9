"""The benchmark workloads of BENCHMARKS.md, each defined once: the fusegraph graph, an eager
torch function computing the same thing, fresh random inputs, min bytes and tensor-core FLOPs.

Inputs are declared in the graph in the same order `make_inputs` returns them, and the eager
function returns its outputs in the graph's set_output order.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

Dims = Mapping[str, int]
BF16 = torch.bfloat16


@dataclass(frozen=True)
class Workload:
    name: str
    suite: str                                          # memory | compute
    shapes: Mapping[str, Dims]                           # "small" (CPU checks) and "full" (BENCHMARKS.md)
    build: Callable[[Any, Dims], None]                   # declares inputs (in order) and outputs on a fg.Graph
    eager: Callable[..., tuple[torch.Tensor, ...]]
    make_inputs: Callable[[Dims, str], list[torch.Tensor]]
    min_bytes: Callable[[Dims], int]
    flops: Callable[[Dims], int]                         # tensor-core FLOPs (0: memory-bound)
    requires: tuple[str, ...] = ()                       # fg.Graph methods the graph needs
    jax_twin: bool = True                                # bench/jax_twins.py has this workload

    @property
    def gemm(self) -> bool:
        return self.suite == "compute"

    def missing(self) -> str | None:
        """Why the workload cannot be built with the ops registered now, or None."""
        import fusegraph as fg

        absent = [m for m in self.requires if not hasattr(fg.Graph, m)]
        return f"needs op(s) not registered yet: {', '.join(absent)}" if absent else None

    def graph(self, dims: Dims) -> Any:
        import fusegraph as fg

        g = fg.Graph(name=self.name, compute_dtype="float32")
        self.build(g, dims)
        return g


def _randn(*shape: int, device: str, dtype: torch.dtype = BF16, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device=device) * scale).to(dtype)


# ---- memory-bound ----

def _add_ln_build(g: Any, d: Dims) -> None:
    m, n = d["M"], d["N"]
    x, r = g.tensor((m, n), "bfloat16", name="x"), g.tensor((m, n), "bfloat16", name="r")
    w, b = g.tensor((n,), "bfloat16", name="w"), g.tensor((n,), "bfloat16", name="b")
    h = g.add(x, r)
    y = g.layernorm(h, weight=w, bias=b, eps=1e-5)
    h.set_output()
    y.set_output()


def _add_ln_eager(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    h = x + r
    return h, F.layer_norm(h, (x.shape[-1],), w, b, 1e-5)


def _rows_and_vectors(d: Dims, device: str, rows: int, vectors: int) -> list[torch.Tensor]:
    m, n = d["M"], d["N"]
    return [_randn(m, n, device=device) for _ in range(rows)] + [_randn(n, device=device) for _ in range(vectors)]


def _rmsnorm_build(g: Any, d: Dims) -> None:
    x, w = g.tensor((d["M"], d["N"]), "bfloat16", name="x"), g.tensor((d["N"],), "bfloat16", name="w")
    g.rmsnorm(x, weight=w, eps=1e-6).set_output()


def _rmsnorm_eager(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    xf = x.float()
    return ((xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()).to(x.dtype),)


def _softmax_build(g: Any, d: Dims) -> None:
    g.softmax(g.tensor((d["M"], d["N"]), "bfloat16", name="x"), -1).set_output()


def _bias_gelu_build(g: Any, d: Dims) -> None:
    x, b = g.tensor((d["M"], d["N"]), "bfloat16", name="x"), g.tensor((d["N"],), "bfloat16", name="b")
    g.gelu(g.add(x, b), approximate="tanh").set_output()


def _bias_gelu_eager(x: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return (F.gelu((x.float() + b.float()), approximate="tanh").to(x.dtype),)


def _ce_build(g: Any, d: Dims) -> None:
    logits = g.tensor((d["M"], d["N"]), "bfloat16", name="logits")
    labels = g.tensor((d["M"],), "int64", name="labels")
    g.cross_entropy(logits, labels).set_output()


def _ce_inputs(d: Dims, device: str) -> list[torch.Tensor]:
    return [_randn(d["M"], d["N"], device=device, scale=2.0),
            torch.randint(0, d["N"], (d["M"],), device=device, dtype=torch.int64)]


def _ln_bwd_build(g: Any, d: Dims) -> None:
    m, n = d["M"], d["N"]
    dy, x = g.tensor((m, n), "bfloat16", name="dy"), g.tensor((m, n), "bfloat16", name="x")
    w = g.tensor((n,), "bfloat16", name="w")
    outs = call_by_names(g.layernorm_backward, {"grad_out": dy, "dy": dy, "grad": dy, "grad_output": dy,
                                                "x": x, "input": x, "weight": w, "w": w,
                                                "normalized_shape": (n,), "eps": 1e-5})
    for t in outs if isinstance(outs, tuple) else (outs,):
        if t is not None:
            t.set_output()


def _ln_bwd_eager(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    xg = x.detach().float().requires_grad_()
    wg = w.detach().float().requires_grad_()
    bg = torch.zeros_like(wg, requires_grad=True)
    y = F.layer_norm(xg, (x.shape[-1],), wg, bg, 1e-5)
    dx, dw, db = torch.autograd.grad(y, (xg, wg, bg), dy.float())
    return dx.to(x.dtype), dw.to(w.dtype), db.to(w.dtype)


def call_by_names(method: Callable[..., Any], values: Mapping[str, Any]) -> Any:
    """Call an op method matching its parameters by name (for ops whose signature may still move);
    a required parameter we have no value for raises TypeError naming it."""
    kwargs = {}
    for name, p in inspect.signature(method).parameters.items():
        if name in values:
            kwargs[name] = values[name]
        elif p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise TypeError(f"{method.__name__} needs {name!r}, which this workload does not provide")
    return method(**kwargs)


# ---- compute-bound ----

def _mlp_build(g: Any, d: Dims) -> None:
    t, dm, h = d["T"], d["D"], d["H"]
    x = g.tensor((t, dm), "bfloat16", name="x")
    w1, b1 = g.tensor((dm, h), "bfloat16", name="w1"), g.tensor((h,), "bfloat16", name="b1")
    w2, b2 = g.tensor((h, dm), "bfloat16", name="w2"), g.tensor((dm,), "bfloat16", name="b2")
    hidden = g.gelu(g.add(g.matmul(x, w1), b1), approximate="tanh")
    g.add(g.matmul(hidden, w2), b2).set_output()


def _mlp_eager(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor,
               b2: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return (F.gelu(x @ w1 + b1, approximate="tanh") @ w2 + b2,)


def _mlp_inputs(d: Dims, device: str) -> list[torch.Tensor]:
    t, dm, h = d["T"], d["D"], d["H"]
    return [_randn(t, dm, device=device), _randn(dm, h, device=device, scale=dm ** -0.5),
            _randn(h, device=device), _randn(h, dm, device=device, scale=h ** -0.5), _randn(dm, device=device)]


def _conv_build(g: Any, d: Dims) -> None:
    n, c, hw, k = d["N"], d["C"], d["HW"], d["K"]
    x = g.tensor((n, c, hw, hw), "bfloat16", name="x", layout="NHWC")
    w = g.tensor((k, c, 3, 3), "bfloat16", name="w", layout="NHWC")
    b = g.tensor((k,), "bfloat16", name="b")
    g.relu(g.conv2d(x, w, bias=b, padding=1)).set_output()


def _conv_eager(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return (F.relu(F.conv2d(x, w, b, padding=1)),)


def _conv_inputs(d: Dims, device: str) -> list[torch.Tensor]:
    n, c, hw, k = d["N"], d["C"], d["HW"], d["K"]
    cl = torch.channels_last
    return [_randn(n, c, hw, hw, device=device).contiguous(memory_format=cl),
            _randn(k, c, 3, 3, device=device, scale=(9 * c) ** -0.5).contiguous(memory_format=cl),
            _randn(k, device=device)]


def _sdpa_build(g: Any, d: Dims) -> None:
    shape = (d["B"], d["H"], d["S"], d["D"])
    q, k, v = (g.tensor(shape, "bfloat16", name=n) for n in ("q", "k", "v"))
    g.scaled_dot_product_attention(q, k, v, is_causal=True).set_output()


def _sdpa_eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return (F.scaled_dot_product_attention(q, k, v, is_causal=True),)


def _mn(m: int, n: int) -> dict[str, int]:
    return {"M": m, "N": n}


WORKLOADS: tuple[Workload, ...] = (
    Workload("add_layernorm", "memory", {"small": _mn(64, 256), "full": _mn(16384, 4096)}, _add_ln_build,
             _add_ln_eager, lambda d, dev: _rows_and_vectors(d, dev, 2, 2),
             lambda d: 4 * d["M"] * d["N"] * 2 + 2 * d["N"] * 2, lambda d: 0, ("layernorm",)),
    Workload("rmsnorm", "memory", {"small": _mn(64, 256), "full": _mn(16384, 4096)}, _rmsnorm_build,
             _rmsnorm_eager, lambda d, dev: _rows_and_vectors(d, dev, 1, 1),
             lambda d: 2 * d["M"] * d["N"] * 2 + d["N"] * 2, lambda d: 0, ("rmsnorm",)),
    Workload("softmax", "memory", {"small": _mn(64, 256), "full": _mn(32768, 4096)}, _softmax_build,
             lambda x: (torch.softmax(x, -1),), lambda d, dev: _rows_and_vectors(d, dev, 1, 0),
             lambda d: 2 * d["M"] * d["N"] * 2, lambda d: 0, ("softmax",)),
    Workload("bias_gelu", "memory", {"small": _mn(64, 256), "full": _mn(16384, 4096)}, _bias_gelu_build,
             _bias_gelu_eager, lambda d, dev: _rows_and_vectors(d, dev, 1, 1),
             lambda d: 2 * d["M"] * d["N"] * 2 + d["N"] * 2, lambda d: 0, ("gelu",)),
    Workload("cross_entropy", "memory", {"small": _mn(64, 256), "full": _mn(32768, 4096)}, _ce_build,
             lambda logits, labels: (F.cross_entropy(logits.float(), labels).to(logits.dtype),), _ce_inputs,
             lambda d: d["M"] * d["N"] * 2 + d["M"] * 8 + 4, lambda d: 0, ("cross_entropy",)),
    Workload("layernorm_backward", "memory", {"small": _mn(64, 256), "full": _mn(16384, 4096)}, _ln_bwd_build,
             _ln_bwd_eager, lambda d, dev: _rows_and_vectors(d, dev, 2, 1),
             lambda d: 3 * d["M"] * d["N"] * 2 + 3 * d["N"] * 2, lambda d: 0, ("layernorm_backward",),
             jax_twin=False),
    Workload("gelu_mlp", "compute", {"small": {"T": 32, "D": 64, "H": 128}, "full": {"T": 8192, "D": 4096, "H": 16384}},
             _mlp_build, _mlp_eager, _mlp_inputs,
             lambda d: 2 * (2 * d["T"] * d["D"] + 2 * d["D"] * d["H"] + d["H"] + d["D"]),
             lambda d: 4 * d["T"] * d["D"] * d["H"], ("matmul", "gelu")),
    Workload("conv_bias_relu", "compute", {"small": {"N": 2, "C": 8, "HW": 8, "K": 8},
                                           "full": {"N": 128, "C": 256, "HW": 56, "K": 256}},
             _conv_build, _conv_eager, _conv_inputs,
             lambda d: 2 * (2 * d["N"] * d["C"] * d["HW"] ** 2 + d["K"] * d["C"] * 9 + d["K"]),
             lambda d: 2 * d["N"] * d["K"] * d["HW"] ** 2 * d["C"] * 9, ("conv2d", "relu")),
    Workload("sdpa", "compute", {"small": {"B": 1, "H": 2, "S": 64, "D": 32},
                                 "full": {"B": 4, "H": 32, "S": 4096, "D": 128}},
             _sdpa_build, _sdpa_eager,
             lambda d, dev: [_randn(d["B"], d["H"], d["S"], d["D"], device=dev) for _ in range(3)],
             lambda d: 4 * d["B"] * d["H"] * d["S"] * d["D"] * 2,
             lambda d: 2 * d["B"] * d["H"] * d["S"] * d["S"] * d["D"], ("scaled_dot_product_attention",)),
)

SUITES = ("memory", "compute")


def select(suites: str) -> list[Workload]:
    """Workloads of a comma-separated list of suites ('all' = every suite), or of named workloads."""
    names = [s.strip() for s in suites.split(",") if s.strip()]
    by_name = {w.name: w for w in WORKLOADS}
    picked: list[Workload] = []
    for name in names:
        if name == "all":
            picked += [w for w in WORKLOADS if w not in picked]
        elif name in SUITES:
            picked += [w for w in WORKLOADS if w.suite == name and w not in picked]
        elif name in by_name:
            if by_name[name] not in picked:
                picked.append(by_name[name])
        else:
            from ..errors import UnsupportedError

            raise UnsupportedError(f"unknown suite or workload {name!r}; suites: {', '.join(SUITES)}, all; "
                                   f"workloads: {', '.join(by_name)}")
    return picked
