"""Command-line interface. `train_main` parses what launchers pass to engine/main.py; `main` is
`python -m engine` with its subcommands.

Each command imports what it runs inside its own function: `validate` is the pre-flight of every
launch and must not pay for torch.distributed, the checkpoint code or the planner it does not use."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path


def _add_overrides(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="PATH=VALUE",
        help="override one config value, e.g. --set trainer.max_steps=50 (typed by the schema; repeatable)",
    )


def train_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    """The arguments DeepSpeed scripts and HF's Trainer pass: the config as `--deepspeed_config CONFIG`
    or as HF's `--deepspeed CONFIG` (a bare `--deepspeed`, DeepSpeed's own flag, is accepted too);
    `args.config` is the one given."""
    parser = argparse.ArgumentParser(prog="engine/main.py", description="Train from one JSON config.")
    parser.add_argument("--deepspeed_config", metavar="CONFIG", help="the engine config (JSON)")
    parser.add_argument(
        "--deepspeed",
        nargs="?",
        const=True,
        default=None,
        metavar="CONFIG",
        help="HF Trainer's spelling of --deepspeed_config; bare, DeepSpeed scripts' flag (ignored)",
    )
    parser.add_argument(
        "--local_rank",
        "--local-rank",
        type=int,
        default=None,
        help="deepspeed passes --local_rank, torch.distributed.launch --local-rank; LOCAL_RANK wins",
    )
    _add_overrides(parser)
    args = parser.parse_args(argv)
    hf_config = args.deepspeed if isinstance(args.deepspeed, str) else None
    if hf_config is not None and args.deepspeed_config is not None and hf_config != args.deepspeed_config:
        parser.error(
            f"--deepspeed names {hf_config} and --deepspeed_config names {args.deepspeed_config}; give the config once"
        )
    args.config = args.deepspeed_config or hf_config
    if args.config is None:
        parser.error("no config: give it as --deepspeed_config CONFIG (or HF's --deepspeed CONFIG)")
    return args


def train_main(argv: list[str] | None = None) -> int:
    """What launchers start (`engine/main.py`): the arguments DeepSpeed scripts pass, then one rank's run."""
    args = train_arguments(argv)
    if args.local_rank is not None:
        os.environ.setdefault("LOCAL_RANK", str(args.local_rank))
    from engine.session import run

    return run(args.config, args.overrides)


def _validate(args: argparse.Namespace) -> int:
    from engine.config import ConfigError, load_config
    from engine.launch.hardware import detect_hardware
    from engine.launch.ops import known_op_problems, ops_needed
    from engine.parallel.layout import parallel_layout
    from engine.preflight import RunError, check_data, check_nvme

    if args.hostfile is not None:
        from engine.launch.hostfile import HostfileError, active_hosts, read_hostfile, ssh_problems

        try:
            hosts = active_hosts(read_hostfile(args.hostfile), args.include, args.exclude, args.num_nodes)
        except HostfileError as error:
            print(f"hostfile error: {error}", file=sys.stderr)
            return 2
        args.world_size = sum(len(slots) for slots in hosts.values())
        problems = ssh_problems(list(hosts), args.ssh_port) if args.check_ssh else []
        if problems:
            lines = "\n  ".join(problems)
            print(f"ssh pre-flight failed (pdsh could not start these nodes):\n  {lines}", file=sys.stderr)
            return 2
    hardware = detect_hardware(local_world_size=args.world_size, recalled=True)
    try:
        config = load_config(
            args.config,
            args.overrides,
            world_size=args.world_size,
            hardware=hardware,
            check_hardware=not args.no_hardware_check,
        )
        config, _ = check_data(config)
    except (ConfigError, RunError) as error:
        print(error, file=sys.stderr)
        return 2
    # The DeepSpeed ops the run will build, checked (compiler, arch list) but not built.
    ops = [] if args.no_hardware_check else ops_needed(config.document, hardware.device_type)
    problems = known_op_problems(ops) if ops else []
    if not args.no_hardware_check:
        try:
            check_nvme(config, hardware)  # this machine's nvme_path, as the run's pre-flight checks it
        except ValueError as error:
            problems.append(str(error))
    if problems:
        print("\n".join(problems), file=sys.stderr)
        return 2
    doc = config.document
    if config.trainer.backend == "accelerate":
        sharding = f"accelerate {config.accelerate_wrapper}"
    else:
        sharding = f"DeepSpeed ZeRO-{config.zero_stage}"
    print(
        f"{args.config}: valid for {args.world_size} rank(s): {config.model.label}, "
        f"{sharding}, {config.precision_label}, data-parallel {config.dp_size}, "
        f"micro-batch {doc['train_micro_batch_size_per_gpu']} x accumulation {doc['gradient_accumulation_steps']} "
        f"x {config.dp_size} = {doc['train_batch_size']}"
    )
    for notice in config.notices:
        print(notice)
    layout = parallel_layout(config)
    if layout.model_parallel or layout.sequence > 1:
        print(layout.describe())
    if args.print_resolved:
        print(json.dumps(doc, indent=2))
    return 0


