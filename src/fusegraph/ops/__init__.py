"""Op definitions. Importing this package registers every op in fusegraph.ir.registry."""

from . import core, norm, pointwise, reduce  # noqa: F401
from .attention import AttentionMethods
from .conv import ConvMethods
from .index_gen import IndexGenMethods
from .layout import LayoutMethods
from .linalg import LinalgMethods
from .loss import LossMethods
from .norm import NormMethods
from .norm_backward import NormBackwardMethods
from .pointwise import PointwiseMethods
from .quant import QuantMethods
from .random import RandomMethods
from .reduce import ReductionMethods
from .scatter import ScatterMethods

OP_METHODS: tuple[type, ...] = (PointwiseMethods, ReductionMethods, NormMethods, LinalgMethods, ConvMethods,
                                AttentionMethods, LayoutMethods)
OP_METHODS += (IndexGenMethods, NormBackwardMethods, LossMethods, RandomMethods, QuantMethods, ScatterMethods)

__all__ = ["OP_METHODS"]
