"""One typed registry of settings: type, default, help text, environment variable, and a scoped
override for tests. Precedence: override > environment > default.

    from fusegraph.settings import settings, override
    settings.debug            # reads FUSEGRAPH_DEBUG (int), default 0
    with override(debug=2): ...

FUSEGRAPH_DEBUG levels (each includes the ones below it):
    0  silent
    1  print each built graph after the passes; verify the IR between passes
    2  also print the plan: its launch list, what each kernel reads and writes, bytes and FLOPs
    3  also print each kernel's generated source
    4  also print the graph after every single pass
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import SettingsError, UnknownSettingError

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def parse_bool(text: str) -> bool:
    word = text.strip().lower()
    if word in _TRUE:
        return True
    if word in _FALSE:
        return False
    raise ValueError(f"expected one of {', '.join(_TRUE + _FALSE)}")


def parse_int(text: str) -> int:
    return int(text.strip())


def parse_float(text: str) -> float:
    return float(text.strip())


def parse_str(text: str) -> str:
    return text


def _default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return str(Path(base) / "fusegraph")


@dataclass(frozen=True)
class Setting:
    name: str
    type: type
    env: str
    parse: Callable[[str], Any]
    default: Callable[[], Any]
    help: str

    def coerce(self, value: Any, origin: str) -> Any:
        """A value of this setting's type from a string (parsed) or a value of the right type."""
        if isinstance(value, str) and self.type is not str:
            try:
                return self.parse(value)
            except ValueError as err:
                raise SettingsError(f"setting {self.name} ({origin}): cannot read {value!r} as "
                                    f"{self.type.__name__}: {err}") from None
        if self.type is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if (self.type is int and isinstance(value, bool)) or not isinstance(value, self.type):
            raise SettingsError(f"setting {self.name} ({origin}): expected {self.type.__name__}, "
                                f"got {type(value).__name__} {value!r}")
        return value


_SETTINGS: dict[str, Setting] = {}
_PARSERS: dict[type, Callable[[str], Any]] = {bool: parse_bool, int: parse_int, float: parse_float, str: parse_str}


def _register(name: str, kind: type, default: Callable[[], Any], help: str) -> None:
    _SETTINGS[name] = Setting(name, kind, "FUSEGRAPH_" + name.upper(), _PARSERS[kind], default, help)


_register("debug", int, lambda: 0,
          "What the compiler prints: 1 each built graph (and verify between passes), 2 + the plan "
          "(launch list, bytes, FLOPs), 3 + generated kernel sources, 4 + the graph after every pass.")
_register("dump_dir", str, lambda: "",
          "When set, every stage (graphs, kernel sources, plans) is written to files in this folder.")
_register("cache_dir", str, _default_cache_dir,
          "Where autotuning choices and compiled-kernel metadata are cached.")
_register("verify", bool, lambda: False,
          "Run the IR verifier between passes (always on when debug >= 1).")
_register("autotune", bool, lambda: True,
          "Time candidate configurations on the GPU; off picks the cost model's first choice.")
_register("tune_min_floor_us", int, lambda: 10,
          "Kernels whose cost-model floor is under this many microseconds are launch-bound: they are not "
          "timed, the cost model's first candidate is used. 0 times every kernel.")
_register("tune_gemm_pair_floor_us", int, lambda: 2,
          "A launch-bound GEMM (floor under tune_min_floor_us) whose floor is at least this many microseconds "
          "(a weight-streaming decode GEMM) is timed between two candidates only: the first Triton config and "
          "cuBLAS (one compile); below it the first candidate is used untimed.")
_register("gemm_library_max_m", int, lambda: 16,
          "On a GPU, GEMMs with at most this many rows (decode-step GEMVs streaming their weights) run in "
          "cuBLAS untimed (our kernels streamed weights slower there; isolated timing could not tell). 0: off.")
_register("gemv_kernel", bool, lambda: True,
          "GEMMs of at most 4 rows times a weight read along K (a decode "
          "step's linear layers) run our weight-streaming GEMV kernel with the epilogue fused; off: cuBLAS.")
_register("gemm_tma_store", bool, lambda: True,
          "On the TMA path, a generated GEMM writes a whole output tile into rows of 16-byte-aligned stride "
          "(e.g. padded logits) through a TMA descriptor store (asynchronous, clipped at the edges by the copy "
          "engine, so no masks). Off: a pointer store. GPT-2's LM head into padded rows: persistent ~0.9 ms with "
          "it, best pointer-store config 1.03 ms (bench/results/ab_gpt2_norm_residual_20261201_2100.txt tune "
          "report, profile_gpt2_final_20261201_2125.txt).")
