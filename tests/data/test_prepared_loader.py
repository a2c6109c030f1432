"""--data Prepared and --data Mixture: lazy shards, the shard order, mixing by weight, exact resume, and the CLI.

The prepared folders are written here (tokenize, cut into shards, write the manifest) in the layout of
llmtrain.data.manifest, so these tests do not depend on `llmtrain prepare_data`.
"""

from __future__ import annotations

import csv
import json
import os
import random
import runpy
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from llmtrain.cli import main
from llmtrain.data import Mixture, MixtureSource, Prepared
from llmtrain.data import manifest as layout
from llmtrain.data.mixture import BLOCK
from llmtrain.data.prepared import ShardOrder
from llmtrain.data.tokens import Piece, encode_pieces, token_dtype
from llmtrain.tokenizer import Tokenizer

from conftest import write_tiny_model
from prepared_loaders import connected, global_samples, loaders, same_rows

WORDS = "the a cat dog sat ran on under mat tree red blue quick slow and then def return if else for in x y".split()


def documents(count: int, seed: int, words: list[str] = WORDS) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(words) for _ in range(rng.randint(20, 120))) for _ in range(count)]


def write_prepared(root: Path, tokenizer: Tokenizer, texts: list[str], shard_tokens: int = 1000,
                   val_texts: list[str] = ()) -> Path:
    """``texts`` tokenized as the token cache does, in shards of ``shard_tokens``, under a manifest."""
    dtype = token_dtype(tokenizer.vocab_size)
    splits = {}
    for split, split_texts in (("train", texts), ("val", val_texts)):
        if not split_texts:
            continue
        ids, count = encode_pieces(tokenizer, [Piece(text) for text in split_texts])
        shards = []
        for index, start in enumerate(range(0, len(ids), shard_tokens)):
            name = layout.shard_name(split, 0, index)
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            (root / name).write_bytes(ids[start : start + shard_tokens].astype(dtype).tobytes())
            shards.append(layout.Shard(name, len(ids[start : start + shard_tokens]), layout.file_sha256(root / name)))
        splits[split] = layout.Split(shards, count)
    layout.write_manifest(root, layout.Manifest(tokenizer.fingerprint, str(tokenizer.checkpoint_dir),
                                                tokenizer.vocab_size, dtype.name, shard_tokens, "test texts", splits))
    return root


@pytest.fixture(scope="module")
def tokenizers(tiny_tokenizer) -> tuple[Tokenizer, Tokenizer]:
    """The tokenizer the folders are prepared with, and another one."""
    return tiny_tokenizer(documents(200, 0)), tiny_tokenizer(documents(200, 1), vocab_size=300)


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tokenizers) -> dict[str, Path]:
    """Three prepared folders: "text" (9 shards), "code" (other words, 4 shards), "other" (another tokenizer)."""
    root = tmp_path_factory.mktemp("prepared")
    tokenizer, other = tokenizers
    code_words = "def return if else for in x y ( ) : = + 0 1 2".split()
    return {"text": write_prepared(root / "text", tokenizer, documents(150, 2), val_texts=documents(20, 3)),
            "code": write_prepared(root / "code", tokenizer, documents(60, 4, code_words), shard_tokens=700),
            "other": write_prepared(root / "other", other, documents(50, 5))}


# ------------------------------------------------------------------------------------ Prepared


