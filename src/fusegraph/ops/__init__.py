"""Op definitions. Importing this package registers every op in fusegraph.ir.registry."""

from . import core, norm, pointwise, reduce  # noqa: F401
from .attention import AttentionMethods
from .conv import ConvMethods
from .layout import LayoutMethods
from .linalg import LinalgMethods
from .norm import NormMethods
from .pointwise import PointwiseMethods
from .reduce import ReductionMethods

OP_METHODS: tuple[type, ...] = (PointwiseMethods, ReductionMethods, NormMethods, LinalgMethods, ConvMethods,
                                AttentionMethods, LayoutMethods)

__all__ = ["OP_METHODS"]
