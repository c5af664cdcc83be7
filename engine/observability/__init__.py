"""What a run shows about itself: metrics and their sinks, plots, FLOPs and MFU, memory per rank,
step phases and per-rank logs. Reads the backend only through the Backend contract's declared
capabilities, and never imports engine.backends (docs/design/code-layout.md, "Code layout and import rules")."""
