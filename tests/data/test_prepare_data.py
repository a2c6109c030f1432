"""`llmtrain prepare_data`: the prepared folder holds the token cache's stream, whoever prepared it and however
often it was stopped, and a finished folder is never redone."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import LAUNCHER_PREFIXES, LAUNCHER_VARS
from prepared_loaders import global_samples, loaders, same_rows

from llmtrain.data import BuiltinStories, HFDataset, Prepared, PythonStdlib, TextFiles
from llmtrain.checkpoint.layout import LOCK_FILE
from llmtrain.data import manifest as layout
from llmtrain.data.prepare import KILL_AFTER_UNITS_ENV
from llmtrain.data.tokens import open_tokens
from llmtrain.recipes.prepare_data import setup as prepare_data

ROOT = Path(__file__).resolve().parents[2]
WORDS = ["the", "cat", "sat", "on", "a", "mat", "and", "then", "ran", "to", "its", "home", "def", "return", "x"]
SHARD_TOKENS = 3000
UNIT_BYTES = 3000


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMTRAIN_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Text files of very different sizes: several per unit, one larger than a unit, one spanning shards."""
    folder = tmp_path_factory.mktemp("corpus") / "text"
    rng = random.Random(0)
    for index, lines in enumerate([30, 5, 40, 1, 400, 20, 60, 0, 35, 25, 50, 10]):
        text = "\n".join(" ".join(rng.choices(WORDS, k=rng.randint(3, 14))) for _ in range(lines))
        (folder / f"part{index // 4}").mkdir(parents=True, exist_ok=True)
        (folder / f"part{index // 4}" / f"file{index:02d}.txt").write_text(text)
    return folder


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer):
    return tiny_tokenizer([" ".join(WORDS)] * 20, vocab_size=300)


def child_env(**extra: str) -> dict[str, str]:
    """No launcher variables of the shell the tests run in, gloo on loopback, one thread per process."""
    env = {name: value for name, value in os.environ.items()
           if name not in LAUNCHER_VARS and not name.startswith(LAUNCHER_PREFIXES)}
    return dict(env, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)


def run_cli(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmtrain", "prepare_data", *args], env=child_env(**env),
                          capture_output=True, text=True, timeout=300, cwd=ROOT)


def text_flags(corpus: Path, tokenizer, out_dir: Path, *extra: str) -> list[str]:
    return ["--data", "TextFiles", "--data.train_data_path", str(corpus), "--tokenizer_dir",
            str(tokenizer.checkpoint_dir), "--out_dir", str(out_dir), "--shard_tokens", str(SHARD_TOKENS),
            "--unit_bytes", str(UNIT_BYTES), *extra]


def contents(root: Path) -> dict[str, bytes]:
    """Every file of a prepared folder but the progress records and the lock file (it names its holder), by path."""
    return {str(path.relative_to(root)): path.read_bytes() for path in sorted(root.rglob("*"))
            if path.is_file() and layout.PROGRESS_DIR not in path.parts and path.name != LOCK_FILE}


def prepared_tokens(root: Path, split: str = "train") -> list[int]:
    manifest = layout.read_manifest(root)
    shards = [layout.open_shard(root, shard, manifest.dtype) for shard in manifest.splits[split].shards]
    return np.concatenate(shards).tolist()


