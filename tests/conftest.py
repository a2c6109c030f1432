"""Shared helpers: tiny models, tokenizers and loaders; free ports and clean environments for multi-process tests.

Plain helpers (``TINY_MODEL``, ``tiny_config``, ``build_model``, ``ListLoader``) are imported by name
(``from conftest import build_model``); the rest are fixtures.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path
from typing import Callable, Iterable, Optional

import pytest
import torch
import yaml

from llmtrain.config import Config
from llmtrain.model import GPT
from llmtrain.tokenizer import Tokenizer, train_bpe_tokenizer

# Variables by which a launcher tells a process who it is; a test that starts processes must not
# pass on those of the shell it runs in (torchrun, srun), or the children would believe them.
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                 "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
LAUNCHER_PREFIXES = ("SLURM_", "TORCHELASTIC_", "LLMTRAIN_")

# The tests live in folders named after llmtrain's packages; the helpers they share (process-group workers, the
# forked CLI, faults, the SLURM cluster) live in tests/helpers/ and are imported by module name.
sys.path.insert(0, str(Path(__file__).resolve().parent / "helpers"))


# Under pytest-xdist the workers share the machine's cores: each gets its share of OpenMP threads (and passes the
# same number on to the processes it starts), because two processes whose threads outnumber the cores make every
# thread wait for the others at each parallel region: an in-process training test ran 4x slower that way.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    _threads = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ.setdefault("OMP_NUM_THREADS", str(_threads))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def free_port_number() -> int:
    """A port that is free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# The files that take longest (2-3 minutes each on 2 cores) run first: the README's command spreads files over two
