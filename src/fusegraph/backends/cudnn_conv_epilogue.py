"""conv2d + a CNN inference epilogue as ONE cuDNN Graph API plan (runtime fusion), an autotune
candidate of a ConvGroup next to torch's conv + our generated epilogue (backends/conv_kernel.py).

The epilogue is read by its meaning, not by its op string: the nodes after the convolution are
interpreted over symbolic values, each either

- per-channel: a value that broadcasts along the channel axis only (BatchNorm's mean, var, weight,
  bias after their casts/reshapes, rsqrt(var + eps), scalars); computed per call with the reference
  executor on the few C elements, or
- linear: sum_k scale_k * T_k + shift over full tensors T_k (the convolution's result, a residual)
  with per-channel scale_k and shift, through add/sub/mul/div/neg and float casts, or
- an activation (relu/gelu/silu) of a linear value, then only casts or a final layout copy.

The result must be scale * conv + shift [+ rscale * residual] [-> activation]; then the plan is

    conv_fprop -> mul(scale) -> add(shift) -> [add(residual) or add(mul(residual, rscale))] -> [act]

fp32 intermediates, NHWC operands and result, per-channel vectors fp32 [1, C, 1, 1]. If cuDNN has
no engine for a scaled residual (a pointwise op off the convolution's chain), the equivalent
chain conv -> mul(scale/r) -> add(shift/r) -> add(residual) -> mul(r) -> act is tried, with r the
residual's scale (|r| < 1e-20 replaced by 1e-20: the residual's term is then negligible, as it is).

The per-channel vectors are folded per call (a few ops on 2 x C elements) and reused while every
per-channel input is a plan input or constant still backed by the same memory (the cache holds the
tensor, so that memory is not reused) at the same version (torch bumps the version counter, shared
by aliases like detach(), on in-place writes; writes through `.data` are not seen). In fusegraph's
own CUDA-graph capture the cached vectors are baked into the graph, with a pre-replay hook that refolds
them when a per-channel input was written in place; inside another capture they are recomputed in the
graph (FoldedVectors).
Anything else in the epilogue: not offered, with the reason under FUSEGRAPH_DEBUG.

Plans are built at build time, once per distinct (shapes, dtypes, conv attributes, epilogue form);
with autotuning on, up to MAX_PLANS of cuDNN's execution plans are timed and the fastest kept. The
ConvGroup's autotuner (backends/conv_kernel.py) checks the candidate against cuDNN conv + our
generated epilogue and picks between them on measured time.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..ir import dtypes
from ..ir.node import Node
from ..ir.spec import strides_for_order
from ..reference import run_node
from ..runtime.cuda_graph import refresh_before_replay
from ..runtime.kernel import in_strides
from ..settings import settings
from . import cudnn_frontend as fe
from . import cudnn_plans as plans

# a per-channel expression: ("leaf", node id) | ("const", value) | (op, a, b) for mul/add/sub/div | ("neg", a)
Expr = tuple[Any, ...]
FLOATS = ("float16", "bfloat16", "float32")
TINY = 1e-20


def _mul(a: Expr | None, b: Expr | None) -> Expr | None:
    """Product of two scales (None = 1)."""
    return b if a is None else a if b is None else ("mul", a, b)


def _add(a: Expr | None, b: Expr | None) -> Expr | None:
    """Sum of two shifts (None = 0)."""
    return b if a is None else a if b is None else ("add", a, b)


def _neg(a: Expr | None) -> Expr:
    return ("const", -1.0) if a is None else ("neg", a)


@dataclass(frozen=True)
class Linear:
    """sum over terms of scale * tensor(base id), plus shift; scale None = 1, shift None = 0."""

    terms: tuple[tuple[int, Expr | None], ...]
    shift: Expr | None = None

    def scaled(self, c: Expr, divide: bool = False) -> Linear:
        def apply(s: Expr | None) -> Expr:
            if divide:
                return ("div", ("const", 1.0) if s is None else s, c)
            return c if s is None else ("mul", s, c)

        return Linear(tuple((b, apply(s)) for b, s in self.terms),
                      None if self.shift is None else ("div" if divide else "mul", self.shift, c))

    def shifted(self, c: Expr) -> Linear:
        return Linear(self.terms, _add(self.shift, c))

    def negated(self) -> Linear:
        return Linear(tuple((b, _neg(s)) for b, s in self.terms), None if self.shift is None else _neg(self.shift))

    def plus(self, other: Linear) -> Linear:
        terms = dict(self.terms)
        for base, s in other.terms:
            if base in terms:
                terms[base] = ("add", terms[base] or ("const", 1.0), s or ("const", 1.0))
            else:
                terms[base] = s
        return Linear(tuple(terms.items()), _add(self.shift, other.shift))


@dataclass(frozen=True)
class Activation:
    name: str           # the frontend's pygraph method (relu, gelu, gelu_approx_tanh, swish)
    of: Linear


@dataclass
class ConvEpilogue:
    """What the epilogue computes: activation(scale * conv + shift + rscale * residual)."""

    conv: Node
    channels: int
    scale: Expr | None
    shift: Expr | None
    residual: Node | None
    residual_scale: Expr | None
    activation: str
    out: Node                                   # the stored value (its dtype is the plan's output dtype)
    chan_nodes: list[Node] = field(default_factory=list)    # per-channel nodes, in order, evaluated per call
    leaves: list[Node] = field(default_factory=list)        # per-channel values read from the kernel's inputs
    constants: list[Node] = field(default_factory=list)     # per-channel generators (scalars), no inputs

    def describe(self) -> str:
        steps = ["conv_fprop"]
        if self.scale is not None:
            steps.append("mul(scale)")
        if self.shift is not None:
            steps.append("add(shift)")
        if self.residual is not None:
            steps.append("add(residual)" if self.residual_scale is None else "add(mul(residual, rscale))")
        if self.activation:
            steps.append(self.activation)
        return " -> ".join(steps)


class NotServed(Exception):
    """The epilogue is not one the fused plan computes (the message says which node and why)."""


def _channel_broadcast(shape: tuple[int, ...], full: tuple[int, ...]) -> bool:
    """Does a value of `shape` broadcast against `full` (N, C, ...) along the channel axis only?"""
    if len(shape) > len(full):
        return False
    offset = len(full) - len(shape)
    return all(d == 1 or (offset + i == 1 and d == full[1]) for i, d in enumerate(shape))


def classify(conv: Node, epilogue: Sequence[Node], inputs: Sequence[Node]) -> ConvEpilogue:
    """Interpret the epilogue nodes (in order) over symbolic values; NotServed names the first node
    that is not per-channel arithmetic, linear in full tensors, or a final activation."""
    if conv.op != "conv2d" or len(conv.spec.shape) != 4:
        raise NotServed(f"{conv.op} {conv.name} is not a 2-d forward convolution")
    full = conv.spec.shape
    values: dict[int, Linear | Activation | str] = {}   # "chan" for per-channel nodes
    epi = ConvEpilogue(conv, full[1], None, None, None, None, "", conv)
    shift0 = None
    if len(conv.inputs) == 3:   # conv bias: a per-channel shift of the product
        bias = conv.inputs[2]
        epi.leaves.append(bias)
        values[bias.id] = "chan"
        shift0 = ("leaf", bias.id)
    values[conv.id] = Linear(((conv.id, None),), shift0)
    given = {n.id for n in inputs}
    for node in epilogue:
        for i in node.inputs:
            if i.id not in values:
                values[i.id] = _leaf(node, i, i.id in given, full, epi)
        values[node.id] = _step(node, [values[i.id] for i in node.inputs], full, epi)
        if values[node.id] == "chan":
            epi.chan_nodes.append(node)
        epi.out = node
    result = values[epi.out.id]
    if isinstance(result, Activation):
        epi.activation, result = result.name, result.of
    if not isinstance(result, Linear):
        raise NotServed(f"the epilogue's result {epi.out.op} {epi.out.name} is per-channel, not the convolution's")
    terms = dict(result.terms)
    if conv.id not in terms:
        raise NotServed("the convolution's result does not reach the output")
    epi.scale, epi.shift = terms.pop(conv.id), result.shift
    if len(terms) > 1:
        raise NotServed(f"{len(terms)} residual tensors (at most one)")
    for base, s in terms.items():
        epi.residual = next(n for n in inputs if n.id == base)
        epi.residual_scale = s
    if epi.out.dtype not in FLOATS or conv.dtype not in ("float16", "bfloat16"):
        raise NotServed(f"dtypes conv {conv.dtype} -> output {epi.out.dtype} (fp16/bf16 convolutions only)")
    if tuple(epi.out.spec.shape) != tuple(full):
        raise NotServed(f"output shape {epi.out.spec.shape} is not the convolution's {full}")
    return epi


def _leaf(node: Node, value: Node, given: bool, full: tuple[int, ...], epi: ConvEpilogue) -> Linear | str:
    """The symbolic value of a tensor the epilogue reads from outside itself: a kernel input of the
    convolution's shape (a residual), a per-channel kernel input, or a per-channel generator."""
    shape = tuple(value.spec.shape)
    if given and shape == tuple(full):
        return Linear(((value.id, None),))
    per_channel = _channel_broadcast(shape, full) or (len(shape) == 1 and shape[0] == full[1])
    if given and per_channel:   # a [C] vector counts where a reshape puts C on the channel axis (checked at use)
        epi.leaves.append(value)
        return "chan"
    if not given and not value.inputs and per_channel:
        epi.constants.append(value)
        return "chan"
    raise NotServed(f"{node.op} {node.name} reads {value.op} {value.name} of shape {shape}, neither per-channel "
                    f"nor of the convolution's shape {full}")


