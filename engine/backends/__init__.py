"""Training backends: each turns (model, config) into something that can run a training step,
evaluate, save and load, so the loop never knows which library is underneath."""

from engine.backends.accelerate_backend import AccelerateBackend
from engine.backends.base import Backend
from engine.backends.deepspeed_backend import DeepSpeedBackend, DeepSpeedEngineBackend
from engine.backends.factory import build_backend
from engine.backends.pipeline_backend import PipelineBackend

__all__ = [
    "AccelerateBackend",
    "Backend",
    "DeepSpeedBackend",
    "DeepSpeedEngineBackend",
    "PipelineBackend",
    "build_backend",
]