@pytest.fixture(scope="module")
def reference(corpus: Path, tokenizer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The corpus prepared by one rank with a pool of two processes."""
    out_dir = tmp_path_factory.mktemp("reference") / "prepared"
    done = run_cli(*text_flags(corpus, tokenizer, out_dir, "--num_workers", "2"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "prepared" in done.stdout and "tokens/s" in done.stdout
    return out_dir


def test_the_prepared_folder_holds_the_token_cache_stream(reference: Path, corpus: Path, tokenizer) -> None:
    manifest = layout.read_manifest(reference)
    layout.check_shards(reference, manifest, check="sha256")  # the manifest's sizes and checksums are the files'
    assert manifest.tokenizer == tokenizer.fingerprint and manifest.dtype == "uint16"
    assert list(manifest.splits) == ["train"]  # the held-out fraction is the reader's business
    shards = manifest.splits["train"].shards
    units = {shard.name.split("-")[1] for shard in shards}
    assert len(units) >= 4 and len(shards) > len(units)  # several units, one of them cut into several shards
    assert all(0 < shard.tokens <= SHARD_TOKENS for shard in shards)
    assert manifest.splits["train"].documents == 11  # 12 files, one of them empty: no document

    cache = TextFiles(train_data_path=corpus, val_split_fraction=0.0, num_workers=1)
    cache.connect(tokenizer, micro_batch_size=1, max_seq_length=8)
    cache.prepare_data()
    assert prepared_tokens(reference) == open_tokens(cache._files.train).tolist()


@pytest.mark.multiproc
def test_two_ranks_prepare_the_same_bytes(reference: Path, corpus: Path, tokenizer, tmp_path: Path) -> None:
    out_dir = tmp_path / "two"
    done = run_cli(*text_flags(corpus, tokenizer, out_dir, "--devices", "2", "--num_workers", "1"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 rank(s)" in done.stdout
    assert contents(out_dir) == contents(reference)
    # Prepared by 2, trained on 3, resumed on 1: exactly the samples of one uninterrupted rank.
    make = lambda: Prepared(out_dir, shuffle_group=2)
    three = loaders(make, tokenizer, 3, seq_len=32)
    first_part = global_samples(three, 20)
    resumed = loaders(make, tokenizer, 1, seq_len=32)[0]
    resumed.load_state_dict(three[0].state_dict())
    second_part = global_samples([resumed], 25)
    assert same_rows(first_part + second_part, global_samples(loaders(make, tokenizer, 1, seq_len=32), 60 + 25))


@pytest.mark.multiproc
def test_an_out_dir_that_another_node_cannot_see_is_refused(corpus: Path, tokenizer, tmp_path: Path,
                                                            free_port) -> None:
    """Two "nodes" under torchrun's variables, each given a folder of its own, as node-local disks would be."""
    port = str(free_port())
    ranks = []
    for rank in range(2):
        env = child_env(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", GROUP_RANK=str(rank),
                        MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        command = [sys.executable, "-m", "llmtrain", "prepare_data",
                   *text_flags(corpus, tokenizer, tmp_path / f"node{rank}", "--num_nodes", "2", "--num_workers", "1")]
        ranks.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      cwd=ROOT))
    outputs = [rank.communicate(timeout=300) for rank in ranks]
    assert all(rank.returncode != 0 for rank in ranks), outputs
    assert "is not the same folder on every node: rank(s) [1]" in outputs[0][1], outputs[0][1]
    assert not layout.is_prepared(tmp_path / "node0") and not layout.is_prepared(tmp_path / "node1")


@pytest.mark.multiproc
def test_a_killed_preparation_resumes_and_ends_identical(reference: Path, corpus: Path, tokenizer,
                                                         tmp_path: Path) -> None:
    out_dir = tmp_path / "killed"
    flags = text_flags(corpus, tokenizer, out_dir, "--num_workers", "1")
    killed = run_cli(*flags, **{KILL_AFTER_UNITS_ENV: "3"})
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr
    assert not layout.is_prepared(out_dir)
    done_before = sorted(path.name for path in (out_dir / layout.PROGRESS_DIR).glob("train-*.json"))
    assert done_before == ["train-00000.json", "train-00001.json", "train-00002.json"]
    # What a unit killed mid-write leaves: a shard without a record, and a temporary file.
    (out_dir / layout.shard_name("train", 3, 0)).write_bytes(b"half a shard")
    (out_dir / "train" / f".unit-00003-0001.bin{layout.TEMP_MARK}999").write_bytes(b"junk")

    resumed = run_cli(*flags)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    total = layout.read_manifest(reference).source.split("train: ")[1].split(" unit")[0]
    assert f"{int(total) - 3} of {total} units to do" in resumed.stdout
    assert contents(out_dir) == contents(reference)



