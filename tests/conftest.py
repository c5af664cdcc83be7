"""Shared test set-up: GPU-marked tests skip where no CUDA device exists; nothing else skips. A
session that will run the NVMe tests builds DeepSpeed's async_io op in the background from its start
(tests/support/background_build.py)."""

import pytest
import torch

_NVME_TESTS = "tests/launched/test_nvme_offload.py"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="session")
def async_io_build(request, tmp_path_factory):
    """The async_io op's build, started with the session where an NVMe test is selected."""
    from tests.support.background_build import start_build, stop_build

    selected = any(item.nodeid.startswith(_NVME_TESTS) for item in request.session.items)
    process = start_build(tmp_path_factory.mktemp("async_io_build") / "build.log") if selected else None
    yield
    if process is not None:
        stop_build(process)


@pytest.fixture(autouse=True, scope="session")
def token_cache(tmp_path_factory):
    """One token cache for the session, outside ~/.cache: launched ranks inherit the variable, so a
    corpus the suite tokenizes once is reused by every later test, as a user's launches reuse it."""
    import os

    from data.tokens.cache import CACHE_ENV

    path = tmp_path_factory.mktemp("token-cache")
    previous = os.environ.get(CACHE_ENV)
    os.environ[CACHE_ENV] = str(path)
    yield path
    if previous is None:
        os.environ.pop(CACHE_ENV)
    else:
        os.environ[CACHE_ENV] = previous


@pytest.fixture(scope="session")
def hf_tokenizer_dir(tmp_path_factory):
    """A small byte-level BPE tokenizer (GPT-2's pre-tokenizer) trained on the spot, saved as Hugging
    Face files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    text = "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n"
    backend.train_from_iterator([text] * 20, trainer)
    directory = tmp_path_factory.mktemp("hf_tokenizer")
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>").save_pretrained(directory)
    return directory
