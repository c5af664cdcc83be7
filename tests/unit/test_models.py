"""The model families: sizes, losses, activation checkpointing and export, on CPU in a few seconds."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file
from torch.utils.data import default_collate
from transformers import AutoModelForImageClassification, GPT2LMHeadModel, ResNetConfig, ResNetForImageClassification

from data import DataBundle, build_datasets
from engine.checkpoints.export import export_model
from models import FAMILIES, ModelFamily, get_family
from models.activation_checkpointing import Checkpointing
from models.gpt import gpt2_config
from models.module_state import count_parameters
from models.parallelize import ParallelRequest
from models.resnet_spec import torchvision_available

GPT = get_family("gpt")
RESNET = get_family("resnet")
TINY_GPT = {"family": "gpt", "preset": "tiny", "vocab_size": 65}
SMALL_RESNET = {"family": "resnet", "preset": "resnet18", "num_classes": 10, "implementation": "transformers"}


class CallOnly:
    """Forwards calls and nothing else, as a DeepSpeed engine wrapping the model would."""

    def __init__(self, module: torch.nn.Module) -> None:
        self._module = module

    def __call__(self, *args, **kwargs):
        return self._module(*args, **kwargs)


def seeded_build(family: ModelFamily, section: dict, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    checkpointing = Checkpointing.of(section.get("activation_checkpointing"))
    return family.parallelize(family.build(section), ParallelRequest(checkpointing=checkpointing))


def token_batch(vocab_size: int = 65, batch: int = 2, seq_len: int = 16) -> dict[str, torch.Tensor]:
    """Samples shaped as the text data cuts them: inputs and, one token on, labels."""
    generator = torch.Generator().manual_seed(1)
    windows = torch.randint(0, vocab_size, (batch, seq_len + 1), generator=generator)
    return {"input_ids": windows[:, :-1], "labels": windows[:, 1:]}


def image_batch(num_classes: int = 10, batch: int = 2, size: int = 32) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(2)
    return {
        "pixel_values": torch.randn(batch, 3, size, size, generator=generator),
        "labels": torch.randint(0, num_classes, (batch,), generator=generator),
    }


def assert_identical(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> None:
    """Bit-for-bit equality, names included; integer buffers such as BatchNorm's step count too."""
    assert expected.keys() == actual.keys()
    for name, tensor in expected.items():
        assert torch.equal(tensor, actual[name]), name


def gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: parameter.grad for name, parameter in model.named_parameters()}


# --- registry and presets ---------------------------------------------------------------------


def test_registry_lists_both_families_and_get_family_returns_them():
    assert set(FAMILIES) == {"gpt", "resnet", "llama"}
    for name, family in FAMILIES.items():
        assert get_family(name) is family
        assert family.name == name


def test_unknown_family_names_the_known_ones():
    with pytest.raises(ValueError, match="gpt, resnet"):
        get_family("bert")


@pytest.mark.parametrize("family, preset", [("gpt", "7B"), ("resnet", "resnet20")])
def test_unknown_preset_names_the_family_presets(family, preset):
    with pytest.raises(ValueError, match="choose one of") as raised:
        get_family(family).architecture({"family": family, "preset": preset})
    assert all(name in str(raised.value) for name in FAMILIES[family].presets)


# Published sizes: GPT-2 with tied embeddings (HF model cards), ResNet from torchvision's docs, Llama
# 3.2 1B (tied) and Llama 3 8B (untied) as their safetensors index totals count them.
EXPECTED_PARAMETERS = {
    ("gpt", "124M"): 124_439_808,
    ("gpt", "350M"): 354_823_168,
    ("gpt", "774M"): 774_030_080,
    ("gpt", "1.5B"): 1_557_611_200,
    ("resnet", "resnet18"): 11_689_512,
    ("resnet", "resnet34"): 21_797_672,
    ("resnet", "resnet50"): 25_557_032,
    ("resnet", "resnet101"): 44_549_160,
    ("resnet", "resnet152"): 60_192_808,
    ("llama", "1B"): 1_235_814_400,
    ("llama", "8B"): 8_030_261_248,
}


def test_every_preset_has_a_published_size_to_check():
    shipped = {(name, preset) for name, family in FAMILIES.items() for preset in family.presets}
    assert shipped - {("gpt", "tiny"), ("llama", "tiny")} == set(EXPECTED_PARAMETERS)


@pytest.mark.parametrize("family, preset", sorted(EXPECTED_PARAMETERS))
def test_preset_parameter_count(family, preset):
    section = {"family": family, "preset": preset, "implementation": "transformers"}
    with torch.device("meta"):
        model = get_family(family).build(section)
    assert count_parameters(model) == EXPECTED_PARAMETERS[family, preset]


