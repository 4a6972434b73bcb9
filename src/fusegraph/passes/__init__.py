"""Graph passes: each a pure, named Graph -> Graph function."""

from .base import Pass, graph_pass
from .pipeline import PIPELINE, optimize

__all__ = ["PIPELINE", "Pass", "graph_pass", "optimize"]
