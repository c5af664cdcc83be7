"""The tiny pretrained Llama the fine-tuning tests read through `model.init_from`: written by
bench/tiny_llama.py, which the `sft` benchmark uses too (bench/sft.py)."""

from bench.tiny_llama import ARCHITECTURE, CHATML_TEMPLATE, SPECIAL_TOKENS, write_chat_tokenizer, write_tiny_llama

__all__ = ["ARCHITECTURE", "CHATML_TEMPLATE", "SPECIAL_TOKENS", "write_chat_tokenizer", "write_tiny_llama"]
