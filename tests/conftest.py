from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from marinlm.config import load_config
from marinlm.kernels import apply_kernels
from marinlm.model import MarinConfig, MarinForCausalLM

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
SHARED_DATA = Path(os.environ.get("MARINLM_SHARED_DATA", ROOT.parent / "shared" / "data"))

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def _one_thread_rank(rank: int, fn, *args) -> None:
    import gc

    torch.set_num_threads(1)
    fn(rank, *args)
    gc.freeze()  # as the marinlm command ends (marinlm/__main__.py)


def spawn_ranks(fn, args: tuple, nprocs: int, join: bool = True):
    """`torch.multiprocessing.spawn` of `fn(rank, *args)` on `nprocs` processes, each on one intra-op
    thread, as torchrun starts its workers (OMP_NUM_THREADS=1). Ranks that share two cores on two
    threads each are slowed several times over: after each parallel region an OpenMP thread spins
    waiting for the next, on a core another rank needs."""
    import torch.multiprocessing as mp

    return mp.spawn(_one_thread_rank, (fn, *args), nprocs=nprocs, join=join)


def torchrun_command(nproc: int) -> list[str]:
    """`torchrun` with `nproc` local processes, its rendezvous on a port the OS picks
    (`--standalone`): launches from tests running side by side never share a port."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]


def shared_data(*parts: str) -> Path:
    """Path under ../shared/data, skipping the test when it is absent (e.g. on a user's machine)."""
    path = SHARED_DATA.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"shared data not available: {path}")
    return path


def tiny_config(**overrides) -> MarinConfig:
    config = load_config(MarinConfig, CONFIGS / "model" / "tiny.yaml")
    if overrides:
        from marinlm.config import from_dict, merge, to_dict

        config = from_dict(MarinConfig, merge(to_dict(config), overrides))
    return config


def build(config: MarinConfig, seed: int = 0, kernels: bool = False, loss_chunk_tokens: int = 1024) -> MarinForCausalLM:
    """The reference model on CPU; with `kernels`, the fast paths swapped in (`apply_kernels`)."""
    from marinlm.kernels.config import KernelConfig

    with torch.device("meta"):
        model = MarinForCausalLM(config)
    chosen = KernelConfig(modules="auto" if kernels else "reference", loss_chunk_tokens=loss_chunk_tokens)
    apply_kernels(model, "cpu", "bf16", chosen)
    model.to_empty(device="cpu")
    model.init_weights(seed=seed)
    return model


def randomize_identity_inits(model: MarinForCausalLM, seed: int = 1) -> None:
    """Give SConv taps, head gates and router biases non-trivial values so tests exercise them."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "sconv" in name or ".gate." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        for name, b in model.named_buffers():
            if name.endswith("router.bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)


SAMPLE_TEXTS = [
    "The quick brown fox jumps over the lazy dog. It was 1234567 years ago.",
    "Shall I compare thee to a summer's day?\nThou art more lovely and more temperate.",
    "天下大势，分久必合，合久必分。学而时习之，不亦说乎？",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Emoji 🚀🔥 and accents: naïve café, Ελληνικά, русский текст, 日本語のテキスト",
    "class Stack:\n\tdef __init__(self):\n\t\tself.items = []\n\n\tdef push(self, x):\n\t\tself.items.append(x)\n",
]


def write_corpus(folder, num_docs: int = 200, num_files: int = 3, seed: int = 0) -> list[str]:
    """A small mixed corpus (English, Chinese, code, emoji) as jsonl files; returns the texts."""
    import json
    import random

    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    texts = []
    for i in range(num_docs):
        parts = rng.sample(SAMPLE_TEXTS, k=rng.randint(1, 3))
        texts.append(f"doc {i}: " + " ".join(parts) * rng.randint(1, 4))
    for f in range(num_files):
        with open(folder / f"part-{f}.jsonl", "w") as out:
            for i in range(f, num_docs, num_files):
                out.write(json.dumps({"id": f"d{i}", "text": texts[i]}) + "\n")
    return texts


def stdlib_python_texts(limit_bytes: int = 2_000_000) -> list[str]:
    """Python standard library sources: a code corpus every Python installation has."""
    import sysconfig

    texts, total = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="ignore")
        texts.append(text)
        total += len(text)
        if total > limit_bytes:
            break
    return texts


@pytest.fixture(scope="session")
def token_data(tmp_path_factory) -> Path:
    """A tokenized mixed corpus (train + val) with its tokenizer: the input of training tests."""
    from marinlm.dataset.tokenize import TokenizeConfig, tokenize
    from marinlm.tokenizer import MarinTokenizer, train_bpe

    root = tmp_path_factory.mktemp("token_data")
    write_corpus(root / "corpus", num_docs=400, num_files=2)
    MarinTokenizer(train_bpe(SAMPLE_TEXTS * 40, vocab_size=700)).save(root / "tokenizer")
    tokenize(
        TokenizeConfig(
            inputs=[str(root / "corpus")],
            tokenizer=str(root / "tokenizer"),
            output_dir=str(root / "tokens"),
            val_fraction=0.1,
            workers=1,
        ),
        progress=False,
    )
    return root / "tokens"


def train_config(token_dir: Path, run_dir: Path, **overrides):
    """A small, fast TrainConfig on the tiny model (2 layers, seq 64, batch 4)."""
    from marinlm.config import from_dict, merge, to_dict
    from marinlm.train.config import TrainConfig

    base = {
        "run_dir": str(run_dir),
        "model": to_dict(tiny_config(num_layers=2, max_seq_len=64, attention={"sliding_window": 16})),
        "data": {"sources": [{"path": str(token_dir)}], "seq_len": 64},
        # fp32 on every host: `auto` picks bf16 on a CPU with bf16 units (utils/device.native_bf16),
        # and these tests compare runs at fp32 tolerances.
        "optim": {"type": "marin", "lr": 0.02, "adam_lr": 0.003, "ns_dtype": "float32"},
        "train": {"steps": 8, "global_batch": 4, "grad_clip": 1.0, "precision": "fp32"},
        "checkpoint": {"every_steps": 4, "keep_last": 3},
        # A given matmul peak: measuring it takes a second a process, and tests do not read MFU.
        "logging": {"every_steps": 1, "progress": False, "tensorboard": True, "peak_flops": 1e11},
        "validation": {"every_steps": 4, "max_rows": 8, "batch_size": 4},
    }
    return from_dict(TrainConfig, merge(base, overrides))
