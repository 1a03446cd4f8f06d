from pathlib import Path

from setuptools import find_packages, setup

# mlflow-skinny is MLflow's client without the server and UI (a fraction of the size), all --logger mlflow needs
LOGGERS = ["tensorboard", "wandb", "mlflow-skinny"]
LM_EVAL = "lm-eval>=0.4.13,<0.5"
LITSERVE = "litserve>=0.2.19,<0.3"  # `lit-model serve`: 0.2.19's ContinuousBatchingLoop and OpenAISpec; 0.3 changes the API

# torch is left unpinned here so a GPU machine keeps its CUDA build; on a CPU-only machine install
# `torch==2.13.0` (the CPU wheel) first, as the README says, and this requirement is already met.
setup(
    name="lit-model",
    version="0.1.0",
    description="Pretrain, fine-tune and run GPT-style language models without losing a run to OOM",
    long_description=Path(__file__).with_name("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["lit_model", "lit_model.*"]),
    package_data={"lit_model.core": ["configs/*.yaml"]},
    # `lit-model COMMAND` runs the recipes (lit_model/recipes/), so a wheel or `pip install .` has every command
    entry_points={"console_scripts": ["lit-model = lit_model.entry:main"]},
    install_requires=[
        "torch>=2.5",
        "lightning>=2.5",
        "jsonargparse[signatures]>=4.30",
        "pyyaml",
        "safetensors>=0.4",
        "tokenizers>=0.20",
        "sentencepiece>=0.2",
        "tqdm",
        "psutil",
        "huggingface_hub>=1.0",  # lit_model.io.download
        "jinja2>=3.1.6",  # older versions have sandbox escapes; checkpoints' chat templates, rendered as transformers does
    ],
    extras_require={
        "quantize": ["bitsandbytes>=0.45"],
        # GaLore, APOLLO, AdamMini, AdaLomo as used here: pytorch_optimizer 4.1; AdamW4bit / AdamWFp8: torchao (no torch
        # dependency of its own, so it keeps the torch already installed)
        "optimizers": ["pytorch_optimizer>=4.1", "torchao>=0.18"],
        "plot": ["matplotlib"],
        "flash": ["flash-attn"],
        "data": ["datasets>=3"],  # --data NAME, .parquet/.csv and save_to_disk directories
        "loggers": LOGGERS,  # --logger tensorboard, wandb, mlflow
        # `lit-model evaluate`. litgpt pins lm-eval below 0.4.9.1 only because its test evaluates a Hub task (logiqa)
        # whose data set needs a loading script. Running remote code stays opt-in in 0.4.13: trust_remote_code
        # defaults to False (only lm-eval's own CLI flag sets it, and we call simple_evaluate with a model object,
        # never passing it), and with datasets >= 4 script data sets do not load at all (0.4.13 drops the key from a
        # task's dataset_kwargs there). Our tests use local tasks; <0.5: 0.5 may change the LM and task APIs we use.
        "evaluate": [LM_EVAL],
        "serve": [LITSERVE],
        # peft: the DoRA parity test's reference implementation; trl: the preference losses' (tests only, like
        # transformers)
        "test": ["pytest", "transformers>=5", "peft>=0.17", "trl>=1.16", "bitsandbytes>=0.45", "pytorch_optimizer>=4.1", "torchao>=0.18",
                 "matplotlib", "datasets>=3", *LOGGERS, LM_EVAL, LITSERVE, "openai"],
        "all": ["bitsandbytes>=0.45", "pytorch_optimizer>=4.1", "torchao>=0.18", "matplotlib", "datasets>=3", *LOGGERS,
                LM_EVAL, LITSERVE],
    },
)
