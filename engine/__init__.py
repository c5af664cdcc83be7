"""A config-driven distributed training engine: one JSON file decides the model, data, batch
arithmetic, ZeRO stage, offload, precision, checkpoints and logging."""

import os

# Training never reaches a hub: data, tokenizers and weights are local by design, and a stray
# download attempt on a cluster node without internet would hang until a network timeout.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