def _step(node: Node, args: list[Any], full: tuple[int, ...], epi: ConvEpilogue) -> Linear | Activation | str:
    """The symbolic value of one epilogue node from its inputs' values."""
    where = f"{node.op} {node.name}"
    if all(a == "chan" for a in args):
        if not _channel_broadcast(tuple(node.spec.shape), full) and node.spec.numel != full[1]:
            raise NotServed(f"{where}: per-channel inputs, but shape {node.spec.shape} is not per-channel")
        return "chan"
    if any(isinstance(a, Activation) for a in args):
        if node.op in ("cast", "to_layout") and (node.op == "to_layout" or node.dtype in FLOATS):
            return args[0]  # type: ignore[no-any-return]
        raise NotServed(f"{where} after the activation (only casts or a layout copy may follow it)")
    chans: list[Expr | None] = []
    for i, a in zip(node.inputs, args, strict=True):
        if a == "chan":
            if not _channel_broadcast(tuple(i.spec.shape), full):
                raise NotServed(f"{where}: {i.name} of shape {i.spec.shape} does not broadcast along channels")
            chans.append(("leaf", i.id))
        else:
            chans.append(None)
    if tuple(node.spec.shape) != tuple(full):
        raise NotServed(f"{where}: shape {node.spec.shape} is not the convolution's {full}")
    op = node.op
    if (op == "cast" and node.dtype in FLOATS) or op == "to_layout" or op in ("reshape", "view", "expand"):
        return args[0]  # type: ignore[no-any-return]
    if op in fe.ACTIVATION_OPS:
        act = fe.ACTIVATIONS.get((op, str(node.attrs.get("approximate", "none")) if op == "gelu" else ""))
        if act is None or len(args) != 1:
            raise NotServed(f"{where}: activation {dict(node.attrs)} not served by the frontend")
        return Activation(act, args[0])
    if node.attrs and op in ("add", "sub", "mul", "div", "neg"):
        raise NotServed(f"{where}: attributes {dict(node.attrs)}")
    if op == "neg" and len(args) == 1:
        return args[0].negated()  # type: ignore[no-any-return]
    if len(args) != 2 or op not in ("add", "sub", "mul", "div"):
        raise NotServed(f"{where}: {op} is not per-channel affine arithmetic, a residual add or relu/gelu/silu")
    a, b = args
    ca, cb = chans
    if op in ("add", "sub"):
        if isinstance(a, Linear) and isinstance(b, Linear):
            return a.plus(b if op == "add" else b.negated())
        if isinstance(a, Linear) and cb is not None:
            return a.shifted(cb if op == "add" else ("neg", cb))
        assert isinstance(b, Linear) and ca is not None
        return (b if op == "add" else b.negated()).shifted(ca)
    if op == "mul" and isinstance(a, Linear) and cb is not None:
        return a.scaled(cb)
    if op == "mul" and isinstance(b, Linear) and ca is not None:
        return b.scaled(ca)
    if op == "div" and isinstance(a, Linear) and cb is not None:
        return a.scaled(cb, divide=True)
    raise NotServed(f"{where}: {op} of two full tensors (not linear)" if op == "mul"
                    else f"{where}: division by a full tensor")


