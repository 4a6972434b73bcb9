"""What a convolution's first call through torch's cuDNN path costs, and what repeats it.

A compiled conv net's first plan run spends seconds in cuDNN convolutions (MobileNetV3-large b64:
3.2 s cold, 1.9 s warm over 35 launches; bench/RESULTS.md, twenty-sixth session). This takes the
convolutions of a torchvision model (shapes read on the meta device, so nothing here touched cuDNN
before), bf16 channels-last at the zoo's batch, and times in a fresh process, each synchronized:
  first     the first call of each convolution, in model order, on the main thread;
  again     the same call again (same tensors);
  moved     new tensors of the same shapes (other addresses);
  thread    the same convolution's first call on another thread (torch keeps cuDNN plans per thread);
  main2     back on the main thread after that.
Totals by kind (depthwise = groups equal to channels, else dense) and the slowest first calls.

    PYTHONPATH=src python bench/cudnn_first_call_gpu.py [--model mobilenet_v3_large] [--batch 64]
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from out_files import write_report


def conv_shapes(model_name: str, batch: int) -> list[dict[str, Any]]:
    import torchvision

    model = getattr(torchvision.models, model_name)().to("meta").eval()
    found: list[dict[str, Any]] = []

    def hook(module: torch.nn.Conv2d, args: tuple[torch.Tensor, ...], _out: Any) -> None:
        found.append({"x": tuple(args[0].shape), "w": tuple(module.weight.shape), "stride": module.stride,
                      "padding": module.padding, "dilation": module.dilation, "groups": module.groups,
                      "bias": module.bias is not None})

    for m in model.modules():
        if isinstance(m, torch.nn.Conv2d):
            m.register_forward_hook(hook)
    with torch.no_grad():
        model(torch.empty(batch, 3, 224, 224, device="meta"))
    return found


def timed(fn: Callable[[], Any]) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="mobilenet_v3_large")
    parser.add_argument("--batch", type=int, default=64)
    opts = parser.parse_args()
    torch.cuda.init()
    torch.empty(1, device="cuda")
    shapes = conv_shapes(opts.model, opts.batch)
    cl, bf16 = torch.channels_last, torch.bfloat16

    def make(s: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        x = torch.randn(s["x"], device="cuda", dtype=bf16).contiguous(memory_format=cl)
        w = torch.randn(s["w"], device="cuda", dtype=bf16).contiguous(memory_format=cl)
        b = torch.randn(s["w"][0], device="cuda", dtype=bf16) if s["bias"] else None
        return x, w, b

    def call(s: dict[str, Any], t: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]) -> Callable[[], Any]:
        return lambda: F.conv2d(t[0], t[1], t[2], s["stride"], s["padding"], s["dilation"], s["groups"])

    rows = []
    for s in shapes:
        t = make(s)
        row = {"shape": s, "first": timed(call(s, t)), "again": timed(call(s, t))}
        row["moved"] = timed(call(s, make(s)))
        rows.append(row)
    for row in rows:   # another thread: torch's cuDNN plan cache is thread-local
        s, t = row["shape"], make(row["shape"])
        box: dict[str, float] = {}
        worker = threading.Thread(target=lambda s=s, t=t: box.update(t=timed(call(s, t))))
        worker.start()
        worker.join()
        row["thread"] = box["t"]
        row["main2"] = timed(call(s, t))
    lines = [f"# python bench/cudnn_first_call_gpu.py {' '.join(sys.argv[1:])}; {torch.cuda.get_device_name()}, "
             f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, "
             f"benchmark={torch.backends.cudnn.benchmark}",
             f"{opts.model} b{opts.batch}: {len(rows)} convolutions (bf16, channels-last)"]
    for kind in ("depthwise", "dense"):
        mine = [r for r in rows if (r["shape"]["groups"] == r["shape"]["x"][1] and r["shape"]["groups"] > 1)
                == (kind == "depthwise")]
        if not mine:
            continue
        sums = {k: sum(r[k] for r in mine) for k in ("first", "again", "moved", "thread", "main2")}
        distinct = len({repr(r["shape"]) for r in mine})
        lines.append(f"  {kind:9s} {len(mine):3d} calls ({distinct} distinct): " +
                     ", ".join(f"{k} {v:.3f} s" for k, v in sums.items()))
    lines.append("  slowest first calls:")
    for r in sorted(rows, key=lambda r: -r["first"])[:10]:
        s = r["shape"]
        lines.append(f"    x {s['x']} w {s['w']} stride {s['stride']} groups {s['groups']}: "
                     f"first {r['first'] * 1e3:.1f} ms, "
                     f"again {r['again'] * 1e3:.2f}, moved {r['moved'] * 1e3:.2f}, thread {r['thread'] * 1e3:.1f}, "
                     f"main2 {r['main2'] * 1e3:.2f}")
    print("\n".join(lines))
    write_report(f"cudnn_first_call_{opts.model}", lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
