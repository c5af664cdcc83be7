"""What a `model.init_from` directory decides, as transformers' `from_pretrained` lets it: the
architecture from its config.json alone, and the tokenizer from its tokenizer files.

It is applied to the config as the user wrote it (the file and its `--set` overrides), before the
schema's defaults and the presets fill the model section, because only there can a field the user
wrote be told from one a preset would supply: a preset gives way to the directory, and a field the
user wrote that disagrees with it is refused, naming both values. config.json is read with `json`
alone: no weights, and no transformers import for `validate` and `plan`.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from engine.config.errors import ConfigError, ConfigIssue
from engine.config.schema import AUTO
from engine.config.validate import schema_issues
from models import ModelFamily, get_family

CONFIG_FILE = "config.json"
# The files AutoTokenizer builds a tokenizer from; config.json alone is no tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def apply_pretrained(document: dict, absent_ok: bool = False) -> dict:
    """A schema-valid `document` with the model-section fields its `model.init_from` directory
    decides written in, and `data.tokenizer` the directory where it holds a tokenizer and the user
    named none; the document itself where no directory decides. ConfigError naming every problem:
    no architecture at all (neither a preset nor such a directory), a directory that is no
    checkpoint of the family, a written field that disagrees with it. `absent_ok` (`plan`, before
    the weights are downloaded): a directory that is not there gives way to a written preset."""
    model = document["model"]
    family = get_family(model["family"])
    init_from = model.get("init_from")
    if init_from is None or family.pretrained_fields is None:
        if "preset" not in model:
            raise ConfigError([ConfigIssue("model.preset", _no_preset(family))])
        return document
    directory = Path(init_from)
    if absent_ok and "preset" in model and not directory.exists():
        return document
    fields = _pretrained_fields(family, directory)
    config_file = directory / CONFIG_FILE
    disagreements = [
        ConfigIssue(
            f"model.{key}",
            f"is {_shown(model[key])} but model.init_from {config_file} has {_shown(value)}; remove it or set "
            f"{_shown(value)}",
        )
        for key, value in fields.items()
        if _written(model.get(key)) and model[key] != value
    ]
    if disagreements:
        raise ConfigError(disagreements)
    adopted = copy.deepcopy(document)
    adopted["model"].update(fields)
    data = adopted.setdefault("data", {})
    if "tokenizer" not in data and any((directory / name).is_file() for name in TOKENIZER_FILES):
        # Its chat template, special tokens and vocabulary come with it, as they do for from_pretrained users.
        data["tokenizer"] = init_from
    # config.json's values held to the schema as the user's are: a broken file stops here, naming itself.
    issues = schema_issues(adopted)
    if issues:
        raise ConfigError(ConfigIssue(issue.path, f"{issue.message} (read from {config_file})") for issue in issues)
    return adopted


def _no_preset(family: ModelFamily) -> str:
    if family.pretrained_fields is None:
        return f"is required: name one of the {family.name} presets ({', '.join(family.presets)})"
    return (
        f"is required: name one of the {family.name} presets ({', '.join(family.presets)}), or set model.init_from "
        "to a pretrained directory, whose config.json then decides the architecture"
    )


def _pretrained_fields(family: ModelFamily, directory: Path) -> dict[str, Any]:
    """The fields `directory`'s config.json decides for `family`; ConfigError on model.init_from
    saying why there are none."""

    def refused(problem: str) -> ConfigError:
        return ConfigError([ConfigIssue("model.init_from", problem)])

    if not directory.exists():
        raise refused(f"{str(directory)!r} does not exist")
    config_file = directory / CONFIG_FILE
    if not config_file.is_file():
        raise refused(
            f"{directory} is not a transformers checkpoint: it holds no {CONFIG_FILE}, which save_pretrained writes "
            "beside the weights"
        )
    try:
        saved = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise refused(f"{config_file} cannot be read as JSON ({error})") from None
    if not isinstance(saved, dict):
        raise refused(f"{config_file} holds no JSON object")
    try:
        return family.pretrained_fields(saved)
    except ValueError as error:
        raise refused(f"{directory} {error}") from None


def _written(value: Any) -> bool:
    """Whether the user pinned a field: null, as in the presets, and "auto" leave it to the directory."""
    return value is not None and value != AUTO


def _shown(value: Any) -> str:
    return json.dumps(value)
