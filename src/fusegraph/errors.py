"""Typed errors. Every message names the node, its op, the offending values and the user's line."""

from __future__ import annotations


class FusegraphError(Exception):
    """Base of every error fusegraph raises on purpose."""


class GraphError(FusegraphError):
    """Graph structure: cycles, unknown tensors, tensors from another graph, missing outputs."""


class ShapeError(FusegraphError):
    """Shapes that do not fit an op: mismatched, not broadcastable, out-of-range axes."""


class DTypeError(FusegraphError):
    """Dtypes an op does not accept, or that do not agree."""


class UnsupportedError(FusegraphError):
    """A valid request fusegraph cannot serve (yet)."""


class InvalidValueError(FusegraphError, ValueError):
    """An attribute or constant value out of range: non-finite or non-positive scales,
    probabilities outside [0, 1], seeds out of range."""


class SettingsError(FusegraphError, ValueError):
    """A setting given a value it cannot take (from the environment or an override)."""


class UnknownSettingError(SettingsError, AttributeError):
    """A setting name that does not exist (also an AttributeError, so hasattr() works)."""


class ExecutionError(FusegraphError):
    """Bad inputs at execute time: missing or extra feeds, wrong shape, dtype or device."""


def where(op: str, name: str, source: str | None) -> str:
    """The standard prefix of an error message: which node, which op, which user line."""
    loc = f" (created at {source})" if source else ""
    return f"node '{name}' (op {op}){loc}"
