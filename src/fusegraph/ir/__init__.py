"""The one IR: TensorSpec, Node, Graph, and the op registry."""

from .graph import Graph, PassRecord, map_nodes, topological_order
from .node import Attrs, Node
from .registry import Cost, OpDef, all_ops, define, get_op
from .spec import TensorSpec

__all__ = ["Attrs", "Cost", "Graph", "Node", "OpDef", "PassRecord", "TensorSpec", "all_ops", "define",
           "get_op", "map_nodes", "topological_order"]
