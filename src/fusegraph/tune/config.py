"""`Config`: one candidate setting of a kernel's tunable knobs, as plain data.

    Config.of(BLOCK_C=1024, num_warps=8)        # the usual spelling
    Config(BLOCK_C=1024, num_warps=8)           # the same
    Config({"BLOCK_C": 1024, "num_warps": 8})   # from a mapping
    cfg["BLOCK_C"], cfg.get("num_stages", 2), dict(cfg), cfg.replace(num_warps=4)

A Config is immutable, hashable, compares by its values (order does not matter), and
round-trips through JSON (`to_json` / `from_json`), which is how the tuning cache stores it.
"""

from __future__ import annotations

import types
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

ConfigValue = int | float | str | bool
_VALUE_TYPES = (int, float, str, bool)


@dataclass(frozen=True, init=False, eq=True)
class Config:
    values: Mapping[str, ConfigValue]
    _sorted: tuple[tuple[str, ConfigValue], ...] = field(init=False, repr=False, compare=False)
    _hash: int = field(init=False, repr=False, compare=False)

    def __init__(self, values: Mapping[str, ConfigValue] | None = None, /, **knobs: ConfigValue) -> None:
        if values is None and len(knobs) == 1 and isinstance(knobs.get("values"), Mapping):
            values = knobs.pop("values")  # type: ignore[assignment]  # Config(values={...}), dataclass style
        merged: dict[str, ConfigValue] = dict(values or {})
        merged.update(knobs)
        for name, value in merged.items():
            if not isinstance(name, str) or not name:
                raise TypeError(f"Config knob names must be non-empty strings, got {name!r}")
            if not isinstance(value, _VALUE_TYPES):
                raise TypeError(f"Config knob {name}={value!r}: values must be int, float, str or bool, "
                                f"not {type(value).__name__}")
        object.__setattr__(self, "values", types.MappingProxyType(merged))
        # computed once: configs are hashed and serialized on every autotune lookup
        object.__setattr__(self, "_sorted", tuple((k, merged[k]) for k in sorted(merged)))
        object.__setattr__(self, "_hash", hash(tuple((k, type(v).__name__, v) for k, v in self._sorted)))

    @classmethod
    def of(cls, **knobs: ConfigValue) -> Config:
        return cls(knobs)

    def __reduce__(self) -> tuple[Any, ...]:  # pickle/deepcopy: a mappingproxy does not pickle
        return (Config, (dict(self.values),))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Config):
            return NotImplemented
        # bool is an int in Python (True == 1); keep BLOCK=1 and flag=True apart.
        return self._hash == other._hash and self._sorted == other._sorted and all(
            type(a[1]) is type(b[1]) for a, b in zip(self._sorted, other._sorted, strict=True))

    def __getitem__(self, name: str) -> ConfigValue:
        try:
            return self.values[name]
        except KeyError:
            raise KeyError(f"{name!r} is not a knob of {self!r}") from None

    def __contains__(self, name: object) -> bool:
        return name in self.values

    def __iter__(self) -> Iterator[str]:
        return iter(self.values)

    def __len__(self) -> int:
        return len(self.values)

    def keys(self) -> Any:
        return self.values.keys()

    def items(self) -> Any:
        return self.values.items()

    def get(self, name: str, default: Any = None) -> Any:
        return self.values.get(name, default)

    def replace(self, **knobs: ConfigValue) -> Config:
        return Config(self.values, **knobs)

    def to_json(self) -> dict[str, ConfigValue]:
        """A plain dict with sorted keys (stable for hashing and for files)."""
        return dict(self._sorted)

    @classmethod
    def from_json(cls, data: Any) -> Config:
        if not isinstance(data, dict):
            raise TypeError(f"a stored Config must be a JSON object, got {type(data).__name__}")
        return cls(data)

    def __repr__(self) -> str:
        return "Config(" + ", ".join(f"{k}={v!r}" for k, v in self.values.items()) + ")"