def test_gpt2_124m_counts_its_tied_embedding_once():
    with torch.device("meta"):
        model = GPT.build({"family": "gpt", "preset": "124M"})
    assert model.lm_head.weight is model.transformer.wte.weight
    assert count_parameters(model) == 124_439_808


@pytest.mark.skipif(not torchvision_available(), reason="torchvision is not installed")
def test_resnet50_torchvision_parameter_count_matches_transformers():
    with torch.device("meta"):
        model = RESNET.build({"family": "resnet", "preset": "resnet50", "implementation": "torchvision"})
    assert type(model).__module__.startswith("torchvision")
    assert count_parameters(model) == 25_557_032


def test_gpt_architecture_merges_overrides_into_the_preset():
    arch = GPT.architecture({"family": "gpt", "preset": "124M", "n_layer": 4, "n_embd": None, "dropout": 0.1})
    assert arch == {
        "n_layer": 4,
        "n_head": 12,
        "n_embd": 768,
        "n_positions": 1024,
        "vocab_size": 50257,
        "dropout": 0.1,
        "attn_implementation": "sdpa",
    }


def test_gpt_architecture_passes_auto_vocab_through_and_build_refuses_it():
    section = {"family": "gpt", "preset": "tiny", "vocab_size": "auto"}
    assert GPT.architecture(section)["vocab_size"] == "auto"
    assert GPT.architecture({"family": "gpt", "preset": "tiny"})["vocab_size"] == "auto"
    with pytest.raises(ValueError, match="tokenizer"):
        GPT.build(section)


def test_resnet_architecture_merges_overrides_and_settles_auto():
    arch = RESNET.architecture({"family": "resnet", "preset": "resnet50", "num_classes": 10})
    assert arch["block"] == "bottleneck"
    assert tuple(arch["depths"]) == (3, 4, 6, 3)
    assert arch["num_classes"] == 10
    assert arch["implementation"] == ("torchvision" if torchvision_available() else "transformers")
    assert RESNET.architecture({"family": "resnet", "preset": "resnet18"})["num_classes"] == 1000


def test_resnet_torchvision_request_fails_loudly_without_torchvision_or_builds_it():
    section = {"family": "resnet", "preset": "resnet18", "num_classes": 10, "implementation": "torchvision"}
    if torchvision_available():
        assert type(RESNET.build(section)).__module__.startswith("torchvision")
    else:
        with pytest.raises(ValueError, match="torchvision does not import"):
            RESNET.build(section)


# --- forward and loss -------------------------------------------------------------------------


def test_gpt_tiny_loss_starts_near_uniform_and_eval_sums_agree():
    model = seeded_build(GPT, TINY_GPT)
    # A character vocabulary has no end-of-text token; GPT-2's own has id 50256.
    assert model.config.bos_token_id is model.config.eos_token_id is None
    assert gpt2_config({**GPT.architecture(TINY_GPT), "vocab_size": 50304}).eos_token_id == 50256
    batch = token_batch()
    loss = GPT.compute_loss(model, batch)
    loss.backward()
    assert loss.ndim == 0
    # GPT-2's small initial weights give near-uniform predictions over the 65 tokens.
    assert abs(loss.item() - math.log(65)) < 0.1
    assert all(parameter.grad is not None for parameter in model.parameters())

    model.eval()
    with torch.no_grad():
        sums = GPT.eval_sums(CallOnly(model), batch)
        mean = GPT.compute_loss(model, batch)
    assert sums["tokens"].item() == 2 * 16
    # transformers' own loss on the whole window, which shifts inside, scores the same targets.
    window = torch.cat([batch["input_ids"], batch["labels"][:, -1:]], dim=1)
    with torch.no_grad():
        shifted_inside = model(input_ids=window, labels=window, use_cache=False).loss
    assert mean.item() == pytest.approx(shifted_inside.item(), rel=1e-6)
    summary = GPT.summarize_eval({key: value.item() for key, value in sums.items()})
    assert summary["loss"] == pytest.approx(mean.item(), rel=1e-6)
    assert summary["perplexity"] == pytest.approx(math.exp(mean.item()), rel=1e-6)


def test_gpt_eval_sums_average_exactly_over_batches():
    model = seeded_build(GPT, TINY_GPT).eval()
    batches = [token_batch(seq_len=8), token_batch(batch=3, seq_len=8)]
    with torch.no_grad():
        totals = {"loss_sum": 0.0, "tokens": 0.0}
        for batch in batches:
            for key, value in GPT.eval_sums(model, batch).items():
                totals[key] += value.item()
        joint = GPT.compute_loss(model, {key: torch.cat([b[key] for b in batches]) for key in batches[0]})
    assert GPT.summarize_eval(totals)["loss"] == pytest.approx(joint.item(), rel=1e-5)


