"""Starting a job: which launcher started us, DeepSpeed hostfiles and the ssh pre-flight, the
environment every rank must see, and what the machine can do (`hardware`). Light on purpose:
submodules import what they need."""
