"""`--data HFDataset --data.streaming true`: each rank streams its own part, tokenized on the fly, resumable exactly."""

import csv
import json
import shutil
import threading
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import llmtrain.data.streaming as streaming
from llmtrain.cli import main
from llmtrain.data import HFDataset
from llmtrain.data.base import TokenWindows, TrainLoader
from llmtrain.data.streaming import StreamingLoader, StreamPosition
from llmtrain.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[2]
SEQ = 8  # --train.max_seq_length of the loader tests: windows of 9 tokens
# Distinct documents of different lengths, so windows straddle document and chunk ends.
DOCUMENTS = [f"Doc {i}: " + " ".join(f"{word}{i % (j + 2)}" for j, word in enumerate(
    ("sun", "moon", "tide", "reef", "shell", "wave", "sand")[: 2 + i % 6])) + "." for i in range(40)]


@pytest.fixture(autouse=True)
def offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    datasets = pytest.importorskip("datasets")
    monkeypatch.setenv("LLMTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True, raising=False)
    # Chunks of a few documents, so that resume points fall inside chunks and between them.
    monkeypatch.setattr(streaming, "STREAM_CHUNK_CHARS", 150)
    datasets.disable_progress_bars()


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer) -> Tokenizer:
    return tiny_tokenizer(DOCUMENTS * 3)


def write_shards(folder: Path, documents: list[str], shards: int, file_format: str = "json") -> str:
    """``documents`` in ``shards`` files, in order; returns the glob that names them."""
    folder.mkdir(parents=True, exist_ok=True)
    for shard, rows in enumerate(np.array_split(np.arange(len(documents)), shards)):
        texts = [documents[i] for i in rows.tolist()]
        if file_format == "json":
            (folder / f"part{shard:02d}.jsonl").write_text("".join(json.dumps({"text": t, "id": 0}) + "\n"
                                                                   for t in texts))
        else:
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.table({"text": texts, "id": [0] * len(texts)}), folder / f"part{shard:02d}.parquet")
    return str(folder / ("*.jsonl" if file_format == "json" else "*.parquet"))


def streamed(files: str, tokenizer: Tokenizer, dp_rank: int = 0, dp_size: int = 1, file_format: str = "json",
             micro_batch_size: int = 2, **fields) -> HFDataset:
    data = HFDataset(file_format, data_files=files, streaming=True, **fields)
    data.validate()
    data.connect(tokenizer, micro_batch_size=micro_batch_size, max_seq_length=SEQ)
    data.prepare_data()
    data.setup(dp_rank, dp_size)
    return data


def take(loader, batches: int) -> list[torch.Tensor]:
    """``batches`` micro-batches as rows of (inputs, last label): the whole window of each sample."""
    rows = []
    for _ in range(batches):
        batch = next(loader)
        rows.extend(torch.cat([batch["input_ids"], batch["labels"][:, -1:]], dim=1))
    return rows


def first_pass_tokens(data: HFDataset) -> list[int]:
    """The token stream of this rank's first pass, stitched from its windows (which share one token) and the
    tokens carried into the second pass."""
    stitched: list[int] = []
    for window, position in data._train_windows(StreamPosition()):
        if position.passes > 0:
            return stitched[:-1] + list(position.carry) if stitched else list(position.carry)
        stitched.extend(window.tolist() if not stitched else window[1:].tolist())
    raise AssertionError("the stream ended")


# ------------------------------------------------------------------------------------------- the windows


@pytest.mark.parametrize("file_format", ["json", "parquet"])
def test_one_rank_streams_the_cached_windows_pass_after_pass(tmp_path, tokenizer, file_format):
    """Unshuffled, the windows are those of the token cache's stream, and the second pass follows the first
    without a seam (as a cached stream repeated)."""
    files = write_shards(tmp_path / "data", DOCUMENTS, shards=3, file_format=file_format)
    cached = HFDataset(file_format, data_files=files, val_split_fraction=0, num_workers=1)
    cached.connect(tokenizer, micro_batch_size=2, max_seq_length=SEQ)
    cached.prepare_data()
    cached.setup()
    tokens = np.asarray(cached._train_tokens)
    windows = TokenWindows(np.concatenate([tokens, tokens, tokens]), SEQ)
    per_pass = len(tokens) // SEQ
    loader = streamed(files, tokenizer, file_format=file_format).train_dataloader()
    rows = take(loader, per_pass + 3)  # 2 windows a micro-batch: past the end of the second pass
    assert [row.tolist() for row in rows] == [windows.batch(np.array([i]))["input_ids"][0].tolist()
                                              + windows.batch(np.array([i]))["labels"][0, -1:].tolist()
                                              for i in range(len(rows))]
    assert loader.epoch == 2.0 and loader.samples_consumed == 2 * (per_pass + 3)
    loader.close()