_register("tanh_branch_free", bool, lambda: True,
          "Generated kernels compute tanh without control flow (ops/pointwise.py _tanh_expr: a series near 0, "
          "the exponential form beyond, one selected). Off: libdevice.tanh, which branches on |x| per element.")
_register("tanh_as_sigmoid", bool, lambda: True,
          "simplify rewrites 1 + tanh(u) -> 2 sigmoid(2u) and 1 - tanh(u)^2 -> 4 sigmoid(2u) sigmoid(-2u) "
          "(passes/simplify.py): GPT-2's spelled-out GELU becomes the sigmoid form, its backward computes no tanh. "
          "Off: the graph keeps the tanh.")
_register("inplace_scatter", bool, lambda: True,
          "A scatter (index_put, index_copy, scatter_add, slice_scatter) whose destination is an intermediate "
          "that dies there writes into it (runtime/memory.py); off: into a copy of it, as torch's functional op does.")
_register("horizontal_fusion", bool, lambda: True,
          "Independent pointwise kernels that read only graph inputs element for element (a training step's "
          "weight casts to the autocast dtype) run as one combo kernel (fusion/horizontal.py, codegen/combo.py).")
_register("gemm_pingpong", bool, lambda: True,
          "On a Hopper GPU (compute capability 9), large 16-bit GEMMs with K >= 4096 (K >= 512 when the epilogue "
          "computes an activation), A read along K and an epilogue beyond a bias also get the warp-specialized "
          "ping-pong kernel written in Gluon "
          "(codegen/matmul_pingpong.py, offer rules in codegen/gemm_configs.py) as an autotuned candidate: two "
          "consumer warpgroups on alternate tiles, so one's epilogue runs under the other's main loop. gelu_mlp's "
          "first GEMM + bias + GELU on an H200: 736 TFLOP/s against 672 for our best Triton config and cuBLAS "
          "(bench/gluon_gemm_gpu.py).")
_register("gemm_streamk", bool, lambda: False,
          "Large GEMMs whose last wave of tiles leaves SMs idle also get a stream-K candidate (the persistent "
          "kernel with the last wave's tiles shared out by K through fp32 partials). Off by default: on the H200 "
          "GPT-2's K=768 GEMMs took 18-24% longer with it (its partials' traffic), and its 1-2% on gelu_mlp's "
          "first GEMM was within the run-to-run spread (bench/streamk_gpu.py, results/streamk_*.txt). A stream-K "
          "kernel's tile counters persist between its launches, so one compiled plan must not run on two streams "
          "at once. Off, the stream-K source is not generated (build option gemm_variant='streamk' needs it on).")
_register("decode_attention", bool, lambda: True,
          "Attention with few query rows per kv head (a decode step) gets the split-KV kernels among its "
          "candidates (codegen/attention.py; timed against cuDNN where the problem is not launch-bound); off: "
          "the usual candidates.")
_register("pdl", bool, lambda: True,
          "On Hopper and newer GPUs, generated kernels are launched with programmatic dependent launch: each may "
          "be scheduled while the kernel before it finishes, waiting for its writes before touching memory "
          "(hides the launch gap between kernels, in CUDA graphs too); off: plain launches.")
_register("direct_call", bool, lambda: True,
          "The torch backend hands AOTAutograd the partitioned graph's code as a plain function calling each "
          "partition's forward (no nn.Module.__call__ per call); off: the FX GraphModule itself.")
_register("direct_inference", bool, lambda: True,
          "The torch backend hands Dynamo an inference graph's compiled function itself, without "
          "AOTAutograd's runtime wrapper, when that wrapper would only switch grad mode and autocast around "
          "it (no duplicate or aliased inputs, input mutations kept in the graph, no output aliasing an input); "
          "off: always AOTAutograd's function. The Llama decode step measured 2.9% lower latency with it "
          "on the H200 (bench/results/ab_decode_direct_inference_20261202_0057.txt).")
_register("pad_align", bool, lambda: True,
          "Misaligned GEMM operands made inside a plan get padded row strides (passes/pad_align.py); off "
          "builds without the pass.")
_register("recompute", bool, lambda: False,
          "Training graphs: split forward/backward with AOTAutograd's min-cut rematerialization partitioner "
          "(recompute cheap pointwise chains in the backward instead of saving them; off by default: slower in "
          "our plans on the H200 GPT-2 step); off: save every intermediate the backward reads.")
