"""One typed registry of settings: default, help text, environment variable, and a test override.

    from fusegraph.settings import settings, override
    settings.debug            # reads FUSEGRAPH_DEBUG (int), default 0
    with override(debug=2): ...
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def _parse_bool(text: str) -> bool:
    return text.strip().lower() in ("1", "true", "yes", "on")


def _default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return str(Path(base) / "fusegraph")


@dataclass(frozen=True)
class Setting:
    name: str
    env: str
    parse: Callable[[str], Any]
    default: Callable[[], Any]
    help: str


_SETTINGS: dict[str, Setting] = {}


def _register(name: str, parse: Callable[[str], Any], default: Callable[[], Any], help: str) -> None:
    _SETTINGS[name] = Setting(name, "FUSEGRAPH_" + name.upper(), parse, default, help)


_register("debug", int, lambda: 0,
          "Detail of what the compiler prints: 1 graph after passes, 2 kernels, 3 sources, 4 every pass.")
_register("dump_dir", str, lambda: "",
          "When set, every stage (graphs, kernel sources, plans) is written to files in this folder.")
_register("cache_dir", str, _default_cache_dir,
          "Where autotuning choices and compiled-kernel metadata are cached.")
_register("verify", _parse_bool, lambda: False,
          "Run the IR verifier between passes (always on when debug >= 1).")
_register("autotune", _parse_bool, lambda: True,
          "Time candidate configurations on the GPU; off picks the cost model's first choice.")
_register("use_triton", _parse_bool, lambda: True,
          "Lower fused kernels to generated Triton code (GPU, or CPU under TRITON_INTERPRET=1).")
_register("cuda_graphs", _parse_bool, lambda: True,
          "Capture static Plans as one CUDA graph when that removes launch overhead.")
_register("max_recompiles", int, lambda: 8,
          "How many input signatures one compiled function may be rebuilt for before it stays eager.")


class _Settings:
    """Attribute access to the current value of each setting: override > environment > default."""

    def __init__(self) -> None:
        self._overrides: dict[str, Any] = {}

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        if name not in _SETTINGS:
            raise AttributeError(f"unknown setting {name!r}; known: {', '.join(sorted(_SETTINGS))}")
        if name in self._overrides:
            return self._overrides[name]
        s = _SETTINGS[name]
        raw = os.environ.get(s.env)
        return s.parse(raw) if raw not in (None, "") else s.default()

    def describe(self) -> list[tuple[str, str, Any, str]]:
        """(name, env var, current value, help) for each setting."""
        return [(s.name, s.env, getattr(self, s.name), s.help) for s in _SETTINGS.values()]


settings = _Settings()


@contextlib.contextmanager
def override(**values: Any) -> Iterator[None]:
    """Temporarily set settings (tests use this instead of touching the environment)."""
    for key in values:
        if key not in _SETTINGS:
            raise AttributeError(f"unknown setting {key!r}")
    saved = dict(settings._overrides)
    settings._overrides.update(values)
    try:
        yield
    finally:
        settings._overrides.clear()
        settings._overrides.update(saved)
