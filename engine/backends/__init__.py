"""Training backends: each turns (model, config) into something that can forward, backward,
step, save and load, so the loop never knows which library is underneath."""

from engine.backends.base import Backend
from engine.backends.deepspeed_backend import DeepSpeedBackend

__all__ = ["Backend", "DeepSpeedBackend"]
