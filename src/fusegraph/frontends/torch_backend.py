"""The torch.compile backend: dynamo graph -> AOTAutograd (ATen forward/backward) -> fusegraph partitions.

    torch.compile(model, backend="fusegraph")        # registered by the torch_dynamo_backends entry point
    fg.compile(model, mode="max-performance")        # the same through a Session that keeps a report

A Session is one compiled model: it owns the options, the report (what was compiled, what fell
back and why), the set of ops already warned about (one warning per model), and the count of
recompiles per frame (settings.max_recompiles; after that a frame runs eagerly).

Modes: "default" and "max-performance" (autotuning forced on) build the same Plans; their Plans are
captured as CUDA graphs automatically when launch-bound (runtime/cuda_graph.py). "reduce-overhead"
builds every partition with cuda_graphs=True: each static partition on CUDA is replayed as one CUDA
graph from its second call (inputs copied into the captured buffers, outputs cloned), whatever the
estimate says; partitions that cannot be captured (CPU, a kernel that syncs) run kernel by kernel.
Training graphs (forward and backward), in every mode, are built with graph_outputs="reuse": once
captured, the forward's activations and the backward's gradients are the captured buffers (valid
while the previous step's are no longer referenced, else that call runs kernel by kernel) and the
backward reads the forward's captured activations in place, so capture costs no copies and the
automatic rule, deciding again at the second call when it knows this, captures them whenever the
launches cost more than the replay. On the H200 the GPT-2-124M step went from 42.3 ms kernel by
kernel (host-bound: ~660 launches) to 27.0 ms replayed (runtime/cuda_graph.py).
Module parameters and buffers (AOTAutograd's fw_metadata.static_input_indices) that a partition
reads directly are its static inputs: a captured graph reads them in place, not copied per call.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch._dispatch.python import no_python_dispatcher
from torch._functorch.aot_autograd import make_boxed_func
from torch._subclasses.fake_tensor import unset_fake_temporarily

from ..errors import UnsupportedError
from ..settings import override, settings
from .causal_mask import rewrite_causal_masks
from .input_mutation import aot_autograd_options
from .loss_rewrite import rewrite_log_softmax_for_backward
from .saved_recompute import recompute_saved_pointwise
from .torch_ops import native_ops
from .torch_partition import GraphRecord, direct_call, partition_graph, warn_fallback

MODES = ("default", "max-performance", "reduce-overhead")
# Options passed on to Graph.build (see compiler.compile_graph).
BUILD_OPTIONS = ("fuse", "max_row_block", "keep_composites", "fast_launch", "cuda_graphs")


def decomposition_table() -> dict[Any, Callable[..., Any]]:
    """Core ATen decompositions, except for ops fusegraph translates natively (layer norm, softmax,
    gelu, addmm, convolution, ...): those reach the translator whole. Built once per set of native
    ops (building torch's core table took ~0.14 s of every compile)."""
    return dict(_decompositions(frozenset(native_ops())))


@functools.lru_cache(maxsize=4)
def _decompositions(keep: frozenset[Any]) -> dict[Any, Callable[..., Any]]:
    from torch._decomp import core_aten_decompositions
    from torch._decomp import decomposition_table as torch_decompositions

    table = {op: fn for op, fn in core_aten_decompositions().items()
             if getattr(op, "overloadpacket", None) not in keep}
    # max pooling's backward: the gradient scattered to the forward's indices (zeros + scatter_add),
    # which the forward's translator computes as torch does (frontends/torch_ops_more.py); torch's own
    # decomposition where it has one (2.13), else ours (2.11 has none: the op would run eagerly)
    backward = torch.ops.aten.max_pool2d_with_indices_backward.default
    table[backward] = torch_decompositions.get(backward, max_pool2d_backward_by_scatter)
    return table


def max_pool2d_backward_by_scatter(grad_output: torch.Tensor, x: torch.Tensor, kernel_size: Any, stride: Any,
                                   padding: Any, dilation: Any, ceil_mode: bool, indices: torch.Tensor) -> Any:
    """max_pool2d_with_indices' input gradient: each output gradient added at the input position its
    index names (an index counts positions within one input plane, h * W + w). fp16/bf16 gradients
    are summed in fp32 (overlapping windows add several into one position), then rounded once.
    Deterministic mode keeps torch's own kernel (scatter_add accumulates in no fixed order)."""
    if torch.are_deterministic_algorithms_enabled():
        return NotImplemented
    batched = x.dim() == 4
    if not batched:
        grad_output, x, indices = grad_output.unsqueeze(0), x.unsqueeze(0), indices.unsqueeze(0)
    n, c, h, w = x.shape
    low = grad_output.dtype in (torch.float16, torch.bfloat16)
    acc = torch.float32 if low else grad_output.dtype
    src = grad_output.reshape(n, c, -1).to(acc)
    grad = grad_output.new_zeros((n, c, h * w), dtype=acc).scatter_add(2, indices.reshape(n, c, -1), src)
    grad = grad.reshape(n, c, h, w).to(grad_output.dtype)
    return grad if batched else grad.squeeze(0)


def partition_fn(split: dict[str, Any] | None = None) -> Callable[..., Any]:
    """How AOTAutograd splits a training graph into forward and backward. Constant causal masks
    become is_causal first (frontends/causal_mask.py), so they are not saved for the backward.
    Then, by default, the default partitioner (save every intermediate the backward reads); with
    settings.recompute the min-cut rematerialization partitioner (what Inductor uses), which saves
    fewer tensors and recomputes cheap pointwise chains in the backward (e.g. a cross-entropy's
    softmax over [tokens, vocab] logits instead of saving an fp32 log-softmax of that size). Not the
    default: on the H200 the GPT-2 training step ran slower with it in our plans (50.5 vs 44.6 ms;
    weight transposes and copies of the saved tensors outweighed the recompute savings).
    `split` (when given) records num_fwd_outputs: the forward's outputs before its saved activations."""
    from torch._functorch.partitioners import default_partition, min_cut_rematerialization_partition

    base: Callable[..., Any] = default_partition if not settings.recompute else \
        functools.partial(min_cut_rematerialization_partition, compiler="inductor")

    def partition(joint_module: torch.fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> Any:
        rewrite_causal_masks(joint_module)   # before the split: a causal mask is then not saved either
        rewrite_log_softmax_for_backward(joint_module)   # save logits + logsumexp, not an fp32 log-softmax
        if settings.recompute_saved and not settings.recompute:   # (min-cut recomputes by its own rules)
            recomputed = recompute_saved_pointwise(joint_module, kwargs.get("num_fwd_outputs"))
            log(str(recomputed))
            if split is not None:
                split["recomputed"] = recomputed
        if split is not None and isinstance(kwargs.get("num_fwd_outputs"), int):
            split["num_fwd_outputs"] = kwargs["num_fwd_outputs"]
        return base(joint_module, joint_inputs, **kwargs)

    return partition


def direct_inference(inference: dict[str, Any], example_inputs: Sequence[Any]) -> Callable[..., Any] | None:
    """The inference graph's compiled function called without AOTAutograd's runtime wrapper, when that
    wrapper would only switch grad mode (and autocast) around it: the ATen graph takes Dynamo's
    arguments as they are (no duplicate inputs merged, no synthetic bases, no effect tokens), keeps its
    input mutations inside (frontends/input_mutation.py) and returns no output that aliases an input
    or another output (those the wrapper regenerates as views). On a CPU with torch 2.13, whose
    wrapper is generated code, a small MLP's host time per call moved within noise
    (bench/host_call_cpu.py); with torch 2.11 on the H200 the Llama decode step's latency was 2.9%
    lower (results/ab_decode_direct_inference_20261202_0057.txt), so the setting is on by default.
    None when not eligible (or the setting is off): the caller keeps AOTAutograd's function."""
    fn, meta = inference.get("fn"), inference.get("meta")
    if not settings.direct_inference or fn is None or meta is None:
        return None
    try:
        from torch._functorch._aot_autograd.schemas import OutputType

        trivial = (not getattr(meta, "is_train", False) and inference["inputs"] == len(example_inputs)
                   and all(type(t) in (torch.Tensor, torch.nn.Parameter) for t in example_inputs)
                   and meta.num_mutated_inp_runtime_indices == 0 and meta.num_intermediate_bases == 0
                   and not meta.tokens and all(o.output_type == OutputType.non_alias for o in meta.output_info))
    except (ImportError, AttributeError):   # another torch's metadata: keep its wrapper
        return None
    if not trivial:
        return None
    inference["record"].direct = True
    grad_on, set_grad = torch.is_grad_enabled, torch._C._set_grad_enabled
    # as AOTAutograd: autocast off around the call (the ATen graph's casts are explicit); Dynamo
    # guards on the autocast state, so the state at compile time is the state of every call
    outside: Callable[[], Any] = torch._C._DisableAutocast if torch._C._is_any_autocast_enabled() \
        else contextlib.nullcontext

    def run(*args: Any) -> Any:
        grad = grad_on()
        if grad:
            set_grad(False)
        try:
            with outside():
                return fn(list(args))
        finally:
            if grad:
                set_grad(True)
    return run


def log(message: str) -> None:
    if settings.debug >= 1:
        print(f"[fusegraph] {message}", file=sys.stderr)


@dataclass
class CompileReport:
    """Everything one Session compiled: per ATen graph, its partitions and its eager fallbacks."""

    graphs: list[GraphRecord] = field(default_factory=list)
    recompiles: list[str] = field(default_factory=list)

    @property
    def fallback_ops(self) -> dict[str, str]:
        """op -> reason, for every op that runs eagerly (unsupported, or its partition failed to build)."""
        out: dict[str, str] = {}
        for graph in self.graphs:
            for (op, reason), _ in graph.fallbacks.items():
                out.setdefault(op, reason)
            for part in graph.partitions:
                if part.status == "eager":
                    for op in part.ops:
                        out.setdefault(op, part.reason)
        return out

    @property
    def compiled_ops(self) -> set[str]:
        return {op for g in self.graphs for p in g.partitions if p.status == "fusegraph" for op in p.ops}

    def __str__(self) -> str:
        lines = [f"fusegraph compile report: {len(self.graphs)} ATen graph(s)"]
        for graph in self.graphs:
            compiled = sum(sum(p.ops.values()) for p in graph.partitions if p.status == "fusegraph")
            lines.append(f"\n{graph.kind} graph: {graph.nodes} ATen ops, {compiled} compiled by fusegraph "
                         f"in {sum(p.status == 'fusegraph' for p in graph.partitions)} partition(s)")
            for part in graph.partitions:
                ops = ", ".join(f"{op.replace('aten.', '')} x{n}" for op, n in sorted(part.ops.items()))
                status = f"fusegraph, {part.kernels} kernel(s)" if part.status == "fusegraph" \
                    else f"EAGER ({part.reason})"
                lines.append(f"  {part.name}: {status}\n      {ops}")
            for (op, reason), count in sorted(graph.fallbacks.items()):
                lines.append(f"  eager: {op} x{count}: {reason}")
            lines.extend(f"  input mutation: {m}" for m in graph.mutations)
            lines.extend(f"  {note}" for note in graph.notes)
        if self.recompiles:
            lines.append("\nrecompiles:")
            lines.extend(f"  {r}" for r in self.recompiles)
        return "\n".join(lines)

    __repr__ = __str__


class Session:
    """One compiled model's backend: options, report, warnings already given, recompile counts."""

    def __init__(self, mode: str = "default", options: dict[str, Any] | None = None) -> None:
        if mode not in MODES:
            raise UnsupportedError(f"fusegraph compile: unknown mode {mode!r}; use one of {', '.join(MODES)}")
        options = dict(options or {})
        unknown = sorted(set(options) - set(BUILD_OPTIONS))
        if unknown:
            raise UnsupportedError(f"fusegraph compile: unknown option(s) {', '.join(unknown)}; "
                                   f"known: {', '.join(BUILD_OPTIONS)}")
        self.mode = mode
        self.options = options
        self.report = CompileReport()
        self._warned: set[str] = set()
        self._signatures: dict[Any, list[list[tuple[tuple[int, ...], torch.dtype]]]] = {}

    # ---- the dynamo backend ----
    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        if _is_symbolic(example_inputs):
            return self._per_shape(gm)
        if not self._admit(example_inputs):
            return gm.forward
        return self._compile_static(gm, example_inputs)

    def _per_shape(self, gm: torch.fx.GraphModule) -> Callable[..., Any]:
        """A graph traced with dynamic dims: compiled once per concrete input shape ("bucket") at its
        first call, up to settings.max_recompiles buckets; further shapes run eagerly in torch."""
        buckets: dict[tuple[Any, ...], Callable[..., Any]] = {}

        def run(*args: Any) -> Any:
            key = tuple((tuple(a.shape), a.stride(), a.dtype) if isinstance(a, torch.Tensor) else a for a in args)
            fn = buckets.get(key)
            if fn is None:
                if len(buckets) > settings.max_recompiles:
                    self._warn_once(f"<buckets {id(gm)}>", f"fusegraph: more than {settings.max_recompiles} "
                                    "shapes of a dynamic graph (FUSEGRAPH_MAX_RECOMPILES); new shapes run eagerly")
                    fn = gm.forward
                else:
                    shapes = [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]
                    line = f"dynamic graph: compiling shape bucket {len(buckets)} for input shapes {shapes}"
                    self.report.recompiles.append(line)
                    log(line)
                    fn = self._compile_static(gm, list(args))
                buckets[key] = fn
            return fn(*args)

        return run

    def _compile_static(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        from torch._dynamo.backends.common import aot_autograd

        inference: dict[str, Any] = {}   # the inference graph's compiled function and AOTAutograd's metadata

        def backend(options: dict[str, Any]) -> Callable[..., Any]:
            split: dict[str, Any] = {}   # the forward's user outputs (the rest: activations saved for the backward)
            return aot_autograd(fw_compiler=self._compiler("forward", split),
                                bw_compiler=self._compiler("backward", split),
                                inference_compiler=self._compiler("inference", inference),
                                decompositions=decomposition_table(), partition_fn=partition_fn(split),
                                **options)

        options = aot_autograd_options()   # inference graphs keep input mutations (copy_) in the graph
        try:
            compiled = backend(options)(gm, example_inputs)
            return direct_inference(inference, example_inputs) or compiled
        except Exception as err:
            if not options:
                return self._aot_failed(gm, err)
            # torch 2.11-2.13 fail to keep a mutation in the graph when the graph also returns the mutated
            # input ("Tried to erase Node copy_ but it still had 1 users"): AOTAutograd's wrapper applies
            # the mutation after our plan instead (one copy), rather than the whole graph running in torch
            log(f"AOTAutograd with input mutations kept in the graph failed ({type(err).__name__}: {err}); "
                "retrying with the mutations applied by AOTAutograd")
        try:
            return backend({})(gm, example_inputs)
        except Exception as err:
            return self._aot_failed(gm, err)

    def _aot_failed(self, gm: torch.fx.GraphModule, err: Exception) -> Callable[..., Any]:
        """AOTAutograd could not trace the graph: it runs in torch, with one warning."""
        self._warn_once("<graph>", f"fusegraph: AOTAutograd failed ({type(err).__name__}: {err}); "
                                   "this graph runs eagerly in torch")
        return gm.forward

    def _compiler(self, kind: str, split: dict[str, Any] | None = None
                  ) -> Callable[[torch.fx.GraphModule, Sequence[Any]], Callable[..., Any]]:
        """The AOTAutograd compiler of one graph kind. `split` carries what the partition function
        learned (forward, backward) or, for inference, receives the compiled function, its input count
        and AOTAutograd's view/mutation metadata (for direct_inference)."""
        def compile_aten(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
            # a training forward's outputs past num_fwd_outputs are saved activations: only the backward
            # reads them, so the caller never keeps one past the next step (reuse plans need not clone them).
            # A backward's outputs are gradients: tracked like the large ones, never cloned (a caller that
            # keeps the previous step's gradient tensors, g = p.grad, keeps the large ones too, which sends
            # that backward kernel by kernel either way; zero_grad(set_to_none=False) keeps replaying)
            held: Sequence[int] | None = None
            if kind == "forward" and split is not None and "num_fwd_outputs" in split:
                held = range(split["num_fwd_outputs"])
            elif kind == "backward" and split is not None:
                held = ()
            # AOTAutograd calls compilers with its fake mode active; a Plan's constants must be real tensors.
            # It also leaves the Python dispatcher on for the forward's compiler: every torch call of the
            # build (example inputs, tuning launches, checks) then took the host 3-5x longer (CPU: 1000
            # empty+addmm 95-188 ms against 33-40 ms), which slowed the build and inflated tuning timings
            with unset_fake_temporarily(), no_python_dispatcher(), self._build_settings():
                # training graphs had it on the joint graph (partition_fn); again here in case that
                # one could not decide (a no-op when it did)
                rewrite_causal_masks(gm)
                # saved activations the forward returns as views with gaps: the backward declares them so
                saved = split.setdefault("saved_strides", {}) if split is not None and \
                    (settings.saved_views or settings.pad_saved) else None
                split_gm, record = partition_graph(gm, kind, self._build_options(kind), self._warn_partition,
                                                   static_input_indices(kind), held, saved)
            if kind == "forward" and split is not None and "recomputed" in split:
                record.notes.append(str(split["recomputed"]))
            self.report.graphs.append(record)
            new_ops = sorted({op for op, _ in record.fallbacks} - self._warned)
            if new_ops:
                self._warned.update(new_ops)
                reasons = {op: reason for op, reason in record.fallbacks}
                listed = "; ".join(f"{op} ({reasons[op]})" for op in new_ops)
                warn_fallback(f"fusegraph: {len(new_ops)} op(s) run eagerly in torch: {listed}")
            log(f"{kind} graph: {len(record.partitions)} fusegraph partition(s), "
                f"{sum(record.fallbacks.values())} eager op(s)")
            boxed = make_boxed_func(direct_call(split_gm) if settings.direct_call else split_gm)
            if kind == "inference" and split is not None:
                context = torch._guards.TracingContext.try_get()
                split.update(fn=boxed, inputs=len(example_inputs), record=record,
                             meta=getattr(context, "fw_metadata", None))
            return boxed
        return compile_aten

    def _build_options(self, kind: str = "inference") -> dict[str, Any]:
        options = dict(self.options)
        if self.mode == "reduce-overhead":
            options.setdefault("cuda_graphs", True)
        if kind in ("forward", "backward"):   # activations and gradients: not cloned per step
            options.setdefault("graph_outputs", "reuse")
        return options

    @contextlib.contextmanager
    def _build_settings(self) -> Iterator[None]:
        if self.mode == "max-performance":
            with override(autotune=True):
                yield
        else:
            yield

    def _warn_partition(self, message: str) -> None:
        self._warn_once(message, message)

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warn_fallback(message)

    # ---- guards and recompiles ----
    def _admit(self, example_inputs: Sequence[Any]) -> bool:
        """Record this compile's input signature; log what changed on a recompile; False (stay eager)
        beyond settings.max_recompiles recompiles of one frame."""
        from torch._guards import CompileContext

        compile_id = CompileContext.current_compile_id()
        frame = getattr(compile_id, "frame_id", None)
        signature = [(tuple(t.shape), t.dtype) for t in example_inputs if isinstance(t, torch.Tensor)]
        seen = self._signatures.setdefault(frame, [])
        if seen:
            line = f"recompile {len(seen)} of frame {frame}: {_describe_change(seen[-1], signature)}"
            self.report.recompiles.append(line)
            log(line)
            if len(seen) > settings.max_recompiles:
                self._warn_once(f"<recompiles {frame}>", f"fusegraph: frame {frame} was recompiled more than "
                                f"{settings.max_recompiles} times (FUSEGRAPH_MAX_RECOMPILES); new input "
                                "signatures run eagerly in torch")
                return False
        seen.append(signature)
        return True


def static_input_indices(kind: str) -> list[int]:
    """Which inputs of the graph AOTAutograd is compiling are parameters or buffers (its
    fw_metadata.static_input_indices, what torch's own CUDA graphs use); [] for a backward graph
    (the metadata describes the forward's inputs) or where this torch does not say."""
    if kind == "backward":
        return []
    from torch._guards import TracingContext

    context = TracingContext.try_get()
    indices = getattr(getattr(context, "fw_metadata", None), "static_input_indices", None)
    return [i for i in indices if isinstance(i, int)] if isinstance(indices, list | tuple) else []


def _is_symbolic(example_inputs: Sequence[Any]) -> bool:
    for value in example_inputs:
        if isinstance(value, torch.SymInt | torch.SymFloat):
            return True
        if isinstance(value, torch.Tensor) and any(not isinstance(s, int) for s in value.shape):
            return True
    return False


def _describe_change(old: list[tuple[tuple[int, ...], torch.dtype]],
                     new: list[tuple[tuple[int, ...], torch.dtype]]) -> str:
    if len(old) != len(new):
        return f"{len(old)} -> {len(new)} tensor inputs"
    changes = []
    for i, ((s0, d0), (s1, d1)) in enumerate(zip(old, new, strict=True)):
        if s0 != s1:
            changes.append(f"input {i} shape {s0} -> {s1}")
        if d0 != d1:
            changes.append(f"input {i} dtype {d0} -> {d1}".replace("torch.", ""))
    return ", ".join(changes) or "same shapes and dtypes (another guard failed)"


def fusegraph_backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], mode: str = "default",
                      options: dict[str, Any] | None = None) -> Callable[..., Any]:
    """The `torch.compile(model, backend="fusegraph")` entry point (one Session per dynamo graph)."""
    return Session(mode or "default", options)(gm, example_inputs)