# ---- per-call folding of the per-channel vectors ----

def evaluate(expr: Expr, vectors: dict[int, torch.Tensor], channels: int, device: torch.device) -> torch.Tensor:
    """An expression over fp32 [C] vectors."""
    kind = expr[0]
    if kind == "leaf":
        v = vectors[expr[1]]
        return v.expand(channels) if v.numel() == 1 else v
    if kind == "const":
        return torch.full((channels,), float(expr[1]), dtype=torch.float32, device=device)
    if kind == "neg":
        return -evaluate(expr[1], vectors, channels, device)
    a, b = (evaluate(e, vectors, channels, device) for e in expr[1:])
    if kind == "mul":
        return a * b
    if kind == "add":
        return a + b
    if kind == "sub":
        return a - b
    return a / b


def constant_values(epi: ConvEpilogue, compute_dtype: str, device: torch.device) -> dict[int, torch.Tensor]:
    """The per-channel generators (eps scalars), made once: a host-to-device copy cannot be captured."""
    return {n.id: run_node(n, [], compute_dtype, device) for n in epi.constants}


def fold(epi: ConvEpilogue, leaf_values: Sequence[torch.Tensor], compute_dtype: str,
         device: torch.device, constants: dict[int, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The fp32 [C] vectors scale, shift and rscale (only those the epilogue has) from the per-channel
    inputs (in epi.leaves order): the per-channel nodes run through the reference executor."""
    env: dict[int, torch.Tensor] = {n.id: t for n, t in zip(epi.leaves, leaf_values, strict=True)}
    env.update(constants if constants is not None else constant_values(epi, compute_dtype, device))
    for n in epi.chan_nodes:
        env[n.id] = run_node(n, [env[i.id] for i in n.inputs], compute_dtype, device)
    vectors = {k: v.reshape(-1).float() for k, v in env.items()}
    out = {}
    for key, expr in (("scale", epi.scale), ("shift", epi.shift), ("rscale", epi.residual_scale)):
        if expr is not None:
            out[key] = evaluate(expr, vectors, epi.channels, device)
    return out


def rescaled(vectors: dict[str, torch.Tensor], channels: int) -> dict[str, torch.Tensor]:
    """scale/r, shift/r and r (the residual's scale, kept away from zero) for the chain that adds the
    residual unscaled and multiplies by r after it."""
    r = vectors["rscale"]
    r = torch.where(r.abs() < TINY, torch.full_like(r, TINY), r)
    one = torch.ones(channels, dtype=torch.float32, device=r.device)
    return {"scale": vectors.get("scale", one) / r,
            "shift": vectors.get("shift", torch.zeros_like(one)) / r, "rscale": r}


# ---- the cuDNN graph ----

NHWC = (0, 2, 3, 1)


def recipe_of(epi: ConvEpilogue, mode: str, vector_dtype: str = "float32") -> plans.ConvRecipe:
    """The plan as plain values (backends/cudnn_plans.py): mode "direct" scales the residual in the
    graph; "rescaled" adds it unscaled and multiplies the sum by its scale; per-channel vectors in
    `vector_dtype`."""
    from ..ops.conv import conv_params

    node = epi.conv
    stride, padding, dilation, _ = conv_params(node.attrs)
    scaled_residual = epi.residual is not None and epi.residual_scale is not None
    rescale = mode == "rescaled" and scaled_residual
    residual = None if epi.residual is None else (tuple(epi.residual.spec.shape), epi.residual.dtype)
    return plans.ConvRecipe(
        x_shape=tuple(node.inputs[0].spec.shape), w_shape=tuple(node.inputs[1].spec.shape), stride=tuple(stride),
        padding=tuple(padding), dilation=tuple(dilation), dtype=node.dtype, vector_dtype=vector_dtype,
        scale=epi.scale is not None or rescale, shift=epi.shift is not None or rescale, residual=residual,
        residual_scaled=scaled_residual and not rescale, rescale_after=rescale, activation=epi.activation,
        out_shape=tuple(epi.out.spec.shape), out_dtype=epi.out.dtype, form=mode)


def recipes_for(epi: ConvEpilogue) -> list[plans.ConvRecipe]:
    """The forms to try, in order: the direct chain, then for a scaled residual the rescaled one,
    each with fp32 per-channel vectors, then with vectors in the convolution's dtype."""
    forms = ["direct", "rescaled"] if epi.residual is not None and epi.residual_scale is not None else ["direct"]
    return [recipe_of(epi, mode, vd) for vd in ("float32", epi.conv.dtype) for mode in forms]


def _same_unchanged(t: torch.Tensor, held: torch.Tensor, version: int) -> bool:
    """Is `t` the memory of `held` (held alive by the cache, so no other tensor can be allocated
    there: the same tensor, or an alias such as t.detach(), which shares its version counter), not
    written in place since the fold?"""
    return (t.data_ptr() == held.data_ptr() and t._version == version and t.shape == held.shape
            and t.stride() == held.stride() and t.dtype == held.dtype)


class FoldedVectors:
    """A fused conv epilogue's per-channel vectors, folded from its per-channel inputs (`leaves`) by
    `fold(leaves, device)` and cached while the leaves are the same memory, unchanged (version
    counters) when `cacheable`. Inside fusegraph's own CUDA-graph capture the cached vectors are baked
    into the graph with a hook (runtime.cuda_graph.refresh_before_replay) that refolds them into the
    same buffers before a replay when a leaf was written in place since (BN statistics updated between
    evaluations); inside any other capture they are folded in the graph, every replay."""

    def __init__(self, cacheable: bool,
                 fold: Callable[[Sequence[torch.Tensor], torch.device], dict[str, torch.Tensor]]) -> None:
        self.cacheable = cacheable
        self.fold = fold
        self._cache: tuple[list[tuple[torch.Tensor, int]], dict[str, torch.Tensor]] | None = None

    def get(self, leaves: Sequence[torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
        capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if self.cacheable and self._cache is not None:
            held, cached = self._cache
            unchanged = len(held) == len(leaves) and all(_same_unchanged(t, h, v)
                                                         for (h, v), t in zip(held, leaves, strict=True))
            if unchanged and (not capturing or refresh_before_replay(self._baked(held, cached))):
                return cached
        got = self.fold(leaves, device)
        if self.cacheable and not capturing:
            self._cache = ([(t, t._version) for t in leaves], got)
        return got

    def _baked(self, held: list[tuple[torch.Tensor, int]], cached: dict[str, torch.Tensor]) -> Callable[[], None]:
        versions = [v for _, v in held]
        tensors = [t for t, _ in held]

        def refresh() -> None:
            if all(t._version == v for t, v in zip(tensors, versions, strict=True)):
                return
            for key, value in self.fold(tensors, tensors[0].device).items():
                cached[key].copy_(value)
            versions[:] = [t._version for t in tensors]

        return refresh


class FusedConvLaunch:
    """The launch of a built plan: args in the ConvGroup's input order -> [result in out_strides].
    `folds` counts how often the per-channel vectors were (re)computed."""

    def __init__(self, epi: ConvEpilogue, plan: fe.FrontendPlan, tensors: dict[str, Any], mode: str,
                 positions: dict[int, int], out_strides: tuple[int, ...], compute_dtype: str,
                 device: torch.device, vector_dtype: str = "float32") -> None:
        self.epi, self.plan, self.tensors, self.mode = epi, plan, tensors, mode
        self.vector_dtype = dtypes.to_torch(vector_dtype)
        node = epi.conv
        self.conv_at = [positions[i.id] for i in node.inputs[:2]]
        self.leaf_at = [positions[n.id] for n in epi.leaves]
        self.residual_at = positions[epi.residual.id] if epi.residual is not None else None
        self.out_shape = tuple(epi.out.spec.shape)
        self.nhwc = strides_for_order(self.out_shape, NHWC)
        self.out_strides = tuple(out_strides)
        self.out_dtype = dtypes.to_torch(epi.out.dtype)
        self.compute_dtype, self.device = compute_dtype, device
        # caching is safe only for values that are plan inputs or constants (not buffers other kernels rewrite)
        self.cacheable = all(n.op in ("input", "constant") for n in epi.leaves)
        self.constants = constant_values(epi, compute_dtype, device)
        self.folds = 0
        self.folded = FoldedVectors(self.cacheable, self._fold)
        self.roles = tuple(tensors)
        uids = [t if isinstance(t, int) else getattr(t, "uid", None) for t in (tensors[r] for r in self.roles)]
        ints = [u for u in uids if isinstance(u, int)]
        self.uids = tuple(ints) if len(ints) == len(uids) else None
        self.ordered: bool | None = None     # the ordered binding path: untried, agreed with the dict path, or not

    def vectors(self, args: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
        """The folded per-channel vectors (FoldedVectors: cached, baked into fusegraph's captures)."""
        return self.folded.get([args[k] for k in self.leaf_at], args[0].device)

    def _fold(self, leaves: Sequence[torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
        self.folds += 1
        got = fold(self.epi, leaves, self.compute_dtype, device, self.constants)
        if self.mode == "rescaled" and "rscale" in got:
            got = rescaled(got, self.epi.channels)
        c = self.epi.channels   # [1, C, 1, 1] in the NHWC strides the graph declares
        return {k: v.to(self.vector_dtype).contiguous().as_strided((1, c, 1, 1), (c, 1, c, c))
                for k, v in got.items()}

    def __call__(self, args: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        cl = torch.channels_last
        x, w = (args[k].contiguous(memory_format=cl) for k in self.conv_at)
        out = torch.empty_strided(self.out_shape, self.nhwc, dtype=self.out_dtype, device=x.device)
        by_role = {"x": x, "w": w, "y": out, **self.vectors(args)}
        if self.residual_at is not None:
            by_role["residual"] = args[self.residual_at].contiguous(memory_format=cl)
        self._execute(by_role)
        return [in_strides(out, self.out_strides)]

    def _execute(self, by_role: dict[str, torch.Tensor]) -> None:
        """Run the plan through the ordered binding path when it was seen to agree with the dict
        path (checked on the first call outside a CUDA graph capture), else the dict path."""
        if self.ordered:
            self.plan.run_ordered(tuple(by_role[r] for r in self.roles), self.uids or ())
            return
        self.plan({self.tensors[r]: v for r, v in by_role.items()})
        out = by_role["y"]
        if self.ordered is None and self.uids is not None and not (
                out.is_cuda and torch.cuda.is_current_stream_capturing()):
            try:
                again = torch.empty_like(out)
                self.plan.run_ordered(tuple(again if r == "y" else by_role[r] for r in self.roles), self.uids)
                self.ordered = bool(torch.equal(again, out))
            except Exception as err:  # an older frontend without tensor_uids: the dict path
                fe.debug("fused conv", f"ordered binding not used: {type(err).__name__}: {str(err)[:120]}")
                self.ordered = False


def candidate(conv: Node, epilogue: Sequence[Node], inputs: Sequence[Node], out_strides: tuple[int, ...],
              compute_dtype: str, device: str, name: str) -> FusedConvLaunch | None:
    """The fused launch (args = `inputs`, the ConvGroup's inputs) or None, with the reason under
    FUSEGRAPH_DEBUG: the frontend unavailable, an epilogue it does not serve, or no cuDNN engine."""
    why = fe.unavailable(device)
    if why is None:
        try:
            epi = classify(conv, epilogue, inputs)
        except NotServed as err:
            why = f"epilogue not served: {err}"
        else:
            if int(conv.attrs.get("groups", 1)) != 1:
                why = "grouped convolution"
    if why is not None:
        fe.debug(name, why)
        return None
    return build(epi, inputs, out_strides, compute_dtype, torch.device(device), name)


# built plans by what they compute (shapes, dtypes, conv attributes, epilogue form): ResNet-50 repeats
# its block shapes, so most of its convolutions reuse a plan; a form no engine builds is remembered too
_BUILT: dict[tuple[Any, ...], tuple[Any, ...]] = {}


def plan_key(epi: ConvEpilogue, cudnn: Any, device: torch.device) -> tuple[Any, ...]:
    conv = epi.conv
    residual = None if epi.residual is None else (tuple(epi.residual.spec.shape), epi.residual.dtype)
    return (id(cudnn), str(device), conv.attrs, tuple(conv.inputs[0].spec.shape), tuple(conv.inputs[1].spec.shape),
            conv.dtype, epi.scale is None, epi.shift is None, residual, epi.residual_scale is None, epi.activation,
            tuple(epi.out.spec.shape), epi.out.dtype, settings.autotune)


def build(epi: ConvEpilogue, inputs: Sequence[Node], out_strides: tuple[int, ...], compute_dtype: str,
          device: torch.device, name: str) -> FusedConvLaunch | None:
    """Build the plan (or take the one built for the same key): the direct chain, then for a scaled
    residual the rescaled one, each with fp32 per-channel vectors, then with vectors in the
    convolution's dtype; the first the frontend builds is the candidate. None when it rejects all
    (debug reason)."""
    cudnn = fe._load()[0]
    key = plan_key(epi, cudnn, device)
    if key not in _BUILT:
        _BUILT[key] = (cudnn, *_build_first(epi, cudnn, device, name))   # cudnn held: its id stays unique
    _, built, why = _BUILT[key]
    if built is None:
        fe.debug(name, why)
        return None
    plan, tensors, mode, vector_dtype = built
    positions = {n.id: k for k, n in enumerate(inputs)}
    return FusedConvLaunch(epi, plan, tensors, mode, positions, out_strides, compute_dtype, device, vector_dtype)


def _build_first(epi: ConvEpilogue, cudnn: Any, device: torch.device, name: str) -> tuple[Any, str]:
    """((plan, tensors, mode, vector dtype), "") for the first form that builds, else (None, why).
    Timed on a GPU: from serialized plans (_from_serialized); otherwise, or when that path fails,
    built here, the heuristics' plan (timed too on a GPU, _time_plans)."""
    handle = fe._handle(cudnn, device)
    recipes = recipes_for(epi)
    if _serialized_route(device):
        try:
            got = _from_serialized(epi, recipes, cudnn, handle, device, name)
        except Exception as err:  # anything unexpected in that route: the in-process builds below
            fe.debug(name, f"serialized plans not used: {type(err).__name__}: {str(err)[:200]}")
            got = None
        if got is not None:
            return got
    failures = []
    for recipe in recipes:
        try:
            graph, tensors = plans.graph_from_recipe(cudnn, handle, recipe)
            fe._build(graph, cudnn)
            if device.type == "cuda" and settings.autotune:
                _time_plans(graph, cudnn, handle, epi, tensors, recipe.form, recipe.vector_dtype, device, name)
            plan = fe.FrontendPlan(cudnn, graph, handle, device)
        except Exception as err:  # no engine for this graph here: try the next form
            failures.append(f"{recipe.form} {recipe.vector_dtype}: {type(err).__name__}: {str(err)[:160]}")
            continue
        return (plan, tensors, recipe.form, recipe.vector_dtype), ""
    return None, f"fused conv epilogue plan ({epi.describe()}) build failed: " + "; ".join(failures)


def _serialized_route(device: torch.device) -> bool:
    """Are plans built as serialized candidates and timed (a GPU, autotuning on)?"""
    return device.type == "cuda" and bool(settings.autotune)


def prefetch(conv: Node, epilogue: Sequence[Node], inputs: Sequence[Node], device: str) -> bool:
    """Submit the fused plan's builds to the build workers (backends/build_workers.py) now, so they
    run while other kernels are built; `build` then takes the result. True when a job was submitted
    (not when the plan is unavailable, already built or stored, or there are no workers)."""
    dev = torch.device(device)
    if fe.unavailable(device) is not None or not _serialized_route(dev) or int(conv.attrs.get("groups", 1)) != 1:
        return False
    try:
        epi = classify(conv, epilogue, inputs)
    except NotServed:
        return False
    if plan_key(epi, fe._load()[0], dev) in _BUILT:
        return False
    return plans.prefetch(recipes_for(epi), MAX_PLANS, dev)


def _from_serialized(epi: ConvEpilogue, recipes: Sequence[plans.ConvRecipe], cudnn: Any, handle: Any,
                     device: torch.device, name: str) -> tuple[Any, str] | None:
    """The plan from the store (a warm compile: nothing built), or the fastest of the first MAX_PLANS
    execution plans, built serialized (by a worker when prefetched), deserialized here and timed; the
    choice is stored. None when no plan deserializes (the caller builds in-process)."""
    key = plans.key_for(recipes, cudnn)
    stored = plans.load(key) if key is not None else None
    if stored is not None and key is not None:
        k, _, blob = stored
        try:
            return _ready(plans.deserialize(cudnn, handle, blob), recipes[k], cudnn, handle, device), ""
        except Exception as err:  # another library build, a truncated blob: build it again
            plans.forget(key, f"not loadable ({type(err).__name__}: {str(err)[:120]})")
    built = plans.fetch(recipes, MAX_PLANS, device, name)
    if built.recipe is None:
        return None, f"fused conv epilogue plan ({epi.describe()}) build failed: " + "; ".join(built.failures)
    recipe = recipes[built.recipe]
    graphs = {}
    for i, blob in built.blobs.items():
        try:
            graphs[i] = plans.deserialize(cudnn, handle, blob)
        except Exception as err:  # this plan does not load here: not a candidate
            fe.debug(name, f"serialized plan {i} not loadable: {type(err).__name__}: {str(err)[:120]}")
    if not graphs:
        return None
    tensors = {role: plans.UIDS[role] for role in recipe.roles()}
    best = min(graphs)
    if len(graphs) > 1:
        bindings = example_bindings(epi, tensors, recipe.vector_dtype, device)
        best = _fastest(graphs, cudnn, handle, bindings, name,
                        {**plan_cache_key(epi, recipe.form, recipe.vector_dtype, cudnn),
                         "plans": min(built.count, MAX_PLANS)})
    if key is not None:
        plans.store(key, built.recipe, best, built.blobs[best])
    return _ready(graphs[best], recipe, cudnn, handle, device), ""


def _ready(graph: Any, recipe: plans.ConvRecipe, cudnn: Any, handle: Any,
           device: torch.device) -> tuple[Any, ...]:
    """(plan, tensors by role as uids, form, vector dtype): what _build_first returns."""
    return (fe.FrontendPlan(cudnn, graph, handle, device), {r: plans.UIDS[r] for r in recipe.roles()},
            recipe.form, recipe.vector_dtype)


def _fastest(graphs: dict[int, Any], cudnn: Any, handle: Any, bindings: dict[Any, torch.Tensor], name: str,
             key: Mapping[str, Any]) -> int:
    """The index of the fastest deserialized plan on `bindings` (the autotuner, cached under `key`)."""
    from ..tune import Config, tune

    device = next(iter(bindings.values())).device

    def bench(config: Config) -> float:
        return _time_selected(graphs[int(config["plan"])], cudnn, handle, bindings, device)

    result = tune(f"{name}_cudnn_plan", key, [Config(plan=i) for i in sorted(graphs)], bench)
    if device.type == "cuda":
        cudnn.set_stream(handle, torch.cuda.current_stream(device).cuda_stream)
    _report_choice(name, int(result.config["plan"]), result)
    return int(result.config["plan"])


def _time_selected(graph: Any, cudnn: Any, handle: Any, bindings: dict[Any, torch.Tensor],
                   device: torch.device) -> float:
    """plan_device_ms of the graph's selected plan on `bindings`, with its own workspace."""
    workspace = torch.empty(max(int(graph.get_workspace_size()), 1), device=device, dtype=torch.uint8)

    def run() -> None:
        if device.type == "cuda":   # plan_device_ms captures on a side stream
            cudnn.set_stream(handle, torch.cuda.current_stream(device).cuda_stream)
        graph.execute(bindings, workspace, handle=handle)

    run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return plan_device_ms(run, device)


def _report_choice(name: str, best: int, result: Any) -> None:
    if settings.debug >= 1:
        timed = ", ".join(f"{t.config['plan']}: {t.ms:.3f}" if t.ms is not None else f"{t.config['plan']}: failed"
                          for t in result.timings)
        print(f"[fusegraph] {name}: cuDNN fused conv plan {best} ({result.source}; timed ms: {timed or '-'})")


MAX_PLANS = 4   # engine configurations timed per graph (each is built: bounded build time)


def plan_cache_key(epi: ConvEpilogue, mode: str, vector_dtype: str, cudnn: Any) -> dict[str, Any]:
    """What a fused conv graph computes, for the tuning cache: the plan_key fields, the graph's form
    and the cuDNN library version (engine lists differ between versions)."""
    conv = epi.conv
    version = plans.cudnn_version(cudnn)
    return {"conv": repr(conv.attrs), "x": str(conv.inputs[0].spec), "w": str(conv.inputs[1].spec),
            "dtype": conv.dtype, "epilogue": epi.describe(), "residual": None if epi.residual is None
            else str(epi.residual.spec), "out": str(epi.out.spec), "mode": mode, "vectors": vector_dtype,
            "cudnn": version}


def _time_plans(graph: Any, cudnn: Any, handle: Any, epi: ConvEpilogue, tensors: dict[str, Any], mode: str,
                vector_dtype: str, device: torch.device, name: str) -> None:
    """pick_fastest_plan on random operands; if that fails, the heuristics' plan again (raises only
    when that cannot be rebuilt)."""
    try:
        pick_fastest_plan(graph, cudnn, handle, example_bindings(epi, tensors, vector_dtype, device), name,
                          plan_cache_key(epi, mode, vector_dtype, cudnn))
    except Exception as err:  # timing is an optimization: keep the heuristics' plan
        fe.debug(name, f"plan timing failed ({type(err).__name__}: {str(err)[:160]}); heuristics' plan kept")
        graph.build_plans()


def example_bindings(epi: ConvEpilogue, tensors: dict[str, Any], vector_dtype: str,
                     device: torch.device) -> dict[Any, torch.Tensor]:
    """Random operands for every graph tensor (per-channel vectors around 1, NHWC full tensors)."""
    cl = torch.channels_last
    conv_dtype = dtypes.to_torch(epi.conv.dtype)
    x_shape, w_shape = epi.conv.inputs[0].spec.shape, epi.conv.inputs[1].spec.shape
    fan_in = max(1, w_shape[1] * w_shape[2] * w_shape[3])
    c = epi.channels
    out: dict[Any, torch.Tensor] = {
        tensors["x"]: torch.randn(x_shape, device=device, dtype=conv_dtype).contiguous(memory_format=cl),
        tensors["w"]: (torch.randn(w_shape, device=device) / fan_in ** 0.5).to(conv_dtype).contiguous(memory_format=cl),
        tensors["y"]: torch.empty_strided(epi.out.spec.shape, strides_for_order(epi.out.spec.shape, NHWC),
                                          dtype=dtypes.to_torch(epi.out.dtype), device=device)}
    for role in ("scale", "shift", "rscale"):
        if role in tensors:
            v = (torch.rand(c, device=device) + 0.5).to(dtypes.to_torch(vector_dtype))
            out[tensors[role]] = v.as_strided((1, c, 1, 1), (c, 1, c, c))
    if epi.residual is not None:
        out[tensors["residual"]] = torch.randn(epi.residual.spec.shape, device=device,
                                               dtype=dtypes.to_torch(epi.residual.dtype)).contiguous(memory_format=cl)
    return out


def plan_device_ms(run: Callable[[], None], device: torch.device) -> float:
    """Steady-state device time of one plan execution: a CUDA graph of 10 executions replayed (how the
    plan runs once its fusegraph Plan is captured). The host's cost of a graph.execute is the same for
    every engine of a graph, so it is left out: timed one call at a time, it overlapped short kernels
    unevenly, and on the H200 ResNet-50's picks moved between runs (a 1x1 conv at 0.049 or 0.117 ms)."""
    from ..perf.timing import device_time
    from ..tune.timing import bench_ms

    if device.type != "cuda":
        return bench_ms(run, warmup_ms=2.0, rep_ms=10.0)
    return device_time(run, calls=10, repeats=3).ms


def pick_fastest_plan(graph: Any, cudnn: Any, handle: Any, bindings: dict[Any, torch.Tensor], name: str,
                      key: Mapping[str, Any]) -> None:
    """cuDNN's heuristics rank runtime-fusion engines poorly at times: the first MAX_PLANS execution
    plans are the autotuner's candidates (each built, then timed on `bindings`), and the fastest is
    left selected. `key` names the graph (what it computes, the cuDNN version): the choice is kept in
    the tuning cache, so a warm compile builds only the chosen plan instead of building and timing
    them all. When none can be timed, or the remembered one does not build, the heuristics' choice."""
    from ..tune import Config, tune

    try:
        count = min(int(graph.get_execution_plan_count()), MAX_PLANS)
    except Exception as err:
        fe.debug(name, f"plan count unavailable ({type(err).__name__}: {str(err)[:120]}); heuristics' first plan kept")
        return
    if count <= 1:
        return
    device = next(iter(bindings.values())).device

    def bench(config: Config) -> float:
        graph.build_plan_at_index(int(config["plan"]))
        return _time_selected(graph, cudnn, handle, bindings, device)

    try:
        result = tune(f"{name}_cudnn_plan", {**key, "plans": count}, [Config(plan=i) for i in range(count)], bench)
        if device.type == "cuda":
            cudnn.set_stream(handle, torch.cuda.current_stream(device).cuda_stream)
        best = int(result.config["plan"])
        graph.build_plan_at_index(best)
    except Exception as err:   # none ran, or the remembered plan does not build: the heuristics' choice
        fe.debug(name, f"no cuDNN plan chosen by timing ({type(err).__name__}: {str(err)[:160]}); "
                       "heuristics' first plan kept")
        graph.build_plans()
        return
    _report_choice(name, best, result)
