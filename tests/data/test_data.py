import json
import re
from pathlib import Path
from typing import Optional

import numpy as np
import pytest
import torch

import llmtrain.data.tokens as tokens_module
from llmtrain.data import REGISTRY, BuiltinStories, DataModule, HFDataset, TextFiles, TrainLoader, ValLoader, cache_dir
from llmtrain.data.base import TokenWindows
from llmtrain.data.stories import NUMBERS, generate_stories
from llmtrain.tokenizer import Tokenizer, train_bpe_tokenizer

DOCUMENTS = [
    f"Story {i}: {name} went to the {place} and found {i % 7 + 1} shells. It was a good day.\n"
    for i, (name, place) in enumerate(
        (name, place) for name in ("Tom", "Lily", "Ben", "Mia") for place in ("park", "beach", "forest", "farm")
    )
]


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("LLMTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer) -> Tokenizer:
    return tiny_tokenizer(DOCUMENTS * 5)


@pytest.fixture
def tokenize_calls(monkeypatch: pytest.MonkeyPatch) -> list:
    """Records every real (uncached) tokenization."""
    calls: list = []
    original = tokens_module._tokenize

    def counting(*args, **kwargs):
        calls.append(args[2])
        return original(*args, **kwargs)

    monkeypatch.setattr(tokens_module, "_tokenize", counting)
    return calls


def write_text_files(folder: Path, documents: list[str]) -> Path:
    for index, text in enumerate(documents):
        path = folder / f"part{index // 4}" / f"doc{index:03d}.txt"  # nested: the search is recursive
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return folder


def arange_loader(num_samples: int, micro_batch_size: int, dp_rank: int = 0, dp_size: int = 1, seed: int = 7,
                  shuffle: bool = True, max_seq_length: int = 4) -> TrainLoader:
    """A loader over windows of 0, 1, 2, ...: window i starts with token i * max_seq_length."""
    windows = TokenWindows(np.arange(num_samples * max_seq_length + 1), max_seq_length)
    return TrainLoader(len(windows), windows.batch, micro_batch_size, dp_rank, dp_size, seed, shuffle)


def window_ids(batch: dict, max_seq_length: int = 4) -> list[int]:
    return (batch["input_ids"][:, 0] // max_seq_length).tolist()


def take(loader, steps: int) -> list[dict]:
    return [next(loader) for _ in range(steps)]


def prepared(module: DataModule, tokenizer: Tokenizer, micro_batch_size: int = 2, max_seq_length: int = 16,
             dp_rank: int = 0, dp_size: int = 1) -> DataModule:
    module.validate()
    module.connect(tokenizer, micro_batch_size=micro_batch_size, max_seq_length=max_seq_length)
    module.prepare_data()
    module.setup(dp_rank, dp_size)
    return module


def stream_of(documents: list[str], tokenizer: Tokenizer) -> list[int]:
    return [i for text in documents for i in tokenizer.encode(text, eos=True)]


# ------------------------------------------------------------------------------------- loaders


def test_windows_and_labels() -> None:
    tokens = np.arange(100, 100 + 4 * 5 + 3, dtype=np.uint16)  # 5 windows of length 4 (+1), 2 tokens spare
    windows = TokenWindows(tokens, max_seq_length=4)
    assert len(windows) == 5
    batch = windows.batch(np.array([0, 3]))
    assert batch["input_ids"].dtype == batch["labels"].dtype == torch.long
    assert batch["input_ids"].tolist() == [[100, 101, 102, 103], [112, 113, 114, 115]]
    assert batch["labels"].tolist() == [[101, 102, 103, 104], [113, 114, 115, 116]]


def test_each_epoch_is_a_fresh_permutation() -> None:
    loader = arange_loader(num_samples=12, micro_batch_size=3)
    first, second = [sum((window_ids(b) for b in take(loader, 4)), []) for _ in range(2)]
    assert sorted(first) == sorted(second) == list(range(12))
    assert first != second and first != list(range(12))
    assert loader.epoch == 2.0 and loader.samples_consumed == 24
    sequential = arange_loader(num_samples=12, micro_batch_size=3, shuffle=False)
    assert sum((window_ids(b) for b in take(sequential, 5)), []) == list(range(12)) + [0, 1, 2]


@pytest.mark.parametrize("stop_after", [0, 2, 3, 4, 7])
def test_restored_position_continues_exactly(stop_after: int) -> None:
    # 10 samples, 3 per step: steps 3 and 6 straddle epoch boundaries.
    uninterrupted = take(arange_loader(num_samples=10, micro_batch_size=3), 10)
    interrupted = arange_loader(num_samples=10, micro_batch_size=3)
    take(interrupted, stop_after)
    state = json.loads(json.dumps(interrupted.state_dict()))  # plain values only
    restored = arange_loader(num_samples=10, micro_batch_size=3)
    restored.load_state_dict(state)
    for expected, actual in zip(uninterrupted[stop_after:], take(restored, 10 - stop_after)):
        assert torch.equal(expected["input_ids"], actual["input_ids"])
        assert torch.equal(expected["labels"], actual["labels"])


@pytest.mark.parametrize("num_samples", [12, 10])
def test_ranks_split_each_global_micro_step(num_samples: int) -> None:
    single = arange_loader(num_samples, micro_batch_size=4)
    halves = [arange_loader(num_samples, micro_batch_size=2, dp_rank=rank, dp_size=2) for rank in (0, 1)]
    for _ in range(6):  # two or more epochs; with 10 samples, steps straddle epoch boundaries
        rank0, rank1 = (window_ids(next(loader)) for loader in halves)
        if num_samples % 4 == 0:  # within one epoch no window repeats, so the ranks never share one
            assert not set(rank0) & set(rank1)
        assert rank0 + rank1 == window_ids(next(single))
    # The same global order also at dp 1 with the per-rank micro batch: two micro-steps per dp-2 step.
    small = arange_loader(num_samples=10, micro_batch_size=2)
    ranks = [arange_loader(num_samples=10, micro_batch_size=2, dp_rank=rank, dp_size=2) for rank in (0, 1)]
    for _ in range(4):
        assert window_ids(next(small)) == window_ids(next(ranks[0]))
        assert window_ids(next(small)) == window_ids(next(ranks[1]))


def test_position_is_independent_of_data_parallel_size() -> None:
    reference = arange_loader(num_samples=10, micro_batch_size=4)
    expected = [window_ids(b) for b in take(reference, 8)]
    ranks = [arange_loader(num_samples=10, micro_batch_size=2, dp_rank=rank, dp_size=2) for rank in (0, 1)]
    for _ in range(3):
        for loader in ranks:
            next(loader)
    assert ranks[0].state_dict() == ranks[1].state_dict()
    resumed = arange_loader(num_samples=10, micro_batch_size=4)  # one rank, twice the micro batch
    resumed.load_state_dict(ranks[0].state_dict())
    assert [window_ids(b) for b in take(resumed, 5)] == expected[3:]
    # And back: a dp-1 state continues at dp 2.
    back = [arange_loader(num_samples=10, micro_batch_size=2, dp_rank=rank, dp_size=2) for rank in (0, 1)]
    for loader in back:
        loader.load_state_dict(resumed.state_dict())
    assert window_ids(next(back[0])) + window_ids(next(back[1])) == window_ids(next(reference))


def test_load_state_rejects_a_changed_dataset() -> None:
    state = arange_loader(num_samples=10, micro_batch_size=2).state_dict()
    with pytest.raises(ValueError, match="samples_per_epoch is 10.*11"):
        arange_loader(num_samples=11, micro_batch_size=2).load_state_dict(state)
    with pytest.raises(ValueError, match="seed"):
        arange_loader(num_samples=10, micro_batch_size=2, seed=8).load_state_dict(state)


def test_val_loader_is_sequential_sharded_and_reiterable() -> None:
    windows = TokenWindows(np.arange(11 * 4 + 1), 4)
    single = ValLoader(len(windows), windows.batch, micro_batch_size=3)
    assert [window_ids(b) for b in single] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10]]
    assert [window_ids(b) for b in single] == [window_ids(b) for b in single] and len(single) == 4
    ranks = [ValLoader(len(windows), windows.batch, 2, dp_rank=rank, dp_size=3) for rank in range(3)]
    assert [[window_ids(b) for b in loader] for loader in ranks] == [
        [[0, 3], [6]], [[1, 4], [7]], [[2, 5], [8]]]  # equal batch counts; windows 9, 10 dropped


