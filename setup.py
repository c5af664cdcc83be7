"""Packaging for the config-driven training engine.

torch and deepspeed are installed by scripts/setup.sh before this file is used:
deepspeed's own setup imports torch, so it must be built against the torch that is
already present (a build-isolated install would pull a multi-GB CUDA torch).
"""

from setuptools import find_packages, setup

setup(
    name="dsengine",
    version="0.1.0",
    description="One JSON config trains GPT and ResNet models under DeepSpeed or accelerate.",
    python_requires=">=3.11",  # transformers>=5.23 requires 3.11
    packages=find_packages(
        include=["engine", "engine.*", "models", "models.*", "data", "data.*", "parallelism", "parallelism.*"]
    ),
    package_data={"engine.config": ["*.json"], "data": ["corpus/*.txt"]},
    install_requires=[
        "torch>=2.1",
        "deepspeed>=0.19,<0.20",
        "transformers>=5.23",  # activation_checkpointing_enable (models/gpt.py)
        "datasets>=3.0",
        "accelerate>=1.0",
        # model.lora: adapters trained, saved and loaded as the field's own library does (models/lora.py).
        "peft>=0.21",
        "jsonschema>=4.18",
        # Configs are read as DeepSpeed reads them; engine/config/load.py uses its decoder's scanner.
        "hjson>=3.1,<4",
        "safetensors>=0.4",
        "tqdm>=4.60",
        "numpy>=1.24",
        "pillow>=9.0",
        "matplotlib>=3.7",
        "tensorboard>=2.14",
        # Megatron's indexed .bin/.idx reader and blending indices (data/tokens/); 0.16 is the newest
        # release served for Python 3.11, and its C++ helpers ship prebuilt.
        "megatron-core>=0.16.1,<0.17",
    ],
    # pytest-xdist: `make gpu-check` runs the GPU tests eight at a time (bench/gpu_check.py). trl: the sft
    # benchmark's baseline (bench/trl_sft.py), one release so that its figures stay comparable.
    extras_require={
        "dev": ["pytest>=8.0", "pytest-xdist>=3.0", "ruff>=0.6", "pre-commit>=3.0", "wandb>=0.16", "trl==1.16.0"]
    },
    entry_points={"console_scripts": ["dsengine=engine.cli:main"]},
)
