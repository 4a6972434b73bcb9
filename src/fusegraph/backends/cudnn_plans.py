"""cuDNN frontend plans as data: a recipe of plain values that describes the graph (a fused
conv-epilogue graph, ConvRecipe; an SDPA forward or backward graph, SdpaRecipe), built (in a worker
process or here) into serialized execution plans, deserialized where they run, and the chosen plan
kept on disk.

    recipes = [recipe_of(epi, "direct", "float32"), ...]            # alternatives, first that builds wins
    built = build_serialized(recipes, max_plans=4, device_index=0)  # what a build worker runs
    graph = deserialize(cudnn, handle, built.blobs[i])               # a few ms; executes by tensor uid

A ConvRecipe is what backends/cudnn_conv_epilogue.ConvEpilogue says in frontend terms (shapes, conv
parameters, which per-channel vectors, residual, activation, dtypes, the graph's form); an SdpaRecipe
holds an attention node's layouts, dtype, scale and mask (backends/cudnn_frontend.py). Either pickles
to a build worker (backends/build_workers.py: `prefetch` submits, `fetch` takes the result or builds
here) and keys the on-disk store. Graph tensors get fixed uids (UIDS, SDPA_UIDS), so a deserialized
graph binds its operands by role without the objects that built it.

The store (<settings.cache_dir>/cudnn_plans/<sha256>.plan) holds the chosen plan of each recipe list
for one GPU and cuDNN version: a JSON header line naming the key, then the serialized plan. A warm
compile deserializes it instead of building any plan. Files are written atomically; an entry that
does not parse, names another key, or does not deserialize is deleted with a CacheWarning and built
again.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..ir.spec import strides_for_order
from ..settings import settings
from ..tune.cache import CacheWarning, write_atomically
from . import cudnn_frontend as fe

NHWC = (0, 2, 3, 1)
UIDS = {"x": 1, "w": 2, "scale": 3, "shift": 4, "residual": 5, "rscale": 6, "y": 7}
SDPA_UIDS = {"q": 11, "k": 12, "v": 13, "o": 14, "stats": 15, "dO": 16, "dq": 17, "dk": 18, "dv": 19}
STORE_SCHEMA = 2
Layout = tuple[tuple[int, ...], tuple[int, ...]]   # (shape, strides) of a graph tensor


@dataclass(frozen=True)
class ConvRecipe:
    """conv_fprop -> [mul(scale)] -> [add(shift)] -> [add(residual) | add(mul(residual, rscale))]
    -> [mul(rscale) after the add: the "rescaled" form] -> [activation], NHWC, fp32 intermediates."""

    x_shape: tuple[int, ...]
    w_shape: tuple[int, ...]
    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]
    dtype: str                                       # the convolution's operands
    vector_dtype: str                                # the per-channel vectors
    scale: bool
    shift: bool
    residual: tuple[tuple[int, ...], str] | None     # (shape, dtype)
    residual_scaled: bool                            # mul(residual, rscale) before the add
    rescale_after: bool                              # mul(rscale) after the residual add
    activation: str                                  # the frontend's method name, "" for none
    out_shape: tuple[int, ...]
    out_dtype: str
    form: str = field(default="direct")              # "direct" | "rescaled" (for reports)

    @property
    def channels(self) -> int:
        return self.w_shape[0]

    def roles(self) -> tuple[str, ...]:
        """The graph's tensors by role, in uid order."""
        present = {"x": True, "w": True, "scale": self.scale, "shift": self.shift,
                   "residual": self.residual is not None, "rscale": self.residual_scaled or self.rescale_after,
                   "y": True}
        return tuple(r for r in UIDS if present[r])

    def describe(self) -> str:
        return f"{self.form} {self.vector_dtype}"


@dataclass(frozen=True)
class SdpaRecipe:
    """cuDNN SDPA, fp32 math, causal top-left aligned or unmasked. Forward: o (and, when `stats` is
    given, the softmax statistics, fp32) from q, k, v. Backward: dq, dk, dv from q, k, v, the forward's
    o, dO and the statistics."""

    backward: bool
    q: Layout
    k: Layout
    v: Layout
    o: Layout
    stats: Layout | None                             # forward: generated when given; backward: read
    d_o: Layout | None
    grads: tuple[Layout, Layout, Layout] | None      # backward: dq, dk, dv
    dtype: str
    scale: float
    causal: bool
    form: str = field(default="sdpa")

    def roles(self) -> tuple[str, ...]:
        if self.backward:
            return ("q", "k", "v", "o", "dO", "stats", "dq", "dk", "dv")
        return ("q", "k", "v", "o") + (("stats",) if self.stats is not None else ())

    def uids(self) -> tuple[int, ...]:
        return tuple(SDPA_UIDS[role] for role in self.roles())

    def describe(self) -> str:
        return f"SDPA {'backward' if self.backward else 'forward'}"


