"""What building a run's data gives the engine: the training and validation datasets and what the
model and the export need to know of them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from data.tokenizers import Tokenizer
from data.tokens.external import TokenFile

if TYPE_CHECKING:
    from torch.utils.data import Dataset

    from data.transforms import ImageTransform

SAMPLES = ("tokens", "images")
"""What a sample holds: token ids and their next-token labels, or an image and its class."""


@dataclass
class DataBundle:
    kind: str
    """The data.type that built it: its registry entry (data/kinds/) answers what the planner asks."""
    train: Dataset
    validation: Dataset
    tokenizer: Tokenizer | None
    """Token data only; saved with the export, so generation from it can decode."""
    vocab_size: int | None
    """Token data and synthetic tokens: the size the model's embedding must have."""
    num_classes: int | None
    """Images and synthetic images."""
    token_files: list[TokenFile] = field(default_factory=list)
    """data.type "tokens": the files read, whose ids the model's vocabulary must cover."""
    class_names: list[str] | None = None
    """Images: each label's name; the export's labels, so a prediction names its class."""
    image_transform: ImageTransform | None = None
    """Images: the evaluation transform, saved with the export as a transformers image processor
    so the export preprocesses an image as evaluation did. Synthetic images, already pixels, have none."""
    streamed: bool = False
    """The training set is a stream (data/streaming.py): no length, read after the process group
    knows this rank's place, in the training process."""
    chat_template: str | None = None
    """Chat and instruction data: the Jinja template the conversations were rendered with, which the
    export saves with the tokenizer so that inference formats prompts as training did."""
    sample_prompt: list[int] | None = None
    """Chat and instruction data: the first validation conversation up to its last answer, rendered
    with the assistant's turn opened (data/chat/prompt.py), which the end-of-run sample answers."""