def test_a_finished_folder_is_never_redone(reference: Path, corpus: Path, tokenizer, clean_launch_env: None,
                                           capsys: pytest.CaptureFixture) -> None:
    times = {path: path.stat().st_mtime_ns for path in reference.rglob("*")}
    prepare_data(TextFiles(train_data_path=corpus), reference, tokenizer_dir=tokenizer.checkpoint_dir,
                 shard_tokens=SHARD_TOKENS, unit_bytes=UNIT_BYTES, verify=True)
    assert "prepared already" in capsys.readouterr().out
    assert {path: path.stat().st_mtime_ns for path in reference.rglob("*")} == times  # not even a progress record


def hf_source(tmp_path: Path, file_format: str) -> HFDataset:
    """A train and a validation file of rows (some empty, which are no documents) in ``file_format``."""
    rng = random.Random(1)
    files = {}
    for split, count in (("train", 300), ("validation", 40)):
        rows = [" ".join(rng.choices(WORDS, k=rng.randint(0, 30))) for _ in range(count)]
        path = tmp_path / f"{split}.{file_format}"
        if file_format == "jsonl":
            path.write_text("".join(json.dumps({"body": row, "id": i}) + "\n" for i, row in enumerate(rows)))
        else:
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.table({"body": rows, "id": list(range(count))}), path)
        files[split] = str(path)
    builder = "json" if file_format == "jsonl" else "parquet"
    return HFDataset(builder, data_files=files, text_field="body", val_split="validation", num_workers=1)


@pytest.mark.parametrize("source", ["jsonl", "parquet", "BuiltinStories", "PythonStdlib"])
def test_every_pretraining_module_prepares_its_cache_stream(source: str, tokenizer, tmp_path: Path,
                                                            clean_launch_env: None, request) -> None:
    if source in ("jsonl", "parquet"):
        request.getfixturevalue("hf_offline")
        data = hf_source(tmp_path, source)
    elif source == "BuiltinStories":
        data = BuiltinStories(num_documents=60, num_val_documents=7)
    else:
        data = PythonStdlib(max_bytes=60_000, val_fraction=0.2)
    out_dir = tmp_path / "prepared"
    prepare_data(data, out_dir, tokenizer_dir=tokenizer.checkpoint_dir, shard_tokens=SHARD_TOKENS,
                 unit_bytes=UNIT_BYTES, num_workers=1)
    manifest = layout.read_manifest(out_dir)
    assert len({shard.name.split("-")[1] for shard in manifest.splits["train"].shards}) >= 2  # several units

    data.connect(tokenizer, micro_batch_size=1, max_seq_length=8)
    data.prepare_data()
    assert prepared_tokens(out_dir, "train") == open_tokens(data._files.train).tolist()
    assert prepared_tokens(out_dir, "val") == open_tokens(data._files.val).tolist()


def test_a_folder_from_another_tokenizer_or_source_is_refused(reference: Path, corpus: Path, tiny_tokenizer,
                                                              tokenizer, clean_launch_env: None) -> None:
    other = tiny_tokenizer(["other words entirely"] * 20, vocab_size=280)
    with pytest.raises(ValueError, match=f"tokenizer in {tokenizer.checkpoint_dir}, not the one in"):
        prepare_data(TextFiles(train_data_path=corpus), reference, tokenizer_dir=other.checkpoint_dir,
                     shard_tokens=SHARD_TOKENS, unit_bytes=UNIT_BYTES)
    with pytest.raises(ValueError, match="holds data prepared from TextFiles"):
        prepare_data(TextFiles(train_data_path=corpus / "part0"), reference, tokenizer_dir=tokenizer.checkpoint_dir,
                     shard_tokens=SHARD_TOKENS, unit_bytes=UNIT_BYTES)