def test_gpt_perplexity_of_a_diverged_run_is_infinite_not_an_error():
    assert GPT.summarize_eval({"loss_sum": 1e6, "tokens": 1.0})["perplexity"] == math.inf


def test_resnet18_loss_and_eval_sums():
    model = seeded_build(RESNET, SMALL_RESNET)
    batch = image_batch()
    loss = RESNET.compute_loss(CallOnly(model), batch)
    loss.backward()
    assert loss.ndim == 0 and torch.isfinite(loss)
    assert all(parameter.grad is not None for parameter in model.parameters())

    model.eval()
    with torch.no_grad():
        sums = RESNET.eval_sums(CallOnly(model), batch)
        logits = model(batch["pixel_values"]).logits
    expected_correct = (logits.argmax(-1) == batch["labels"]).sum().item()
    summary = RESNET.summarize_eval({key: value.item() for key, value in sums.items()})
    assert sums["samples"].item() == 2
    assert summary["accuracy"] == expected_correct / 2
    expected_loss = torch.nn.functional.cross_entropy(logits, batch["labels"]).item()
    assert summary["loss"] == pytest.approx(expected_loss, rel=1e-6)


def test_resnet_loss_accepts_plain_logits_as_torchvision_returns_them():
    classifier = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, 10))
    batch = image_batch()
    loss = RESNET.compute_loss(classifier, batch)
    expected = torch.nn.functional.cross_entropy(classifier(batch["pixel_values"]), batch["labels"])
    torch.testing.assert_close(loss, expected)


# --- activation checkpointing -----------------------------------------------------------------


def test_gpt_activation_checkpointing_gives_identical_loss_and_gradients():
    plain = seeded_build(GPT, TINY_GPT)
    checkpointed = seeded_build(GPT, {**TINY_GPT, "activation_checkpointing": True})
    assert checkpointed.is_activation_checkpointing and not plain.is_activation_checkpointing
    batch = token_batch()
    losses = []
    for model in (plain, checkpointed):
        loss = GPT.compute_loss(model, batch)
        loss.backward()
        losses.append(loss)
    torch.testing.assert_close(losses[0], losses[1])
    torch.testing.assert_close(gradients(plain), gradients(checkpointed))


def test_resnet_activation_checkpointing_gives_identical_loss_gradients_and_batchnorm_stats():
    plain = seeded_build(RESNET, SMALL_RESNET)
    checkpointed = seeded_build(RESNET, {**SMALL_RESNET, "activation_checkpointing": True})
    assert [name for name, _ in plain.named_parameters()] == [name for name, _ in checkpointed.named_parameters()]
    assert plain.state_dict().keys() == checkpointed.state_dict().keys()

    # The first convolution of the first residual block runs twice per step only when recomputed.
    convolution_calls = Counter()
    for label, model in (("plain", plain), ("checkpointed", checkpointed)):
        convolution = model.resnet.encoder.stages[0].layers[0].layer[0].convolution
        convolution.register_forward_hook(lambda *_, label=label: convolution_calls.update([label]))

    losses = []
    for model in (plain, checkpointed):
        for step in range(2):
            model.zero_grad()
            loss = RESNET.compute_loss(model, image_batch(size=32 + 8 * step))
            loss.backward()
        losses.append(loss)
    assert convolution_calls == {"plain": 2, "checkpointed": 4}
    torch.testing.assert_close(losses[0], losses[1])
    torch.testing.assert_close(gradients(plain), gradients(checkpointed))
    assert_identical(dict(plain.named_buffers()), dict(checkpointed.named_buffers()))
    assert plain.resnet.embedder.embedder.normalization.num_batches_tracked.item() == 2


# --- export and init_from ---------------------------------------------------------------------


def trained_gpt() -> torch.nn.Module:
    """A tiny GPT one optimiser step away from its initialisation, so a load that silently
    re-initialises weights cannot pass for a roundtrip."""
    model = seeded_build(GPT, TINY_GPT)
    GPT.compute_loss(model, token_batch()).backward()
    torch.optim.SGD(model.parameters(), lr=1.0).step()
    return model.eval()