def test_windows_are_the_shards_tokens(folders, tokenizers) -> None:
    """Every window of an epoch once, read from the shard files: L + 1 tokens inside one shard, labels shifted."""
    module = connected(Prepared(folders["text"]), tokenizers[0], micro_batch_size=1)
    loader = module.train_dataloader()
    manifest = layout.read_manifest(folders["text"])
    expected = set()
    for shard in manifest.splits["train"].shards:
        tokens = np.fromfile(folders["text"] / shard.name, dtype=manifest.dtype)
        expected |= {tuple(tokens[i * 16 : i * 16 + 17].tolist()) for i in range((shard.tokens - 1) // 16)}
    seen = []
    for _ in range(loader.samples_per_epoch):
        batch = next(loader)
        assert torch.equal(batch["input_ids"][0, 1:], batch["labels"][0, :-1])
        seen.append(tuple(batch["input_ids"][0].tolist()) + (int(batch["labels"][0, -1]),))
    assert loader.samples_per_epoch == len(expected) and set(seen) == expected
    val = module.val_dataloader()
    assert val is not None and len(list(val)) > 0


def test_resume_on_one_rank_sees_what_an_uninterrupted_run_sees(folders, tokenizers) -> None:
    """3 ranks for 40 micro-steps (past an epoch), then 1 rank from their checkpointed position: the same samples,
    in the same order, as one rank from the start."""
    make = lambda: Prepared(folders["text"], shuffle_group=3)
    three = loaders(make, tokenizers[0], 3, seq_len=64)
    first_part = global_samples(three, 40)
    assert three[0].epoch > 1
    state = three[0].state_dict()
    assert all(loader.state_dict() == state for loader in three)
    resumed = loaders(make, tokenizers[0], 1, seq_len=64)[0]
    resumed.load_state_dict(state)
    second_part = global_samples([resumed], 30)
    uninterrupted = global_samples(loaders(make, tokenizers[0], 1, seq_len=64), 120 + 30)
    assert same_rows(first_part + second_part, uninterrupted)


def test_epochs_differ_and_the_seed_decides(folders, tokenizers) -> None:
    order = connected(Prepared(folders["text"]), tokenizers[0]).train_dataloader().order
    size = order.samples_per_epoch
    epoch0, epoch1 = order.indices(np.arange(size)), order.indices(np.arange(size, 2 * size))
    assert sorted(epoch0.tolist()) == sorted(epoch1.tolist()) == list(range(size))
    assert not np.array_equal(epoch0, epoch1)
    again = connected(Prepared(folders["text"]), tokenizers[0]).train_dataloader().order
    assert np.array_equal(again.indices(np.arange(2 * size)), np.concatenate([epoch0, epoch1]))
    other_seed = connected(Prepared(folders["text"]), tokenizers[0], seed=8).train_dataloader().order
    assert not np.array_equal(other_seed.indices(np.arange(size)), epoch0)


def test_shard_order_needs_no_permutation_of_every_window() -> None:
    """Half a million shards of 4096 windows (2 billion samples, 4T tokens at 2048): an index anywhere, at once."""
    order = ShardOrder(np.full(500_000, 4096), seed=1, group=8)
    started = time.perf_counter()
    positions = np.array([0, 1, 10**9, 2 * 10**9 - 1, 5 * 10**9 + 3])
    first = order.indices(positions)
    assert time.perf_counter() - started < 5
    assert ((first >= 0) & (first < order.samples_per_epoch)).all()
    assert np.array_equal(ShardOrder(np.full(500_000, 4096), seed=1, group=8).indices(positions[::-1]), first[::-1])
    group = order.indices(np.arange(8 * 4096))  # the first group: 8 whole shards, each window once
    assert len(np.unique(group)) == 8 * 4096 and len(np.unique(group // 4096)) == 8


def test_the_folder_decides_the_order_in_checkpoints(folders, tokenizers) -> None:
    """A checkpoint of another folder (or of a permutation-ordered module) is refused, naming the orders."""
    state = connected(Prepared(folders["text"]), tokenizers[0]).train_dataloader().state_dict()
    code = connected(Prepared(folders["code"]), tokenizers[0]).train_dataloader()
    with pytest.raises(ValueError, match="Cannot resume the data position"):
        code.load_state_dict({**state, "samples_per_epoch": code.samples_per_epoch})
    with pytest.raises(ValueError, match="a permutation"):
        code.load_state_dict({key: value for key, value in state.items() if key != "order"}
                             | {"samples_per_epoch": code.samples_per_epoch})


@pytest.mark.parametrize("damage", ["truncated", "missing"])
def test_a_damaged_folder_fails_naming_the_file(folders, tmp_path, tokenizers, damage) -> None:
    root = write_prepared(tmp_path / "damaged", tokenizers[0], documents(30, 6))
    shard = root / layout.shard_name("train", 0, 1)
    if damage == "truncated":
        shard.write_bytes(shard.read_bytes()[:-2])
    else:
        shard.unlink()
    with pytest.raises(ValueError, match=str(shard)):
        Prepared(root).validate()
    with pytest.raises(ValueError, match=str(shard)):
        Mixture([MixtureSource(folders["text"]), MixtureSource(root)]).validate()


def test_another_tokenizer_fails_naming_both(folders, tokenizers) -> None:
    tokenizer, other = tokenizers
    with pytest.raises(ValueError) as error:
        connected(Prepared(folders["text"]), other)
    assert str(tokenizer.checkpoint_dir) in str(error.value) and str(other.checkpoint_dir) in str(error.value)


def test_a_folder_without_manifest_says_how_to_prepare_it(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="--data.path .* prepare_data"):
        Prepared(tmp_path).validate()


def test_val_split_fraction_holds_out_the_tail(folders, tokenizers) -> None:
    """Without a val split of its own, the last tokens validate; train and val windows do not overlap."""
    module = connected(Prepared(folders["code"], val_split_fraction=0.2), tokenizers[0], micro_batch_size=1)
    train_windows = module._windows(module._splits.train)
    val_windows = module._windows(module._splits.val)
    total = sum(shard.tokens for shard in layout.read_manifest(folders["code"]).splits["train"].shards)
    assert sum(span.tokens for span in module._splits.val) == int(total * 0.2)
    assert sum(span.tokens for span in module._splits.train + module._splits.val) == total
    assert len(train_windows) + len(val_windows) > 0 and len(list(module.val_dataloader())) == len(val_windows)
    with pytest.raises(ValueError, match="validation split of its own"):
        Prepared(folders["text"], val_split_fraction=0.1).validate()  # before launch, not at setup
    with pytest.raises(ValueError, match="val_split_fraction 1e-09 .* holds out no token"):  # not silently no validation
        connected(Prepared(folders["code"], val_split_fraction=1e-9), tokenizers[0], micro_batch_size=1)


# ------------------------------------------------------------------------------------ Mixture


def mixture(folders, text_weight: float = 0.7, code_weight: float = 0.3) -> Mixture:
    return Mixture([MixtureSource(folders["text"], text_weight), MixtureSource(folders["code"], code_weight)],
                   val_split_fraction=0.1)


def test_mixture_hits_its_weights_and_reads_each_source(folders, tokenizers) -> None:
    module = connected(mixture(folders), tokenizers[0], micro_batch_size=10)
    loader = module.train_dataloader()
    order = loader.order
    sources, _ = order.locate(np.arange(10_000))
    assert abs((sources == 0).mean() - 0.7) < 0.02
    # Over any 10k positions, not only the first: blocks hold the weights exactly.
    sources, _ = order.locate(np.arange(123_457, 133_457))
    assert abs((sources == 0).mean() - 0.7) < 0.02
    # Across blocks, each source's samples are numbered 0, 1, 2, ... in position order, and counted alike.
    sources, local = order.locate(np.arange(2 * BLOCK + 1234))
    for source in (0, 1):
        assert np.array_equal(local[sources == source], np.arange((sources == source).sum()))
    assert np.array_equal(order.samples_before(2 * BLOCK + 1234), np.bincount(sources))
    text_windows = connected(Prepared(folders["text"]), tokenizers[0])._windows(
        connected(Prepared(folders["text"]), tokenizers[0])._splits.train)
    text_rows = {tuple(row.tolist()) for row in text_windows.batch(np.arange(len(text_windows)))["input_ids"]}
    from_text = 0
    for _ in range(100):
        from_text += sum(tuple(row.tolist()) in text_rows for row in next(loader)["input_ids"])
    assert abs(from_text / 1000 - 0.7) < 0.03  # the rows really come from the folders, by weight
    tokens = loader.metrics()
    assert tokens == {"data/tokens/text": order.samples_before(1000)[0] * 16,
                      "data/tokens/code": order.samples_before(1000)[1] * 16}
    assert sum(tokens.values()) == 1000 * 16


def test_mixture_resumes_exactly_at_another_world_size(folders, tokenizers) -> None:
    """Past the code source's first epoch: it is small, and repeats sooner than the text."""
    make = lambda: mixture(folders)
    three = loaders(make, tokenizers[0], 3, seq_len=64)
    first_part = global_samples(three, 50)
    resumed = loaders(make, tokenizers[0], 1, seq_len=64)[0]
    resumed.load_state_dict(three[1].state_dict())
    second_part = global_samples([resumed], 40)
    uninterrupted = global_samples(loaders(make, tokenizers[0], 1, seq_len=64), 150 + 40)
    assert same_rows(first_part + second_part, uninterrupted)
    sources, local = resumed.order.locate(np.arange(340))
    assert local[sources == 1].max() >= resumed.order.orders[1].samples_per_epoch
    with pytest.raises(ValueError, match="mixture"):  # other weights: another order
        other_weights = loaders(lambda: mixture(folders, 0.5, 0.5), tokenizers[0], 1, seq_len=64)[0]
        other_weights.load_state_dict(resumed.state_dict())


def test_mixture_validation_mixes_the_sources(folders, tokenizers) -> None:
    """text has its own val split, code holds out its tail: every val window is used at most once."""
    module = connected(mixture(folders), tokenizers[0], micro_batch_size=1)
    rows = [tuple(batch["input_ids"][0].tolist()) for batch in module.val_dataloader()]
    assert len(rows) > 10 and len(set(rows)) == len(rows)


@pytest.mark.parametrize("sources, says", [
    ([], "--data.sources is empty"),
    ([("text", 0.7), ("code", 0.0)], "weight 0"),
    ([("text", 1.0), ("code", -1.0)], "weight -1"),
    ([("text", 1.0), ("code", float("nan"))], "weight nan"),
    ([("text", 1.0), ("code", float("inf"))], "weight inf: every weight must be a positive, finite number"),
    ([("text", 1.0), ("other", 1.0)], "different tokenizers"),
    ([("text", 1.0), ("missing", 1.0)], r"--data.sources\[1\].path .*missing"),
    ([("text", 1.0), ("code", 1e-6)], "too small"),
    ([("text", 1.0), ("text", 1.0)], "give each a \"name\""),
])
def test_mixture_refuses_bad_sources(folders, sources, says) -> None:
    with pytest.raises((ValueError, FileNotFoundError), match=says):
        Mixture([MixtureSource(folders.get(name, folders["text"].parent / name), weight)
                 for name, weight in sources]).validate()


def test_mixture_refuses_a_val_fraction_that_no_source_takes(folders) -> None:
    """text has a val split of its own: the fraction would hold out nothing of a mixture of it alone."""
    both_have_val = [MixtureSource(folders["text"]), MixtureSource(folders["text"], name="again")]
    with pytest.raises(ValueError, match="--data.val_split_fraction 0.1 .*every source has a val split"):
        Mixture(both_have_val, val_split_fraction=0.1).validate()
    Mixture(both_have_val).validate()
    mixture(folders).validate()  # code has no val split: the fraction is its validation


# ------------------------------------------------------------------------------------ the CLI


def pretrain_args(model_file: Path, out_dir: Path, tokenizer: Tokenizer, *data: str) -> list[str]:
    return ["pretrain", "--model_config", str(model_file), "--out_dir", str(out_dir), *data,
            "--tokenizer_dir", str(tokenizer.checkpoint_dir), "--train.global_batch_size", "4",
            "--train.micro_batch_size", "2", "--train.max_seq_length", "32", "--train.max_steps", "6",
            "--train.lr_warmup_steps", "2", "--train.log_interval", "2", "--eval.interval", "100",
            "--eval.max_iters", "2", "--optimizer", "AdamW", "--optimizer.lr", "0.003"]


def test_pretrain_on_a_prepared_folder_and_on_a_mixture(folders, tokenizers, tmp_path) -> None:
    """The real CLI: a prepared folder trains; a mixture logs the tokens of each source, which add up."""
    model = write_tiny_model(tmp_path / "tiny.yaml", vocab_size=tokenizers[0].vocab_size)
    main(pretrain_args(model, tmp_path / "one", tokenizers[0], "--data", "Prepared", "--data.path",
                       str(folders["text"])))
    assert (tmp_path / "one" / "final" / "model.safetensors").is_file()
    sources = f'[{{"path": "{folders["text"]}", "weight": 0.7}}, {{"path": "{folders["code"]}", "weight": 0.3}}]'
    main(pretrain_args(model, tmp_path / "mix", tokenizers[0], "--data", "Mixture", "--data.sources", sources))
    with open(tmp_path / "mix" / "metrics.csv") as handle:
        rows = [row for row in csv.DictReader(handle) if row["loss"]]
    assert [int(row["step"]) for row in rows] == [2, 4, 6]
    for row in rows:
        text, code = int(row["data/tokens/text"]), int(row["data/tokens/code"])
        assert text + code == int(row["tokens"]) == int(row["step"]) * 4 * 32 and text > 0 and code > 0


def test_a_folder_without_a_validation_split_says_at_start_that_validation_is_off(folders, tokenizers, tmp_path,
                                                                                  capsys) -> None:
    model = write_tiny_model(tmp_path / "tiny.yaml", vocab_size=tokenizers[0].vocab_size)
    main(pretrain_args(model, tmp_path / "out", tokenizers[0], "--data", "Prepared", "--data.path",
                       str(folders["code"])))
    out = capsys.readouterr().out
    assert (f"--data.path {folders['code']} has no validation split: validation is off (no validation loss). To "
            "validate, pass --data.val_split_fraction 0.05") in out
    assert out.index("validation is off") < out.index("training 6 steps")  # said before the run, once
    assert out.count("validation is off") == 1
    with open(tmp_path / "out" / "metrics.csv") as handle:
        assert not any(row.get("val_loss") for row in csv.DictReader(handle))


def test_pretrain_refuses_the_wrong_tokenizers_before_launch(folders, tokenizers, tmp_path) -> None:
    """Exit 2 with one message naming both tokenizers, before any process starts or out_dir is made."""
    model = write_tiny_model(tmp_path / "tiny.yaml", vocab_size=tokenizers[0].vocab_size)
    sources = f'[{{"path": "{folders["text"]}"}}, {{"path": "{folders["other"]}"}}]'
    with pytest.raises(ValueError, match="different tokenizers"):
        main(pretrain_args(model, tmp_path / "out", tokenizers[0], "--data", "Mixture", "--data.sources", sources))
    argv = pretrain_args(model, tmp_path / "out", tokenizers[1], "--data", "Prepared", "--data.path",
                         str(folders["text"]), "--devices", "2", "--accelerator", "cpu")
    done = subprocess.run([sys.executable, "-m", "llmtrain", *argv], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("error: --data.path") and "Traceback" not in done.stderr
    assert str(tokenizers[0].checkpoint_dir) in done.stderr and str(tokenizers[1].checkpoint_dir) in done.stderr
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match="--data Prepared needs a tokenizer"):
        main([arg for arg in pretrain_args(model, tmp_path / "out", tokenizers[0], "--data", "Prepared",
                                           "--data.path", str(folders["text"]))
              if arg not in ("--tokenizer_dir", str(tokenizers[0].checkpoint_dir))])


def test_loader_benchmark_script_runs(tmp_path, monkeypatch) -> None:
    """bench/ab/loader_throughput.py on a small corpus: it reports positive rates and the 3T order's numbers."""
    results = tmp_path / "data.jsonl"
    monkeypatch.setattr("sys.argv", ["loader_throughput.py", "--shards", "3", "--shard_tokens", "5000",
                                     "--batches", "20", "--seq_len", "64", "--results", str(results)])
    script = Path(__file__).resolve().parents[2] / "bench" / "ab" / "loader_throughput.py"
    runpy.run_path(str(script), run_name="__main__")
    record = json.loads(results.read_text())
    assert record["prepared_tokens_per_s"] > 0 and record["mixture_tokens_per_s"] > 0
    assert record["corpus_shards"] == 357_627 and record["order_peak_memory_mb"] < 100
