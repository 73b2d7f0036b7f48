"""Compute kernels: Triton for CUDA, a vectorised torch reference for each, one dispatch point (``ops``)."""

from lbd.kernels import ops
from lbd.kernels.metadata import AttentionMetadata

__all__ = ["AttentionMetadata", "ops"]