Recipe = ConvRecipe | SdpaRecipe


def graph_from_recipe(cudnn: Any, handle: Any, r: Recipe) -> tuple[Any, dict[str, Any]]:
    """The frontend graph of a recipe (not built) and its tensors by role, each with its fixed uid."""
    if isinstance(r, SdpaRecipe):
        return _sdpa_graph(cudnn, handle, r)
    dt = fe._data_type(cudnn, r.dtype)
    fp32 = cudnn.data_type.FLOAT
    graph = cudnn.pygraph(io_data_type=dt, intermediate_data_type=fp32, compute_data_type=fp32, handle=handle)
    t: dict[str, Any] = {
        "x": graph.tensor(name="x", dim=list(r.x_shape), stride=list(strides_for_order(r.x_shape, NHWC)), data_type=dt),
        "w": graph.tensor(name="w", dim=list(r.w_shape), stride=list(strides_for_order(r.w_shape, NHWC)), data_type=dt)}
    c = r.channels

    def vector(role: str) -> Any:
        t[role] = graph.tensor(name=role, dim=[1, c, 1, 1], stride=[c, 1, c, c],
                               data_type=fe._data_type(cudnn, r.vector_dtype))
        return t[role]

    y = graph.conv_fprop(image=t["x"], weight=t["w"], padding=list(r.padding), stride=list(r.stride),
                         dilation=list(r.dilation), compute_data_type=fp32, name="conv")
    if r.scale:
        y = graph.mul(a=y, b=vector("scale"), compute_data_type=fp32, name="scale")
    if r.shift:
        y = graph.add(a=y, b=vector("shift"), compute_data_type=fp32, name="shift")
    if r.residual is not None:
        shape, dtype = r.residual
        res = t["residual"] = graph.tensor(name="residual", dim=list(shape),
                                           stride=list(strides_for_order(shape, NHWC)),
                                           data_type=fe._data_type(cudnn, dtype))
        if r.residual_scaled:
            res = graph.mul(a=res, b=vector("rscale"), compute_data_type=fp32, name="residual_scale")
        y = graph.add(a=y, b=res, compute_data_type=fp32, name="residual")
        if r.rescale_after:
            y = graph.mul(a=y, b=vector("rscale"), compute_data_type=fp32, name="rescale")
    if r.activation:
        y = getattr(graph, r.activation)(input=y, name=r.activation)
    y.set_output(True).set_data_type(fe._data_type(cudnn, r.out_dtype)).set_dim(list(r.out_shape)) \
        .set_stride(list(strides_for_order(r.out_shape, NHWC)))
    t["y"] = y
    for role, tensor in t.items():
        tensor.set_uid(UIDS[role])
    return graph, t


def _sdpa_graph(cudnn: Any, handle: Any, r: SdpaRecipe) -> tuple[Any, dict[str, Any]]:
    dt = fe._data_type(cudnn, r.dtype)
    fp32 = cudnn.data_type.FLOAT
    graph = cudnn.pygraph(io_data_type=dt, intermediate_data_type=fp32, compute_data_type=fp32, handle=handle)

    def tensor(name: str, layout: Layout, data_type: Any = dt) -> Any:
        return graph.tensor(name=name, dim=list(layout[0]), stride=list(layout[1]), data_type=data_type)

    def output(value: Any, layout: Layout, data_type: Any = dt) -> Any:
        return value.set_output(True).set_data_type(data_type).set_dim(list(layout[0])).set_stride(list(layout[1]))

    t = {"q": tensor("q", r.q), "k": tensor("k", r.k), "v": tensor("v", r.v)}
    if not r.backward:
        o, stats = fe._causal_sdpa(graph, cudnn, t["q"], t["k"], t["v"], r.scale, r.causal, stats=r.stats is not None)
        t["o"] = output(o, r.o)
        if r.stats is not None:
            t["stats"] = output(stats, r.stats, fp32)
    else:
        assert r.d_o is not None and r.stats is not None and r.grads is not None
        t.update(o=tensor("o", r.o), dO=tensor("dO", r.d_o), stats=tensor("stats", r.stats, fp32))
        kw = {"name": "sdpa_backward", "q": t["q"], "k": t["k"], "v": t["v"], "o": t["o"], "dO": t["dO"],
              "stats": t["stats"], "attn_scale": r.scale}
        grads = fe._with_causal(graph.sdpa_backward, cudnn, kw, r.causal)
        for role, grad, layout in zip(("dq", "dk", "dv"), grads, r.grads, strict=True):
            t[role] = output(grad, layout)
    for role, value in t.items():
        value.set_uid(SDPA_UIDS[role])
    return graph, t


