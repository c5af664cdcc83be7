"""model.kernels "liger": Liger-Kernel's Triton kernels in the Llama family's decoders on CUDA.

Liger replaces RMSNorm, the SwiGLU MLP and the rotary embedding with fused Triton kernels (its
`_apply_liger_kernel_to_instance`, which picks the replacements by the model's `model_type`:
Llama, Qwen2 and Mistral alike). The loss is left to `model.loss`, whose "fused" choice is Liger's
fused linear cross-entropy where it runs (models/tiling.py): one key per decision.

liger-kernel is optional: the engine runs without it, and a config asking for it where it cannot
run (no CUDA device, or the package missing) is refused before launch (engine/config/rules.py).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

LIGER = "liger"


def liger_installed() -> bool:
    return importlib.util.find_spec("liger_kernel") is not None


def apply_kernels(model: nn.Module, section: Mapping[str, Any]) -> None:
    """Swap in the kernels `model.kernels` names, in place; parameter names stay as they are."""
    if section.get("kernels", "none") != LIGER:
        return
    from liger_kernel.transformers.monkey_patch import _apply_liger_kernel_to_instance

    _apply_liger_kernel_to_instance(
        model=model, rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=False
    )
