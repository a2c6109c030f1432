"""PythonStdlib: the running interpreter's standard library as a corpus, split by file, with its own tokenizer.

Every test that tokenizes uses a small --data.max_bytes and a small tokenizer, so the module runs in seconds.
"""

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

import llmtrain.data.stdlib as stdlib
import llmtrain.data.tokens as tokens_module
from llmtrain.cli import main
from llmtrain.data import REGISTRY, PythonStdlib
from llmtrain.data.tokens import open_tokens

SMALL = dict(max_bytes=200_000, val_fraction=0.2, vocab_size=512)


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("LLMTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    # A tenth of the real tokenizer's text: the same code path, a fraction of a second.
    monkeypatch.setattr(stdlib, "TOKENIZER_TRAINING_BYTES", 400_000)
    return tmp_path / "cache"


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> dict[str, list]:
    """Every tokenizer trained and every (uncached) tokenization, as they happen."""
    calls: dict[str, list] = {"tokenizers": [], "tokenizations": []}
    train, tokenize = stdlib.train_bpe_tokenizer, tokens_module._tokenize
    monkeypatch.setattr(stdlib, "train_bpe_tokenizer",
                        lambda *args, **kwargs: calls["tokenizers"].append(args[2]) or train(*args, **kwargs))
    monkeypatch.setattr(tokens_module, "_tokenize",
                        lambda *args, **kwargs: calls["tokenizations"].append(args[2]) or tokenize(*args, **kwargs))
    return calls


def prepared(module: PythonStdlib) -> PythonStdlib:
    module.validate()
    module.connect(module.default_tokenizer(), micro_batch_size=2, max_seq_length=64)
    module.prepare_data()
    module.setup()
    return module


def test_registered_under_its_name():
    assert REGISTRY["PythonStdlib"] is PythonStdlib


def test_the_corpus_is_this_interpreters_library_without_tests_or_site_packages():
    files = stdlib.list_stdlib_files(include_tests=False)
    root = Path(sysconfig.get_paths()["stdlib"])
    names = {file.relative for file in files}
    assert {"os.py", "json/decoder.py", "collections/__init__.py"} <= names
    assert all(file.path == root / file.relative and file.size > 0 for file in files)
    assert not any(name.startswith(("site-packages/", "dist-packages/", "test/")) for name in names)
    assert not any({"tests", "idle_test"} & set(name.split("/")) for name in names)
    with_tests = {file.relative for file in stdlib.list_stdlib_files(include_tests=True)}
    assert names < with_tests and any(name.startswith("test/") for name in with_tests)


def test_split_is_by_file_deterministic_and_disjoint():
    files = stdlib.list_stdlib_files(include_tests=False)
    train, val = stdlib.split_files(files, 0.05)
    assert (train, val) == stdlib.split_files(files, 0.05)
    assert {f.relative for f in train}.isdisjoint({f.relative for f in val})
    assert sorted(train + val, key=lambda f: f.relative) == list(files)
    assert 0.01 < len(val) / len(files) < 0.15
    # A file's side depends on its path alone: another interpreter's list (here: half of this one) splits alike.
    half_train, half_val = stdlib.split_files(files[::2], 0.05)
    assert set(half_val) == set(val) & set(files[::2]) and set(half_train) == set(train) & set(files[::2])


def test_max_bytes_takes_a_fixed_sample_from_each_side_of_the_split():
    train, val = PythonStdlib(**SMALL).files()
    assert (train, val) == PythonStdlib(**SMALL).files()
    assert train and val
    assert sum(f.size for f in train) <= 160_000 and sum(f.size for f in val) <= 40_000
    full_train, full_val = stdlib.split_files(stdlib.list_stdlib_files(include_tests=False), 0.2)
    assert set(train) <= set(full_train) and set(val) <= set(full_val)


def test_tokens_of_both_splits_and_a_tokenizer_trained_once(counted):
    data = prepared(PythonStdlib(**SMALL))
    tokenizer = data.tokenizer
    assert len(counted["tokenizers"]) == 1 and 300 < tokenizer.vocab_size <= 512
    assert len(counted["tokenizations"]) == 2  # train and validation
    train, val = data._train_tokens, data._val_tokens
    assert len(train) > 3 * len(val) > 0
    text = tokenizer.decode(train[:2000].tolist())
    assert text.startswith("<|bos|>") and ("def " in text or "import " in text)
    batch = next(iter(data.val_dataloader()))
    assert batch["input_ids"].shape == (2, 64)

    # Again, as a second run would: nothing is trained or tokenized, the same files are found.
    again = prepared(PythonStdlib(**SMALL))
    assert again.tokenizer.fingerprint == tokenizer.fingerprint
    assert len(counted["tokenizers"]) == 1 and len(counted["tokenizations"]) == 2
    assert (open_tokens(again._files.train) == open_tokens(data._files.train)).all()

    # The tokenizer does not depend on --data.max_bytes, so checkpoints work with any limit.
    assert PythonStdlib(**{**SMALL, "max_bytes": 100_000}).default_tokenizer().fingerprint == tokenizer.fingerprint
    assert len(counted["tokenizers"]) == 1


def test_another_python_version_gets_its_own_cache(counted, monkeypatch):
    first = PythonStdlib(**SMALL).default_tokenizer()
    monkeypatch.setattr(stdlib, "python_version", lambda: "3.99.0")
    second = PythonStdlib(**SMALL).default_tokenizer()
    assert len(counted["tokenizers"]) == 2 and first.checkpoint_dir != second.checkpoint_dir


def test_a_limit_that_leaves_no_validation_file_says_which_flags():
    module = PythonStdlib(max_bytes=1000, val_fraction=0.001, vocab_size=512)
    module.connect(module.default_tokenizer(), micro_batch_size=1, max_seq_length=16)
    with pytest.raises(ValueError, match="--data.max_bytes 1000 with --data.val_fraction 0.001 leaves no validation"):
        module.prepare_data()


BAD_VALUES = [
    (["--data.val_fraction", "1"], "--data.val_fraction must be in [0, 1), got 1.0"),
    (["--data.max_bytes", "10"], "--data.max_bytes must be at least 1000"),
    (["--data.vocab_size", "100"], "--data.vocab_size must be at least 300, got 100"),
]


def bad_run(tmp_path: Path, flags: list[str]) -> list[str]:
    return ["pretrain", "llama-debug", "--out_dir", str(tmp_path / "out"), "--data", "PythonStdlib", *flags]


@pytest.mark.parametrize("flags, says", BAD_VALUES, ids=[flags[0] for flags, _ in BAD_VALUES])
def test_bad_values_are_refused_before_anything_is_built(tmp_path, flags, says):
    with pytest.raises(ValueError) as error:
        main(bad_run(tmp_path, flags))
    assert str(error.value).startswith(says)
    assert not (tmp_path / "out").exists() and not (tmp_path / "cache").exists()


def test_a_bad_value_exits_2_with_one_message_from_the_command_line(tmp_path):
    env = {**os.environ, "LLMTRAIN_CACHE_DIR": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    flags, says = BAD_VALUES[0]
    done = subprocess.run([sys.executable, "-m", "llmtrain", *bad_run(tmp_path, flags)],
                          capture_output=True, text=True, timeout=300, env=env)
    message = done.stderr.strip()
    assert done.returncode == 2, message
    assert "Traceback" not in message and message.count("error:") == 1 and says in message, message
    assert not (tmp_path / "out").exists()
