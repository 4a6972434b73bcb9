"""ResNet-50's 1x1 convolutions with their inference epilogue (batchnorm, residual add, relu), three ways,
device time per call (fusegraph.perf.timing.device_time), b128 bf16 channels-last:

- "plan": the module (conv 1x1 + BatchNorm2d [+ residual] + ReLU) through fg.compile, the way the ResNet-50
  target runs it (cuDNN fused graph, or ours where the tuner picks it; the kernel's config is printed);
- "gemm": the same computation declared as a GEMM graph ([M, C_in] x [C_in, C_out] with the folded
  batchnorm's scale and shift, the residual and relu as its epilogue), built by fg (generated GEMM
  or cuBLAS, tuned);
- the HBM floor (bytes / 4.8 TB/s).

    PYTHONPATH=src python bench/conv1x1_gemm_gpu.py
"""

from __future__ import annotations

import os
import sys

import torch

import fusegraph as fg
from fusegraph.perf.timing import device_time

# (name, batch, C_in, C_out, H=W, residual)
CASES = [
    ("l1_expand_res", 128, 64, 256, 56, True),
    ("l2_expand_res", 128, 128, 512, 28, True),
    ("l3_expand_res", 128, 256, 1024, 14, True),
    ("l4_expand_res", 128, 512, 2048, 7, True),
    ("l1_reduce", 128, 256, 64, 56, False),
    ("l2_reduce", 128, 512, 128, 28, False),
]
HBM_TBS = 4.8


class Tail(torch.nn.Module):
    def __init__(self, c_in: int, c_out: int, residual: bool) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(c_in, c_out, 1, bias=False)
        self.bn = torch.nn.BatchNorm2d(c_out)
        self.residual = residual
        with torch.no_grad():
            self.bn.running_mean.uniform_(-1, 1)
            self.bn.running_var.uniform_(0.5, 2)
            self.bn.weight.uniform_(0.5, 2)
            self.bn.bias.uniform_(-1, 1)

    def forward(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        y = self.bn(self.conv(x))
        return torch.relu(y + r if self.residual else y)


def gemm_plan(m: int, c_in: int, c_out: int, residual: bool) -> object:
    g = fg.Graph(name="conv1x1_as_gemm", compute_dtype="float32")
    a = g.tensor((m, c_in), "bfloat16", name="x")
    w = g.tensor((c_out, c_in), "bfloat16", name="w")
    scale = g.tensor((c_out,), "float32", name="scale")
    shift = g.tensor((c_out,), "float32", name="shift")
    y = g.add(g.mul(g.matmul(a, g.transpose(w, 0, 1)), scale), shift)
    if residual:
        y = g.add(y, g.tensor((m, c_out), "bfloat16", name="r"))
    g.cast(g.relu(y), "bfloat16").set_output()
    return g.build(device="cuda")


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-12))


def main() -> None:
    out_dir = os.environ.get("OUT")
    lines = [f"== 1x1 conv + bn (+ residual) + relu, {torch.cuda.get_device_name()}, bf16 channels-last; ms per call"]
    print(lines[0], flush=True)
    cl = torch.channels_last
    for name, n, c_in, c_out, hw, residual in CASES:
        torch.manual_seed(0)
        model = Tail(c_in, c_out, residual).cuda().to(torch.bfloat16).to(memory_format=cl).eval()  # type: ignore[call-overload]
        x = torch.randn(n, c_in, hw, hw, device="cuda", dtype=torch.bfloat16).contiguous(memory_format=cl)
        r = torch.randn(n, c_out, hw, hw, device="cuda", dtype=torch.bfloat16).contiguous(memory_format=cl)
        m = n * hw * hw
        floor_bytes = 2 * (m * c_in + m * c_out * (2 if residual else 1))
        with torch.no_grad():
            want = model(x, r)
            compiled = fg.compile(model)
            got = compiled(x, r)
            t_plan = device_time(lambda: compiled(x, r)).ms
            configs = [f"{k.backend} {k.config}" for graph in compiled.fusegraph_report.graphs
                       for part in graph.partitions if part.plan is not None
                       for k in part.plan.kernels if k.kind == "convolution"]
            bn = model.bn
            scale = (bn.weight.float() / (bn.running_var.float() + bn.eps).sqrt()).contiguous()
            shift = (bn.bias.float() - bn.running_mean.float() * scale).contiguous()
            a = x.permute(0, 2, 3, 1).reshape(m, c_in)                       # NHWC: a view
            w = model.conv.weight.reshape(c_out, c_in)
            feeds = [a, w, scale, shift] + ([r.permute(0, 2, 3, 1).reshape(m, c_out)] if residual else [])
            plan = gemm_plan(m, c_in, c_out, residual)
            y = plan(*feeds)
            got_gemm = y.view(n, hw, hw, c_out).permute(0, 3, 1, 2)
            t_gemm = device_time(lambda: plan(*feeds)).ms
            gemm_kernels = [f"{k.kind}/{k.backend} {k.config}" for k in plan.kernels]
        floor = floor_bytes / (HBM_TBS * 1e9)
        text = (f"{name:15s} M={m} {c_in}->{c_out}{' +res' if residual else ''}: plan {t_plan:.4f} ms "
                f"(err {rel_err(got, want):.1e}), gemm {t_gemm:.4f} ms (err {rel_err(got_gemm, want):.1e}), "
                f"floor {floor:.4f}; gemm/plan {t_gemm / t_plan:.2f}\n    plan: {configs}\n    gemm: {gemm_kernels}")
        print(text, flush=True)
        lines.append(text)
    if out_dir:
        with open(os.path.join(out_dir, "conv1x1_gemm.txt"), "a") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
