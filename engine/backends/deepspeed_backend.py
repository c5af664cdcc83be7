"""DeepSpeed as the engine's primary backend: ZeRO 0-3, CPU offload, mixed precision,
accumulation, clipping, optimizer and LR schedule all come from `deepspeed.initialize` with the
resolved config. This class adapts DeepSpeedEngine to the Backend interface, and adds what the
engine needs beside it: under fp32 ZeRO-0, torch's gradient clipping and, on one data-parallel
rank, no backward all-reduce (docs/design/precision.md); the mending of ZeRO-3's universal loads; and the
fp32 masters read for the export.

Under tensor parallelism the engine is given DeepSpeed's `PipelineParallelGrid` (one stage) as its
`mpu`, which is how DeepSpeed learns the data-parallel group to reduce gradients over and the
tensor-parallel group to sum gradient norms over.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.checkpoint.constants import (
    FP32_FLAT_GROUPS,
    LOSS_SCALER,
    OPTIMIZER_STATE_DICT,
    UNIVERSAL_CHECKPOINT_INFO,
)
from deepspeed.monitor.monitor import MonitorMaster
from deepspeed.runtime.pipe.topology import PipelineParallelGrid
from deepspeed.runtime.utils import is_model_parallel_parameter

from engine.backends.base import Backend, BackendSettings, Batch, to_device
from engine.backends.cpu_adam_steps import replay_cpu_adam_steps
from engine.backends.fp16_loss_scale import Fp16WithoutZero, fp16_without_zero
from engine.backends.optim import group_settings, parameter_groups, restore_group_settings
from engine.backends.token_mean import TargetCount
from engine.backends.zero_checks import defer_norm_checks
from engine.checkpoints.background import BackgroundCheckpointEngine, BackgroundWriter
from engine.checkpoints.nvme import fp32_state_dict
from engine.checkpoints.universal import (
    UNIVERSAL_FOLDER,
    canonical_names,
    loading_view,
    merged_info,
    restore_buffers,
    save_names,
    save_optimizer_order,
    saved_names,
    universal_info,
)
from engine.observability.memory import ModelStateTensors, StepWatch, optimizer_state_tensors
from engine.parallel.consolidate import (
    fp16_optimizer_masters,
    gather_full_state,
    saved_fp16_optimizer_masters,
    tensor_names,
)
from engine.parallel.sequence import SequenceShards
from models.module_state import persistent_buffers


def fp32_grad_norm(
    parameters: Iterable[torch.nn.Parameter], grid: PipelineParallelGrid | None, device: torch.device
) -> float:
    """The norm DeepSpeed's fp32 clipping computes and discards (`deepspeed.runtime.utils.clip_grad_norm_`):
    each gradient counted on the model-parallel rank that owns it, summed over the model-parallel group.
    (`get_flattened_grad_norm` would count a tensor-replicated weight once per shard.)"""
    lead = grid is None or grid.get_model_parallel_rank() == 0
    total = torch.zeros((), dtype=torch.float32, device=device)
    for p in parameters:
        if p.grad is not None and (lead or is_model_parallel_parameter(p)):
            total += p.grad.detach().float().norm().square()
    if grid is not None:
        dist.all_reduce(total, group=grid.get_model_parallel_group())
    return float(total.sqrt())


def tied_aliases(model: torch.nn.Module) -> dict[str, str]:
    """State-dict names that hold a parameter already named earlier (a tied weight's second name),
    mapped to the name `named_parameters` gives it."""
    first: dict[int, str] = {}
    for name, parameter in model.named_parameters():
        first.setdefault(id(parameter), name)
    return {
        name: first[id(tensor)]
        for name, tensor in model.state_dict(keep_vars=True).items()
        if first.get(id(tensor), name) != name
    }


class DeepSpeedEngineBackend(Backend):
    """What every DeepSpeed engine does the same way, whole model or pipeline: the learning rate,
    and checkpoints through `save_checkpoint` / `load_checkpoint`."""

    engine: deepspeed.DeepSpeedEngine
    grid: PipelineParallelGrid | None
    _names: dict[int, str]  # the unsplit model's name of every tensor, by identity
    _writer: BackgroundWriter | None = None  # trainer.async_save's
    _fp16: Fp16WithoutZero | None = None  # ZeRO-0 fp16's repairs (engine/backends/fp16_loss_scale.py)

    def learning_rate(self) -> float:
        return float(self.engine.get_lr()[0])

    @property
    def adapters_only(self) -> bool:
        """Only adapters train (model.lora): checkpoints hold them and their optimizer states alone,
        and the frozen base comes from model.init_from at every start."""
        return any(not parameter.requires_grad for parameter in self.engine.module.parameters())

    def start_writer(self, settings: BackendSettings) -> None:
        """trainer.async_save: start the writer process before `deepspeed.initialize`, so that its
        start-up overlaps DeepSpeed's."""
        self._writer = BackgroundWriter() if settings.async_save else None

    def write_in_background(self, settings: BackendSettings) -> None:
        """trainer.async_save: every file DeepSpeed's `save_checkpoint` writes goes through the
        engine's background checkpoint engine (engine/checkpoints/background.py says why not
        DeepSpeed's decoupled one). Set after `deepspeed.initialize`, which builds its torch.save
        engine; loads read with torch.load as that one does."""
        if self._writer is not None:
            self._writer.wait_ready()
            self.engine.checkpoint_engine = BackgroundCheckpointEngine(
                self.engine._config, self._writer, settings.hooks.during_write
            )

    def writes_done(self) -> bool:
        return self._writer is None or self._writer.done()

    def wait_for_writes(self) -> None:
        if self._writer is not None:
            self._writer.wait()

    def compile(self) -> None:
        """torch.compile through DeepSpeed (`DeepSpeedEngine.compile`): the whole module, or under the
        pipeline engine each of this stage's layers (`PipelineModule.compile`), with the
        accelerator's default backend (inductor). The family's `parallelize` step calls it once the
        engine wraps the model (models/parallelize.py)."""
        self.engine.compile()
        self.compiled = self.engine.is_compiled

    def watch_gradients(self) -> None:
        """Count model-state bytes at the optimizer step of every logged step (`engine.observability.memory.rank_memory`
        reads them)."""
        self.state_watch = StepWatch(
            self.engine.optimizer,
            self._gradient_tensors,
            self.model_state_tensors,
            lambda: self.timing,
        )

    def _gradient_tensors(self) -> list[torch.Tensor | None]:
        """Where DeepSpeed keeps gradients at the optimizer step: `.grad` of the parameters (ZeRO-0;
        bf16's fp32 accumulation buffers), the partitioned buffers ZeRO reduces into
        (`averaged_gradients`, stage 3's `grad_partitions_flat_buffer`), and the fp32 gradient of the
        offloaded master partition (`single_partition_of_fp32_groups[i].grad`, stage 3's
        `fp32_partitioned_groups_flat[i].grad`)."""
        optimizer = self.engine.optimizer
        tensors: list[torch.Tensor | None] = [p.grad for p in self.engine.module.parameters()]
        averaged = getattr(optimizer, "averaged_gradients", None) or {}
        for group in averaged.values() if isinstance(averaged, dict) else averaged:
            tensors.extend(group or [])
        for name in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat", "fp32_groups_flat"):
            tensors.extend(master.grad for master in getattr(optimizer, name, []))
        tensors.extend(getattr(optimizer, "fp32_groups_gradients_flat", []))
        tensors.append(getattr(optimizer, "grad_partitions_flat_buffer", None))
        return tensors

    def model_state_tensors(self) -> ModelStateTensors:
        """The model's parameters (under ZeRO-3 each one's `ds_tensor` partition, and the full
        tensor where it is gathered or persistent) and the optimizer's fp32 masters and state."""
        optimizer = self.engine.optimizer
        parameters: list[torch.Tensor] = []
        for parameter in self.engine.module.parameters():
            parameters.append(parameter)
            if hasattr(parameter, "ds_tensor"):
                parameters.append(parameter.ds_tensor)
        masters = [
            master
            for name in (
                "single_partition_of_fp32_groups",  # ZeRO-1/2
                "fp32_partitioned_groups_flat",  # ZeRO-3
                "fp32_groups_flat_partition",  # bf16 without ZeRO
                "fp32_groups_flat",  # fp16 without ZeRO
            )
            for master in getattr(optimizer, name, [])
        ]
        # fp16, and bf16 without ZeRO or pipeline, under a non-fused optimizer: one master per parameter.
        masters += [master for group in getattr(optimizer, "fp32_groups", []) for master in group]
        inner = getattr(optimizer, "optimizer", optimizer)
        return ModelStateTensors(parameters, masters + optimizer_state_tensors(inner))

    def save(self, checkpoint_dir: Path, tag: str, client_state: dict[str, Any]) -> None:
        module = self.engine.module
        tensor_size = self.grid.get_slice_parallel_world_size() if self.grid is not None else 1
        # What ds_to_universal needs to join this layout's pieces, should a later run reshape it.
        infos: list[dict[str, Any] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(infos, universal_info(module, tensor_size))
        client_state = {**client_state, UNIVERSAL_CHECKPOINT_INFO: merged_info([info for info in infos if info])}
        # `latest` is published by engine.checkpoints.store once every rank is done, not by DeepSpeed.
        self.engine.save_checkpoint(
            str(checkpoint_dir),
            tag=tag,
            client_state=client_state,
            save_latest=False,
            exclude_frozen_parameters=self.adapters_only,
        )
        save_names(checkpoint_dir / tag, dist.get_rank(), canonical_names(module, self._names))
        if self.engine.zero_optimization_stage() == 3 and self.engine.zero_gather_16bit_weights_on_model_save():
            # What the key asks of DeepSpeed: the gathered weights beside the shards, in the same
            # atomically published folder (a collective: every rank gathers, rank 0 writes).
            self.engine.save_16bit_model(str(checkpoint_dir / tag), exclude_frozen_parameters=self.adapters_only)

    def load(self, checkpoint_dir: Path, tag: str) -> dict[str, Any]:
        settings = group_settings(self.engine.optimizer)
        # Without the frozen base, which the build has just read from model.init_from again.
        path, client_state = self.engine.load_checkpoint(
            str(checkpoint_dir), tag=tag, load_module_strict=not self.adapters_only
        )
        if path is None:
            raise FileNotFoundError(f"DeepSpeed found no checkpoint {tag!r} in {checkpoint_dir}")
        if self.engine.zero_nvme_offload_optimizer() and not self.engine.load_universal_checkpoint():
            _load_nvme_optimizer_states(self.engine, checkpoint_dir, tag)
        replay_cpu_adam_steps(self.engine.optimizer)
        restore_group_settings(self.engine.optimizer, settings, self.engine.lr_scheduler)
        if hasattr(self.engine.optimizer, "clip_grad"):
            # DeepSpeed's optimizers restore the clipping they were saved with, too.
            self.engine.optimizer.clip_grad = self.engine.gradient_clipping()
        return client_state or {}

    def local_buffers(self) -> dict[str, torch.Tensor]:
        return persistent_buffers(self.engine.module)

    def load_universal(self, tag_dir: Path) -> dict[str, Any]:
        """Restore from the universal form of `tag_dir` (built with `checkpoint.load_universal` on),
        under this run's parameter names: rank 0 links a view of it that every rank then loads its
        partitions from.

        Collective: the names of every pipeline stage are gathered for the view."""
        names: list[dict[str, str] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(names, canonical_names(self.engine.module, self._names))
        view = tag_dir / "views" / f"world{dist.get_world_size()}"
        if dist.get_rank() == 0:
            wanted = {local: canonical for rank_names in names for local, canonical in (rank_names or {}).items()}
            loading_view(tag_dir / UNIVERSAL_FOLDER, saved_names(tag_dir), wanted, view)
        dist.barrier()
        decays = [group["weight_decay"] for group in self.engine.optimizer.param_groups]
        client_state = self.load(view.parent, view.name)
        if self.engine.zero_optimization_stage() == 3:
            _mend_zero3_universal_load(self.engine.optimizer, decays)
        restore_buffers(self.engine.module, self._names, tag_dir)
        return client_state

    def deepspeed_monitor(self) -> MonitorMaster:
        return self.engine.monitor

    def grad_norm(self) -> float | None:
        if self._untracked_norm:
            return None if self._norm is None else float(self._norm)
        # Recorded by the ZeRO, bf16 and fp16 optimizers at each step, before clipping.
        norm = self.engine.get_global_grad_norm()
        if norm is None:
            return None
        return self._fp16.unscaled_norm(float(norm)) if self._fp16 else float(norm)

    def nonfinite_gradients(self) -> torch.Tensor | None:
        # fp32 ZeRO-0's clipping norm (`_clip_fp32_gradients`), or the norm the ZeRO-1/2 optimizer
        # keeps on the device (a float where it found an overflow itself: that step is counted in
        # `skipped_steps`); DeepSpeed marks a non-finite group norm with -1.
        norm = self._norm if self._untracked_norm else getattr(self.engine.optimizer, "_global_grad_norm", None)
        if not isinstance(norm, torch.Tensor):
            return None
        return ~torch.isfinite(norm) | (norm < 0)

    def _track_norm(self) -> None:
        # fp32 ZeRO-0 steps a bare torch optimizer, which reports no norm to the engine: the backend
        # computes it on the steps the loop logs, before the step clips and zeroes the gradients.
        self._untracked_norm = self.engine.zero_optimization_stage() == 0 and not (
            self.engine.bfloat16_enabled() or self.engine.fp16_enabled()
        )
        self._norm: float | torch.Tensor | None = None
        self._norm_from_clipping = False

    def _measure_norm(self) -> None:
        if self._untracked_norm and not self._norm_from_clipping and self.timing:
            self._norm = fp32_grad_norm(self.engine.module.parameters(), self.grid, self.device)

    def _clip_fp32_gradients(self) -> None:
        """torch's `clip_grad_norm_` in place of DeepSpeed's for fp32 ZeRO-0 without model parallelism.

        The same coefficient, max_norm / (norm + 1e-6) capped at 1, from torch's multi-tensor norm
        and scale instead of DeepSpeed's kernel pair per parameter and its norm all-reduce (1.9 against
        3.4 ms a step for the benchmark model on the CI machine). Every data-parallel rank holds the
        averaged gradients by now, so each computes the same norm alone. The norm, left on the
        device, is the one the metrics report."""
        self._norm = torch.nn.utils.clip_grad_norm_(self.engine.module.parameters(), self.engine.gradient_clipping())

    def skipped_steps(self) -> int:
        # Counted in `_take_model_step` whenever the optimizer reports `overflow`: ZeRO 1-3 and the
        # bf16/fp16 wrappers test the gradients' norm; fp32 ZeRO-0's bare torch optimizer never skips.
        return self.engine.skipped_steps

    def loss_scale(self) -> float | None:
        # Every DeepSpeed fp16 optimizer (ZeRO or not) exposes its scaler's current scale so.
        return float(self.engine.optimizer.loss_scale) if self.engine.fp16_enabled() else None


def _load_nvme_optimizer_states(engine: Any, checkpoint_dir: Path, tag: str) -> None:
    """What DeepSpeed 0.19.8's `load_checkpoint` leaves out under NVMe optimizer offload: it copies the
    saved swap files back (`offloaded_tensors`) and skips `_load_zero_checkpoint` (engine.py), so the
    optimizer's own state (each Adam step count, and every sub-group too small to swap, masters and
    moments, which live in host memory) stays as the fresh run made it, and the resumed losses drift.

    The rank's ZeRO state is loaded here the way ZeRO-3's `_rigid_load_state_dict` loads it, in an
    order that also serves parameters on NVMe: that method copies each restored master into its
    sub-group's flat parameter buffer, which a sub-group whose parameters live on NVMe does not have
    (None). Here the masters kept in memory are restored first, then every sub-group goes through
    the optimizer's own step epilogue (`_reassign_or_swap_out_partitioned_parameters`), which copies
    the master into the parameters or writes it to their swap files, after the swapped sub-groups'
    masters and moments are read from the files just copied back. A swapped sub-group's moments were
    saved as empty tensors, and the swapper registers a state tensor again only if it is large
    enough to swap (optimizer_utils.py `_get_state_tensors`), so each comes in as an uninitialised
    tensor of the sub-group's size, filled from its file on the first swap-in; left empty,
    DeepSpeed's CPU Adam would step on zero-size moments (a segmentation fault)."""
    optimizer = engine.optimizer
    saved = engine._get_all_zero_checkpoints(str(checkpoint_dir), tag)
    if saved is None:
        raise FileNotFoundError(f"{checkpoint_dir / tag} holds no ZeRO optimizer states")
    mine = saved[dist.get_rank(group=optimizer.dp_process_group)]
    swapper = optimizer.optimizer_swapper
    states = mine[OPTIMIZER_STATE_DICT]["state"]
    for index, master in enumerate(optimizer.fp32_partitioned_groups_flat):
        info = swapper.swap_params_info.get(swapper.parameter_id(master))
        for key, value in states.get(index, {}).items():
            if info is not None and torch.is_tensor(value) and value.numel() == 0:
                states[index][key] = torch.empty(info.numel(), dtype=value.dtype)
    optimizer.checkpoint_event_prologue()
    optimizer.loss_scaler = mine[LOSS_SCALER]
    optimizer.dynamic_loss_scale = mine["dynamic_loss_scale"]
    optimizer.overflow = mine["overflow"]
    optimizer._set_fp32_optimizer_param_groups()
    optimizer.optimizer.load_state_dict(mine[OPTIMIZER_STATE_DICT])
    optimizer._clear_fp32_optimizer_param_groups()
    swapper.purge_state()
    for master, kept in zip(optimizer.fp32_partitioned_groups_flat, mine[FP32_FLAT_GROUPS], strict=True):
        if kept.numel():
            master.data.copy_(kept.data)
    timers: set[str] = set()
    optimizer._partition_all_parameters()
    for index in range(len(optimizer.fp16_groups)):
        optimizer._prepare_sub_group(index, timers)
        optimizer._reassign_or_swap_out_partitioned_parameters(index)
        optimizer._release_sub_group(index, timers)
    optimizer._post_step(timers)
    if optimizer.persistent_parameters:
        optimizer.persistent_parameters[0].partition(optimizer.persistent_parameters)
    optimizer.checkpoint_event_epilogue()


def _mend_zero3_universal_load(optimizer: Any, decays: list[float]) -> None:
    """Undo two things stage3.py `load_hp_checkpoint_state_from_checkpoint_dir_stage3` does to an
    optimizer of more than one group or sub-group: it gives every group the hyperparameters of the
    checkpoint's first (the biases and gains would start decaying), and it hands every sub-group
    one shared `step` tensor, which Adam then advances once per sub-group at each step. Each group
    gets back the decay the config built it with, each sub-group a step of its own."""
    for group, decay in zip(optimizer.param_groups, decays, strict=True):
        group["weight_decay"] = decay
    for state in optimizer.optimizer.state.values():
        if isinstance(state.get("step"), torch.Tensor):
            state["step"] = state["step"].clone()


class DeepSpeedBackend(DeepSpeedEngineBackend):
    def __init__(self, model: torch.nn.Module, settings: BackendSettings, sequence: SequenceShards | None = None):
        ds_config, grid = settings.deepspeed_config, settings.grid
        self.sequence = sequence
        groups = parameter_groups(model.parameters(), ds_config["optimizer"], settings.weight_decay_on)
        names = {id(parameter): name for name, parameter in model.named_parameters()}
        self._groups = [[names[id(parameter)] for parameter in group["params"]] for group in groups]
        self._trainable = [name for group in self._groups for name in group]
        self._names = tensor_names(model)
        self._aliases = tied_aliases(model)
        defer_norm_checks(settings)
        self.start_writer(settings)
        self.engine, _, _, _ = deepspeed.initialize(
            model=model,
            model_parameters=groups,
            config=ds_config,
            # DeepSpeed learns the groups it reduces gradients over from the grid's or Ulysses' state.
            mpu=grid if sequence is None else sequence.groups,
        )
        self.device, self.family, self.input_dtype, self.grid = (
            settings.device,
            settings.family,
            settings.input_dtype,
            grid,
        )
        self.hooks = settings.hooks
        self.write_in_background(settings)
        self._accumulation = self.engine.gradient_accumulation_steps()
        if sequence is not None:
            # Every slice's loss is summed over the global batch's targets, whatever the data: a
            # slice's own mean would weigh each slice as a whole sequence.
            self.target_count = TargetCount(
                self._accumulation, settings.layout.data, sequence.data_group, sequence.size
            )
        elif settings.masked_labels:
            # Under tensor parallelism the data-parallel group is the grid's, as DeepSpeed reduces over it.
            self.target_count = TargetCount(
                self._accumulation, self.engine.dp_world_size, self.engine.data_parallel_group
            )
        self._zero_stage = self.engine.zero_optimization_stage()
        self._mixed_precision = self.engine.bfloat16_enabled() or self.engine.fp16_enabled()
        self._fp16 = fp16_without_zero(self.engine.optimizer)
        if self._zero_stage == 0 and self.engine.dp_world_size == 1:
            # Without ZeRO, DeepSpeed averages the gradients over the data-parallel group even when
            # that group is this rank alone: every step it flattens every gradient, all-reduces the
            # buffer with itself and copies it back. The flag is the one PipelineEngine clears.
            self.engine.enable_backward_allreduce = False
        # Training mode is set here and restored after each evaluation, not walked every step; a
        # model loaded with from_pretrained (model.init_from) starts in eval mode.
        self.engine.train()
        self.watch_gradients()
        self._track_norm()
        if self._untracked_norm and grid is None and self.engine.gradient_clipping() > 0:
            # An instance attribute: `_take_model_step` calls it by name, DeepSpeed's code untouched.
            self.engine.clip_fp32_gradients = self._clip_fp32_gradients
            self._norm_from_clipping = True

    def save(self, checkpoint_dir: Path, tag: str, client_state: dict[str, Any]) -> None:
        super().save(checkpoint_dir, tag, client_state)
        if self._untracked_norm and self.grid is None and dist.get_rank() == 0:
            # fp32 ZeRO-0 saves torch's own optimizer state, keyed by position: which parameter each
            # position is lets a later run reshape it (`engine.checkpoints.from_torch.universal_from_zero0`).
            save_optimizer_order(checkpoint_dir / tag, self._trainable)

    def _train_step(self, batches: Iterator[Batch]) -> torch.Tensor:
        loss_sum = torch.zeros((), device=self.device)
        micro_batches, divisor = self.micro_batches(batches, self._accumulation)
        for micro_step in range(self._accumulation):
            with self.phase("data"):
                batch = next(micro_batches)
            with self.phase("forward"):
                loss = self.hooks.on_loss(self.family.compute_loss(self.engine, batch, divisor))
            with self.phase("backward"):
                if self.sequence is not None:
                    loss = loss * self.sequence.grad_scale
                self.engine.backward(self._fp16.scaled(loss) if self._fp16 else loss)
            if micro_step == self._accumulation - 1:
                self._measure_norm()
            with self.phase("step"):
                self.engine.step()
                if self._fp16:
                    self._fp16.after_step()
            loss_sum += loss.detach().float()
        if self.sequence is not None:
            # Each slice's share of the sequence's loss: the mean over the ranks must count a whole
            # sequence's once per data replica, as without slices.
            loss_sum *= self.sequence.size / self.sequence.grad_scale
        return loss_sum / self._accumulation

    def eval_sums(self, batches: Iterable[Batch]) -> dict[str, torch.Tensor]:
        self.engine.eval()
        totals: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for batch in batches:
                sums = self.family.eval_sums(self.engine, to_device(self.sliced(batch), self.device, self.input_dtype))
                for key, value in sums.items():
                    totals[key] = totals.get(key, 0) + value.detach().double()
        self.engine.train()
        if self.grid is not None and self.grid.get_slice_parallel_rank() != 0:
            # Every tensor shard computed the same sums; one of them counts.
            totals = {key: torch.zeros_like(value) for key, value in totals.items()}
        return totals

    def consolidated_state_dict(self, checkpoint_dir: Path, tag: str) -> dict[str, torch.Tensor] | None:
        if self.grid is not None and self.grid.get_slice_parallel_world_size() > 1:
            # Tensor-parallel shards: zero_to_fp32 cannot join them; gather from the live ranks,
            # which hold exactly what checkpoint `tag` saved.
            return gather_full_state(
                self.engine.module,
                self._names,
                self.grid.get_slice_parallel_group(),
                is_writer=self.grid.get_data_parallel_rank() == 0 and self.grid.get_slice_parallel_rank() == 0,
                mixed_precision=self._mixed_precision,
                masters=fp16_optimizer_masters(self.engine.optimizer),
                device=self.device,
            )
        if dist.get_rank() != 0:
            return None
        return self._read_checkpoint(checkpoint_dir, tag)

    def _read_checkpoint(self, checkpoint_dir: Path, tag: str) -> dict[str, torch.Tensor]:
        if self._zero_stage >= 1:
            # ZeRO keeps the fp32 master weights in the optimizer partitions of every rank (or, swapped to
            # NVMe, in the checkpoint's copies of the swap files).
            return fp32_state_dict(checkpoint_dir / tag)
        states = torch.load(checkpoint_dir / tag / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
        weights = {name: t.float() if t.is_floating_point() else t for name, t in states["module"].items()}
        if self._mixed_precision:
            masters = saved_fp16_optimizer_masters(states["optimizer"], [[weights[n] for n in g] for g in self._groups])
            weights.update(zip(self._trainable, (master.float() for master in masters), strict=True))
            # A tied weight's second name (GPT-2's lm_head) holds the same master.
            weights.update({alias: weights[name] for alias, name in self._aliases.items()})
        return weights