@dataclass
class Built:
    """What build_serialized returns: the first recipe (by position) that built, the number of
    execution plans cuDNN offered for it, and the first max_plans of them serialized (by plan index;
    an index that did not build or serialize is missing, its reason in `failures`)."""

    recipe: int | None
    count: int = 0
    blobs: dict[int, bytes] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)


def build_serialized(recipes: Sequence[Recipe], max_plans: int, device_index: int | None) -> Built:
    """Build the first recipe cuDNN has engines for: its first `max_plans` execution plans, each
    serialized. The job a build worker runs (backends/build_workers.py); also run in-process."""
    import torch

    cudnn, why = fe._load()
    if cudnn is None:
        return Built(None, failures=[str(why)])
    if device_index is None:
        return _build(cudnn, None, recipes, max_plans)
    with torch.cuda.device(device_index):   # the plans are built for (and on) that GPU
        return _build(cudnn, fe._handle(cudnn, torch.device("cuda", device_index)), recipes, max_plans)


def _build(cudnn: Any, handle: Any, recipes: Sequence[Recipe], max_plans: int) -> Built:
    failures: list[str] = []
    for k, recipe in enumerate(recipes):
        try:
            graph, _ = graph_from_recipe(cudnn, handle, recipe)
            graph.validate()
            graph.build_operation_graph()
            graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
            graph.check_support()
            count = int(graph.get_execution_plan_count())
        except Exception as err:  # no engine for this form: the next one
            failures.append(f"{recipe.describe()}: {type(err).__name__}: {str(err)[:160]}")
            continue
        built = Built(k, count, failures=failures)
        for i in range(min(count, max(1, max_plans))):
            try:
                graph.build_plan_at_index(i)
                built.blobs[i] = _serialize(graph)
            except Exception as err:  # this engine does not build (or serialize) here
                built.failures.append(f"plan {i}: {type(err).__name__}: {str(err)[:160]}")
        if built.blobs:
            return built
        failures.append(f"{recipe.describe()}: none of {count} plans built")
    return Built(None, failures=failures)


def _serialize(graph: Any) -> bytes:
    try:
        return bytes(graph.serialize(as_bytes=True))
    except TypeError:   # an older frontend: a list of byte values
        return bytes(graph.serialize())


def deserialize(cudnn: Any, handle: Any, blob: bytes) -> Any:
    """A ready-to-execute graph from a serialized plan (its tensors bound by UIDS uid)."""
    graph = cudnn.pygraph(handle=handle)
    graph.deserialize(handle, blob)
    return graph


# ---- builds in worker processes ----

# build-worker jobs submitted ahead of the kernels' builds (prefetch), by their recipe lists; a job
# not done after WORKER_TIMEOUT_S is abandoned and its plans built in-process
WORKER_TIMEOUT_S = 300.0
_PENDING: dict[tuple[Recipe, ...], Any] = {}


def prefetch(recipes: Sequence[Recipe], max_plans: int, device: Any) -> bool:
    """Submit build_serialized(recipes) to the build workers; False when there are none, the job is
    already pending, or the store already holds the plan."""
    from . import build_workers

    recipes = tuple(recipes)
    key = key_for(recipes, fe._load()[0])
    if recipes in _PENDING or key is None or load(key) is not None:
        return False
    workers = build_workers.pool()
    if workers is None:
        return False
    _PENDING[recipes] = workers.submit("fusegraph.backends.cudnn_plans:build_serialized", list(recipes), max_plans,
                                       device_index(device))
    return True


def fetch(recipes: Sequence[Recipe], max_plans: int, device: Any, name: str) -> Built:
    """The prefetched worker's result, or (none submitted, or the worker failed) built here."""
    future = _PENDING.pop(tuple(recipes), None)
    if future is not None:
        try:
            built: Built = future.result(timeout=WORKER_TIMEOUT_S)
            if built.recipe is not None:
                return built
            # nothing built there: confirmed here, so a worker's own environment never drops the candidate
            fe.debug(name, f"the build worker built no plan ({'; '.join(built.failures)[:200]}); trying in-process")
        except Exception as err:  # the worker died, failed or hangs: build here
            fe.debug(name, f"build worker failed ({type(err).__name__}: {str(err)[:160]}); building in-process")
    return build_serialized(recipes, max_plans, device_index(device))


