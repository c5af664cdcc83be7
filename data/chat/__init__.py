"""Conversations for fine-tuning: records read and checked (records.py), rendered with a chat
template into token ids and a loss mask (render.py), tokenized once into the token cache
(prepare.py), and served one conversation per sample or packed into windows (samples.py)."""
