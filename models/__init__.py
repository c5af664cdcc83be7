"""Model families the engine trains: transformers and torchvision models as shipped, and the
engine-specific pieces (presets, loss, evaluation sums, export) beside them."""

from models.module_state import count_parameters
from models.registry import FAMILIES, ModelFamily, get_family

__all__ = ["FAMILIES", "ModelFamily", "count_parameters", "get_family"]
