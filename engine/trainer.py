"""The trainer: builds what a run trains with from the prepared inputs (the backend, the loaders,
the metrics and the checkpoint manager), runs the step loop (engine/loop.py), then exports. The
process group is already up (engine/session.py)."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable

import torch

from data.loader import make_eval_loader
from data.train_feed import BatchShape, SampledFeed, StreamedFeed, train_feed
from engine.backends.base import Backend, BackendSettings, Batch, StepHooks
from engine.backends.factory import build_backend
from engine.backends.prefetch import DevicePrefetcher
from engine.checkpoints.export import export_model, load_exported, sample_reply, sample_text
from engine.checkpoints.manager import CheckpointManager
from engine.checkpoints.store import step_tag
from engine.config.rules import labels_can_be_masked
from engine.failures.nonfinite import NonfinitePolicy
from engine.failures.preemption import StopRequests
from engine.launch.signals import EXIT_PREEMPTED
from engine.loop import LoopSettings, train
from engine.observability.metrics import MetricsLogger
from engine.observability.plots import write_plots
from engine.observability.sinks import build_sinks
from engine.parallel.process_group import barrier, is_main_process
from engine.run_description import RunDescription
from models import ModelFamily, get_family
from models.seeding import seed_everything

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def backend_settings(
    description: RunDescription, family: ModelFamily, device: torch.device, hooks: StepHooks
) -> BackendSettings:
    """What every backend is built from: the run's description as the backends read it."""
    config = description.config
    return BackendSettings(
        backend=config.trainer.backend,
        family=family,
        model_fields=config.model.fields,
        device=device,
        input_dtype=_DTYPES[config.precision],
        deepspeed_config=copy.deepcopy(description.deepspeed_config),
        batch=description.batch,
        precision=config.precision,
        weight_decay_on=config.trainer.weight_decay_on,
        zero_stage=config.zero_stage,
        accelerate_wrapper=config.accelerate_wrapper,
        layout=description.layout,
        pipeline_partition_method=config.parallel.pipeline_partition_method,
        pipeline_activation_checkpoint_interval=config.parallel.pipeline_activation_checkpoint_interval,
        hooks=hooks,
        compile=config.trainer.compile,
        nonfinite=config.trainer.nonfinite,
        async_save=config.trainer.async_save,
        masked_labels=labels_can_be_masked(config.data.as_mapping()),
        seed=config.trainer.seed,
    )


