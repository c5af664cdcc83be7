"""Checkpoints: where they live and how one is published and resumed (`store`), the layout each
records and which resumes must convert (`layout`), and the conversions through DeepSpeed's
universal form (`universal` for DeepSpeed's ZeRO checkpoints, `from_torch` for the accelerate
backend's and fp32 ZeRO-0's, `to_torch` for the accelerate backend resuming a universal one).
Imports nothing itself, so each part costs only what it uses."""
