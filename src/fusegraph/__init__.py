"""fusegraph: a deep-learning graph compiler for NVIDIA GPUs."""

from .api import Graph, Tensor
from .compile_api import compile, explain
from .errors import (
                     DTypeError,
                     ExecutionError,
                     FusegraphError,
                     GraphError,
                     InvalidValueError,
                     ShapeError,
                     UnsupportedError,
)
from .reference import reference

__version__ = "0.1.0"

__all__ = ["DTypeError", "ExecutionError", "FusegraphError", "Graph", "GraphError", "InvalidValueError",
           "ShapeError",
           "Tensor", "UnsupportedError", "__version__", "compile", "explain", "reference"]
