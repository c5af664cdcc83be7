"""Which kinds of data (`data.type`) each model family trains on: one table, read by the config rules
(before anything loads) and by the data builders."""

DATA_TYPES_BY_FAMILY: dict[str, tuple[str, ...]] = {
    "gpt": ("text", "tokens", "synthetic"),
    "resnet": ("image", "synthetic"),
}