# pytest-xdist workers in collection order, and a long file started last would leave one worker idle at the end.
LONGEST_FIRST = ("test_runnable_docs.py", "test_layout_refusals.py", "test_reliability.py", "test_slurm.py",
                 "test_deepspeed.py", "test_flag_walk.py", "test_pretrain_distributed.py", "test_tensor_parallel.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Longest files first (:data:`LONGEST_FIRST`; a stable sort, so each file's tests stay together and in order).
    A test that asks for ``dist_env`` starts processes of its own: it belongs to the multiproc tier."""
    rank = {name: index for index, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FIRST)))
    for item in items:
        if "dist_env" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.multiproc)


@pytest.fixture
def small_matmul_peak(monkeypatch: pytest.MonkeyPatch) -> None:
    """``llmtrain benchmark``'s matmul peak measured on 512 × 512 products only, in this process: the default sizes
    (up to 4096) take one thread 10-40 s, twice a run, for a test that checks nothing of the peak."""
    from llmtrain.flops import measure_matmul_peak

    monkeypatch.setattr(measure_matmul_peak, "__defaults__", ((512,), *measure_matmul_peak.__defaults__[1:]))


@pytest.fixture
def free_port() -> Callable[[], int]:
    """Call it for a port that is free on 127.0.0.1 right now (a new one each call)."""
    return free_port_number


@pytest.fixture
def dist_env() -> dict[str, str]:
    """An environment for child processes: no launcher variables, gloo on loopback, one thread each."""
    env = {name: value for name, value in os.environ.items()
           if name not in LAUNCHER_VARS and not name.startswith(LAUNCHER_PREFIXES)}
    env.update(GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


@pytest.fixture
def clean_launch_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process's own environment without launcher variables, for in-process launch tests."""
    for name in list(os.environ):
        if name in LAUNCHER_VARS or name.startswith(LAUNCHER_PREFIXES):
            monkeypatch.delenv(name)


# ---- tiny models ---------------------------------------------------------------------------------

# A 2-layer Llama-style model for CLI runs (`--model_config`): a few seconds per run on one core.
TINY_MODEL = dict(name="tiny", vocab_size=1100, padding_multiple=64, block_size=64, n_layer=2, n_head=2,
                  n_embd=64, n_query_groups=1, intermediate_size=128)


def write_tiny_model(path: Path, **overrides) -> Path:
    """TINY_MODEL with ``overrides`` as a `--model_config` YAML file at ``path``."""
    path.write_text(yaml.safe_dump({**TINY_MODEL, **overrides}))
    return path


@pytest.fixture
def compiled_blocks(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Filled as runs in this process compile: for each Block of each compiled model, whether it is compiled."""
    from llmtrain.distributed import parallelize
    from llmtrain.model import transformer_blocks

    compiled: list[bool] = []
    original = parallelize.apply_compile

    def recording(model):
        original(model)
        compiled.extend(block._compiled_call_impl is not None for block in transformer_blocks(model))

    monkeypatch.setattr(parallelize, "apply_compile", recording)
    return compiled


@pytest.fixture
def tiny_model_file(tmp_path: Path) -> Path:
    """TINY_MODEL as a `--model_config` file in this test's tmp_path."""
    return write_tiny_model(tmp_path / "tiny.yaml")


def tiny_config(name: str, **overrides) -> Config:
    """A zoo debug config made even smaller for fast tests."""
    return Config.from_name(name, **{"block_size": 64, "vocab_size": 128, **overrides})


def write_random_model_dir(path: Path, tokenizer: Tokenizer, *, std: float, block_size: int = 256,
                           write_extras: Optional[Callable[[Path], None]] = None) -> Path:
    """A model directory of a 2-layer llama-debug model over ``tokenizer``, every weight drawn from N(0, std) with
    seed 0: logits far from uniform, so that different prompts get different greedy answers."""
    from llmtrain.checkpoint.files import write_model_dir

    config = tiny_config("llama-debug", n_layer=2, block_size=block_size, vocab_size=tokenizer.vocab_size)
    torch.manual_seed(0)
    model = GPT(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, std)
    return write_model_dir(path, state_dict=model.state_dict(), model_config=config, hyperparameters=None,
                           tokenizer=tokenizer, write_extras=write_extras)


def build_model(config: Config, seed: int = 0) -> GPT:
    """The model of ``config`` with weights initialised from ``seed``, in eval mode."""
    model = GPT(config)
    torch.manual_seed(seed)
    model.init_weights()
    return model.eval()


# ---- tiny tokenizers and data --------------------------------------------------------------------


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Tokenizer]:
    """Call it with texts for a byte-level BPE tokenizer trained on them, in a folder of its own."""
    def train(texts: Iterable[str], vocab_size: int = 400) -> Tokenizer:
        return train_bpe_tokenizer(iter(texts), vocab_size=vocab_size, out_dir=tmp_path_factory.mktemp("tok") / "tok")

    return train


@pytest.fixture(scope="session")
def sentencepiece_style_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """A tokenizer.json as transformers converts a Llama 2 tokenizer.model: a "▁" before the text and for each
    space, <s> in front, and bytes as <0xNN> tokens for characters it never saw (ASCII only here)."""
    import json

    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, normalizers, processors, trainers

    hf_tokenizer = HFTokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    hf_tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    hf_tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                              decoders.Strip(" ", 1, 0)])
    byte_tokens = [f"<0x{byte:02X}>" for byte in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>", *byte_tokens],
                                  show_progress=False)
    hf_tokenizer.train_from_iterator(["The cat sat on the mat.", "A quick brown fox jumps over the lazy dog."] * 20,
                                     trainer=trainer)
    hf_tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B:1",
                                                                special_tokens=[("<s>", 1)])
    out_dir = tmp_path_factory.mktemp("sentencepiece_style")
    data = json.loads(hf_tokenizer.to_str())
    # The trainer lists the byte tokens as added tokens; in a converted Llama 2 tokenizer they are plain vocabulary.
    data["added_tokens"] = [token for token in data["added_tokens"] if token["content"] not in byte_tokens]
    (out_dir / "tokenizer.json").write_text(json.dumps(data))
    (out_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "add_bos_token": True, "add_eos_token": False, "legacy": True}))
    return Tokenizer(out_dir)


@pytest.fixture
def hf_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`datasets` with a cache in this test's tmp_path and no network (HFDataset on local files)."""
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True, raising=False)
    datasets.disable_progress_bars()


class ListLoader:
    """A fixed list of (input_ids, labels) samples served as micro-batches, sharded like llmtrain.data's
    TrainLoader: one global position; in each micro-step rank r takes the r-th contiguous slice of
    micro_batch_size samples."""

    def __init__(self, samples, micro_batch_size: int, dp_rank: int = 0, dp_size: int = 1) -> None:
        self.samples, self.micro_batch_size = samples, micro_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.samples_consumed = 0

    @property
    def epoch(self) -> float:
        return self.samples_consumed / len(self.samples)

    @property
    def samples_per_epoch(self) -> int:
        return len(self.samples)

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        start = self.samples_consumed + self.dp_rank * self.micro_batch_size
        chunk = [self.samples[(start + i) % len(self.samples)] for i in range(self.micro_batch_size)]
        self.samples_consumed += self.dp_size * self.micro_batch_size
        return {"input_ids": torch.stack([c[0] for c in chunk]), "labels": torch.stack([c[1] for c in chunk])}

    def state_dict(self) -> dict:
        return {"samples_consumed": self.samples_consumed}

    def load_state_dict(self, state: dict) -> None:
        self.samples_consumed = state["samples_consumed"]
