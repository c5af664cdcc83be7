"""Token files: a text corpus tokenized once and cached (prepare), the prepared format every rank
memory-maps (files), and token files other tools wrote (external, blend)."""
