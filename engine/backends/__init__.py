"""Training backends: each turns (model, config) into something that can run a training step,
evaluate, save and load, so the loop never knows which library is underneath. The accelerate
backend is imported by `build_backend` when a run asks for it."""

from engine.backends.base import Backend
from engine.backends.deepspeed_backend import DeepSpeedBackend, DeepSpeedEngineBackend
from engine.backends.factory import build_backend
from engine.backends.pipeline_backend import PipelineBackend

__all__ = [
    "Backend",
    "DeepSpeedBackend",
    "DeepSpeedEngineBackend",
    "PipelineBackend",
    "build_backend",
]
