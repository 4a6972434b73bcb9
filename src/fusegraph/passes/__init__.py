"""Graph passes: each a pure, named Graph -> Graph function."""

from .base import Pass, graph_pass
from .cse import cse
from .dce import dce
from .decompose import decompose
from .fold import fold
from .pipeline import PIPELINE, optimize
from .simplify import simplify

__all__ = ["PIPELINE", "Pass", "cse", "dce", "decompose", "fold", "graph_pass", "optimize", "simplify"]
