"""The planner on the CPU, without launches: exact model-state bytes worked out here from the
architecture (not copied from the planner), data memory, verdicts and suggest. The `plan` and
`explain` commands, run as a user runs them, are in tests/launched/test_plan_launched.py."""

from __future__ import annotations

import json
import pickle
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from deepspeed.pipe import PipelineModule
from deepspeed.runtime.utils import partition_balanced
from PIL import Image

from data import DataBundle
from data.streaming import StreamedCorpus
from data.text import PackedTokens
from data.tokenizers import ByteTokenizer
from engine.config import load_config
from engine.launch.hardware import Hardware, detect_hardware
from engine.plan import DataSizes, data_sizes, format_bytes, parse_bytes, plan_run, verdict
from engine.plan.data import data_memory
from engine.preflight import check_data, load_data, settle_vocabulary
from models import get_family
from tests.support.plan import GPT2, HIDDEN, LAYERS, POSITIONS, VOCAB

RESNET = "configs/tiny_resnet.json"
# The planner reads no data, so the config's corpus need not exist here; GPT-2's own vocabulary
# (the config's byte tokenizer would otherwise settle "auto" to 256 rows).
NO_DATA = ["data.path=null", f"model.vocab_size={VOCAB}"]


def gpt2_parameter_numels() -> list[int]:
    """GPT-2 124M's parameters in registration order, from its shape."""
    block = [HIDDEN, HIDDEN, HIDDEN * 3 * HIDDEN, 3 * HIDDEN, HIDDEN * HIDDEN, HIDDEN, HIDDEN, HIDDEN]
    block += [HIDDEN * 4 * HIDDEN, 4 * HIDDEN, 4 * HIDDEN * HIDDEN, HIDDEN]
    return [VOCAB * HIDDEN, POSITIONS * HIDDEN, *block * LAYERS, HIDDEN, HIDDEN]


def gpt2_matrix_numels() -> list[int]:
    """The parameters of GPT-2 124M that weight decay reaches: the embeddings and the four weight
    matrices of each block; the rest are biases and LayerNorm gains."""
    block = [HIDDEN * 3 * HIDDEN, HIDDEN * HIDDEN, HIDDEN * 4 * HIDDEN, 4 * HIDDEN * HIDDEN]
    return [VOCAB * HIDDEN, POSITIONS * HIDDEN, *block * LAYERS]


def plan_of(config: str, world_size: int, overrides: list[str]):
    hardware = detect_hardware(local_world_size=world_size)
    document = load_config(config, [*NO_DATA, *overrides], world_size=world_size, hardware=hardware)
    return plan_run(document)


def machine(device_type: str, ranks_per_node: int) -> Hardware:
    """A node to plan for, whatever this one is: a GPU node's ranks have a device each, a CPU node's
    only the host."""
    return Hardware(device_type, True, True, cpu_count=16, local_world_size=ranks_per_node)


FP32_ZERO3_FULL_OFFLOAD = [
    "zero_optimization.stage=3",
    "zero_optimization.offload_optimizer.device=cpu",
    "zero_optimization.offload_param.device=cpu",
    "bf16.enabled=false",
    "fp16.enabled=false",
]


