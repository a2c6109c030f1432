"""Process groups, meshes, launching and sharded checkpoints."""

from llmtrain.distributed.runtime import Runtime

__all__ = ["Runtime"]