_register("recompute_saved", bool, lambda: True,
          "Training graphs: pointwise values the backward reads are recomputed there from a value it saves "
          "anyway, or from the producer (e.g. a GEMM output) they all come from when saving it takes fewer "
          "bytes, instead of being saved (frontends/saved_recompute.py; e.g. GPT-2's GELU saves x, not x and "
          "three functions of it); off: the default partitioner's choice.")
_register("recompute_materialized", str, lambda: "held",
          "Training graphs (with recompute_saved): saved values a non-pointwise backward op reads (a "
          "convolution's input, as ReLU(batchnorm(conv)) in ResNet) that are pointwise functions of values "
          "saved anyway are recomputed in the backward, largest first: 'held' convolution inputs until the bytes "
          "dropped cover what a captured step keeps beyond eager (gradients, copied inputs), 'all' every one "
          "(GEMM operands too), 'off' none.")
_register("compile_threads", int, lambda: 0,
          "Threads that compile a kernel's candidate configurations in parallel before timing "
          "(0: one per CPU core, at most 16; 1: one after another).")
_register("build_workers", int, lambda: -1,
          "Worker processes that build cuDNN frontend plans in parallel while a plan is built (their builds "
          "hold the GIL, so threads do not overlap them); plans come back serialized. -1: half the CPU cores "
          "(divided among LOCAL_WORLD_SIZE ranks), at most 8; 0: build in-process. Each worker holds a CUDA "
          "context while it lives and exits after 30 s without work.")
_register("tune", str, lambda: "fast",
          "How much to tune: 'fast' (memory-bound kernels whose floor is under tune_heuristic_floor_us take "
          "their shape's heuristic config untimed; the rest are timed) or 'full' (time every kernel above "
          "tune_min_floor_us).")
_register("tune_heuristic_floor_us", int, lambda: 50,
          "With tune=fast, memory-bound kernels (pointwise, reductions) whose cost-model floor is under this "
          "many microseconds use the heuristic config of their shape without timing.")
_register("tune_early_stop", float, lambda: 1.5,
          "While tuning, a candidate whose median over its first timed calls is more than this many times the best "
          "candidate's so far stops there (it cannot win): its calls beyond those are not made. 0 times every "
          "candidate in full. On the H200: a cold build's tuning seconds ResNet-50 15.3 -> 14.9, GPT-2's step "
          "5.1 -> 4.8, the same winners but for a few within noise (bench/results/tune_early_stop_20261202_0905.txt).")
_register("profile_build", bool, lambda: False,
          "Print where each build's time goes (stages, kernels, tuning, Triton compiles) to stderr; the "
          "profile is also kept as plan.build_profile and shown by plan.explain(). A captured plan's first "
          "calls are reported too: the kernel-by-kernel run, the capture's side-stream warm-up and the capture "
          "(each synchronized, so they cost the first call a few device waits).")
_register("pad_gemm_dims", bool, lambda: True,
          "A large GEMM whose M, N or K is not 16-byte aligned (a 50257-token vocabulary) runs on operands "
          "zero-padded to an aligned size, its result sliced (passes/pad_dims.py): cuBLAS then runs its aligned "
          "kernels instead of align1 ones. Off: such GEMMs keep their sizes (pad_align still pads their strides). "
          "GPT-2's step: 17.517 against 17.680 ms without it (bench/results/ab_gpt2_pad_gemm_dims_20261202_0852.txt).")
_register("pad_results", bool, lambda: False,
          "pad_align also pads GEMM results that no GEMM reads (and the pointwise values right after them), "
          "e.g. a [tokens, 50257] logits tensor read by the loss: aligned rows for the kernels reading it.")
_register("norm_residual", bool, lambda: True,
          "A residual add (and the casts before it) between a matmul and the row normalization after it "
          "(a transformer's LayerNorm) fuses into the normalization's kernel instead of the matmul's epilogue; "
          "the matmul keeps its bias, which cuBLAS can compute itself (fusion/views.py). Off: the epilogue "
          "takes the residual. On by default since GPT-2's step measured 17.983 against 18.170 ms without it "
          "(bench/results/ab_gpt2_norm_residual_20261201_2100.txt; 0.992x in an earlier session's state).")
_register("pad_saved", bool, lambda: True,
          "Training: a large activation saved for the backward whose rows are not 16-byte aligned (GPT-2's "
          "[tokens, 50257] logits) is returned by the forward's plan with padded rows (passes/pad_align.py); "
          "the backward's plan reads it so. Its readers on both sides then load whole aligned vectors. On by "
          "default since the odd-row kernels split full blocks from the last one: GPT-2's step 17.933 against "
          "18.138 ms without it (bench/results/ab_gpt2_pad_saved_20261201_2050.txt).")
