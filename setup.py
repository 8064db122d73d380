"""Packaging for setdiff-megatron: set diffusion language models at scale."""

from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).parent
VERSION = {}
exec((ROOT / "setdiff_megatron" / "version.py").read_text(), VERSION)

EXTRAS = {
    # megatron-core 0.16.x is the newest line for Python 3.11; psutil is needed by its
    # dist_checkpointing (without it a save errors and then hangs).
    "megatron": ["megatron-core>=0.16.1,<0.17", "psutil", "pybind11"],
    # DeepSpeed installs as pure Python on a CPU-only machine (its ops compile on first use, and the
    # engine uses none on CPUs); pinned to the tested line, as the engine reads the format of its
    # BF16_Optimizer checkpoints. The engine also runs megatron-core's LR scheduler and, through
    # data/, its dataset builder.
    "deepspeed": ["deepspeed>=0.19.8,<0.20", "psutil", "megatron-core>=0.16.1,<0.17"],
    "hf": ["transformers>=4.45", "safetensors>=0.4", "tokenizers>=0.21"],
    # Preprocessing writes megatron-core indexed datasets and packs samples with its GPTDataset;
    # jinja2 renders supervised chat records with the tokenizer's chat template.
    "data": ["tokenizers>=0.21", "datasets>=2.19", "pyarrow>=14", "megatron-core>=0.16.1,<0.17", "jinja2>=3.1"],
    # Evaluation jobs: ROUGE, Pareto plots.
    "eval": ["rouge-score>=0.1.2", "matplotlib>=3.8"],
    # lm-evaluation-harness adapter (evaluation/lm_eval_adapter.py). Not in `dev`: about 30 more
    # packages (scikit-learn, sacrebleu, evaluate, ...) and minutes to install; its tests skip without it.
    "lm-eval": ["lm-eval>=0.4.13,<0.5"],
    # `setdiff serve`: the OpenAI-compatible server (serving/); jinja2 renders chat templates, its
    # responses are the openai package's own types, and prometheus-client serves /metrics.
    "serve": ["fastapi>=0.110", "uvicorn>=0.29", "jinja2>=3.1", "openai>=1.30", "prometheus-client>=0.20"],
    "wandb": ["wandb>=0.17"],
    "tensorboard": ["tensorboard>=2.14"],
    # GPU only: Transformer Engine needs CUDA torch, cuDNN and nvcc. Install it yourself on a GPU
    # machine with `pip install --no-build-isolation "transformer-engine[pytorch]>=2.9,<2.12"`;
    # the extra is empty so that `pip install .[te]` never tries to build it on a CPU machine.
    "te": [],
}
# The test suite exercises every CPU engine and format, so `dev` pulls in their extras (`serve`
# brings the `openai` client the serving tests drive the server with), and ruff for the lint gate.
EXTRAS["dev"] = sorted(
    {
        "pytest>=8",
        "pytest-timeout>=2.3",
        "ruff>=0.17,<0.18",
        *EXTRAS["megatron"],
        *EXTRAS["deepspeed"],
        *EXTRAS["hf"],
        *EXTRAS["data"],
        *EXTRAS["tensorboard"],
        *EXTRAS["eval"],
        *EXTRAS["serve"],
    }
)

setup(
    name="setdiff-megatron",
    version=VERSION["__version__"],
    description="Distributed pretraining of set diffusion language models on megatron-core and DeepSpeed",
    long_description=(ROOT / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.11",
    packages=find_packages(include=["setdiff_megatron", "setdiff_megatron.*"]),
    install_requires=["torch>=2.4", "numpy", "pyyaml>=6", "pydantic>=2.7", "tqdm>=4.66"],
    extras_require=EXTRAS,
    entry_points={"console_scripts": ["setdiff=setdiff_megatron.cli:main"]},
    classifiers=[
        "Programming Language :: Python :: 3.11",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