class Trainer:
    """One rank's training, from a built backend to the export."""

    def __init__(self, description: RunDescription, device: torch.device, hooks: StepHooks):
        self.description, self.config, self.data = description, description.config, description.data
        self.device, self.hooks = device, hooks
        self.family = get_family(self.config.model.family)
        self.output_dir = self.config.trainer.output_path
        self.checkpoints = CheckpointManager(
            self.output_dir,
            description.resume,
            description.manifest,
            description.saved_manifest,
            description.reshape,
            self.config.world_size,
            self.config.trainer.keep_checkpoints,
            before_publish=hooks.before_publish,
            background=self.config.trainer.async_save,
        )

    def run(self) -> int:
        """Build, resume, train, save and export; the exit code (EXIT_PREEMPTED when a signal or
        trainer.max_wall_time stopped the run early, with a save)."""
        config, trainer_section = self.config, self.config.trainer
        if is_main_process():
            (self.output_dir / "resolved_config.json").write_text(json.dumps(config.document, indent=2) + "\n")
        seed_everything(trainer_section.seed)
        self.checkpoints.convert_source(self.description.batch.train_batch_size)
        settings = backend_settings(self.description, self.family, self.device, self.hooks)
        backend, dp_rank = build_backend(settings)
        feed = self.train_feed(dp_rank)
        start_step = self.checkpoints.resume(backend, feed.position)
        stops = self.stop_requests()
        loop_settings = self.loop_settings(stops)
        logger = MetricsLogger(
            self.output_dir,
            enabled=is_main_process(),
            total_steps=loop_settings.max_steps,
            start_step=start_step,
            progress_bar=trainer_section.progress_bar,
            sinks=build_sinks(self.description.deepspeed_config, backend.deepspeed_monitor()),
        )
        self.announce(backend, logger, start_step)
        end = train(
            backend,
            self.family,
            # The sampler's batches each on their way to the device while the step before trains.
            feed.micro_batches(start_step, lambda batches: DevicePrefetcher(batches, self.device, backend.input_dtype)),
            lambda: self.eval_batches(dp_rank),
            loop_settings,
            logger,
            self.checkpoints,
            start_step,
            self.hooks,
        )
        if end.saved == start_step:
            self.checkpoints.keep_untrained(start_step)
        backend.finish(self.output_dir, logger.write)
        if end.stopped is not None:
            logger.close()
            return EXIT_PREEMPTED
        if trainer_section.export:
            self.export(backend, end.saved, logger, stops)
        if stops is not None and stops.signalled():
            # After the last step's save: nothing is lost by ending, and the scheduler's grace is running.
            logger.write(f"{stops.signal_name()} received after the last step, which is saved: ending (exit code 0)")
            logger.close()
            return 0
        logger.close()
        if trainer_section.plots and is_main_process():
            paths = write_plots(self.output_dir)
            print(f"plots: {len(paths)} PNGs in {paths[0].parent if paths else self.output_dir}", flush=True)
        return 0

    def stop_requests(self) -> StopRequests | None:
        """Collective: the signals and wall-clock limit that stop the run early with a save, caught
        from here on (None where neither is asked for)."""
        stops = self.description.stops
        if not stops.asked:
            return None
        return StopRequests(list(stops.signals), stops.grace_s, stops.wall_time_s).install()

    def loop_settings(self, stops: StopRequests | None = None) -> LoopSettings:
        """What the step loop needs of the config and the family, and nothing else."""
        config, trainer_section = self.config, self.config.trainer
        family, data = self.family, config.data.as_mapping()
        return LoopSettings(
            max_steps=trainer_section.max_steps,
            log_interval=trainer_section.log_interval,
            eval_interval=trainer_section.eval_interval,
            save_interval=trainer_section.save_interval,
            items_per_step=self.description.batch.train_batch_size * family.items_per_sample(data),
            throughput_key=family.throughput_key,
            world_size=config.world_size,
            nonfinite=NonfinitePolicy(
                trainer_section.nonfinite, trainer_section.max_skipped_steps, self.checkpoints.latest
            ),
            flops_per_item=family.flops_per_item(family.architecture(config.model.fields), data),
            peak_flops=None if trainer_section.peak_tflops is None else trainer_section.peak_tflops * 1e12,
            parameters=self.description.parameters,
            stops=stops,
        )

    def train_feed(self, dp_rank: int) -> SampledFeed | StreamedFeed:
        """This rank's training data as its kind reads it (data/train_feed.py)."""
        config, batch = self.config, self.description.batch
        shape = BatchShape(
            micro_batch_size=batch.micro_batch_size,
            grad_accum=batch.gradient_accumulation_steps,
            dp_rank=dp_rank,
            dp_size=config.dp_size,
            seed=config.trainer.seed,
            num_workers=config.data.num_workers,
            pin_memory=config.data.pin_memory,
        )
        return train_feed(self.data, shape)

    def eval_batches(self, dp_rank: int) -> Iterable[Batch]:
        """This rank's validation batches, afresh for each evaluation."""
        config = self.config
        return make_eval_loader(
            self.data.validation,
            micro_batch_size=self.description.batch.micro_batch_size,
            dp_rank=dp_rank,
            dp_size=config.dp_size,
            max_batches=config.trainer.eval_batches,
            num_workers=config.data.num_workers,
            pin_memory=config.data.pin_memory,
        )

    def announce(self, backend: Backend, logger: MetricsLogger, start_step: int) -> None:
        """The start-up lines: what the backend built, the rank layout, the run, and any reshape."""
        config = self.config
        description = backend.describe()
        if description is not None:
            logger.write(description)
        layout = self.description.layout
        if layout.model_parallel or layout.sequence > 1:
            logger.write(layout.describe(backend.stage_layers()))
        logger.write(
            f"training {config.model.label} on {config.world_size} rank(s), "
            f"{config.trainer.backend} backend, ZeRO stage {config.zero_stage}, {config.precision_label}, "
            f"global batch {self.description.batch.train_batch_size}"
            + (", compiled (torch.compile)" if backend.compiled else "")
            + (f", resuming at step {start_step}" if start_step else "")
        )
        if config.rerouted:
            logger.write(f"{config.rerouted} (trainer.single_rank_fast_path)")
        for notice in config.notices:
            logger.write(notice)
        if self.description.saved_manifest is not None:
            saved, now = self.description.saved_manifest.describe(), self.description.manifest.describe()
            if self.description.reshape:
                logger.write(f"resumed through a universal checkpoint: saved on {saved}, now {now}")
            elif saved != now:
                logger.write(f"resumed on another layout: saved on {saved}, now {now}")

    def sample(self, model: torch.nn.Module, num_tokens: int) -> str:
        """What the exported model says: its reply to the chat data's sample prompt (the first
        validation conversation up to its last answer, through the chat template), else a continuation."""
        tokenizer, prompt, seed = self.data.tokenizer, self.data.sample_prompt, self.config.trainer.seed
        if prompt is None:
            return "sample:\n" + sample_text(model, tokenizer, num_tokens, seed)
        reply = sample_reply(model, tokenizer, prompt, num_tokens, seed, stop=tokenizer.eos_id)
        return (
            "sample, the reply to the first validation conversation (rendered through the chat template up to "
            f"its last answer):\n{tokenizer.decode(prompt)}{reply}"
        )

    def export(self, backend: Backend, step: int, logger: MetricsLogger, stops: StopRequests | None) -> None:
        """Collective: rank 0 consolidates the checkpoint of `step` into the export (and samples text
        from it, unless a stop signal came); the others wait."""
        barrier()
        self.hooks.before_export(step)
        state = backend.consolidated_state_dict(self.checkpoints.root, step_tag(step))
        if is_main_process():
            export_dir = self.output_dir / "export"
            tokenizer = self.data.tokenizer
            written = export_model(
                self.family,
                state,
                self.config.model.fields,
                export_dir,
                tokenizer=tokenizer,
                chat_template=self.data.chat_template,
                image_transform=self.data.image_transform,
                class_names=self.data.class_names,
                merge_lora=self.config.trainer.export_merge_lora,
            )
            logger.write(f"exported {written} to {export_dir}")
            tokens = self.config.trainer.sample_tokens
            if tokens and tokenizer is not None and stops is not None and stops.signalled():
                logger.write(f"{stops.signal_name()} received: the export is written, text sampling skipped")
            elif tokens and tokenizer is not None:
                logger.write(self.sample(load_exported(self.family, self.config.model.fields, export_dir), tokens))
        barrier()
