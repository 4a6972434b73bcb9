"""The partitioner: groups a primitive graph into kernels by iteration space."""

from .partition import Domain, KernelGroup, Partition, partition_graph

__all__ = ["Domain", "KernelGroup", "Partition", "partition_graph"]