def _accelerate_config(args: argparse.Namespace) -> int:
    import torch
    import yaml

    from engine.config import ConfigError, load_config
    from engine.launch.detect import accelerate_settings
    from engine.launch.hardware import detect_hardware

    hardware = detect_hardware()
    on_cpu = hardware.device_type == "cpu"
    processes = args.num_processes or (2 if on_cpu else torch.cuda.device_count())
    try:
        config = load_config(args.config, args.overrides, world_size=processes, hardware=hardware)
    except ConfigError as error:
        print(error, file=sys.stderr)
        return 2
    settings, command = accelerate_settings(config.precision, processes, on_cpu)
    args.output.write_text(yaml.safe_dump(settings, sort_keys=False))
    print(f"wrote {args.output}; launch with:")
    print("  " + command.format(file=args.output, config=args.config))
    return 0


def _plan(args: argparse.Namespace) -> int:
    """`plan` and `explain`: the per-rank table (or the rank-by-rank story) of a config, without
    starting anything; exit 1 when it does not fit the memory given, 2 on bad input."""
    from engine.config import ConfigError, load_config
    from engine.launch.hardware import detect_hardware
    from engine.plan import data_sizes, explain, parse_bytes, plan_run, suggest, table, verdict
    from engine.plan.report import describe_candidate
    from engine.preflight import RunError, check_data, check_lora_targets, settle_vocabulary

    try:
        device_memory = parse_bytes(args.device_memory) if getattr(args, "device_memory", None) else None
        host_memory = parse_bytes(args.host_memory) if getattr(args, "host_memory", None) else None
    except ValueError as error:
        print(f"plan: {error}", file=sys.stderr)
        return 2
    hardware = detect_hardware(local_world_size=args.world_size)

    def load(extra: list[str]):
        # A model.init_from directory not downloaded yet gives way to model.preset: plan before fetching weights.
        return load_config(
            args.config,
            [*args.overrides, *extra],
            world_size=args.world_size,
            hardware=hardware,
            check_hardware=False,
            pretrained_required=False,
        )

    try:
        config = load([])
        absent = config.model.init_from is not None and not Path(config.model.init_from).exists()
        bundle = None
        if absent:
            # Its tokenizer is there too: the data cannot be read, and is not counted.
            check_lora_targets(config)
            data = None
        else:
            config, bundle = check_data(config)
            data = data_sizes(bundle)
        plan = plan_run(config, hardware, data)
    except (ConfigError, RunError) as error:
        print(error, file=sys.stderr)
        return 2
    if absent:
        print(
            f"model.init_from {config.model.init_from} is not here: planned from model.preset {config.model.preset}, "
            "without the data, whose tokenizer it holds"
        )
    if args.command == "explain":
        print(explain(plan))
        return 0
    try:
        fits, text = verdict(plan, device_memory, host_memory)
    except ValueError as error:
        print(f"plan: {error}", file=sys.stderr)
        return 2
    print(table(plan))
    if text:
        print(text)
    if args.suggest:
        # Each layout's vocabulary as a launch settles it, from the tokenizer of the data read once above.
        settled = load if bundle is None else lambda extra: settle_vocabulary(load(extra), bundle)
        candidates = suggest(config, settled, device_memory, host_memory, hardware, data)
        print(f"{len(candidates)} layout(s) fit, cheapest communication first:")
        for candidate in candidates:
            print("  " + describe_candidate(candidate))
    return 0 if fits else 1


def _prepare_data(args: argparse.Namespace) -> int:
    """Tokenize the config's data into the token cache now, rather than at the first launch."""
    from data.kinds import NothingToPrepare, get_kind
    from engine.config import ConfigError, load_config
    from engine.launch.hardware import detect_hardware

    try:
        hardware = detect_hardware()
        config = load_config(args.config, args.overrides, world_size=1, hardware=hardware, check_hardware=False)
    except ConfigError as error:
        print(error, file=sys.stderr)
        return 2
    try:
        print(get_kind(config.data.type).prepare_ahead(config.data.as_mapping()))
    except NothingToPrepare as reason:
        print(f"prepare-data: {args.config} {reason}: there is nothing to tokenize ahead", file=sys.stderr)
        return 2
    except (ValueError, TimeoutError) as error:
        print(f"data error: {error}", file=sys.stderr)
        return 2
    return 0


