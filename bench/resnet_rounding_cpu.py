"""Where ResNet-50's bf16 error against fp32 comes from, on the CPU (no GPU needed): every bottleneck's
last step (conv3 -> batchnorm -> + identity -> relu) computed three ways, the rest of the model in eager
bf16, output compared with the fp32 model by relative norm error:

- eager: each op in bf16 (the conv's product, the batchnorm's and the add's results each rounded);
- fused: the conv's product kept in fp32 through the epilogue, rounded once at the end (what cuDNN's
  fused conv + epilogue kernels and our Triton conv's fused store do);
- gemm: the conv's product rounded to bf16, then the epilogue in fp32, rounded once (what a GEMM of
  bf16 operands does under fusegraph's IR, whose matmul result is bf16: backends/conv_gemm.py).

    python bench/resnet_rounding_cpu.py      (torchvision's resnet50, random weights, 2 images)
"""

from __future__ import annotations

import os
import sys
import types

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import zoo_models


def main() -> None:
    zoo_models.ensure_torchvision_importable()
    from torchvision.models import resnet

    torch.manual_seed(0)
    model = resnet.resnet50().eval()
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        ref = model(x)

    def tail(mode: str) -> object:
        def forward(self: resnet.Bottleneck, inp: torch.Tensor) -> torch.Tensor:
            identity = inp if self.downsample is None else self.downsample(inp)
            out = self.relu(self.bn1(self.conv1(inp)))
            out = self.relu(self.bn2(self.conv2(out)))
            if mode == "eager":
                return self.relu(self.bn3(self.conv3(out)) + identity)
            product = torch.nn.functional.conv2d(out.float(), self.conv3.weight.float())
            if mode == "gemm":
                product = product.to(torch.bfloat16).float()
            bn = self.bn3
            scale = bn.weight.float() / (bn.running_var.float() + bn.eps).sqrt()
            shift = bn.bias.float() - bn.running_mean.float() * scale
            y = product * scale[:, None, None] + shift[:, None, None] + identity.float()
            return torch.relu(y).to(torch.bfloat16)
        return forward

    for mode in ("eager", "fused", "gemm"):
        low = resnet.resnet50().eval()
        low.load_state_dict(model.state_dict())
        for block in low.modules():
            if isinstance(block, resnet.Bottleneck):
                block.forward = types.MethodType(tail(mode), block)  # type: ignore[method-assign]
        low = low.to(torch.bfloat16)
        with torch.no_grad():
            got = low(x.to(torch.bfloat16)).float()
        err = float((got - ref).norm() / ref.norm())
        print(f"{mode:6s} rel err vs fp32 {err:.2e}, output norm {float(got.norm()):.2f} "
              f"(fp32 {float(ref.norm()):.2f})")


if __name__ == "__main__":
    main()