# ------------------------------------------------------------------------------------- TextFiles


def test_text_files_end_to_end(tmp_path: Path, tokenizer: Tokenizer, isolated_cache: Path) -> None:
    folder = write_text_files(tmp_path / "texts", DOCUMENTS)
    data = prepared(TextFiles(folder, val_split_fraction=0.25, num_workers=1), tokenizer)
    stream = stream_of(DOCUMENTS, tokenizer)  # files are read in sorted path order
    num_val = int(len(stream) * 0.25)
    assert data._train_tokens.tolist() == stream[: len(stream) - num_val]
    assert data._val_tokens.tolist() == stream[len(stream) - num_val :]
    assert data._train_tokens.dtype == np.uint16
    batch = next(iter(data.train_dataloader()))
    assert batch["input_ids"].shape == batch["labels"].shape == (2, 16)
    assert torch.equal(batch["input_ids"][:, 1:], batch["labels"][:, :-1])
    val_batches = list(data.val_dataloader())
    assert sum(len(b["input_ids"]) for b in val_batches) == (num_val - 1) // 16
    assert cache_dir() == isolated_cache and not list(isolated_cache.rglob("*.tmp-*"))  # writes were atomic


def test_text_files_with_val_folder_and_no_split(tmp_path: Path, tokenizer: Tokenizer) -> None:
    train = write_text_files(tmp_path / "train", DOCUMENTS[:12])
    val = write_text_files(tmp_path / "val", DOCUMENTS[12:])
    data = prepared(TextFiles(train, val_data_path=val, num_workers=1), tokenizer)
    assert data._train_tokens.tolist() == stream_of(DOCUMENTS[:12], tokenizer)
    assert data._val_tokens.tolist() == stream_of(DOCUMENTS[12:], tokenizer)
    no_val = prepared(TextFiles(train, val_split_fraction=0.0, num_workers=1), tokenizer)
    assert no_val.val_dataloader() is None