def _plot(run_dir: Path) -> int:
    from engine.observability.plots import write_plots

    try:
        paths = write_plots(run_dir)
    except FileNotFoundError as error:
        print(f"plot: {error}", file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    return 0


def _positive(text: str) -> int:
    """argparse's type for a process count: argparse names the option and exits 2."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return int(text)


def main(argv: list[str] | None = None) -> int:
    """`python -m engine COMMAND`: the commands' arguments, then `COMMANDS`; the exit code."""
    parser = argparse.ArgumentParser(prog="python -m engine")
    commands = parser.add_subparsers(dest="command", required=True)

    validate = commands.add_parser("validate", help="check a config completely, without starting anything")
    validate.add_argument("config")
    validate.add_argument("--world-size", type=_positive, default=1, help="number of processes the run will have")
    validate.add_argument("--hostfile", type=Path, help="a DeepSpeed hostfile: the world size is its slots")
    validate.add_argument("--include", default="", help="deepspeed's --include, applied to the hostfile")
    validate.add_argument("--exclude", default="", help="deepspeed's --exclude, applied to the hostfile")
    validate.add_argument("--num-nodes", type=int, default=-1, help="deepspeed's --num_nodes, applied to the hostfile")
    validate.add_argument("--check-ssh", action="store_true", help="check every hostfile host answers ssh (pdsh route)")
    validate.add_argument("--ssh-port", type=int, help="deepspeed's --ssh_port, for --check-ssh")
    validate.add_argument(
        "--no-hardware-check",
        action="store_true",
        help="skip checks against this machine (fp16/bf16 support, what DeepSpeed's ops need to build)",
    )
    validate.add_argument(
        "--print-resolved",
        action="store_true",
        help='print the config with every default and "auto" resolved (model.vocab_size from the tokenizer the '
        "data builds)",
    )
    _add_overrides(validate)

    train = commands.add_parser("train", help="train in this process (same as engine/main.py)")
    train.add_argument("config")
    _add_overrides(train)

    accelerate = commands.add_parser(
        "accelerate-config", help="write the accelerate config file a config needs, and print the launch command"
    )
    accelerate.add_argument("config")
    accelerate.add_argument("--num-processes", type=int, help="default: the GPUs here, or 2 CPU processes")
    accelerate.add_argument("--output", type=Path, default=Path("accelerate_config.yaml"))
    _add_overrides(accelerate)

    launch_env = commands.add_parser(
        "launch-env", help="write the environment every rank must see (for deepspeed's pdsh route, via DS_ENV_FILE)"
    )
    launch_env.add_argument("output", type=Path)

    plan = commands.add_parser(
        "plan", help="per-rank memory (exact model states, estimated activations) and communication, before a run"
    )
    plan.add_argument("config")
    plan.add_argument("--world-size", type=_positive, default=1, help="number of processes the run will have")
    plan.add_argument("--device-memory", help="memory of one device, e.g. 80GiB: print whether the busiest rank fits")
    plan.add_argument(
        "--host-memory",
        help="memory of one node's host, e.g. 512GiB: offloaded states and data of its ranks (everything, without "
        "an accelerator)",
    )
    plan.add_argument("--suggest", action="store_true", help="list the layouts that fit, cheapest communication first")
    _add_overrides(plan)

    explain = commands.add_parser("explain", help="what each rank holds, told rank by rank")
    explain.add_argument("config")
    explain.add_argument("--world-size", type=_positive, default=1, help="number of processes the run will have")
    _add_overrides(explain)

    prepare_data = commands.add_parser(
        "prepare-data",
        help="tokenize the config's text corpus into the token cache once (a launch otherwise does it first)",
    )
    prepare_data.add_argument("config")
    _add_overrides(prepare_data)

    plot = commands.add_parser("plot", help="draw a run's curves from its metrics.jsonl as PNGs in RUN_DIR/plots")
    plot.add_argument("run_dir", type=Path, metavar="RUN_DIR")

    commands.add_parser("schema", help="print the config's JSON Schema")
    docs = commands.add_parser("docs", help="write the config reference generated from the schema")
    docs.add_argument("--output", type=Path, default=Path("docs/config_reference.md"))

    args = parser.parse_args(argv)
    return COMMANDS[args.command](args)


def _train(args: argparse.Namespace) -> int:
    return train_main(["--deepspeed_config", args.config, *(f"--set={item}" for item in args.overrides)])


def _launch_env(args: argparse.Namespace) -> int:
    from engine.launch.environment import write_launch_env

    try:
        variables = write_launch_env(args.output)
    except ValueError as error:
        print(f"launch environment: {error}", file=sys.stderr)
        return 2
    print(f"every rank gets: {', '.join(sorted(variables)) or '(nothing beyond DeepSpeed defaults)'}")
    return 0


def _schema(args: argparse.Namespace) -> int:
    from engine.config.schema import SCHEMA

    print(json.dumps(SCHEMA, indent=2))
    return 0


def _docs(args: argparse.Namespace) -> int:
    from engine.config.reference import render_reference

    args.output.write_text(render_reference())
    print(f"wrote {args.output}")
    return 0


# `python -m engine COMMAND`: what each command runs (the parser above declares their arguments).
COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "validate": _validate,
    "train": _train,
    "accelerate-config": _accelerate_config,
    "launch-env": _launch_env,
    "plan": _plan,
    "explain": _plan,
    "prepare-data": _prepare_data,
    "plot": lambda args: _plot(args.run_dir),
    "schema": _schema,
    "docs": _docs,
}
