"""Training backends: each turns (model, `base.BackendSettings`) into something that can run a
training step, evaluate, save and load, so the loop never knows which library is underneath
(`base.Backend`). Light on purpose: import the submodule you need (`factory.build_backend` builds
one), so that `backends.optim` does not bring DeepSpeed's engine with it."""
