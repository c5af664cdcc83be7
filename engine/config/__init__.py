"""Config loading, validation and resolution; see engine/config/schema.py for the keys."""

from engine.config.errors import ConfigError, ConfigIssue
from engine.config.load import load_config
from engine.config.resolve import EngineConfig

__all__ = ["ConfigError", "ConfigIssue", "EngineConfig", "load_config"]