@pytest.mark.parametrize("fraction", [0.3, 0.0])
def test_text_files_refuse_a_val_fraction_beside_a_val_folder(tmp_path: Path, fraction: float) -> None:
    train = write_text_files(tmp_path / "train", DOCUMENTS[:12])
    val = write_text_files(tmp_path / "val", DOCUMENTS[12:])
    with pytest.raises(ValueError, match=f"--data.val_split_fraction {fraction:g} .*--data.val_data_path {val}"):
        TextFiles(train, val_data_path=val, val_split_fraction=fraction).validate()


def test_text_files_refuse_a_val_folder_inside_the_train_folder(tmp_path: Path) -> None:
    """The search is recursive: a val folder under the train folder would be trained on too."""
    train = write_text_files(tmp_path / "corpus", DOCUMENTS[:12])
    val = write_text_files(tmp_path / "corpus" / "val", DOCUMENTS[12:])
    with pytest.raises(ValueError, match=f"--data.val_data_path {val} and --data.train_data_path {train} share 4 "):
        TextFiles(train, val_data_path=val).validate()
    TextFiles(train / "part0", val_data_path=val).validate()  # disjoint: fine


def test_text_files_skip_empty_files_and_refuse_a_folder_of_them(tmp_path: Path, tokenizer: Tokenizer) -> None:
    folder = write_text_files(tmp_path / "texts", DOCUMENTS[:2] + [""] + DOCUMENTS[2:4])
    data = prepared(TextFiles(folder, val_split_fraction=0.0, num_workers=1), tokenizer, max_seq_length=4)
    assert data._train_tokens.tolist() == stream_of(DOCUMENTS[:4], tokenizer)  # no bos, eos for the empty file
    units = TextFiles(folder).work_units("train", unit_bytes=1 << 20)  # what prepare_data reads
    assert [Path(file).name for unit in units for file in unit.files] == ["doc000.txt", "doc001.txt", "doc003.txt",
                                                                          "doc004.txt"]
    empty = write_text_files(tmp_path / "empty", ["", ""])
    with pytest.raises(ValueError, match=f"--data.train_data_path {empty} holds only empty .txt files"):
        TextFiles(empty).validate()
    with pytest.raises(ValueError, match=f"--data.val_data_path {empty / 'part0' / 'doc000.txt'} holds only empty"):
        TextFiles(folder, val_data_path=empty / "part0" / "doc000.txt").validate()


def test_second_prepare_reuses_the_cache(tmp_path: Path, tokenizer: Tokenizer, tokenize_calls: list) -> None:
    folder = write_text_files(tmp_path / "texts", DOCUMENTS)
    first = prepared(TextFiles(folder, num_workers=1), tokenizer)
    cached = first._files.train
    mtime = cached.stat().st_mtime_ns
    second = prepared(TextFiles(folder, num_workers=1), tokenizer)  # as a later run would
    second.prepare_data()  # and again: idempotent
    assert len(tokenize_calls) == 1 and second._files.train == cached and cached.stat().st_mtime_ns == mtime
    assert np.array_equal(first._train_tokens, second._train_tokens)
    (folder / "part0" / "doc000.txt").write_text("An edited story.\n")
    prepared(TextFiles(folder, num_workers=1), tokenizer)
    assert len(tokenize_calls) == 2  # edited data gets a new cache entry