@pytest.mark.parametrize("embedding_keys", ["both", "wte only", "lm_head only"])
def test_gpt_export_loads_back_with_identical_logits(tmp_path: Path, embedding_keys: str):
    model = trained_gpt()
    state_dict = {key: value.clone() for key, value in model.state_dict().items()}
    if embedding_keys == "wte only":
        del state_dict["lm_head.weight"]
    if embedding_keys == "lm_head only":
        del state_dict["transformer.wte.weight"]
    GPT.export(state_dict, TINY_GPT, tmp_path)

    input_ids = token_batch()["input_ids"]
    with torch.no_grad():
        expected = model(input_ids=input_ids).logits
        for loaded in (GPT.load_export(tmp_path), GPT2LMHeadModel.from_pretrained(tmp_path)):
            assert loaded.lm_head.weight is loaded.transformer.wte.weight
            torch.testing.assert_close(loaded(input_ids=input_ids).logits, expected, rtol=0, atol=0)


@pytest.mark.parametrize("family", ["gpt", "llama"])
@pytest.mark.parametrize("kind", ["char", "byte"])
def test_an_export_with_the_engines_own_tokenizer_generates_through_transformers_pipeline(
    family: str, kind: str, tmp_path: Path
):
    """The export as transformers' users load it: `pipeline("text-generation", model=dir)` finds the
    model and the tokenizer beside it, and what it generates decodes with the engine's tokenizer."""
    from transformers import pipeline

    from data.tokenizers import load_tokenizer

    text = "The king hath spoken; the realm obeys."
    tokenizer = load_tokenizer(kind, training_text=text)
    decoder = get_family(family)
    section = {"family": family, "preset": "tiny", "vocab_size": tokenizer.vocab_size}
    decoder.export(seeded_build(decoder, section).state_dict(), section, tmp_path)
    tokenizer.save(tmp_path)
    generator = pipeline("text-generation", model=str(tmp_path), device="cpu")
    generated = generator("The king", max_new_tokens=8, do_sample=False)[0]["generated_text"]
    assert generated.startswith("The king") and len(generated) > len("The king")
    assert tokenizer.decode(tokenizer.encode(generated)) == generated


def test_gpt_export_refuses_a_state_dict_of_another_model(tmp_path: Path):
    state_dict = {f"module.{key}": value for key, value in trained_gpt().state_dict().items()}
    with pytest.raises(ValueError, match="missing"):
        GPT.export(state_dict, TINY_GPT, tmp_path)
    assert not any(tmp_path.iterdir())


def test_gpt_init_from_a_local_checkpoint_keeps_its_weights(tmp_path: Path):
    model = trained_gpt()
    model.save_pretrained(tmp_path)
    loaded = GPT.build({**TINY_GPT, "init_from": str(tmp_path), "attn_implementation": "eager"})
    assert loaded.training
    assert loaded.config._attn_implementation == "eager"
    input_ids = token_batch()["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(input_ids=input_ids).logits, model(input_ids=input_ids).logits)


def test_gpt_init_from_refuses_another_architecture(tmp_path: Path):
    trained_gpt().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="n_layer 2 .configured: 3"):
        GPT.build({**TINY_GPT, "n_layer": 3, "init_from": str(tmp_path)})


def trained_resnet() -> torch.nn.Module:
    """One training step moves the weights and BatchNorm statistics off their initial values."""
    model = seeded_build(RESNET, SMALL_RESNET)
    RESNET.compute_loss(model, image_batch()).backward()
    torch.optim.SGD(model.parameters(), lr=0.01).step()
    return model.eval()


def test_resnet_export_loads_back_with_identical_logits(tmp_path: Path):
    model = trained_resnet()
    RESNET.export(model.state_dict(), SMALL_RESNET, tmp_path)

    metadata = json.loads((tmp_path / "export.json").read_text())
    assert metadata == {
        "family": "resnet",
        "preset": "resnet18",
        "num_classes": 10,
        "implementation": "transformers",
        "labels": [f"LABEL_{index}" for index in range(10)],
    }
    # The weights must load into transformers' own class, built without the engine.
    config = ResNetConfig(layer_type="basic", depths=[2, 2, 2, 2], hidden_sizes=[64, 128, 256, 512], num_labels=10)
    plain = ResNetForImageClassification(config)
    plain.load_state_dict(load_file(tmp_path / "model.safetensors"))

    pixel_values = image_batch()["pixel_values"]
    with torch.no_grad():
        expected = model(pixel_values).logits
        assert torch.isfinite(expected).all()
        for loaded in (
            RESNET.load_export(tmp_path),
            plain.eval(),
            AutoModelForImageClassification.from_pretrained(tmp_path),
        ):
            torch.testing.assert_close(loaded(pixel_values).logits, expected, rtol=0, atol=0)


