"""The Kernel of a MatmulGroup: candidates are the generated Triton GEMM (tiled, persistent, stream-K
and split-K kernels, one candidate per config: codegen/gemm_configs.gemm_candidates) and cuBLAS
(torch.matmul + the epilogue, and any claimed amax, as further launches); the autotuner picks per
shape on a GPU. Without timing, the first candidate wins: the tiled fused Triton GEMM when it
covers the group (build option gemm_variant="persistent"|"streamk"|"splitk"|"tiled" keeps only
that kind; "streamk" with settings.gemm_streamk on).

Build time: gemm_configs keeps few candidates (by the cost model and the shape), a launch-bound
GEMM (floor under settings.tune_min_floor_us) is not timed (but one whose floor is above
tune_gemm_pair_floor_us, a decode GEMM streaming its weight, is timed against cuBLAS only), the
kept Triton candidates compile in parallel before timing (tune/precompile.py), and the epilogue
kernel of the cuBLAS candidate is only generated when cuBLAS is timed or chosen.
Kernel.tuning records where the time went."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import torch

from ..codegen.compile import interpreting, load_triton_function
from ..codegen.gemm_configs import candidate_set
from ..codegen.matmul import (
    GeneratedGemm,
    gemm_candidates,
    gemm_launch_parameters,
    gemm_supported,
    gemv_configs,
    generate_gemm,
    split_k_finish_grid,
    streamk_workspace,
)
from ..codegen.matmul_pingpong import PINGPONG_MAXNREG
from ..errors import SettingsError
from ..fusion.epilogue import MatmulGroup
from ..ir import dtypes
from ..ir.node import Node
from ..ir.registry import Cost, get_op
from ..runtime.kernel import Kernel
from ..runtime.launch import pdl_options
from ..settings import settings
from . import cublas

log = logging.getLogger("fusegraph.backends")


def matmul_group_cost(group: MatmulGroup) -> Cost:
    nbytes = sum(n.spec.nbytes for n in group.inputs) + sum(n.spec.nbytes for n in group.outputs)
    flops = sum(get_op(n.op).cost([i.spec for i in n.inputs], list(n.specs), n.attrs).flops for n in group.nodes)
    return Cost(nbytes, flops)


class GemmLaunch:
    """Allocate the outputs and launch the generated GEMM with one config: the tiled kernel (`fn`),
    or the config's VARIANT ("persistent"; "streamk": persistent, the last wave's tiles shared out by
    K through an fp32 workspace and per-tile counters; "splitk": partials into an fp32 workspace, then
    the reduction + epilogue kernel), loaded from `gen`'s variant source."""

    def __init__(self, fn: Any, gen: GeneratedGemm, config: dict[str, Any], device: str) -> None:
        self.variant = str(config.get("VARIANT", "tiled"))
        self.fns = [fn] if self.variant == "tiled" else [
            load_triton_function(gen.variants[self.variant][1], kernel) for kernel in gen.variants[self.variant][0]]
        self.fn = self.fns[0]
        self.grid, self.constexprs, self.num_warps, self.num_stages = gemm_launch_parameters(gen.geometry, config)
        pdl_consts, self.launch_options = pdl_options(device)   # programmatic dependent launch (Hopper)
        if self.variant == "pingpong":   # a Gluon kernel: no PDL prologue; registers moved between partitions
            pdl_consts, self.launch_options = {}, {"maxnreg": PINGPONG_MAXNREG}
        self.constexprs.update(pdl_consts)
        self.out_specs = [(n.shape, n.spec.memory_strides, dtypes.to_torch(n.dtype)) for n in gen.outputs]
        self.atomic_max = gen.atomic_max_outputs
        self.device = torch.device(device)
        self.workspace = 0
        if self.variant == "splitk":
            geo = gen.geometry
            self.finish_grid, self.finish_constexprs = split_k_finish_grid(geo, config)
            self.finish_constexprs.update(pdl_consts)
            self.workspace = int(config["SPLITS"]) * max(1, geo.batch_numel) * geo.m * geo.n

        self.sk_count: torch.Tensor | None = None   # stream-K's counters (allocated at the first launch)
        self.sk_tiles = max(1, int(config.get("SK_TILES", 0))) if self.variant == "streamk" else 0
        if self.sk_tiles:
            self.workspace = streamk_workspace(config)

        # device-side TMA descriptors (the ping-pong kernel always makes them)
        self.uses_tma = bool(self.constexprs.get("USE_TMA", False)) or self.variant == "pingpong"
        if self.uses_tma and self.device.type == "cuda":
            _set_tma_allocator()

    def _outputs(self) -> list[torch.Tensor]:
        """Fresh outputs; an atomic-max output (amax) is an fp32 scratch at -inf, cast by `_finish`."""
        return [torch.full(s, float("-inf"), dtype=torch.float32, device=self.device) if k in self.atomic_max
                else torch.empty_strided(s, st, dtype=dt, device=self.device)
                for k, (s, st, dt) in enumerate(self.out_specs)]

    def _finish(self, outs: list[torch.Tensor]) -> list[torch.Tensor]:
        for k in self.atomic_max:
            outs[k] = outs[k].to(self.out_specs[k][2])
        return outs

    def warmup_jobs(self, args: Sequence[torch.Tensor]) -> list[Any]:
        """Calls that make Triton compile this config's kernels without launching them (tune/precompile.py)."""
        def job() -> Any:
            return self.fn.warmup(*args, *self._outputs(), *self._streamk_args(), grid=self.grid, **self.constexprs,
                                  num_warps=self.num_warps, num_stages=self.num_stages, **self.launch_options)

        if self.variant != "splitk":
            return [job]
        ws = torch.empty(self.workspace, dtype=torch.float32, device=self.device)

        def partial() -> Any:
            return self.fns[0].warmup(*args, ws, grid=self.grid, **self.constexprs, num_warps=self.num_warps,
                                      num_stages=self.num_stages, **self.launch_options)

        def finish() -> Any:
            return self.fns[1].warmup(*args, *self._outputs(), ws, grid=self.finish_grid, **self.finish_constexprs,
                                      num_warps=4, **self.launch_options)

        return [partial, finish]

    def _streamk_args(self) -> list[torch.Tensor]:
        """A stream-K launch's workspace (fresh: the partials live within one launch) and its tail
        tiles' arrival counters: zero between launches (the last arrival at a tile resets its own), so
        a GemmLaunch runs one launch at a time."""
        if not self.sk_tiles:
            return []
        if self.sk_count is None:
            self.sk_count = torch.zeros(self.sk_tiles, dtype=torch.int32, device=self.device)
        return [torch.empty(self.workspace, dtype=torch.float32, device=self.device), self.sk_count]

    def warmup_job(self, args: Sequence[torch.Tensor]) -> Any:
        return self.warmup_jobs(args)[0]

    def __call__(self, args: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        outs = self._outputs()
        if self.variant == "splitk":
            ws = torch.empty(self.workspace, dtype=torch.float32, device=self.device)
            self.fns[0][self.grid](*args, ws, **self.constexprs, num_warps=self.num_warps, num_stages=self.num_stages,
                                   **self.launch_options)
            self.fns[1][self.finish_grid](*args, *outs, ws, **self.finish_constexprs, num_warps=4,
                                          **self.launch_options)
            return self._finish(outs)
        consts = self.constexprs
        if self.uses_tma:
            if any(t.data_ptr() % 16 for t in args):  # TMA needs aligned bases: pointer path
                if self.variant == "pingpong":
                    raise ValueError("the ping-pong GEMM needs 16-byte-aligned operands")
                consts = dict(consts, USE_TMA=False)
            elif self.device.type == "cuda":
                _set_tma_allocator()                   # this thread's (Triton's allocator is per thread)
        if self.sk_tiles:   # stream-K: its workspace and counters after the outputs
            self.fn[self.grid](*args, *outs, *self._streamk_args(), **consts, num_warps=self.num_warps,
                               num_stages=self.num_stages, **self.launch_options)
            return self._finish(outs)
        self.fn[self.grid](*args, *outs, **consts, num_warps=self.num_warps, num_stages=self.num_stages,
                           **self.launch_options)
        return self._finish(outs)


class _LazyEpilogue:
    """The group's epilogue (or `part`: one of its claimed reductions) as our generated kernel, built
    on first use: only the cuBLAS candidate needs it, and generating (and tuning) it costs build
    time when cuBLAS is never timed."""

    def __init__(self, group: MatmulGroup, name: str, compute_dtype: str, device: str,
                 options: dict[str, Any], part: Any = None, suffix: str = "epilogue") -> None:
        self.args = (group.epilogue if part is None else part, f"{name}_{suffix}", compute_dtype, device, options)
        self.kernel: Kernel | None = None

    def build(self) -> Kernel:
        if self.kernel is None:
            from ..lower import fused_kernel  # lower imports this module
            self.kernel = fused_kernel(*self.args)
        return self.kernel

    def __call__(self, args: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
        return self.build().launch(args)


def matmul_group_kernel(group: MatmulGroup, name: str, compute_dtype: str, device: str,
                        options: dict[str, Any]) -> Kernel:
    from ..lower import reference_launch  # lower imports this module

    start = time.perf_counter()
    cost = matmul_group_cost(group)
    identity = not group.epilogue_nodes
    # cuBLAS computing a bias or fp32-cast epilogue itself (one launch, as eager runs a linear layer),
    # or the bias of a longer epilogue, the rest as the second launch
    own = cublas.own_epilogue(group, device) if device.startswith("cuda") else None
    split = cublas.bias_first(group, device) if own is None else None
    epilogue = None if identity else _LazyEpilogue(group, name, compute_dtype, device, options,
                                                   None if split is None else split.rest)
    reductions = [_LazyEpilogue(group, name, compute_dtype, device, options, r, f"amax{k}")
                  for k, r in enumerate(group.reductions)]
    library = cublas.cublas_launch(group, epilogue, reductions, own, split)
    kernel = Kernel(name=name, kind="matmul", backend="cublas", nodes=tuple(group.nodes),
                    inputs=tuple(group.inputs), outputs=tuple(group.outputs), cost=cost, launch=library,
                    source=cublas.describe(group, own, split))
    kernel = _matmul_kernel(kernel, group, name, compute_dtype, device, library, reference_launch,
                            options.get("gemm_variant"), own, split, candidate_set(options))
    if kernel.backend == "cublas" and device.startswith("cuda") and own is None:
        for part in ([epilogue] if epilogue is not None else []) + reductions:
            part.build()  # generated and compiled now, not at the first call (or in a CUDA-graph capture)
    kernel.tuning = dict(kernel.tuning or {"source": "default", "seconds": 0.0, "candidates": 1},
                         build_s=round(time.perf_counter() - start, 4))
    return kernel


def _matmul_kernel(kernel: Kernel, group: MatmulGroup, name: str, compute_dtype: str, device: str,
                   library: Any, reference_launch: Any, variant: str | None = None,
                   own: cublas.OwnEpilogue | None = None, split: cublas.BiasFirst | None = None,
                   candidates: str = "full") -> Kernel:
    """`variant` (build option gemm_variant: "tiled", "persistent", "streamk", "splitk" or "gemv"): only
    that kind's candidates (and cuBLAS) are considered; none of that kind: the usual candidates. Without one, a
    GEMM the GEMV kernel covers takes it by rule (`_gemv_rule`). `own`: the epilogue cuBLAS computes
    itself (the library candidate is one launch); `split`: its bias, the rest a second launch.
    `candidates`: the candidate set (build option gemm_candidates, gemm_configs.GEMM_CANDIDATE_SETS)."""
    identity = not group.epilogue_nodes or own is not None
    described = cublas.describe(group, own, split)
    form = cublas.form_of(own, split)
    why = gemm_supported(group)
    if why is not None:
        kernel.note = f"cuBLAS only: {why}"
        _debug(name, kernel.note)
        return kernel
    if device.startswith("cuda") and gemm_backend() == "cublas":
        kernel.config, kernel.tuning = {"backend": "cublas"}, {"source": "rule", "seconds": 0.0, "candidates": 1}
        kernel.note = "cuBLAS: settings.gemm_backend='cublas'" + ("" if identity else " (epilogue as a second launch)")
        return kernel
    gen = generate_gemm(group, name)
    gemv = _gemv_rule(gen) if variant in (None, "gemv") else []   # an explicit gemm_variant wins
    if not gemv and device.startswith("cuda") and _library_only(gen) and gemm_backend() == "auto":
        kernel.config, kernel.tuning = {"backend": "cublas"}, {"source": "rule", "seconds": 0.0, "candidates": 1}
        kernel.note = (f"cuBLAS: {gen.geometry.m} row(s) <= gemm_library_max_m, a weight-streaming GEMV"
                       + ("" if identity else " (epilogue as a second launch)"))
        return kernel
    configs = gemv or _gemm_candidates(gen, device, group, candidates)
    if variant is not None:
        configs = [c for c in configs if c.get("VARIANT", "tiled") == variant] or configs
    kernel.source, kernel.backend = gen.source_of(configs[0].get("VARIANT", "tiled")), "triton"
    kernel.config = dict(configs[0], backend="triton")
    if not settings.use_triton or not (device.startswith("cuda") or interpreting()):
        kernel.note = "planned as a Triton GEMM; runs through the reference on this device"
        kernel.launch = _reference_group_launch(group, compute_dtype, reference_launch)
        return kernel
    try:
        fn = load_triton_function(gen.source, name)
    except Exception as err:  # codegen must never take the plan down
        kernel.backend, kernel.source, kernel.config = "cublas", described, {"backend": "cublas"}
        kernel.note = f"Triton GEMM failed to load ({type(err).__name__}: {err}); cuBLAS"
        _debug(name, kernel.note)
        return kernel
    if gemv:
        choice = dict(gemv[0], backend="triton")
        kernel.tuning = {"source": "rule", "seconds": 0.0, "candidates": 1}
        kernel.note = (f"weight-streaming GEMV kernel: {gen.geometry.m} row(s), the weight read along K "
                       "(settings.gemv_kernel)")
    else:
        choice = _choose(kernel, gen, fn, configs, library, device, form)
    if choice.get("backend") == "cublas":
        kernel.backend, kernel.source, kernel.config = "cublas", described, dict(choice)
        timed = (kernel.tuning or {}).get("source") in ("tuned", "cache", "memo")
        failed = (kernel.tuning or {}).get("failed", [])
        why = "cuBLAS was faster for this shape" if timed else "cuBLAS: the untimed pick for exact fp32"
        if failed and len(failed) >= (kernel.tuning or {}).get("candidates", 0) - 1:
            why = f"cuBLAS: every Triton candidate failed ({len(failed)}; first: {failed[0]})"
        kernel.note = why + ("" if identity else " (epilogue as a second launch)") + \
            (f" (its {own.kind} epilogue in the same call)" if own is not None else "")
        return kernel
    launch = GemmLaunch(fn, gen, choice, device)
    kernel.source = gen.source_of(launch.variant)
    if device.startswith("cuda"):
        try:  # compile now: a config that does not build falls back to cuBLAS here, not at run time
            example = _example_inputs(gen.inputs, device)
            got = launch(example)
            if kernel.tuning.get("source") not in ("tuned", "cache", "memo"):  # untimed, so unchecked yet:
                reference = _reference_group_launch(group, compute_dtype, reference_launch)  # no compile
                check_same(got, reference(example), f"{name} {choice}", dtypes.itemsize(group.matmul.dtype) <= 2)
        except Exception as err:
            kernel.backend, kernel.source, kernel.config = "cublas", described, {"backend": "cublas"}
            kernel.note = f"Triton GEMM failed to compile or check ({type(err).__name__}: {str(err)[:200]}); cuBLAS"
            _debug(name, kernel.note)
            return kernel
    kernel.config = dict(choice)
    kernel.launch = launch
    return kernel


def _choose(kernel: Kernel, gen: GeneratedGemm, fn: Any, configs: list[dict[str, Any]], library: Any,
            device: str, form: str | None = None) -> dict[str, Any]:
    """The config to run, by the autotuner (recorded in kernel.tuning). Triton candidates are checked
    once against cuBLAS's result (one run each, the baseline computed once) before they are timed."""
    from ..tune import Config, bench_ms, tune
    from ..tune.autotuner import floor_ms_of, summary
    from ..tune.precompile import compile_in_parallel

    name = kernel.name
    if not device.startswith("cuda"):  # the interpreter runs the generated kernel (what CPU tests check)
        return dict(_candidates(configs)[0].values)
    candidates = _candidates(configs, gen)
    args = _example_inputs(gen.inputs, device)
    expected: list[Any] = []
    # the product is rounded to 16 bits on its way to the outputs
    low_precision = any(n.op == "matmul" and dtypes.itemsize(n.dtype) <= 2 for n in kernel.nodes)

    def bench(config: Config) -> float:
        values = dict(config.values)
        launch = library if values["backend"] == "cublas" else GemmLaunch(fn, gen, values, device)
        if values["backend"] == "triton":  # a config that computes something else is not a candidate
            if not expected:
                expected.extend(library(args))
            check_same(launch(args), expected, f"{name} {config}", low_precision)
        return bench_ms(lambda: launch(args))

    def precompile(kept: Sequence[Config]) -> None:
        compile_in_parallel([job for c in kept if c["backend"] == "triton"
                             for job in GemmLaunch(fn, gen, dict(c.values), device).warmup_jobs(args)])

    key = _tune_key(gen, device, form)
    floor = floor_ms_of(kernel)
    if _paired(floor) and gemm_backend() == "auto":
        # weight-streaming but launch-bound: time the first Triton config against cuBLAS only
        candidates = [candidates[0], next(c for c in candidates if c["backend"] == "cublas")]
        floor = None if candidates[0] != candidates[1] else floor
    result = tune(name, key, candidates, bench, floor_ms=floor, precompile=precompile)
    kernel.tuning = summary(result, len(candidates))
    failed = [f"{t.config}: {str(t.error)[:160]}" for t in result.timings if t.ms is None]
    if failed:
        kernel.tuning["failed"] = failed
        _debug(name, f"{len(failed)} of {len(candidates)} candidates failed; first: {failed[0]}")
    return dict(result.config.values)


def gemm_warmup_jobs(group: MatmulGroup, name: str, device: str, seen: set[str] | None = None,
                     candidates: str = "full") -> list[Any]:
    """Compile jobs (tune/precompile.py) for the Triton candidates this GEMM's build will compile:
    the first config when it is launch-bound or autotuning is off, the memo/disk-cached choice when
    there is one, else every kept config; [] when it has no Triton GEMM, or when `seen` already has
    its sources (the same GEMM in another layer)."""
    from .plan_precompile import first_time

    gen, configs, _ = build_preview(group, name, device, candidates)
    if gen is None or not first_time(gen.all_sources, seen) or not configs:
        return []
    fn = load_triton_function(gen.source, name)
    args = _example_inputs(gen.inputs, device)
    return [job for c in configs for job in GemmLaunch(fn, gen, c, device).warmup_jobs(args)]


def build_preview(group: MatmulGroup, name: str, device: str,
                  candidates: str = "full") -> tuple[GeneratedGemm | None, list[dict[str, Any]], bool]:
    """What matmul_group_kernel will compile and run for this GEMM, decided as it decides (without
    timing anything): (the generated GEMM or None, the Triton configs it compiles, whether it runs
    the cuBLAS candidate: chosen by rule or cache, or timed, when it is also the baseline every Triton
    candidate is checked against)."""
    from ..tune.autotuner import cached_choice, floor_ms_of, launch_bound

    if gemm_supported(group) is not None or (device.startswith("cuda") and gemm_backend() == "cublas"):
        return None, [], True
    gen = generate_gemm(group, name)
    gemv = _gemv_rule(gen)
    if gemv:
        return gen, gemv[:1], False
    if device.startswith("cuda") and _library_only(gen) and gemm_backend() == "auto":
        return gen, [], True
    configs = _gemm_candidates(gen, device, group, candidates)
    shape = Kernel(name=name, kind="matmul", backend="triton", nodes=tuple(group.nodes), inputs=tuple(group.inputs),
                   outputs=tuple(group.outputs), cost=matmul_group_cost(group), launch=lambda args: [])
    floor = floor_ms_of(shape)
    if not settings.autotune or launch_bound(floor):
        if settings.autotune and _paired(floor) and gemm_backend() == "auto":   # first config against cuBLAS
            return gen, configs[:1], True
        exact = _exact_fp32(gen)   # the untimed pick: cuBLAS for exact fp32
        return gen, [] if exact else configs[:1], exact
    known = cached_choice(name, _tune_key(gen, device, cublas.library_form(group, device)), _candidates(configs, gen))
    if known is not None:
        if known["backend"] == "cublas":
            return gen, [], True
        return gen, [{a: v for a, v in known.items() if a != "backend"}], False
    return gen, configs, True


def cublas_second_launch(group: MatmulGroup, name: str, device: str, candidates: str = "full") -> Any:
    """The kernel group the build runs as the cuBLAS candidate's second launch, our generated kernel
    named `{name}_epilogue` (compiled then, unless precompiled with the plan): the group's epilogue,
    or the rest of it after a bias cuBLAS adds (cublas.bias_first); None when there is none."""
    if not group.epilogue_nodes or not device.startswith("cuda") or cublas.own_epilogue(group, device) is not None:
        return None
    if not build_preview(group, name, device, candidates)[2]:
        return None
    split = cublas.bias_first(group, device)
    return group.epilogue if split is None else split.rest


def gemm_backend() -> str:
    """settings.gemm_backend, checked: 'auto', 'cublas' or 'triton'."""
    mode = settings.gemm_backend
    if mode not in ("auto", "cublas", "triton"):
        raise SettingsError(f"setting gemm_backend: {mode!r} is not one of 'auto', 'cublas', 'triton'")
    return str(mode)


def _gemv_rule(gen: GeneratedGemm) -> list[dict[str, Any]]:
    """[the GEMV kernel's config] when it covers the GEMM (codegen/gemm_configs.gemv_covers: a decode
    step's few rows times an nn.Linear weight) and settings.gemv_kernel is on, else []. Untimed: on
    an H200 it streamed each of a Llama decode step's weights faster than cuBLAS (3.2-3.8 TB/s
    against 1.1-3.6; the seven back to back in 103 us against 125: bench/gemv_gpu.py), and the
    epilogue rides in its store instead of a second launch."""
    if "gemv" not in gen.variants or not settings.gemv_kernel:
        return []
    return gemv_configs(gen.geometry)


def _library_only(gen: GeneratedGemm) -> bool:
    """A GEMM of at most settings.gemm_library_max_m rows (one batch entry): a decode step's GEMV,
    bound by streaming its weight. cuBLAS runs it untimed: on the H200 our tiled/split-K kernels
    streamed weights 1.1-1.8x slower than cuBLAS in a decode step (bench/decode_gemm_gpu.py), while
    the autotuner's isolated timing (L2 flushed, one call) rated them equal, so timing cannot be
    trusted to choose here."""
    limit = settings.gemm_library_max_m
    return limit > 0 and gen.geometry.batch_numel == 1 and gen.geometry.m <= limit


def _paired(floor_ms: float | None) -> bool:
    """A launch-bound GEMM still worth one timing of its first Triton config against cuBLAS (settings
    tune_gemm_pair_floor_us): the weight-streaming GEMMs of a decode step, where the two differ by up
    to 2x (the Triton kernel's one compile is paid anyway for the untimed pick)."""
    from ..tune.autotuner import launch_bound

    return (settings.autotune and launch_bound(floor_ms) and floor_ms is not None
            and floor_ms * 1e3 >= settings.tune_gemm_pair_floor_us)


def _candidates(configs: list[dict[str, Any]], gen: GeneratedGemm | None = None) -> list[Any]:
    """Triton configs then cuBLAS; cuBLAS first for exact fp32 (our tl.dot then runs on the CUDA
    cores, well behind cuBLAS's SGEMM), so an untimed (launch-bound) pick takes it."""
    from ..tune import Config

    triton = [Config(dict(c, backend="triton")) for c in configs]
    if gemm_backend() == "triton" and triton:
        return triton
    if gen is not None and _exact_fp32(gen):
        return [Config(backend="cublas"), *triton]
    return [*triton, Config(backend="cublas")]


def _exact_fp32(gen: GeneratedGemm) -> bool:
    return 'input_precision="ieee"' in gen.source


def _tune_key(gen: GeneratedGemm, device: str, form: str | None = None) -> dict[str, Any]:
    key = {"source": gen.all_sources, "device": device, "torch": torch.__version__}
    if gemm_backend() == "triton":   # candidates without cuBLAS
        key["gemm_backend"] = "triton"
    if form is not None:   # the cuBLAS candidate computes (part of) the epilogue itself: another candidate
        key["cublas_epilogue"] = form
    return key


def _gemm_candidates(gen: GeneratedGemm, device: str, group: MatmulGroup,
                     candidates: str = "full") -> list[dict[str, Any]]:
    """Tiled, persistent (stream-K with settings.gemm_streamk) and split-K configs of this GEMM on
    `device` (warp specialization only where Triton 3.6 supports it: Blackwell, compute capability >= 10),
    from the candidate set `candidates` (gemm_configs.GEMM_CANDIDATE_SETS)."""
    pingpong = "pingpong" in gen.variants and _pingpong_available(device)
    return gemm_candidates(gen.geometry, tma=gen.tma and _tma_available(device), sms=sm_count(device),
                           itemsize=dtypes.itemsize(group.matmul.inputs[0].dtype),
                           warp_specialize=_capability(device) >= 10, store_itemsize=gen.tma_store_itemsize,
                           streamk=settings.gemm_streamk and "streamk" in gen.variants, candidates=candidates,
                           pingpong_store_itemsize=gen.pingpong_store_itemsize if pingpong else None,
                           pingpong_activation=gen.pingpong_activation)


def _pingpong_available(device: str) -> bool:
    """The ping-pong kernel runs here: a Hopper GPU (wgmma: compute capability 9 exactly), not under the
    interpreter (which does not run Gluon), with Triton's Gluon Hopper module."""
    if interpreting() or _capability(device) != 9:
        return False
    try:
        from triton.experimental.gluon.language.nvidia import hopper  # noqa: F401
    except ImportError:
        return False
    return True


def _capability(device: str) -> int:
    if not device.startswith("cuda") or not torch.cuda.is_available():
        return 0
    return int(torch.cuda.get_device_capability(torch.device(device))[0])


def sm_count(device: str) -> int:
    """The GPU's SM count (the H100/H200's where there is no GPU): how many programs fill it."""
    from ..codegen.matmul import SMS

    if not device.startswith("cuda") or not torch.cuda.is_available():
        return SMS
    return int(torch.cuda.get_device_properties(torch.device(device)).multi_processor_count)


def _tma_available(device: str) -> bool:
    """TMA descriptors: a Hopper-or-newer GPU (or the interpreter, which emulates them)."""
    if interpreting():
        return True
    if not device.startswith("cuda") or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(torch.device(device))[0] >= 9


def _tma_scratch(size: int, alignment: int, stream: Any) -> torch.Tensor:
    return torch.empty(size, device="cuda", dtype=torch.int8)


def _allocator_var() -> Any:
    """Triton's ContextVar holding the launch allocator (None in a Triton without one)."""
    try:
        from triton.runtime import _allocation
        return _allocation._allocator
    except (ImportError, AttributeError):
        return None


_ALLOCATOR = _allocator_var()


def _set_tma_allocator() -> None:
    """Device-side TMA descriptors need scratch memory from an allocator Triton calls at launch.
    Triton keeps it in a ContextVar, so it is per thread: set where the kernel is launched, not once
    per process (a GEMM first built in a precompile worker thread, as on a warm build whose tuning
    comes from the cache, left the launching thread without one; the compile check then failed and
    GPT-2's LM-head backward fell back to cuBLAS's align1 kernel, 4.9 ms instead of 0.9). Per call:
    one ContextVar read."""
    if _ALLOCATOR is not None and _ALLOCATOR.get() is _tma_scratch:
        return
    import triton

    triton.set_allocator(_tma_scratch)


def check_same(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor], what: str,
               low_precision: bool = False) -> None:
    """Raise ValueError unless each output matches (relative norm error over finite values; 16-bit
    and 8-bit floats 2e-2, others 1e-3: candidates differ in summation order and fp32 rounding;
    int8 codes may differ by one in 0.1% of elements, other integers must be equal). low_precision:
    the outputs went through a 16-bit value on the way (a bf16 GEMM product cast to fp32, where a
    different summation order flips bf16 roundings: 3e-3 measured for GPT-2's LM-head dh), so floats
    get the 16-bit limit whatever their own width."""
    for g, w in zip(got, want, strict=True):
        if not g.dtype.is_floating_point:
            if g.dtype == torch.int8 and g.shape == w.shape:  # quantized codes: a sum-order difference can
                diff = (g.int() - w.int()).abs()               # move x / scale across a rounding boundary
                if diff.numel() and (int(diff.max()) > 1 or float((diff > 0).float().mean()) > 1e-3):
                    raise ValueError(f"{what}: int8 output differs from the baseline beyond one code in 0.1%")
                continue
            if not torch.equal(g, w):
                raise ValueError(f"{what}: integer output differs from the baseline")
            continue
        limit = 2e-2 if g.element_size() <= 2 or low_precision else 1e-3
        if g.element_size() == 1:  # fp8: compared in fp32 (not every op has fp8 kernels)
            g, w = g.float(), w.float()
        finite = torch.isfinite(w)
        if not torch.equal(finite, torch.isfinite(g)):
            raise ValueError(f"{what}: non-finite values differ from the baseline")
        g64, w64 = g[finite].double(), w[finite].double()
        err = ((g64 - w64).norm() / w64.norm().clamp(min=1e-30)).item()
        if not err <= limit:
            raise ValueError(f"{what}: relative error {err:.2e} against the baseline (limit {limit:.0e})")


def _reference_group_launch(group: MatmulGroup, compute_dtype: str, reference_launch: Any) -> Any:
    """The matmul and its epilogue run node by node with the torch reference."""
    from ..reference import run_node

    parts = [(reference_launch(p, compute_dtype), p.inputs) for p in (group.epilogue, *group.reductions)]
    mm = group.matmul
    positions = {n.id: k for k, n in enumerate(group.inputs)}

    def launch(args: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        product = run_node(mm, [args[positions[i.id]] for i in mm.inputs], compute_dtype, args[0].device)
        return [out for run, inputs in parts
                for out in run([product if n.id == mm.id else args[positions[n.id]] for n in inputs])]

    return launch


def _example_inputs(nodes: Sequence[Node], device: str) -> list[torch.Tensor]:
    from ..lower import _example_inputs as make

    return make(nodes, device)


def _debug(name: str, why: str) -> None:
    if settings.debug >= 1:
        print(f"[fusegraph] {name}: {why}")
    log.debug("%s: %s", name, why)
