"""JAX/XLA twins of the benchmark workloads, run in a subprocess by `fusegraph bench --compare jax`:

    python -m fusegraph.perf.jax_twins WORKLOAD '{"M": 16384, "N": 4096}'

prints one JSON line: device_ms (100 back-to-back calls, then block_until_ready; median of 5),
latency_ms (one call then block; median of 50), compile_s (first call).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any


def _twins() -> dict[str, tuple[Callable[..., Any], Callable[[dict[str, int], Any], list[Any]]]]:
    import jax
    import jax.numpy as jnp

    bf16 = jnp.bfloat16

    def rnd(key: Any, *shape: int, scale: float = 1.0) -> Any:
        return (jax.random.normal(key, shape, jnp.float32) * scale).astype(bf16)

    def keys(n: int) -> list[Any]:
        return list(jax.random.split(jax.random.PRNGKey(int(time.time())), n))

    def layernorm(h: Any, w: Any, b: Any) -> Any:
        hf = h.astype(jnp.float32)
        mean = hf.mean(-1, keepdims=True)
        var = ((hf - mean) ** 2).mean(-1, keepdims=True)
        return ((hf - mean) * jax.lax.rsqrt(var + 1e-5) * w.astype(jnp.float32) + b.astype(jnp.float32)).astype(bf16)

    def add_ln(x: Any, r: Any, w: Any, b: Any) -> Any:
        h = x + r
        return h, layernorm(h, w, b)

    def rms(x: Any, w: Any) -> Any:
        xf = x.astype(jnp.float32)
        return (xf * jax.lax.rsqrt((xf * xf).mean(-1, keepdims=True) + 1e-6) * w.astype(jnp.float32)).astype(bf16)

    def softmax(x: Any) -> Any:
        return jax.nn.softmax(x.astype(jnp.float32), axis=-1).astype(bf16)

    def bias_gelu(x: Any, b: Any) -> Any:
        return jax.nn.gelu((x + b).astype(jnp.float32), approximate=True).astype(bf16)

    def ce(logits: Any, labels: Any) -> Any:
        lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        return -jnp.take_along_axis(lp, labels[:, None], axis=-1).mean()

    def mlp(x: Any, w1: Any, b1: Any, w2: Any, b2: Any) -> Any:
        return jax.nn.gelu(x @ w1 + b1, approximate=True) @ w2 + b2

    def conv(x: Any, w: Any, b: Any) -> Any:  # NHWC x, HWIO w
        y = jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return jax.nn.relu(y + b)

    def sdpa(q: Any, k: Any, v: Any) -> Any:  # [B, S, H, D] as jax.nn.dot_product_attention wants
        return jax.nn.dot_product_attention(q, k, v, is_causal=True)

    def mn(rows: int, vecs: int) -> Callable[[dict[str, int], Any], list[Any]]:
        def make(d: dict[str, int], _: Any) -> list[Any]:
            ks = keys(rows + vecs)
            return [rnd(ks[i], d["M"], d["N"]) for i in range(rows)] + [rnd(ks[rows + i], d["N"]) for i in range(vecs)]
        return make

    def ce_in(d: dict[str, int], _: Any) -> list[Any]:
        k1, k2 = keys(2)
        return [rnd(k1, d["M"], d["N"], scale=2.0), jax.random.randint(k2, (d["M"],), 0, d["N"])]

    def mlp_in(d: dict[str, int], _: Any) -> list[Any]:
        ks = keys(5)
        t, dm, h = d["T"], d["D"], d["H"]
        return [rnd(ks[0], t, dm), rnd(ks[1], dm, h, scale=dm ** -0.5), rnd(ks[2], h),
                rnd(ks[3], h, dm, scale=h ** -0.5), rnd(ks[4], dm)]

    def conv_in(d: dict[str, int], _: Any) -> list[Any]:
        ks = keys(3)
        return [rnd(ks[0], d["N"], d["HW"], d["HW"], d["C"]),
                rnd(ks[1], 3, 3, d["C"], d["K"], scale=(9 * d["C"]) ** -0.5), rnd(ks[2], d["K"])]

    def sdpa_in(d: dict[str, int], _: Any) -> list[Any]:
        return [rnd(k, d["B"], d["S"], d["H"], d["D"]) for k in keys(3)]

    return {"add_layernorm": (add_ln, mn(2, 2)), "rmsnorm": (rms, mn(1, 1)), "softmax": (softmax, mn(1, 0)),
            "bias_gelu": (bias_gelu, mn(1, 1)), "cross_entropy": (ce, ce_in), "gelu_mlp": (mlp, mlp_in),
            "conv_bias_relu": (conv, conv_in), "sdpa": (sdpa, sdpa_in)}


def main(argv: list[str]) -> int:
    try:
        import jax
    except ImportError:
        print(json.dumps({"note": "jax is not installed"}))
        return 0
    name, dims = argv[0], json.loads(argv[1])
    twins = _twins()
    if name not in twins:
        print(json.dumps({"note": f"no JAX twin for {name}"}))
        return 0
    fn, make = twins[name]
    args = make(dims, None)
    jitted = jax.jit(fn)
    t0 = time.perf_counter()
    jax.block_until_ready(jitted(*args))
    compile_s = time.perf_counter() - t0
    for _ in range(3):
        jax.block_until_ready(jitted(*args))
    device = []
    for _ in range(5):
        t0 = time.perf_counter()
        out = None
        for _ in range(100):
            out = jitted(*args)
        jax.block_until_ready(out)
        device.append((time.perf_counter() - t0) / 100 * 1e3)
    latency = []
    for _ in range(50):
        t0 = time.perf_counter()
        jax.block_until_ready(jitted(*args))
        latency.append((time.perf_counter() - t0) * 1e3)
    print(json.dumps({"device_ms": statistics.median(device), "latency_ms": statistics.median(latency),
                      "compile_s": compile_s, "method": "100 async calls then block (host clock)",
                      "note": f"jax {jax.__version__} on {jax.devices()[0].device_kind}"}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
