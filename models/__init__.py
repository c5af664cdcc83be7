"""Model families the engine trains: transformers and torchvision models as shipped, and the
engine-specific pieces (presets, loss, evaluation sums, export) beside them."""

from models.registry import FAMILIES, ModelFamily, get_family

__all__ = ["FAMILIES", "ModelFamily", "get_family"]
