"""The autotuner and its on-disk cache.

    from fusegraph.tune import Config, autotune
    cfg = autotune("kernel_name", {"sig": ..., "shape": ..., "dtype": ...}, candidates, bench, prune=...)

Candidates are data (`Config`); choices are cached by (kernel, key, GPU, library versions).
`fusegraph.tune.timing.bench_ms` times one candidate; `fusegraph cache info|clear` manages the cache.
"""

from .autotuner import TuneResult, autotune, clear_memo, tune
from .cache import CacheEntry, CacheWarning, Timing, TuneCache
from .config import Config, ConfigValue
from .timing import bench_ms

__all__ = ["CacheEntry", "CacheWarning", "Config", "ConfigValue", "Timing", "TuneCache", "TuneResult",
           "autotune", "bench_ms", "clear_memo", "tune"]
