"""The label no loss is taken on, in a module of its own so that the data, which writes it into
samples, imports no torch to know it."""

IGNORE_INDEX = -100
"""The label every family's loss and evaluation skip (torch's and transformers' default): prompts,
padding, and the samples evaluation repeats to fill its batches (data/loader.make_eval_loader)."""
