"""`python -m bench.nanogpt --config configs/shakespeare_char.json --steps 2000 --out F`: nanoGPT's own
model and training loop (karpathy/nanoGPT model.py and train.py, restated) on benchmark 3's recipe,
validated exactly as the engine validates.

Benchmark 3's loss goal (1.89) is nanoGPT's published figure for this recipe, estimated there from
20 random validation batches. This calibrates the goal: the engine and its PyTorch loop train
transformers' GPT-2 (with biases), while nanoGPT trains its own model (no biases, windows drawn
at random offsets with replacement); both decay the matrices only. If nanoGPT itself
does not reach the goal on the whole validation split, the goal's figure came from its noisier
estimate, not from a better recipe.

The recipe's numbers (sizes, batch, optimizer, warm-up, floor of the cosine, clipping, split) are
read from the engine's config as the engine resolves it, so the two cannot drift apart.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ConfigError, load_config
from engine.launch.hardware import detect_hardware


class LayerNorm(nn.Module):
    """nanoGPT's bias-free LayerNorm (torch's had no `bias=False` when nanoGPT was written)."""

    def __init__(self, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, None, 1e-5)


class Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = LayerNorm(width), LayerNorm(width)
        self.c_attn, self.attn_proj = nn.Linear(width, 3 * width, bias=False), nn.Linear(width, width, bias=False)
        self.c_fc, self.mlp_proj = nn.Linear(width, 4 * width, bias=False), nn.Linear(4 * width, width, bias=False)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = (
            t.view(batch, length, self.heads, width // self.heads).transpose(1, 2)
            for t in self.c_attn(x).split(width, dim=2)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.attn_proj(y.transpose(1, 2).contiguous().view(batch, length, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.ln_1(x))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class GPT(nn.Module):
    """nanoGPT's GPT with bias=False: tied embedding and head, N(0, 0.02) weights, residual
    projections at 0.02 / sqrt(2 * layers)."""

    def __init__(self, vocab: int, context: int, layers: int, heads: int, width: int):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(context, width)
        self.h = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.wte.weight = self.lm_head.weight
        for name, parameter in self.named_parameters():
            if parameter.dim() == 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith("_proj.weight") else 0.02
                nn.init.normal_(parameter, 0.0, std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def learning_rate(step: int, peak: float, floor: float, warmup: int, total: int) -> float:
    """nanoGPT's `get_lr`: linear warm-up from (1 / (warmup + 1)) * peak, then a cosine to `floor`."""
    if step < warmup:
        return peak * (step + 1) / (warmup + 1)
    progress = (step - warmup) / max(1, total - warmup)
    return floor + 0.5 * (1.0 + math.cos(math.pi * progress)) * (peak - floor)


def train(recipe: dict[str, Any], text: str, steps: int, seed: int, samples: int) -> dict[str, float]:
    """nanoGPT's loop for `steps` steps; then the engine's validation: the mean next-character loss
    over the split's first `samples` samples as the engine cuts them (seq_len inputs every seq_len
    characters, each with the character after it as target)."""
    torch.manual_seed(seed)
    vocabulary = {char: index for index, char in enumerate(sorted(set(text)))}
    data = torch.tensor([vocabulary[char] for char in text], dtype=torch.long)
    split = int((1 - recipe["data"]["validation_fraction"]) * len(data))
    train_data, validation = data[:split], data[split:]
    arch, context, batch = recipe["model"], recipe["data"]["seq_len"], recipe["train_micro_batch_size_per_gpu"]
    model = GPT(len(vocabulary), context, arch["n_layer"], arch["n_head"], arch["n_embd"])
    params = recipe["optimizer"]["params"]
    schedule = recipe["scheduler"]["params"]
    decayed = [p for p in model.parameters() if p.dim() >= 2]
    gains = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decayed, "weight_decay": params["weight_decay"]}, {"params": gains, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=params["lr"], betas=tuple(params["betas"]), eps=params["eps"])
    peak, floor = params["lr"], params["lr"] * schedule["cos_min_ratio"]
    started = time.perf_counter()
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, peak, floor, schedule["warmup_num_steps"], steps)
        offsets = torch.randint(len(train_data) - context, (batch,))
        x = torch.stack([train_data[i : i + context] for i in offsets])
        y = torch.stack([train_data[i + 1 : i + 1 + context] for i in offsets])
        loss = F.cross_entropy(model(x).view(-1, len(vocabulary)), y.view(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), recipe["gradient_clipping"])
        optimizer.step()
    seconds_per_step = (time.perf_counter() - started) / steps
    model.eval()
    with torch.no_grad():
        windows = validation.unfold(0, context + 1, context)[:samples]
        logits = model(windows[:, :-1])
        eval_loss = F.cross_entropy(logits.reshape(-1, len(vocabulary)), windows[:, 1:].reshape(-1)).item()
    return {"eval_loss": eval_loss, "seconds_per_step": seconds_per_step}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, required=True, help="the engine config whose recipe nanoGPT follows")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--seed", type=int, default=1337, help="nanoGPT's default seed")
    parser.add_argument("--samples", type=int, required=True, help="validation samples the engine evaluates")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    try:
        config = load_config(args.config, [], world_size=1, hardware=detect_hardware(local_world_size=1))
    except ConfigError as error:
        parser.exit(2, f"{error}\n")
    recipe = config.document  # the engine's defaults filled in, as the engine trains it
    path = recipe["data"]["path"]  # relative to the working directory, as the engine reads it
    corpus = Path(path) if isinstance(path, str) else None
    if corpus is None or not corpus.is_file():
        parser.error(f"{args.config}: data.path {path!r} is not one text file, which is what nanoGPT trains on")
    torch.set_num_threads(args.threads)
    text = corpus.read_text()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(train(recipe, text, args.steps, args.seed, args.samples), indent=1) + "\n")


if __name__ == "__main__":
    main()