_register("nhwc_saved", bool, lambda: True,
          "Training: a 4-D activation saved for the backward that the forward's plan computes channels-last "
          "(around tensor-core convolutions, passes/layout.py) is returned so, and the backward's plan reads "
          "it so: no copy to row-major in the forward and back to channels-last in the backward.")
_register("sink_shared_reshapes", bool, lambda: False,
          "sink_reshapes also moves a reshape of a matmul result below several same-shape pointwise readers "
          "when the result or its reshape is a graph output (a training forward's activation function then "
          "joins the linear layer's epilogue; fusion/views.py). Off: only a reshape with one reader moves. "
          "Off by default: GPT-2's step took 20.34 ms with it, 19.25 without (bench/results/ab_gpt2_sink_shared_"
          "20261201_1348.txt): the GEMM then lost cuBLAS's own bias epilogue. With the bias-first cuBLAS "
          "candidate (backends/cublas.bias_first) it still measured 18.650 against 17.559 ms "
          "(bench/results/ab_gpt2_sink_shared_bias_first_20261202_0549.txt): sinking stopped at the GELU's fp32 "
          "cast, so the GEMM stored an fp32 value and the GELU ran as two kernels. Sunk to the chain's end, the GELU "
          "is the GEMM's epilogue and the autotuner runs it as cuBLAS + the epilogue's launch, as without the "
          "setting: 18.057 against 18.063 ms (bench/results/ab_gpt2_sink_shared_chain_20261202_0647.txt). With the "
          "ping-pong kernel offered to that GEMM (twenty-eighth session) still the same: 17.565 against 17.606 ms "
          "(bench/results/ab_gpt2_sink_stores_20261203.txt); the spelled-out GELU outlasts its short main loop.")
_register("fuse_gathers", bool, lambda: True,
          "An embedding lookup or an index_select of a graph input (a weight, a rotary table, a mask) is read by "
          "the kernel that uses its rows, at the gathered row (fusion/partition.py, 'gather' entries): no launch "
          "and no buffer for the selected rows. Off: torch runs the lookup as its own launch.")
_register("reshape_copy_kernel", bool, lambda: True,
          "A reshape that is no view of its input's layout (it regroups dims that are not contiguous in memory, "
          "as torchvision's attention does with q.view(T, B*H, D) of a permuted projection) runs as our generated "
          "copy kernel over the two shapes' common refinement (lower.reshape_copy_kernel). Off: torch's strided "
          "copy (the reference), which ran at about a third of the bytes' floor on the H200 in ViT-B/16.")
_register("round_intermediates", bool, lambda: True,
          "Inside a generated kernel, every fp16/bf16 op's result is rounded to its dtype, as eager PyTorch "
          "rounds op by op. Off (Inductor's way): values stay fp32 in registers from load to store; explicit "
          "casts (a .to(), autocast's and the decompositions' casts) and stored values that later ops read "
          "still round. Off is closer to the fp32 result and has two conversions fewer per op and element, but "
          "GPT-2's step measured 1.3% slower with it off (median of 5 alternating rounds, 18.008 against "
          "17.775 ms, bench/results/ab_gpt2_round_intermediates_20261202_0339.txt), so on by default.")
_register("share_row_pass", bool, lambda: True,
          "Column reductions (a linear layer's bias gradient, layernorm's weight gradients) run in the pass of "
          "the row kernel whose data they read: also when they only load the same tensors, and several per "
          "row kernel; a sum over a reshape that merges dims reduces the reshape's input, in its producer's "
          "iteration space (passes/simplify.py, fusion/partition.py). Off: a column reduction pairs only with "
          "a row kernel that computes a value it reads, one per row kernel.")
_register("saved_views", bool, lambda: True,
          "Training: activations saved for the backward that torch traced as views with gaps (q, k, v sliced "
          "out of one qkv projection) are returned as views of that result, and the backward's plan reads "
          "them so, instead of a dense copy of each; off: copied dense.")
_register("cublas_epilogues", bool, lambda: True,
          "The cuBLAS candidate of a GEMM computes a bias-add or fp32-cast epilogue itself (torch.addmm, "
          "torch.mm(out_dtype=)) instead of a second launch; an epilogue that starts with the bias and goes on "
          "gets torch.addmm, then the rest as the second launch (backends/cublas.bias_first).")
