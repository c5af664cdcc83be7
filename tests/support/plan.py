"""The config and GPT-2 124M's shape the planner's tests share (tests/unit/test_plan.py and
tests/launched/test_plan_launched.py)."""

GPT2 = "configs/gpt2_124m.json"
HIDDEN, LAYERS, VOCAB, POSITIONS = 768, 12, 50257, 1024