def test_worker_processes_and_pieces_give_the_same_tokens(
    tmp_path: Path, tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    long_document = "".join(DOCUMENTS) * 3  # many lines, no blank lines
    folder = write_text_files(tmp_path / "texts", [long_document] + DOCUMENTS[:5])
    expected = stream_of([long_document] + DOCUMENTS[:5], tokenizer)
    monkeypatch.setattr(tokens_module, "PROCESS_POOL_MIN_CHARS", 0)  # use the pool despite the tiny corpus
    monkeypatch.setattr(tokens_module, "PIECE_CHARS", 500)  # cut the long file into pieces
    monkeypatch.setattr(tokens_module, "CHUNK_CHARS", 1000)  # and spread them over several chunks
    data = prepared(TextFiles(folder, val_split_fraction=0.0, num_workers=2), tokenizer)
    assert data._train_tokens.tolist() == expected


# ------------------------------------------------------------------------------------- HFDataset


@pytest.mark.parametrize("file_format", ["json", "parquet", "text"])
def test_hf_dataset_from_local_files(tmp_path: Path, tokenizer: Tokenizer, hf_offline: None, file_format: str) -> None:
    documents = [d.strip() for d in DOCUMENTS]  # the text builder makes one row per line
    path = tmp_path / f"data.{'txt' if file_format == 'text' else file_format}"
    if file_format == "json":
        path.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(documents)))
    elif file_format == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"text": documents, "id": list(range(len(documents)))}), path)
    else:
        path.write_text("\n".join(documents) + "\n")
    data = prepared(HFDataset(file_format, data_files=str(path), val_split_fraction=0.0, num_workers=1), tokenizer)
    assert data._train_tokens.tolist() == stream_of(documents, tokenizer)


def test_hf_dataset_val_split_and_caching(
    tmp_path: Path, tokenizer: Tokenizer, hf_offline: None, tokenize_calls: list
) -> None:
    for name, rows in (("train", DOCUMENTS[:12]), ("validation", DOCUMENTS[12:])):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"body": d}) + "\n" for d in rows))
    files = {"train": str(tmp_path / "train.jsonl"), "validation": str(tmp_path / "validation.jsonl")}
    module = HFDataset("json", data_files=files, text_field="body", val_split="validation", num_workers=1)
    data = prepared(module, tokenizer)
    assert data._train_tokens.tolist() == stream_of(DOCUMENTS[:12], tokenizer)
    assert data._val_tokens.tolist() == stream_of(DOCUMENTS[12:], tokenizer)
    prepared(HFDataset("json", data_files=files, text_field="body", val_split="validation", num_workers=1), tokenizer)
    assert len(tokenize_calls) == 2  # train and validation once each
    with pytest.raises(ValueError, match="--data.val_split_fraction 0.3 .*--data.val_split 'validation'"):
        HFDataset("json", data_files=files, val_split="validation", val_split_fraction=0.3).validate()
    with pytest.raises(ValueError, match="--data.val_split 'train' is --data.split, the training data"):
        HFDataset("json", data_files=files, val_split="train").validate()


# ------------------------------------------------------------------------------------- BuiltinStories


def test_stories_are_deterministic_and_consistent() -> None:
    first = list(generate_stories(0, "train", 50))
    assert first == list(generate_stories(0, "train", 50))
    assert first != list(generate_stories(0, "val", 50)) and first != list(generate_stories(1, "train", 50))
    sums = 0
    for story in generate_stories(0, "train", 300):
        for a, b, total in re.findall(r"(\w+) and (\w+) make (\w+),", story):
            assert NUMBERS.index(a.lower()) + NUMBERS.index(b) == NUMBERS.index(total)
            sums += 1
        for a, op, b, answer in re.findall(r'"(\d+) (plus|minus) (\d+) is (\d+)\."', story):
            assert int(answer) == (int(a) + int(b) if op == "plus" else int(a) - int(b))
    assert sums > 30