_register("conv_as_gemm", bool, lambda: True,
          "A 1x1, stride-1 convolution over dense channels-last operands (fp16/bf16), with its inference "
          "epilogue (batchnorm, residual, activation), gets one more autotuned candidate beside cuDNN: the same "
          "computation as a GEMM [N*H*W, C_in] x [C_in, C_out] built by fusegraph (backends/conv_gemm.py).")
_register("gemm_backend", str, lambda: "auto",
          "Which GEMM kernels a plan may use: 'auto' (the autotuner times generated Triton kernels against "
          "cuBLAS per shape), 'cublas' (cuBLAS only, untimed) or 'triton' (generated kernels only where they "
          "cover the GEMM; cuBLAS where none does).")
_register("profile_ranges", bool, lambda: False,
          "Plans built with this on run every kernel inside a torch.profiler range 'fg:<kind>:<kernel>', each "
          "torch.compile partition inside 'fg:partition:<name>' and its glue steps in 'fg:glue:<step>': a trace "
          "shows which plan kernel or step issued each ATen call (copies, clones, torch library calls); Triton "
          "and cuDNN frontend launches are attributed by the profiler to the enclosing ATen op instead. Costs "
          "host time per launch.")
_register("stream_compiles", bool, lambda: False,
          "A plan's kernel builds (tuning, timing) start while its batch of Triton compiles still runs: "
          "each waits only for the kernels it launches. Off (default): the whole batch compiles first; on "
          "the H200 host the compile threads starved the builds' own thread (ResNet-50's cold compile "
          "45.8 s streamed against 37.6 s not: bench/results/compile_stream_20261202_0155.txt).")
_register("prebuild_launchers", bool, lambda: True,
          "After a parallel precompile, build the compiled kernels' C launchers (Triton's per-signature "
          "host stubs) in the same thread pool instead of one by one at each kernel's first launch.")
_register("triton_lean_cache", bool, lambda: True,
          "Write Triton's on-disk kernel cache with a temporary file beside each entry instead of a "
          "temporary directory per file (tune/triton_cache.py): the same files, two file-system "
          "operations fewer per file; not when TRITON_CACHE_MANAGER names another manager.")
_register("build_gc_pause", bool, lambda: True,
          "Pause Python's cyclic garbage collector while a plan is built (a full collection with torch "
          "imported costs a few hundred milliseconds); reference counting still frees acyclic garbage.")
_register("use_triton", bool, lambda: True,
          "Lower fused kernels to generated Triton code (GPU, or CPU under TRITON_INTERPRET=1).")
_register("cuda_graphs", bool, lambda: True,
          "Capture static Plans as one CUDA graph when that removes launch overhead.")
_register("max_recompiles", int, lambda: 8,
          "How many input signatures one compiled function may be rebuilt for before it stays eager.")


def setting(name: str) -> Setting:
    """The definition of one setting; UnknownSettingError lists the known names."""
    if name not in _SETTINGS:
        raise UnknownSettingError(f"unknown setting {name!r}; known: {', '.join(sorted(_SETTINGS))}")
    return _SETTINGS[name]


class _Settings:
    """Attribute access to the current value of each setting: override > environment > default."""

    def __init__(self) -> None:
        self._overrides: dict[str, Any] = {}

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        s = setting(name)
        if name in self._overrides:
            return self._overrides[name]
        raw = os.environ.get(s.env)
        return s.coerce(raw, f"environment variable {s.env}") if raw not in (None, "") else s.default()

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_"):
            object.__setattr__(self, name, value)
            return
        raise SettingsError(f"settings are read-only; use `with override({name}=...)` or set {setting(name).env}")

    def __dir__(self) -> list[str]:
        return sorted(_SETTINGS)

    def describe(self) -> list[tuple[str, str, Any, str]]:
        """(name, env var, current value, help) for each setting."""
        return [(s.name, s.env, getattr(self, s.name), s.help) for s in _SETTINGS.values()]


settings = _Settings()


def help_text() -> str:
    """Every setting, its environment variable, type, current value and help (for the CLI)."""
    lines = []
    for s in _SETTINGS.values():
        lines.append(f"{s.env} ({s.type.__name__}, now {getattr(settings, s.name)!r})")
        lines.append(f"    {s.help}")
    return "\n".join(lines)


@contextlib.contextmanager
def override(**values: Any) -> Iterator[None]:
    """Temporarily set settings (tests use this instead of touching the environment). Strings are
    parsed like environment values; other values must have the setting's type."""
    checked = {key: setting(key).coerce(value, "override") for key, value in values.items()}
    saved = dict(settings._overrides)
    settings._overrides.update(checked)
    try:
        yield
    finally:
        settings._overrides.clear()
        settings._overrides.update(saved)
