"""The DeepSpeed part of the schema, read from DeepSpeed's own pydantic models.

DeepSpeed defines most sections of its config (ZeRO, fp16, bf16, the monitors, comms logging,
compile, the hybrid engine, AutoTP, timers) as pydantic models. Their fields, types, bounds,
documented spellings and deprecated aliases are read here, so the schema follows the installed
DeepSpeed release instead of a copy that drifts; engine/config/schema.py lays the engine's own
defaults and `"auto"` rules over the fields it decides. DeepSpeed's own list of removed keys, with
its messages, is read the same way.

Importing DeepSpeed takes seconds, so the config does not import this module: it reads what
`read_deepspeed` answers for the pinned release from engine/config/deepspeed_facts.json
(engine/config/deepspeed_facts.py), and comes here only for another release or a conversion.
`python -m engine.config.deepspeed_schema` rewrites that file.
"""

from __future__ import annotations

import ast
import enum
import inspect
import json
import textwrap
import types
import typing
from collections.abc import Callable, Iterator
from pathlib import Path, PurePath
from typing import Any, NamedTuple

import deepspeed
import torch
from deepspeed.comm.config import CommsLoggerConfig
from deepspeed.compile.config import CompileConfig
from deepspeed.monitor.config import CometConfig, CSVConfig, TensorBoardConfig, WandbConfig
from deepspeed.runtime import config as deepspeed_runtime_config
from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS, HybridEngineConfig
from deepspeed.runtime.config_utils import DeepSpeedConfigModel
from deepspeed.runtime.precision_config import BFLOAT16, BFLOAT16_OLD, DeepSpeedBF16Config, DeepSpeedFP16Config
from deepspeed.runtime.tensor_parallel.config import TPTrainingConfig
from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
from deepspeed.utils.config import DeepSpeedThroughputTimerConfig
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

# Top-level keys whose value DeepSpeed parses with one of its pydantic models.
MODEL_SECTIONS: dict[str, type[DeepSpeedConfigModel]] = {
    "zero_optimization": DeepSpeedZeroConfig,
    "fp16": DeepSpeedFP16Config,
    "bf16": DeepSpeedBF16Config,
    "tensorboard": TensorBoardConfig,
    "csv_monitor": CSVConfig,
    "wandb": WandbConfig,
    "comet": CometConfig,
    "comms_logger": CommsLoggerConfig,
    "compile": CompileConfig,
    "hybrid_engine": HybridEngineConfig,
    "tensor_parallel": TPTrainingConfig,
}
# `timers` holds one model under `throughput` (deepspeed/utils/config.py get_timers_config).
TIMER_SECTIONS: dict[str, type[DeepSpeedConfigModel]] = {"throughput": DeepSpeedThroughputTimerConfig}


def attribute_docs(model: type[BaseModel]) -> dict[str, str]:
    """The docstring under each field of `model` (and its bases): DeepSpeed documents its fields
    with a string after the assignment, which pydantic does not keep."""
    docs: dict[str, str] = {}
    for cls in reversed(model.__mro__):
        if not (isinstance(cls, type) and issubclass(cls, BaseModel)) or cls is BaseModel:
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for statement, following in zip(body, body[1:], strict=False):
            if (
                isinstance(statement, ast.AnnAssign)
                and isinstance(statement.target, ast.Name)
                and isinstance(following, ast.Expr)
                and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)
            ):
                docs[statement.target.id] = " ".join(following.value.value.split())
    return docs


def spelling(name: str, field: FieldInfo) -> str:
    """The key a config writes for a field: its alias where it has one (DeepSpeed documents
    `stage3_prefetch_bucket_size`, the field is `prefetch_bucket_size`)."""
    return field.alias or name


def deprecated(field: FieldInfo) -> dict | None:
    """DeepSpeed's deprecation record of a field, or None for a current one."""
    extra = field.json_schema_extra
    return extra if isinstance(extra, dict) and extra.get("deprecated") else None