@pytest.mark.parametrize("shards", [4, 3], ids=["shards-divide", "rows-interleaved"])
def test_two_ranks_read_disjoint_parts_that_cover_the_data(tmp_path, tokenizer, shards):
    files = write_shards(tmp_path / "data", DOCUMENTS, shards=shards)
    seen = []
    for rank in range(2):
        stream = first_pass_tokens(streamed(files, tokenizer, rank, 2))
        ends = [i for i, token in enumerate(stream) if token == tokenizer.eos_id]
        assert ends[-1] == len(stream) - 1
        documents = [stream[a + 1 : b] for a, b in zip([-1] + ends, ends)]  # each: bos, text
        assert all(document[0] == tokenizer.bos_id for document in documents)
        seen.append([tokenizer.decode(document[1:]).strip() for document in documents])
    assert seen[0] and seen[1] and not set(seen[0]) & set(seen[1])
    assert sorted(seen[0] + seen[1]) == sorted(DOCUMENTS)


# ------------------------------------------------------------------------------------------- resume


@pytest.mark.parametrize("stop_after", [1, 7, 23], ids=["first-chunk", "mid-pass", "second-pass"])
def test_resume_gives_exactly_the_uninterrupted_windows(tmp_path, tokenizer, stop_after):
    files = write_shards(tmp_path / "data", DOCUMENTS, shards=4)
    total = 30  # micro-batches: about one and a half passes of rank 1's part
    uninterrupted = take(streamed(files, tokenizer, 1, 2).train_dataloader(), total)
    states = []
    for rank in range(2):  # what a checkpoint after `stop_after` micro-steps holds: every rank's position
        loader = streamed(files, tokenizer, rank, 2).train_dataloader()
        take(loader, stop_after)
        states.append(loader.state_dict())
        loader.close()
    if stop_after > 1:  # past the first chunk the ranks' positions differ: taking rank 0's would give other windows
        assert states[0]["position"] != states[1]["position"]
    saved = tmp_path / "data_state.pt"
    torch.save({"per_rank": states}, saved)
    resumed = streamed(files, tokenizer, 1, 2).train_dataloader()
    resumed.load_state_dict(torch.load(saved, weights_only=True))  # plain values, as training_state.pt needs
    assert resumed.samples_consumed == 2 * 2 * stop_after
    rest = take(resumed, total - stop_after)
    assert all(torch.equal(a, b) for a, b in zip(uninterrupted[2 * stop_after :], rest))
    assert len(rest) == len(uninterrupted) - 2 * stop_after


def test_resume_on_another_data_parallel_size_is_refused(tmp_path, tokenizer):
    files = write_shards(tmp_path / "data", DOCUMENTS, shards=2)
    loader = streamed(files, tokenizer).train_dataloader()
    take(loader, 2)
    state = {"per_rank": [loader.state_dict()]}
    with pytest.raises(ValueError, match="the checkpoint streamed on 1 data-parallel ranks, this run has 2"):
        streamed(files, tokenizer, 0, 2).train_dataloader().load_state_dict(state)
    with pytest.raises(ValueError, match="did not stream its data, this one does"):
        streamed(files, tokenizer).train_dataloader().load_state_dict({"samples_consumed": 8})
    with pytest.raises(ValueError, match="streamed its data, this one does not"):
        TrainLoader(10, lambda indices: {}, micro_batch_size=2).load_state_dict(state)
    loader.close()


def test_validation_is_the_head_of_val_split_the_same_on_every_call(tmp_path, tokenizer):
    files = {"train": write_shards(tmp_path / "train", DOCUMENTS[:30], shards=2),
             "validation": write_shards(tmp_path / "val", DOCUMENTS[30:], shards=1)}
    cached = HFDataset("json", data_files=files, val_split="validation", num_workers=1)
    cached.connect(tokenizer, micro_batch_size=2, max_seq_length=SEQ)
    cached.prepare_data()
    cached.setup()
    windows = TokenWindows(np.asarray(cached._val_tokens), SEQ)
    for rank in range(2):
        val = streamed(files, tokenizer, rank, 2, val_split="validation").val_dataloader()
        first = [batch["input_ids"] for batch in val]
        assert [b.tolist() for b in first] == [b["input_ids"].tolist() for b in val]  # every iter starts over
        rows = torch.cat(first).tolist()
        per_rank = len(windows) // 2
        assert rows == windows.batch(np.arange(per_rank) * 2 + rank)["input_ids"].tolist()
    assert streamed(files, tokenizer).val_dataloader() is None  # no --data.val_split: no validation


# ------------------------------------------------------------------------------------------- bad input


def test_bad_streaming_input_names_the_flag(tmp_path, tokenizer):
    files = write_shards(tmp_path / "data", DOCUMENTS, shards=1)
    with pytest.raises(ValueError, match="--data.val_split_fraction 0.05 holds out the end"):
        HFDataset("json", data_files=files, streaming=True, val_split_fraction=0.05).validate()
    with pytest.raises(ValueError, match="--data.val_split 'validation' is not available"):
        streamed(files, tokenizer, val_split="validation")
    with pytest.raises(ValueError, match="--data.text_field 'body' is not a column"):
        streamed(files, tokenizer, text_field="body")
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"text": ""}) + "\n")
    with pytest.raises(ValueError, match="has no text"):
        next(streamed(str(empty), tokenizer).train_dataloader())


