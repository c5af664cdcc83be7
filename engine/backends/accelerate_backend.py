"""accelerate as the fallback backend: plain DDP and FSDP from the same DeepSpeed-shaped config.

`zero_optimization.stage` picks the wrapper, so one config means the same layout under both
backends: 0 is DDP (accelerate's `prepare_model`), 2 and 3 are torch FSDP2 `fully_shard` (one unit
per block plus the root; parameters, gradients and optimizer states sharded between steps), and
only 3 reshards parameters after the forward, so 2 holds a block's full parameters from its forward
to its backward as ZeRO-2 holds them through the step; either offload key moves parameters,
gradients and the optimizer step to the CPU (`CPUOffloadPolicy`). FSDP is applied with torch's own
API rather than accelerate's plugin because the plugin does not shard on CPU: FSDP2 silently
degrades to DDP there and FSDP1 fails looking for a device. Optimizer and schedule come from the
same DeepSpeed keys (`engine/backends/optim.py`); checkpoints are torch distributed checkpoints in the same
`checkpoints/stepNNNNNNNN` + `latest` layout as DeepSpeed's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from accelerate import Accelerator
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from engine.backends.base import Backend, BackendSettings, Batch, to_device
from engine.backends.optim import (
    build_optimizer,
    build_scheduler,
    group_settings,
    parameter_groups,
    restore_group_settings,
)
from engine.backends.token_mean import TargetCount
from engine.checkpoints.from_torch import ENGINE_STATE
from engine.checkpoints.to_torch import FullState, full_state, progress
from engine.checkpoints.universal import canonical_names, save_names
from engine.observability.memory import ModelStateTensors, StepWatch, optimizer_state_tensors
from engine.parallel.consolidate import tensor_names
from models import ModelFamily
from models.module_state import persistent_buffers


def local_parameter_elements(model: torch.nn.Module) -> int:
    """Elements of the parameters this rank holds: its shard of a sharded parameter."""
    return sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())


class AccelerateBackend(Backend):
    def __init__(self, model: torch.nn.Module, settings: BackendSettings):
        document, family, device = settings.deepspeed_config, settings.family, settings.device
        self.family, self.device, self.hooks = family, device, settings.hooks
        self.wrapper = settings.accelerate_wrapper
        self._accumulation = settings.batch.gradient_accumulation_steps
        if settings.masked_labels:
            # DDP and FSDP2 average gradients over every rank, as the divisor assumes.
            self.target_count = TargetCount(self._accumulation, dist.get_world_size(), None)
        self._clipping = document["gradient_clipping"]
        self._autocast_dtype = torch.bfloat16 if settings.precision == "bf16" else None
        self.accelerator = Accelerator(cpu=device.type == "cpu")
        # Compiled block by block before this wrapping, by the family's `parallelize` step.
        self.compiled = settings.compile
        if self.wrapper == "ddp":
            self.model = self.accelerator.prepare_model(model)
        else:
            full = self.wrapper == "fsdp_full"
            self.model = _fully_shard(model, family, device, reshard=full, offload=settings.offloads)
        # torch's fused kernel where the resolved config says (optimizer.params.fused: on a GPU, nothing offloaded).
        self.optimizer = build_optimizer(
            document["optimizer"],
            parameter_groups(self.model.parameters(), document["optimizer"], settings.weight_decay_on),
        )
        self.scheduler = build_scheduler(document.get("scheduler"), self.optimizer)
        self._skipped = 0
        self._skips_nonfinite = settings.nonfinite == "skip"
        self._norm: torch.Tensor | None = None
        self._check_wrapper()
        # trainer.async_save: torch's writer thread agrees on its plan over a gloo group of its own,
        # beside the training's collectives on the default group.
        self._save_group = dist.new_group(backend="gloo") if settings.async_save else None
        self._upload: Future | None = None
        self.state_watch = StepWatch(
            self.optimizer,
            lambda: [p.grad for p in self.model.parameters()],
            self.model_state_tensors,
            lambda: self.timing,
        )

    def model_state_tensors(self) -> ModelStateTensors:
        """The parameters (FSDP2: this rank's DTensor shards) and the torch optimizer's state."""
        return ModelStateTensors(list(self.model.parameters()), optimizer_state_tensors(self.optimizer))

    def _check_wrapper(self) -> None:
        """Refuse to train in a layout other than the one asked for (never a silent fallback)."""
        world = dist.get_world_size()
        if self.accelerator.num_processes != world:
            raise RuntimeError(f"accelerate sees {self.accelerator.num_processes} process(es), torch {world}")
        wrapped = (
            isinstance(self.model, FSDPModule)
            if self.wrapper != "ddp"
            else (world == 1 or isinstance(self.model, DistributedDataParallel))
        )
        if not wrapped:
            raise RuntimeError(f"the model is a {type(self.model).__name__}, not the {self.wrapper} asked for")

    def describe(self) -> str:
        # On the accelerator's device: NCCL gathers device tensors only.
        counts = torch.tensor([local_parameter_elements(self.model)], dtype=torch.long, device=self.accelerator.device)
        gathered = [torch.zeros_like(counts) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, counts)
        total = sum(p.numel() for p in self.model.parameters())  # a DTensor counts its global size
        return (
            f"accelerate backend: {self.wrapper} on {dist.get_world_size()} process(es); parameter elements per "
            f"rank: {[int(count) for count in gathered]} of {total}"
        )

    def _gradient_sync(self, sync: bool) -> contextlib.AbstractContextManager:
        """Gradients are reduced on the last micro-batch of a step only."""
        if isinstance(self.model, FSDPModule):
            self.model.set_requires_gradient_sync(sync)
            return contextlib.nullcontext()
        if sync or not isinstance(self.model, DistributedDataParallel):
            return contextlib.nullcontext()
        return self.model.no_sync()

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self._autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self._autocast_dtype)

    def _train_step(self, batches: Iterator[Batch]) -> torch.Tensor:
        self.model.train()
        loss_sum = torch.zeros((), device=self.device)
        micro_batches, divisor = self.micro_batches(batches, self._accumulation)
        for micro_step in range(self._accumulation):
            with self.phase("data"):
                batch = next(micro_batches)
            with self._gradient_sync(micro_step == self._accumulation - 1):
                with self.phase("forward"), self._autocast():
                    loss = self.hooks.on_loss(self.family.compute_loss(self.model, batch, divisor))
                with self.phase("backward"):
                    (loss / self._accumulation).backward()
            loss_sum += loss.detach().float()
        with self.phase("step"):
            self._norm = self._gradient_norm()
            # Under "skip", the test DeepSpeed's optimizers make, at the same cost (a host sync per
            # step): a NaN/inf gradient never reaches the weights, the optimizer's moments or the LR
            # schedule. Under "stop" the step goes ahead and the loop reads `nonfinite_gradients`
            # before anything of it is saved.
            if not self._skips_nonfinite or torch.isfinite(self._norm):
                self.optimizer.step()
                if self.scheduler is not None:
                    self.scheduler.step()
            else:
                self._skipped += 1
            self.optimizer.zero_grad(set_to_none=True)
        return loss_sum / self._accumulation

    def grad_norm(self) -> float | None:
        return None if self._norm is None else float(self._norm)

    def nonfinite_gradients(self) -> torch.Tensor | None:
        return None if self._norm is None else ~torch.isfinite(self._norm)

    def _gradient_norm(self) -> torch.Tensor:
        """The gradients' global norm, clipping them to gradient_clipping on the way when that is set.

        Every rank gets the same value without another collective: DDP has already all-reduced the
        gradients, and FSDP's norm of sharded gradients is reduced over the shards (`full_tensor`)."""
        if self._clipping > 0:
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self._clipping)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in self.model.parameters() if p.grad is not None])
        return norm.full_tensor() if isinstance(norm, DTensor) else norm

    def eval_sums(self, batches: Iterable[Batch]) -> dict[str, torch.Tensor]:
        self.model.eval()
        totals: dict[str, torch.Tensor] = {}
        with torch.no_grad(), self._autocast():
            for batch in batches:
                sums = self.family.eval_sums(self.model, to_device(batch, self.device, torch.float32))
                for key, value in sums.items():
                    totals[key] = totals.get(key, 0) + value.detach().double()
        self.model.train()
        return totals

    def learning_rate(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def skipped_steps(self) -> int:
        return self._skipped

    def loss_scale(self) -> float | None:
        return None  # fp16 is refused on this backend (engine/config/rules.py)

    def save(self, checkpoint_dir: Path, tag: str, client_state: dict[str, Any]) -> None:
        """torch distributed checkpoint's files, or under trainer.async_save its `async_save`: the
        state copied to host memory here, written by torch's thread (`writes_done`). Its thread
        mode, not its process mode: the launchers' SIGTERM reaches a rank's children, and torch's
        checkpoint process would die of it in the middle of the save the signal asks for."""
        path = checkpoint_dir / tag
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer, options=self._checkpointed())
        state = {"model": model_state, "optimizer": optimizer_state}
        if self._save_group is None:
            dcp.save(state, checkpoint_id=str(path))
        else:
            path.mkdir(parents=True, exist_ok=True)
            self._upload = dcp.async_save(state, checkpoint_id=str(path), process_group=self._save_group)
            self.hooks.during_write(client_state["step"])
        # Lets a resume under DeepSpeed find each parameter by the unsplit model's name (a tied weight's too).
        module = self._unwrapped()
        save_names(path, dist.get_rank(), canonical_names(module, tensor_names(module)))
        if dist.get_rank() == 0:
            scheduler = self.scheduler.state_dict() if self.scheduler is not None else None
            torch.save({"client_state": client_state, "scheduler": scheduler}, path / ENGINE_STATE)

    def writes_done(self) -> bool:
        if self._upload is None or not self._upload.done():
            return self._upload is None
        self.wait_for_writes()  # raises a failed write
        return True

    def wait_for_writes(self) -> None:
        if self._upload is not None:
            self._upload.result()
            self._upload = None

    def load(self, checkpoint_dir: Path, tag: str) -> dict[str, Any]:
        path = checkpoint_dir / tag
        if not (path / ENGINE_STATE).is_file():
            raise FileNotFoundError(
                f"{path} is not a checkpoint of the accelerate backend (no {ENGINE_STATE}); a DeepSpeed "
                "checkpoint saved without its layout (layout.json) resumes under the DeepSpeed backend only"
            )
        settings = group_settings(self.optimizer)
        options = self._checkpointed()
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer, options=options)
        state = {"model": model_state, "optimizer": optimizer_state}
        dcp.load(state, checkpoint_id=str(path))
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
            options=options,
        )
        saved = torch.load(path / ENGINE_STATE, map_location="cpu", weights_only=False)
        if self.scheduler is not None and saved["scheduler"] is not None:
            self.scheduler.load_state_dict(saved["scheduler"])
        restore_group_settings(self.optimizer, settings, self.scheduler)
        return saved["client_state"]

    def _adapters_only(self) -> bool:
        """Only adapters train (model.lora): the frozen base is model.init_from's, read at every start."""
        return any(not parameter.requires_grad for parameter in self.model.parameters())

    def _checkpointed(self) -> StateDictOptions:
        """What a checkpoint holds: under model.lora the trained tensors alone (`strict` off on load,
        where the frozen base's names are absent), else every tensor."""
        adapters = self._adapters_only()
        return StateDictOptions(ignore_frozen_params=adapters, strict=not adapters)

    def _unwrapped(self) -> torch.nn.Module:
        """The model under its own names (FSDP2 wraps in place; DDP holds it as `module`)."""
        return self.model.module if isinstance(self.model, DistributedDataParallel) else self.model

    def local_buffers(self) -> dict[str, torch.Tensor]:
        return persistent_buffers(self._unwrapped())

    def load_universal(self, tag_dir: Path) -> dict[str, Any]:
        """A DeepSpeed checkpoint, whole tensors from its universal form, cut by torch into what this
        rank holds (`engine/checkpoints/to_torch.py`). Rank 0 alone maps the tensors; torch
        broadcasts them one at a time."""
        settings = group_settings(self.optimizer)
        state = full_state(tag_dir, self._unwrapped(), self.optimizer) if dist.get_rank() == 0 else FullState({}, {})
        # Not `set_state_dict`: on the ranks given an empty model state it loads the optimizer only,
        # and rank 0 waits in the model's broadcast for ever (torch 2.13).
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_optimizer_state_dict(self.model, self.optimizer, state.optimizer, options=options)
        set_model_state_dict(self.model, state.model, options=options)
        saved = progress(tag_dir)
        if self.scheduler is not None and saved.scheduler is not None:
            self.scheduler.load_state_dict(saved.scheduler)
        restore_group_settings(self.optimizer, settings, self.scheduler)
        return saved.client

    def consolidated_state_dict(self, checkpoint_dir: Path, tag: str) -> dict[str, torch.Tensor] | None:
        # The live model holds exactly what checkpoint `tag` saved: it is the last save of the run.
        options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=self._adapters_only())
        state = get_model_state_dict(self.model, options=options)
        if dist.get_rank() != 0:
            return None
        return {name: value.float() if value.is_floating_point() else value for name, value in state.items()}


def _fully_shard(
    model: torch.nn.Module, family: ModelFamily, device: torch.device, *, reshard: bool, offload: bool
) -> torch.nn.Module:
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = CPUOffloadPolicy(pin_memory=device.type == "cuda") if offload else OffloadPolicy()
    if not offload:
        model.to(device)
    for unit in family.shard_units(model):
        fully_shard(unit, mesh=mesh, reshard_after_forward=reshard, offload_policy=policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard, offload_policy=policy)
    return model