def model_schema(model: type[BaseModel], description: str = "") -> dict:
    """A JSON Schema object for `model`: every current field under its documented spelling, typed
    and bounded as pydantic checks it, described by DeepSpeed's own docstring and default. No
    defaults are written in: an absent key stays absent and DeepSpeed applies its own."""
    docs = attribute_docs(model)
    properties = {}
    for name, field in model.model_fields.items():
        if deprecated(field):
            continue
        schema = annotation_schema(field.annotation)
        schema.update(_bounds(field))
        default = deepspeed_default(field)
        said = docs.get(name, "")
        if said and not said.endswith("."):
            said += "."
        if default is not PydanticUndefined:
            said = f"{said} DeepSpeed's default: {_json_text(default)}.".strip()
        schema["description"] = said or f"DeepSpeed's {spelling(name, field)}."
        properties[spelling(name, field)] = schema
    doc = " ".join((model.__doc__ or "").split())
    return {
        "type": "object",
        "description": description or doc or f"DeepSpeed's {model.__name__}.",
        "properties": properties,
        "additionalProperties": False,
    }


def deepspeed_default(field: FieldInfo) -> Any:
    """A field's default as JSON would write it, or PydanticUndefined where it has none to write."""
    if field.default_factory is not None:
        try:
            value = field.default_factory()
        except TypeError:
            return PydanticUndefined
    else:
        value = field.default
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, BaseModel):
        return PydanticUndefined
    if isinstance(value, (bool, int, float, str, list, dict, type(None))):
        return value
    return PydanticUndefined


def _json_text(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, int):
        return repr(int(value))  # DeepSpeed's pp_int prints with thousands separators
    return repr(value)


def _bounds(field: FieldInfo) -> dict:
    bounds = {}
    for item in field.metadata:
        for attribute, keyword in (
            ("gt", "exclusiveMinimum"),
            ("ge", "minimum"),
            ("lt", "exclusiveMaximum"),
            ("le", "maximum"),
        ):
            if getattr(item, attribute, None) is not None:
                bounds[keyword] = getattr(item, attribute)
    return bounds


def annotation_schema(annotation: Any) -> dict:
    """JSON Schema for a pydantic field annotation, as loose as pydantic's own parsing is."""
    origin = typing.get_origin(annotation)
    arguments = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        options = [annotation_schema(argument) for argument in arguments]
        return {"anyOf": options}
    if origin is typing.Literal:
        return {"enum": list(arguments)}
    if origin in (list, tuple, set) or annotation in (list, tuple, set):
        items = annotation_schema(arguments[0]) if arguments and arguments[0] is not Ellipsis else {}
        return {"type": "array", "items": items} if items else {"type": "array"}
    if origin is dict or annotation is dict:
        return {"type": "object"}
    if annotation is type(None):
        return {"type": "null"}
    if isinstance(annotation, type):
        if issubclass(annotation, BaseModel):
            return model_schema(annotation)
        if issubclass(annotation, enum.Enum):
            return {"enum": [member.value for member in annotation]}
        simple = {bool: "boolean", int: "integer", float: "number", str: "string"}
        for python_type, json_type in simple.items():
            if issubclass(annotation, python_type):
                return {"type": json_type}
        if issubclass(annotation, PurePath):
            return {"type": "string"}
    if annotation is torch.dtype:
        return {"type": "string"}
    return {}


# ---------------------------------------------------------------------------------------------
# Spellings DeepSpeed reads as other keys
# ---------------------------------------------------------------------------------------------


class _Alias(NamedTuple):
    """A key DeepSpeed reads as another: `new` is the current key beside it (None where DeepSpeed
    ignores the old one), `convert` turns the old value into the new one's. engine/config/
    deepspeed_facts.py keeps all but `convert`, which stays here with DeepSpeed."""

    section: tuple[str, ...]
    old: str
    new: str | None
    convert: Callable[[Any], Any] | None = None
    deprecated: bool = True


