"""GPU check of the norm / loss / dropout / quantization ops: build each graph for the device,
run the plan, compare with the reference executor on the same device. Dropout and rand_uniform
must match bit for bit (the hash is integer arithmetic); the rest by relative norm error.

    .venv/bin/python bench/check_norm_loss_quant_gpu.py            # cuda when present, else cpu
    TRITON_INTERPRET=1 .venv/bin/python bench/check_norm_loss_quant_gpu.py --device cpu
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

import torch

import fusegraph as fg


def _case(name: str, build: Callable[..., Any], feeds: list[torch.Tensor], exact: bool, device: str) -> bool:
    g = fg.Graph(name=name, compute_dtype="float32")
    handles = [g.tensor_like(t) for t in feeds]
    outs = build(g, *handles)
    g.set_output(*(outs if isinstance(outs, tuple) else (outs,)))
    try:
        plan = g.build(device=device)
        got = plan(*feeds)
    except Exception as err:  # report and go on: this is a check script
        print(f"{name:28s} FAILED to build/run: {type(err).__name__}: {err}")
        return False
    ref = fg.reference(g)(*feeds)
    got = got if isinstance(got, tuple | list) else (got,)
    ref = ref if isinstance(ref, tuple) else (ref,)
    ok, errs = True, []
    for a, b in zip(got, ref, strict=True):
        if exact:
            same = torch.equal(a, b)
            errs.append("exact" if same else "DIFFERS")
            ok &= same
        else:
            err = ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-12)).item()
            errs.append(f"{err:.1e}")
            ok &= err <= (2e-2 if a.dtype in (torch.bfloat16, torch.float16) else 1e-4)
    kinds = ",".join(f"{k.kind}/{k.backend}" for k in plan.kernels)
    print(f"{name:28s} {'ok ' if ok else 'BAD'} {' '.join(errs):30s} kernels: {kinds}")
    return ok


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    device = parser.parse_args().device
    torch.manual_seed(0)
    small = device == "cpu"  # the Triton interpreter is slow: small shapes on CPU
    M, N = (64, 96) if small else (4096, 1024)
    C, S = (8, 5) if small else (64, 14)
    x = torch.randn(M, N, device=device, dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    w = torch.randn(N, device=device, dtype=torch.bfloat16)
    t = torch.randint(0, N, (M,), device=device)
    t[::7] = -100
    xc = torch.randn(8, C, S, S, device=device, dtype=torch.bfloat16)
    wc = torch.randn(C, device=device, dtype=torch.bfloat16)
    checks = [
        ("rand_uniform", lambda g: g.rand_uniform((M, N), seed=123, offset=7), [], True),
        ("dropout", lambda g, x: g.dropout(x, 0.1, seed=5), [x], True),
        ("layernorm_backward", lambda g, dy, x, w: g.layernorm_backward(dy, x, weight=w), [dy, x, w], False),
        ("rmsnorm_backward", lambda g, dy, x, w: g.rmsnorm_backward(dy, x, weight=w), [dy, x, w], False),
        ("cross_entropy", lambda g, x, t: g.cross_entropy(x, t, label_smoothing=0.1), [x, t], False),
        ("cross_entropy_backward", lambda g, x, t: g.cross_entropy_backward(g.constant(1.0), x, t), [x, t], False),
        ("batch_norm_train", lambda g, x, w: g.batch_norm(x, None, None, w, w, training=True), [xc, wc], False),
        ("batchnorm_backward", lambda g, x, w: g.batchnorm_backward(x, x, w), [xc, wc], False),
        ("group_norm", lambda g, x, w: g.group_norm(x, 4, w, w), [xc, wc], False),
        ("quantize_fp8_row", lambda g, x: g.quantize(x, "float8_e4m3fn", "row"), [x], True),
        ("quantize_int8_block", lambda g, x: g.quantize(x, "int8", "block", block_size=32), [x], True),
        ("dequantize_fp8_tensor", lambda g, x: g.dequantize(*g.quantize(x, "float8_e5m2")), [x], False),
    ]
    results = [_case(name, build, feeds, exact, device) for name, build, feeds, exact in checks]
    print(f"{sum(results)}/{len(results)} ok on {device}")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