def test_documents_without_tokens_are_refused(tmp_path: Path, tokenizer, hf_offline: None,
                                              clean_launch_env: None) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text("".join(json.dumps({"text": ""}) + "\n" for _ in range(5)))
    with pytest.raises(ValueError, match="has no training tokens"):
        prepare_data(HFDataset("json", data_files=str(path), num_workers=1), tmp_path / "out",
                     tokenizer_dir=tokenizer.checkpoint_dir, num_workers=1)
    assert not layout.is_prepared(tmp_path / "out")


def test_bad_input_exits_2_with_one_message_before_any_work(tmp_path: Path, corpus: Path, tokenizer,
                                                             clean_launch_env: None, monkeypatch, capsys) -> None:
    """As the console script, in this process (a fresh interpreter would add only its start-up)."""
    from llmtrain.cli import main

    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setattr(sys, "argv", ["llmtrain", "prepare_data", *text_flags(empty, tokenizer, tmp_path / "out")])
    with pytest.raises(SystemExit) as exit_info:
        main()
    stderr = capsys.readouterr().err
    assert exit_info.value.code == 2 and stderr.startswith("error: --data.train_data_path"), stderr
    assert "contains no .txt files" in stderr and not (tmp_path / "out").exists()
    assert "Traceback" not in stderr


def test_an_out_dir_that_cannot_be_written_is_refused(tmp_path: Path, corpus: Path, tokenizer,
                                                      clean_launch_env: None) -> None:
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    with pytest.raises(ValueError, match=f"--out_dir {a_file / 'out'} cannot be written"):
        prepare_data(TextFiles(train_data_path=corpus), a_file / "out", tokenizer_dir=tokenizer.checkpoint_dir)


def test_a_streaming_source_is_refused(tmp_path: Path, tokenizer) -> None:
    """prepare_data tokenizes everything up front: a --data.streaming true source is a contradiction, not ignored."""
    (tmp_path / "docs.jsonl").write_text(json.dumps({"text": "one document"}) + "\n")
    data = HFDataset(path="json", data_files=str(tmp_path / "docs.jsonl"), streaming=True)
    with pytest.raises(ValueError, match="--data.streaming true tokenizes while training"):
        prepare_data(data=data, out_dir=tmp_path / "prepared", tokenizer_dir=tokenizer.checkpoint_dir)
    assert not (tmp_path / "prepared").exists()


def test_a_val_split_fraction_is_refused_not_ignored(tmp_path: Path, corpus: Path, tokenizer) -> None:
    """A prepared folder has no held-out tail: the fraction belongs to the run that trains on it."""
    (tmp_path / "docs.jsonl").write_text(json.dumps({"text": "one document"}) + "\n")
    for data in (TextFiles(train_data_path=corpus, val_split_fraction=0.2),
                 HFDataset(path="json", data_files=str(tmp_path / "docs.jsonl"), val_split_fraction=0.0)):
        fraction = f"{data.val_split_fraction:g}"
        with pytest.raises(ValueError, match=f"--data.val_split_fraction {fraction} holds out .*--data Prepared "
                                             f"--data.path {tmp_path / 'prepared'} --data.val_split_fraction {fraction}"):
            prepare_data(data=data, out_dir=tmp_path / "prepared", tokenizer_dir=tokenizer.checkpoint_dir)
        assert not (tmp_path / "prepared").exists()


def test_another_shard_size_for_a_prepared_folder_is_refused(reference: Path, corpus: Path, tokenizer) -> None:
    """--shard_tokens is never ignored: a finished folder cut into other shards is named, not called prepared."""
    before = contents(reference)
    with pytest.raises(ValueError, match=f"with --shard_tokens {SHARD_TOKENS}, not {2 * SHARD_TOKENS}"):
        prepare_data(TextFiles(corpus, num_workers=1), reference, tokenizer_dir=tokenizer.checkpoint_dir,
                     shard_tokens=2 * SHARD_TOKENS, unit_bytes=UNIT_BYTES, num_workers=1)
    assert contents(reference) == before
