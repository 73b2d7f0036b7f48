"""Compute kernels: Triton for CUDA, a vectorised torch reference for each, one dispatch point (``ops``)."""

from kernels import ops
from kernels.metadata import AttentionMetadata

__all__ = ["AttentionMetadata", "ops"]