def _model_aliases(model: type[BaseModel], section: tuple[str, ...]) -> Iterator[_Alias]:
    for name, field in model.model_fields.items():
        record = deprecated(field)
        if record:
            new = record.get("new_param") if record.get("set_new_param", True) else None
            if new in model.model_fields:
                new = spelling(new, model.model_fields[new])
            yield _Alias(section, name, new, record.get("new_param_fn"))
        elif field.alias and field.alias != name:
            yield _Alias(section, name, field.alias, deprecated=False)
        nested = field.annotation
        for candidate in (nested, *typing.get_args(nested)):
            if isinstance(candidate, type) and issubclass(candidate, BaseModel):
                yield from _model_aliases(candidate, (*section, spelling(name, field)))


def _aliases() -> list[_Alias]:
    """Every alias DeepSpeed's models declare, plus the top-level `bfloat16` (DeepSpeed reads it
    where `bf16` is absent, deepspeed/runtime/precision_config.py) and `aio.thread_count`, the older
    name of `intra_op_parallelism` that DeepSpeed 0.19.8 no longer reads (runtime/swap_tensor/
    aio_config.py): written by the documents, silently ignored there, read here as its successor."""
    found = [_Alias((), BFLOAT16_OLD, BFLOAT16), _Alias(("aio",), "thread_count", "intra_op_parallelism")]
    for key, model in MODEL_SECTIONS.items():
        found.extend(_model_aliases(model, (key,)))
    for key, model in TIMER_SECTIONS.items():
        found.extend(_model_aliases(model, ("timers", key)))
    return found


def convert(section: tuple[str, ...], old: str, value: Any) -> Any:
    """The value the key that replaces `old` in `section` takes, as DeepSpeed converts it (a model
    turned back into JSON)."""
    function = next(alias.convert for alias in _aliases() if alias.section == tuple(section) and alias.old == old)
    if function is None:
        return value
    value = function(value)
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json", exclude_unset=True, by_alias=True)
    return value


# ---------------------------------------------------------------------------------------------
# Keys DeepSpeed removed, with DeepSpeed's reasons
# ---------------------------------------------------------------------------------------------


def removed_keys() -> dict[tuple[str, ...], str]:
    """Path of each key DeepSpeed refuses as removed, and DeepSpeed's message for it."""
    removed = {(key,): message for key, message in deepspeed_runtime_config._REMOVED_TOP_LEVEL_CONFIG_KEYS.items()}
    for key, message in deepspeed_runtime_config._REMOVED_ZERO_CONFIG_KEYS.items():
        removed[("zero_optimization", key)] = message
    return removed


# ---------------------------------------------------------------------------------------------
# What the config reads without importing DeepSpeed
# ---------------------------------------------------------------------------------------------


def read_deepspeed() -> dict:
    """Everything the config takes from the installed DeepSpeed, as JSON: its version, the schema of
    each section it parses with a model, its aliases, its removed keys and its optimizer names."""
    return {
        "version": deepspeed.__version__,
        "sections": {key: model_schema(model) for key, model in MODEL_SECTIONS.items()},
        "timers": {key: model_schema(model) for key, model in TIMER_SECTIONS.items()},
        "aliases": [
            {
                "section": list(alias.section),
                "old": alias.old,
                "new": alias.new,
                "converts": alias.convert is not None,
                "deprecated": alias.deprecated,
            }
            for alias in _aliases()
        ],
        "removed": [{"path": list(path), "message": message} for path, message in removed_keys().items()],
        "optimizers": list(DEEPSPEED_OPTIMIZERS),
    }


def facts_text() -> str:
    """engine/config/deepspeed_facts.json as `read_deepspeed` answers now."""
    return json.dumps(read_deepspeed(), indent=1) + "\n"


if __name__ == "__main__":
    facts = Path(__file__).with_name("deepspeed_facts.json")
    facts.write_text(facts_text())
    print(f"wrote {facts}")
