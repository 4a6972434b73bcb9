"""Op definitions. Importing this package registers every op in fusegraph.ir.registry."""

from . import core, norm, pointwise, reduce  # noqa: F401
from .norm import NormMethods
from .pointwise import PointwiseMethods
from .reduce import ReductionMethods

OP_METHODS: tuple[type, ...] = (PointwiseMethods, ReductionMethods, NormMethods)

__all__ = ["OP_METHODS"]
