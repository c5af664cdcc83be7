"""Parallelism mechanisms applied to a built model, below both models/ and engine/: the families
name what splits (their tensor-parallel plans), the engine decides the degrees and the process
groups, and both import the mechanism from here. It imports neither of them, nor data/."""