def image_folder_bundle(root: Path, image_size: int = 32) -> DataBundle:
    """Three classes of random RGB PNGs, wider and taller than `image_size` in turn, so that every
    image is resized and cropped, loaded as a run loads `data.type` "image"."""
    rng = np.random.default_rng(3)
    for label in ("cat", "dog", "ship"):
        (root / label).mkdir(parents=True)
        for index, (height, width) in enumerate([(37, 45), (50, 35), (41, 41), (33, 60)]):
            pixels = rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / label / f"{index}.png")
    data = {
        "type": "image",
        "path": str(root),
        "image_size": image_size,
        "augment": True,
        "mean": [0.4914, 0.4822, 0.4465],
        "std": [0.247, 0.243, 0.261],
        "validation_fraction": 0.25,
    }
    return build_datasets(data, samples="images", seed=0, seq_len=None, vocab_size=None, num_classes=None)


def test_resnet_export_classifies_an_image_through_transformers_pipeline_as_the_engine_does(tmp_path: Path):
    """The export as transformers' users load it: `pipeline("image-classification", model=dir)` finds
    the image processor and the class names beside the model, and its logits for a raw image are
    the engine's for its own evaluation preprocessing of that image."""
    from transformers import AutoImageProcessor, pipeline

    bundle = image_folder_bundle(tmp_path / "images")
    section = {**SMALL_RESNET, "num_classes": 3}
    model = seeded_build(RESNET, section)
    RESNET.compute_loss(model, default_collate([bundle.train[index] for index in range(4)])).backward()
    torch.optim.SGD(model.parameters(), lr=0.01).step()
    model.eval()
    export_dir = tmp_path / "export"
    export_model(
        RESNET,
        model.state_dict(),
        section,
        export_dir,
        image_transform=bundle.image_transform,
        class_names=bundle.class_names,
    )

    assert bundle.class_names == ["cat", "dog", "ship"]
    processor = AutoImageProcessor.from_pretrained(export_dir)
    classifier = pipeline("image-classification", model=str(export_dir), device="cpu")
    for index in range(len(bundle.validation)):
        picture = Image.fromarray(bundle.validation.source.image(index).permute(1, 2, 0).numpy())
        assert picture.size != (32, 32)
        engine_pixels = bundle.validation[index]["pixel_values"]
        processed = processor(images=picture, return_tensors="pt")["pixel_values"][0]
        torch.testing.assert_close(processed, engine_pixels, rtol=0, atol=0)

        with torch.no_grad():
            engine_logits = model(engine_pixels[None]).logits[0]
        scores = classifier(picture, top_k=None, function_to_apply="none")
        logits = {score["label"]: score["score"] for score in scores}
        assert sorted(logits) == bundle.class_names
        piped = torch.tensor([logits[name] for name in bundle.class_names])
        torch.testing.assert_close(piped, engine_logits, rtol=0, atol=1e-6)
        top = classifier(picture)[0]
        assert top["label"] == bundle.class_names[int(engine_logits.argmax())]
        assert top["score"] == pytest.approx(float(engine_logits.softmax(-1).max()), abs=1e-6)


def test_resnet_export_labels_outputs_the_data_has_no_class_for_and_refuses_extra_names(tmp_path: Path):
    state_dict = trained_resnet().state_dict()
    RESNET.export(state_dict, SMALL_RESNET, tmp_path, ["cat", "dog", "ship"])
    config = ResNetConfig.from_pretrained(tmp_path)
    assert config.id2label == {0: "cat", 1: "dog", 2: "ship", **{i: f"LABEL_{i}" for i in range(3, 10)}}
    assert config.label2id == {label: index for index, label in config.id2label.items()}
    assert json.loads((tmp_path / "export.json").read_text())["labels"] == list(config.id2label.values())
    with pytest.raises(ValueError, match="11 class names for a classifier of 10 outputs"):
        RESNET.export(state_dict, SMALL_RESNET, tmp_path, [f"class {i}" for i in range(11)])
    with pytest.raises(ValueError, match="no classes"):
        GPT.export(trained_gpt().state_dict(), TINY_GPT, tmp_path, ["cat"])


def test_resnet_init_from_an_export_keeps_its_weights_and_refuses_another_head(tmp_path: Path):
    model = trained_resnet()
    RESNET.export(model.state_dict(), SMALL_RESNET, tmp_path)
    loaded = RESNET.build({**SMALL_RESNET, "init_from": str(tmp_path)})
    assert_identical(model.state_dict(), loaded.state_dict())
    with pytest.raises(ValueError, match="num_classes 10 .configured: 100"):
        RESNET.build({**SMALL_RESNET, "num_classes": 100, "init_from": str(tmp_path)})
