"""DeepSpeed as the engine's primary backend: ZeRO 0-3, CPU offload, mixed precision,
accumulation, clipping, optimizer and LR schedule all come from `deepspeed.initialize` with the
resolved config; this class only adapts DeepSpeedEngine to the Backend interface."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import deepspeed
import torch
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

from engine.backends.base import Backend


class DeepSpeedBackend(Backend):
    def __init__(self, model: torch.nn.Module, ds_config: dict[str, Any], device: torch.device):
        self._trainable = [name for name, p in model.named_parameters() if p.requires_grad]
        self.engine, _, _, _ = deepspeed.initialize(
            model=model, model_parameters=[p for p in model.parameters() if p.requires_grad], config=ds_config
        )
        self.model = self.engine
        self.device = device
        self._zero_stage = self.engine.zero_optimization_stage()
        self._mixed_precision = self.engine.bfloat16_enabled() or self.engine.fp16_enabled()

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)

    def step(self) -> None:
        self.engine.step()

    def learning_rate(self) -> float:
        return float(self.engine.get_lr()[0])

    def train(self, mode: bool = True) -> None:
        self.engine.train(mode)

    def save(self, checkpoint_dir: Path, tag: str, client_state: dict[str, Any]) -> None:
        self.engine.save_checkpoint(str(checkpoint_dir), tag=tag, client_state=client_state)

    def load(self, checkpoint_dir: Path, tag: str) -> dict[str, Any]:
        path, client_state = self.engine.load_checkpoint(str(checkpoint_dir), tag=tag)
        if path is None:
            raise FileNotFoundError(f"DeepSpeed found no checkpoint {tag!r} in {checkpoint_dir}")
        return client_state or {}

    def consolidated_state_dict(self, checkpoint_dir: Path, tag: str) -> dict[str, torch.Tensor]:
        if self._zero_stage >= 1:
            # ZeRO keeps the fp32 master weights in the optimizer partitions of every rank.
            return get_fp32_state_dict_from_zero_checkpoint(str(checkpoint_dir), tag=tag)
        states = torch.load(checkpoint_dir / tag / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
        weights = {name: t.float() if t.is_floating_point() else t for name, t in states["module"].items()}
        if self._mixed_precision:
            # ZeRO-0 under fp16/bf16: DeepSpeed's fp16-style optimizer holds the fp32 masters in one
            # group, in the order of the parameters handed to deepspeed.initialize.
            masters = states["optimizer"]["fp32_groups"][0]
            weights.update(zip(self._trainable, (master.float() for master in masters), strict=True))
        return weights