# ------------------------------------------------------------------------------------------- the CLI


def cli_args(tmp_path: Path, tokenizer: Tokenizer, out_dir: Path, *extra: str) -> list[str]:
    files = write_shards(tmp_path / "data", DOCUMENTS * 4, shards=2)
    model = tmp_path / "model.yaml"
    if not model.exists():
        from conftest import write_tiny_model

        write_tiny_model(model, vocab_size=512)
    return ["pretrain", "--model_config", str(model), "--out_dir", str(out_dir), "--tokenizer_dir",
            str(tokenizer.checkpoint_dir), "--data", "HFDataset", "--data.path", "json", "--data.data_files", files,
            "--data.streaming", "true", "--train.global_batch_size", "4", "--train.micro_batch_size", "2",
            "--train.max_seq_length", "16", "--train.lr_warmup_steps", "2", "--train.log_interval", "1",
            "--train.max_steps", "8", "--train.save_interval", "4", "--eval.interval", "100",
            "--optimizer", "AdamW", "--optimizer.lr", "0.003", *extra]


def losses(out_dir: Path) -> dict[int, float]:
    with open(out_dir / "metrics.csv") as handle:
        return {int(r["step"]): float(r["loss"]) for r in csv.DictReader(handle) if r["loss"]}


def test_pretrain_streams_and_resumes_through_the_cli(tmp_path, tokenizer):
    """Steps 5-8 after a resume from step 4 have the losses of the uninterrupted run: the same windows."""
    full = tmp_path / "full"
    main(cli_args(tmp_path, tokenizer, full))
    # the run stopped its loaders' reading threads itself, none is left for the interpreter's exit to cut short
    assert not [thread for thread in threading.enumerate() if thread.name == "llmtrain-stream"]
    crashed = tmp_path / "crashed"
    crashed.mkdir()
    shutil.copytree(full / "step-00000004", crashed / "step-00000004")
    main(cli_args(tmp_path, tokenizer, crashed, "--resume", "auto"))
    expected, resumed = losses(full), losses(crashed)
    assert [resumed[s] for s in range(5, 9)] == [expected[s] for s in range(5, 9)]
    state = torch.load(full / "step-00000004" / "training_state.pt", weights_only=True)
    assert [entry["samples_consumed"] for entry in state["data"]["per_rank"]] == [16]
    with pytest.raises(ValueError, match="streamed its data, this one does not"):  # before any model is built
        main(cli_args(tmp_path, tokenizer, crashed, "--resume", "auto", "--data.streaming", "false"))


def test_streaming_errors_exit_2_through_the_command_line(tmp_path, tokenizer, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["llmtrain", *cli_args(tmp_path, tokenizer, tmp_path / "o",
                                                             "--data.val_split_fraction", "0.1")])
    with pytest.raises(SystemExit) as exit_info:
        main()  # as the console script: one message, exit 2
    assert exit_info.value.code == 2
    assert "error: --data.val_split_fraction 0.1 holds out the end" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()  # refused before anything was built


def test_two_ranks_stream_save_every_position_and_resume(tmp_path, tokenizer, dist_env):
    """Two gloo workers each stream their part; a checkpoint keeps both positions, a resume on two continues
    with the uninterrupted run's losses, and a resume on one is refused with the reason."""
    env = dict(dist_env, LLMTRAIN_CACHE_DIR=str(tmp_path / "cache"), HF_HUB_OFFLINE="1",
               HF_DATASETS_CACHE=str(tmp_path / "hf_cache"))

    def run(out_dir: Path, *extra: str) -> None:
        command = [sys.executable, "-m", "llmtrain", *cli_args(tmp_path, tokenizer, out_dir, "--devices", "2",
                                                                 "--strategy", "ddp", *extra)]
        result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    full = tmp_path / "full"
    run(full)
    state = torch.load(full / "step-00000004" / "training_state.pt", weights_only=True)
    ranks = state["data"]["per_rank"]
    assert [entry["dp_rank"] for entry in ranks] == [0, 1]
    crashed = tmp_path / "crashed"
    crashed.mkdir()
    shutil.copytree(full / "step-00000004", crashed / "step-00000004")
    run(crashed, "--resume", "auto")
    expected, resumed = losses(full), losses(crashed)
    assert [resumed[s] for s in range(5, 9)] == [expected[s] for s in range(5, 9)]
    with pytest.raises(ValueError, match="--resume .* streamed on 2 data-parallel ranks, this run has 1"):
        main(cli_args(tmp_path, tokenizer, crashed, "--resume", "auto"))
