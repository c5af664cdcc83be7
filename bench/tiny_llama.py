"""A pretrained model directory as users have them: a tiny Llama written by transformers'
`save_pretrained`, beside a byte-level BPE tokenizer that carries a chat template (ChatML, as Qwen2's
checkpoints ship it, tool turns included). Built offline from the embedded corpus; what
`model.init_from` reads in the fine-tuning tests (through tests/support/pretrained.py) and what the
`sft` benchmark fine-tunes with the engine and with TRL (bench/sft.py). Here, beside the benchmark,
rather than in models/ (models must not import data, whose corpus trains the tokenizer) or tests/."""

from __future__ import annotations

from pathlib import Path

# Qwen2.5's ChatML, less its tool-call formatting: every turn "<|im_start|>role\n...<|im_end|>\n".
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Not the engine's tiny preset (hidden 32, intermediate 64): a directory must decide the architecture.
ARCHITECTURE = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 176,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}


def write_chat_tokenizer(directory: Path, vocab_size: int = 384, template: str | None = CHATML_TEMPLATE) -> Path:
    """A byte-level BPE trained on the embedded corpus, saved as Hugging Face files; `template`
    None leaves the chat template out (a base model's tokenizer)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from data.corpus import DEFAULT_CORPUS

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator([Path(DEFAULT_CORPUS).read_text(encoding="utf-8")], trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None
    )
    if template is not None:
        tokenizer.chat_template = template
    tokenizer.save_pretrained(directory)
    return directory


def write_tiny_llama(directory: Path, seed: int = 0, **overrides: object) -> Path:
    """A transformers-written Llama checkpoint (config.json, model.safetensors) and its chat
    tokenizer in one directory, as `from_pretrained` reads it."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    write_chat_tokenizer(directory)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    config = LlamaConfig(
        **{**ARCHITECTURE, **overrides},
        vocab_size=len(tokenizer),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(directory)
    return directory