def test_gpt2_zero3_offload_on_8_ranks_holds_an_eighth_of_each_parameter():
    overrides = FP32_ZERO3_FULL_OFFLOAD
    plan = plan_of(GPT2, 8, overrides)
    numels = gpt2_parameter_numels()
    assert sum(numels) == 124_439_808
    partition = sum(-(-numel // 8) for numel in numels)
    persistent = sum(numel for numel in numels if numel <= 10 * HIDDEN)  # the resolved threshold
    for rank in plan.ranks:
        assert rank.states.parameter == 4 * (partition + persistent)
        # Device reduce-scatter buffer plus the fp32 host gradient of the offloaded master.
        assert rank.states.gradient == 2 * 4 * partition
        # fp32 master and Adam's two moments; DeepSpeedCPUAdam keeps no step tensor.
        assert rank.states.optimizer == 3 * 4 * partition
        assert rank.states.offloaded == 4 * partition + 4 * partition + 3 * 4 * partition


def test_zero0_holds_everything_and_torch_adam_adds_its_step_tensors():
    plan = plan_of(GPT2, 2, ["zero_optimization.stage=0", "bf16.enabled=false", "fp16.enabled=false"])
    numels = gpt2_parameter_numels()
    states = plan.ranks[0].states
    assert (states.parameter, states.gradient) == (4 * sum(numels), 4 * sum(numels))
    assert states.optimizer == 8 * sum(numels) + 4 * len(numels)


def test_zero1_pads_and_partitions_each_optimizer_group_on_its_own():
    """Decay on the matrices only makes two groups; ZeRO pads each to a multiple of 2 x dp and
    cuts it into dp partitions, and torch's Adam keeps one step tensor per partition."""
    overrides = ["zero_optimization.stage=1", "bf16.enabled=false", "fp16.enabled=false", "train_batch_size=400"]
    plan = plan_of(GPT2, 5, overrides)
    matrices = sum(gpt2_matrix_numels())
    vectors = sum(gpt2_parameter_numels()) - matrices
    padded = [-(-group // 10) * 10 for group in (matrices, vectors)]
    assert padded != [matrices, vectors]  # 5 ranks: both groups need padding
    for rank in plan.ranks:
        assert rank.states.parameter == 4 * sum(padded)
        assert rank.states.optimizer == sum(3 * 4 * group // 5 + 4 for group in padded)


def test_fsdp_allocates_padded_row_pieces_and_the_last_rank_holds_fewer_rows():
    """The accelerate backend's FSDP2 cuts each parameter into pieces of ceil(rows / 3) rows. GPT-2's
    50257 vocabulary rows and 1024 positions do not divide by 3: every rank allocates 16753 and 342
    of them for the weight and its gradient, but the last rank's Adam moments cover only the 16751
    and 340 it holds. Every other first dimension (768, 2304, 3072) divides by 3."""
    overrides = [
        "trainer.backend=accelerate",
        "zero_optimization.stage=3",
        "zero_optimization.offload_param.device=cpu",
        "bf16.enabled=false",
        "fp16.enabled=false",
        "train_batch_size=384",
    ]
    plan = plan_of(GPT2, 3, overrides)
    numels = gpt2_parameter_numels()
    embeddings = (16753 + 342) * HIDDEN
    padded = embeddings + sum(numels[2:]) // 3
    held = [padded, padded, padded - (2 + 2) * HIDDEN]  # elements with moments, by rank
    steps = 4 * len(numels)  # torch's Adam: one step tensor per parameter
    for rank, elements in zip(plan.ranks, held, strict=True):
        assert (rank.states.parameter, rank.states.gradient) == (4 * padded, 4 * padded)
        assert rank.states.optimizer == 2 * 4 * elements + steps
        assert rank.states.offloaded == rank.states.total  # CPUOffloadPolicy: everything lives on the host


def test_suggest_lists_only_layouts_that_fit_cheapest_first():
    from engine.plan import suggest
    from engine.plan.report import verdict

    hardware, gpu = detect_hardware(local_world_size=2), machine("cuda", 2)

    def load(extra: list[str]):
        return check_data(load_config("configs/tiny_gpt.json", extra, world_size=2, hardware=hardware))[0]

    config = load([])
    zero2 = plan_run(load(["zero_optimization.stage=2"]), gpu)
    limit = zero2.device_peak  # ZeRO-0 holds more, so it must be left out
    candidates = suggest(config, load, limit, None, gpu)
    assert candidates
    assert all(verdict(candidate.plan, limit, None)[0] for candidate in candidates)
    volumes = [candidate.plan.communication for candidate in candidates]
    assert volumes == sorted(volumes)
    assert all(
        candidate.plan.config.zero_stage != 0 or candidate.plan.ranks[0].device <= limit for candidate in candidates
    )


def test_memory_sizes_parse_in_both_unit_systems():
    assert parse_bytes("80GiB") == 80 * 2**30
    assert parse_bytes("512 GB") == 512 * 10**9
    assert parse_bytes("1024") == 1024
    with pytest.raises(ValueError):
        parse_bytes("80GB?")


@pytest.mark.parametrize("config", ["configs/tiny_resnet.json", "configs/tiny_gpt.json"])
def test_the_type_partition_splits_the_blocks_where_deepspeed_does(config: str):
    """DeepSpeed's own matcher (`PipelineModule._find_layer_type`, a regular expression searched in
    each layer's class name) and its balancing, against the layer ranges the planner reports."""
    overrides = ["parallel.pipeline_parallel_size=2", "parallel.pipeline_partition_method=type"]
    loaded = load_config(config, overrides, world_size=2, hardware=detect_hardware(local_world_size=2))
    plan = plan_run(check_data(loaded)[0])
    family = get_family(plan.config.model.family)
    with torch.device("meta"):
        layers = family.pipeline.layers(family.build(plan.config.model.fields))
    matcher = types.SimpleNamespace(_layer_specs=layers)
    blocks = PipelineModule._find_layer_type(matcher, family.pipeline.block_type)
    parts = partition_balanced([1 if index in blocks else 0 for index in range(len(layers))], num_parts=2)
    assert len(blocks) == family.pipeline.num_blocks(family.architecture(plan.config.model.fields))
    assert [rank.layers for rank in plan.ranks] == [f"layers {parts[s]}-{parts[s + 1] - 1}" for s in (0, 1)]


def test_resnet_stages_send_the_feature_map_at_their_cut():
    """ResNet-18 at 64 pixels cut by block type after its fourth block (the second of the 128-channel
    stage, an 8x8 map): stage 1 sends those activations forward, stage 2 their gradient back."""
    overrides = ["parallel.pipeline_parallel_size=2", "parallel.pipeline_partition_method=type"]
    config = load_config(RESNET, overrides, world_size=2, hardware=detect_hardware(local_world_size=2))
    plan = plan_run(config)
    micro, fp32 = config.document["train_micro_batch_size_per_gpu"], 4
    assert config.data.image_size == 64 and config.document["gradient_accumulation_steps"] == 1
    assert [rank.layers for rank in plan.ranks] == ["layers 0-4", "layers 5-9"]
    assert [rank.communication.pipeline for rank in plan.ranks] == [micro * 128 * 8 * 8 * fp32] * 2


# --- the data's memory ---------------------------------------------------------------------------


def token_file(path: Path, tokens: int, dtype: type = np.uint8) -> np.memmap:
    """A flat token file as the token cache and nanoGPT write it, memory-mapped."""
    array = np.memmap(path, dtype=dtype, mode="w+", shape=(tokens,))
    array[:] = np.arange(tokens) % 200
    array.flush()
    return np.memmap(path, dtype=dtype, mode="r", shape=(tokens,))


def test_a_text_corpus_is_mapped_once_per_node_and_ordered_by_every_rank(tmp_path, hf_tokenizer_dir):
    """A 300-id vocabulary is stored as uint16, so the page cache of a node holds 2 bytes per token
    of the corpus, once for its ranks; each rank keeps an int64 per training sample for the epoch's
    order, and each of its DataLoader workers two micro-batches of int64 ids and labels."""
    text = "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n" * 100
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(text)
    sets = [f"data.path={corpus}", f"data.tokenizer={hf_tokenizer_dir}", "data.num_workers=3"]
    config = load_config("configs/tiny_gpt.json", sets, world_size=4, hardware=detect_hardware(local_world_size=4))
    bundle = load_data(config)
    config = settle_vocabulary(config, bundle)
    assert bundle.tokenizer.vocab_size == 300
    tokens = len(bundle.tokenizer.encode(text))  # one document: no end-of-text id
    seq_len, micro = config.data.seq_len, config.document["train_micro_batch_size_per_gpu"]
    samples = (int(tokens * 0.9) - seq_len - 1) // seq_len + 1  # windows of seq_len + 1 tokens, seq_len apart

    plan = plan_run(config, machine("cuda", 2), data_sizes(bundle))
    assert (plan.data.shared, plan.data.order, plan.data.blend, plan.data.loaded) == (2 * tokens, 8 * samples, 0, 0)
    assert plan.data.workers == 3 * 2 * micro * (2 * 8 * seq_len)
    assert plan.data.private == 8 * samples + 3 * 2 * micro * 2 * 8 * seq_len
    # Four ranks, two per node, nothing offloaded at ZeRO-0: two ranks' private data and the file once.
    assert plan.host_total == 2 * plan.data.private + 2 * tokens


@pytest.mark.parametrize("samples", [2**20, 2**20 + 1])
def test_the_sample_order_is_held_up_to_2_20_samples_and_computed_beyond(tmp_path, samples: int):
    """At stride 1 a sample starts at every token but the last seq_len: a 1 MiB uint8 file makes 2**20
    samples, whose randperm is 8 MiB per rank; one token more and the order is computed on the fly."""
    seq_len = 4
    train = PackedTokens(token_file(tmp_path / "train.bin", samples + seq_len), seq_len, stride=1)
    validation = PackedTokens(np.arange(100, dtype=np.int64), seq_len)  # an array in memory, not a map
    bundle = DataBundle("text", train, validation, None, 256, None)
    sizes = data_sizes(bundle)
    memory = data_memory(sizes, micro_batch=4, num_workers=0)
    assert sizes.samples == samples
    assert memory.order == (8 * samples if samples <= 2**20 else 0)
    assert (memory.shared, memory.loaded) == (samples + seq_len, 8 * 100)
    assert memory.private == memory.order + 8 * 100


def test_a_blend_of_token_files_maps_each_and_indexes_every_blended_sample(tmp_path):
    """Two flat uint16 token files blended 3:1: the node's page cache holds both files whole, and every
    rank Megatron's two blending indices, an int16 source and an int64 sample per blended sample, for
    the training and the validation set, each a blend of the files' heads and tails."""
    seq_len, lengths = 8, (1001, 2001)
    paths = [tmp_path / f"{length}.bin" for length in lengths]
    for path, length in zip(paths, lengths, strict=True):
        token_file(path, length, np.uint16)
    sets = [
        "data.type=tokens",
        f"data.path={json.dumps([str(path) for path in paths])}",
        "data.weights=[3, 1]",
        "data.dtype=uint16",
        f"data.seq_len={seq_len}",
        "model.vocab_size=256",
    ]
    config = load_config("configs/tiny_gpt.json", sets, world_size=1, hardware=detect_hardware(local_world_size=1))
    sizes = data_sizes(load_data(config))
    cuts = [int(length * 0.9) for length in lengths]  # the default validation_fraction 0.1 of each file's tail
    train = sum((cut - seq_len - 1) // seq_len + 1 for cut in cuts)
    validation = sum((length - cut - seq_len - 1) // seq_len + 1 for length, cut in zip(lengths, cuts, strict=True))
    assert sizes.samples == train and sizes.mapped == 2 * sum(lengths)
    assert sizes.blend_index == (2 + 8) * (train + validation)
    memory = data_memory(sizes, micro_batch=2, num_workers=0)
    assert memory.private == 8 * train + 10 * (train + validation)


def test_a_streamed_corpus_has_no_order_and_no_workers_only_its_mapped_validation(tmp_path):
    """Streamed training text has no length to shuffle and is read in the training process; its held-out
    text is a prepared token file, mapped like any corpus."""
    validation = PackedTokens(token_file(tmp_path / "validation.bin", 500), 8)
    tokenizer = ByteTokenizer()
    bundle = DataBundle(
        "text", StreamedCorpus("corpus.txt", "text", tokenizer, 8), validation, tokenizer, 256, None, streamed=True
    )
    memory = data_memory(data_sizes(bundle), micro_batch=4, num_workers=2)
    assert (memory.order, memory.workers, memory.private, memory.shared) == (0, 0, 0, 500)


def write_cifar(directory: Path, per_batch: int) -> Path:
    """A CIFAR-10 python directory: five training batches and a test batch of `per_batch` images."""
    directory.mkdir(parents=True)
    names = [*(f"data_batch_{i}" for i in range(1, 6)), "test_batch"]
    for name in names:
        pixels = np.random.default_rng(0).integers(0, 256, size=(per_batch, 3072), dtype=np.uint8)
        batch = {b"data": pixels, b"labels": [i % 10 for i in range(per_batch)]}
        (directory / name).write_bytes(pickle.dumps(batch))
    return directory


def test_cifar_is_read_whole_into_every_rank(tmp_path):
    """CIFAR-10's pickles are decoded into one uint8 tensor per split and int64 labels, in each rank's
    own memory; a sample is float32 pixels at the configured size and an int64 label."""
    cifar = write_cifar(tmp_path / "cifar-10-batches-py", per_batch=3)
    sets = ["data.type=image", f"data.path={cifar}", "data.image_size=40", "data.num_workers=1"]
    config = load_config(RESNET, sets, world_size=1, hardware=detect_hardware(local_world_size=1))
    sizes = data_sizes(load_data(config))
    images = 6 * 3  # five training batches and the test batch
    assert (sizes.samples, sizes.loaded, sizes.mapped) == (15, images * (3 * 32 * 32 + 8), 0)
    assert sizes.sample_bytes == 4 * 3 * 40 * 40 + 8
    plan = plan_run(config, machine("cuda", 1), sizes)
    micro = config.document["train_micro_batch_size_per_gpu"]
    assert plan.data.private == 8 * 15 + images * (3 * 32 * 32 + 8) + 2 * micro * sizes.sample_bytes


def test_an_imagefolder_is_read_through_the_page_cache(tmp_path):
    """An imagefolder is decoded one file at a time: its files' bytes are the node's page cache, and
    each rank holds only the table of their paths and labels."""
    files = []
    for label in ("cat", "dog"):
        (tmp_path / "images" / label).mkdir(parents=True)
        for index in range(4):
            pixels = np.random.default_rng(index).integers(0, 256, size=(24, 24, 3), dtype=np.uint8)
            path = tmp_path / "images" / label / f"{index}.png"
            Image.fromarray(pixels).save(path)
            files.append(path)
    sets = ["data.type=image", f"data.path={tmp_path / 'images'}", "data.validation_fraction=0.25"]
    config = load_config(RESNET, sets, world_size=1, hardware=detect_hardware(local_world_size=1))
    sizes = data_sizes(load_data(config))
    assert sizes.samples == 6 and sizes.mapped == sum(path.stat().st_size for path in files)
    assert 0 < sizes.loaded < sum(len(str(path)) + 64 for path in files)  # paths and labels, no pixels


# --- one pool without an accelerator -------------------------------------------------------------


def test_without_an_accelerator_a_rank_holds_everything_in_host_memory():
    """GPT-2 124M under ZeRO-3 with optimizer and parameter offload on one rank. The split verdict
    weighed only the offloaded states against the host, 20 bytes per partitioned element, and they
    fit; on a CPU the parameters, the device gradients and the activations are host memory too."""
    overrides = FP32_ZERO3_FULL_OFFLOAD
    config = load_config(GPT2, [*NO_DATA, *overrides], world_size=1, hardware=detect_hardware(local_world_size=1))
    seq_len, micro = config.data.seq_len, config.document["train_micro_batch_size_per_gpu"]
    sizes = DataSizes(samples=5000, sample_bytes=2 * 8 * seq_len, loaded=0, mapped=3 * 2**30, blend_index=0)
    numels = gpt2_parameter_numels()  # one rank: each parameter whole
    persistent = sum(numel for numel in numels if numel <= 10 * HIDDEN)
    offloaded = 4 * sum(numels) + 4 * sum(numels) + 3 * 4 * sum(numels)  # fp32 parameters, host gradients, Adam
    states = offloaded + 4 * persistent + 4 * sum(numels)  # and persistent parameters, device gradients
    # What GPT2Block saves without dropout under SDPA's flash kernel, 28 fp32 tensors as wide as the
    # model per token (models/gpt.py), and at the peak the larger of one layer's gradients in flight and
    # the full loss's three fp32 logits-sized tensors (ZeRO-3's head takes "auto" to the full loss).
    layer = seq_len * micro * HIDDEN * 28 * 4
    final_norm = seq_len * micro * HIDDEN * 2 * 4  # the final LayerNorm's input and output
    activations = LAYERS * layer + final_norm + max(layer, 3 * 4 * seq_len * micro * VOCAB)
    private = 8 * 5000

    cpu = plan_run(config, machine("cpu", 1), sizes)
    assert (cpu.ranks[0].states.total, cpu.ranks[0].activations) == (states, activations)
    assert cpu.host_total == states + activations + private + 3 * 2**30
    host_memory = offloaded + private + 3 * 2**30 + 2**30  # the offloaded states fit it with 1 GiB to spare
    fits, text = verdict(cpu, None, host_memory)
    assert not fits and "one pool" in text
    assert f"{format_bytes(cpu.host_total)}" in text and f"{format_bytes(cpu.host_total - host_memory)} over" in text
    with pytest.raises(ValueError, match="no accelerator"):
        verdict(cpu, 80 * 2**30, host_memory)

    gpu = plan_run(config, machine("cuda", 1), sizes)
    assert gpu.host_total == offloaded + private + 3 * 2**30
    assert gpu.device_peak == 4 * persistent + 4 * sum(numels) + activations
    fits, text = verdict(gpu, 80 * 2**30, host_memory)
    assert fits and "device:" in text and f"host: {format_bytes(gpu.host_total)}" in text
