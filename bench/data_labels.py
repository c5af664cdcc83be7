"""How the data benchmark names a corpus size and a rank count: one spelling in its printed lines, its
run folders and its rows, which bench/data.py, bench/data_preparation.py and bench/data_launches.py
all write."""

from __future__ import annotations


def size_label(size_mb: float) -> str:
    return f"{size_mb / 1000:g} GB" if size_mb >= 1000 else f"{size_mb:g} MB"


def ranks_label(count: int) -> str:
    return f"{count} rank" + ("s" if count > 1 else "")