def test_builtin_stories_tokenizer_is_trained_once(monkeypatch: pytest.MonkeyPatch, tokenize_calls: list) -> None:
    trained: list = []
    original = train_bpe_tokenizer
    monkeypatch.setattr("llmtrain.data.stories.train_bpe_tokenizer",
                        lambda *args, **kwargs: trained.append(1) or original(*args, **kwargs))
    monkeypatch.setattr("llmtrain.data.stories.TOKENIZER_TRAINING_DOCUMENTS", 300)
    module = BuiltinStories(num_documents=200, num_val_documents=20, vocab_size=512)
    tokenizer = module.default_tokenizer()
    data = prepared(module, tokenizer, micro_batch_size=4, max_seq_length=64)
    assert trained == [1] and tokenizer.vocab_size <= 512
    assert BuiltinStories(num_documents=200, vocab_size=512).default_tokenizer().fingerprint == tokenizer.fingerprint
    assert trained == [1]  # reused from the cache
    assert tokenizer.decode(data._train_tokens[:400]).startswith("<|bos|>")
    assert len(data._val_tokens) < len(data._train_tokens) / 5
    batch = next(iter(data.val_dataloader()))
    assert batch["input_ids"].shape == (4, 64)
    prepared(BuiltinStories(num_documents=200, num_val_documents=20, vocab_size=512), tokenizer)
    assert len(tokenize_calls) == 2


# ------------------------------------------------------------------------------------- errors


def test_missing_and_empty_paths_name_the_flag(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="--data.train_data_path") as error:
        TextFiles(tmp_path / "missing").validate()
    assert str(tmp_path / "missing") in str(error.value)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.md").write_text("not a .txt file")
    with pytest.raises(ValueError, match="--data.train_data_path .*empty.*no .txt files"):
        TextFiles(tmp_path / "empty").validate()
    write_text_files(tmp_path / "train", DOCUMENTS[:2])
    with pytest.raises(FileNotFoundError, match="--data.val_data_path"):
        TextFiles(tmp_path / "train", val_data_path=tmp_path / "nope").validate()
    with pytest.raises(ValueError, match="--data.val_split_fraction"):
        TextFiles(tmp_path / "train", val_split_fraction=1.0).validate()
    with pytest.raises(FileNotFoundError, match="--data.data_files .*absent.json"):
        HFDataset("json", data_files=str(tmp_path / "absent.json")).validate()
    with pytest.raises(ValueError, match="--data.data_files"):
        HFDataset("parquet").validate()


def test_too_small_dataset_names_path_and_numbers(tmp_path: Path, tokenizer: Tokenizer) -> None:
    folder = write_text_files(tmp_path / "small", DOCUMENTS[:1])
    module = TextFiles(folder, val_split_fraction=0.0, num_workers=1)
    num_tokens = len(stream_of(DOCUMENTS[:1], tokenizer))
    with pytest.raises(ValueError) as error:
        prepared(module, tokenizer, micro_batch_size=4, max_seq_length=16, dp_size=2)
    message = str(error.value)
    assert f"--data.train_data_path {folder}" in message and f"has {num_tokens} tokens" in message
    assert "takes 8" in message and "--train.micro_batch_size" in message
    with pytest.raises(ValueError, match="--data.val_split_fraction"):  # a val tail too short for one window
        prepared(TextFiles(folder, val_split_fraction=0.05, num_workers=1), tokenizer, micro_batch_size=1)


def test_missing_text_field_lists_columns(tmp_path: Path, tokenizer: Tokenizer, hf_offline: None) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"content": "a", "meta": 1}) + "\n")
    module = HFDataset("json", data_files=str(path), num_workers=1)
    module.connect(tokenizer, 2, 16)
    with pytest.raises(ValueError, match=r"--data.text_field 'text'.*\['content', 'meta'\]"):
        module.prepare_data()
    module = HFDataset("json", data_files=str(path), text_field="meta", num_workers=1)
    module.connect(tokenizer, 2, 16)
    with pytest.raises(ValueError, match="--data.text_field 'meta' .* not text"):
        module.prepare_data()


# ------------------------------------------------------------------------------------- registry and CLI


def test_registry_and_cli_resolution(tmp_path: Path) -> None:
    pretraining = {"BuiltinStories": BuiltinStories, "TextFiles": TextFiles, "HFDataset": HFDataset}
    assert pretraining.items() <= REGISTRY.items()
    assert all(issubclass(cls, DataModule) and name == cls.__name__ for name, cls in REGISTRY.items())
    import jsonargparse

    parser = jsonargparse.ArgumentParser()
    parser.add_argument("--data", type=Optional[DataModule])
    args = parser.parse_args(["--data", "TextFiles", "--data.train_data_path", str(tmp_path),
                              "--data.num_workers", "3"])
    data = parser.instantiate(args).data
    assert isinstance(data, TextFiles) and data.train_data_path == tmp_path and data.num_workers == 3
