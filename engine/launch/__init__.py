"""Starting a job: which launcher started us, DeepSpeed hostfiles and the ssh pre-flight, and the
environment every rank must see. Light on purpose: submodules import what they need."""