def device_index(device: Any) -> int | None:
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return None
    return device.index if device.index is not None else torch.cuda.current_device()


def cudnn_version(cudnn: Any) -> str:
    try:
        return str(cudnn.backend_version())
    except Exception:  # an older frontend: the module's own version
        return str(getattr(cudnn, "__version__", "unknown"))


# ---- the on-disk store of chosen plans ----

def store_key(recipes: Sequence[Recipe], gpu: dict[str, str], cudnn_version: str) -> dict[str, Any]:
    return {"schema": STORE_SCHEMA, "recipes": [{"type": type(r).__name__, **asdict(r)} for r in recipes],
            "gpu": gpu, "cudnn": cudnn_version}


def key_for(recipes: Sequence[Recipe], cudnn: Any) -> dict[str, Any] | None:
    """The store key of these recipes on this GPU and cuDNN (None without a GPU identity)."""
    from ..tune import keys

    gpu = keys.gpu_identity()
    return None if gpu is None or cudnn is None else store_key(recipes, gpu, cudnn_version(cudnn))


def directory() -> Path:
    return Path(settings.cache_dir).expanduser() / "cudnn_plans"


def _path(key: dict[str, Any]) -> Path:
    text = json.dumps(key, sort_keys=True)
    return directory() / f"{hashlib.sha256(text.encode()).hexdigest()}.plan"


def stored() -> list[Path]:
    """The stored plans (what `fusegraph cache info` counts and `fusegraph cache clear` removes)."""
    folder = directory()
    return sorted(folder.glob("*.plan")) if folder.is_dir() else []


def clear() -> int:
    """Remove every stored plan; returns how many."""
    removed = 0
    for path in stored():
        with contextlib.suppress(OSError):
            path.unlink()
            removed += 1
    return removed


def load(key: dict[str, Any]) -> tuple[int, int, bytes] | None:
    """(recipe position, plan index, serialized plan) stored for `key`, or None (missing, or corrupt:
    deleted with a warning)."""
    path = _path(key)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as err:
        warnings.warn(f"cannot read cuDNN plan {path}: {err}; building it again", CacheWarning, stacklevel=2)
        return None
    try:
        stored_key, recipe, plan, blob = parse_entry(raw)
        if json.dumps(stored_key, sort_keys=True) != json.dumps(key, sort_keys=True):
            raise ValueError("it holds another key")
        return recipe, plan, blob
    except ValueError as err:
        forget(key, f"corrupt ({err})")
        return None


def parse_entry(raw: bytes) -> tuple[dict[str, Any], int, int, bytes]:
    """(key, recipe position, plan index, serialized plan) of a stored plan file's bytes; ValueError
    when they do not parse (also what tune/bundle.py checks before importing one)."""
    try:
        head, _, blob = raw.partition(b"\n")
        header = json.loads(head)
        if not blob:
            raise ValueError("no serialized plan after the header")
        return header["key"], int(header["recipe"]), int(header["plan"]), blob
    except (KeyError, TypeError, UnicodeDecodeError) as err:
        raise ValueError(f"{type(err).__name__}: {err}") from err


def file_name(key: dict[str, Any]) -> str:
    """The stored plan's file name for `key` (the hash of the key)."""
    return _path(key).name


def forget(key: dict[str, Any], why: str) -> None:
    """Delete the stored plan for `key` (with a warning saying why)."""
    path = _path(key)
    warnings.warn(f"cuDNN plan {path} is {why}; deleting it and building the plan again", CacheWarning,
                  stacklevel=3)
    with contextlib.suppress(OSError):
        path.unlink()


def store(key: dict[str, Any], recipe: int, plan: int, blob: bytes) -> Path | None:
    """Write the chosen plan atomically (tune.cache.write_atomically); None with a warning on failure."""
    path = _path(key)
    header = json.dumps({"key": key, "recipe": recipe, "plan": plan}, sort_keys=True).encode()
    try:
        write_atomically(path, header + b"\n" + blob)
    except OSError as err:
        warnings.warn(f"cannot write cuDNN plan {path}: {err}", CacheWarning, stacklevel=2)
        return None
    return path
