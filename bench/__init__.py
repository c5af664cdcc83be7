"""Benchmarks that run the engine side by side with a minimal baseline (`python -m bench`).

Speed and memory are measured here, never in timed unit tests: a shared machine's noise makes a
timed test flaky, while a benchmark can pair both sides in one process, window by window
(bench/paired.py), and report the median of their ratios next to its goal. Each benchmark is one
module returning a `Result`; the harness (`bench/__main__.py`) runs the ones asked for and
rewrites docs/benchmarks.md.
"""
