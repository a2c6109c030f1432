"""Data a user hands us, damaged or hostile, stops the run with one line naming the file and the repair (issue 42):
prepared shards that are cut short, edited or flipped; token ids outside the vocabulary; a 50 MB instruction
record; JSON nested 100,000 deep; tokenizer files cut short."""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import LAUNCHER_PREFIXES, LAUNCHER_VARS, write_tiny_model
from forked_cli import run_forked

from llmtrain.data import Prepared, TextFiles
from llmtrain.data import manifest as layout
from llmtrain.data.instruct import read_json_records, tokenize_conversations, record_to_conversation
from llmtrain.prompts import PromptStyle, read_chat_template
from llmtrain.recipes.prepare_data import setup as prepare_data

ROOT = Path(__file__).resolve().parents[2]
WORDS = ["the", "cat", "sat", "on", "a", "mat", "and", "then", "ran", "to", "its", "home", "def", "return", "x"]
SHARD_TOKENS = 100_000
"""200 KB shards of uint16 ids: four sampled-check blocks, two of which the check does not read."""


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMTRAIN_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer):
    return tiny_tokenizer([" ".join(WORDS)] * 20, vocab_size=300)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    lines = (" ".join(rng.choice(WORDS, size=12)) for _ in range(25_000))
    (folder / "text.txt").write_text("\n".join(lines))
    return folder


def prepare(corpus: Path, tokenizer, out_dir: Path, verify: bool = False) -> None:
    prepare_data(TextFiles(train_data_path=corpus), out_dir, tokenizer_dir=tokenizer.checkpoint_dir,
                 shard_tokens=SHARD_TOKENS, verify=verify)


@pytest.fixture(scope="module")
def reference(corpus: Path, tokenizer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out_dir = tmp_path_factory.mktemp("reference") / "prepared"
    with pytest.MonkeyPatch.context() as monkeypatch:
        for name in list(os.environ):
            if name in LAUNCHER_VARS or name.startswith(LAUNCHER_PREFIXES):
                monkeypatch.delenv(name)
        prepare(corpus, tokenizer, out_dir)
    assert len(layout.read_manifest(out_dir).splits["train"].shards) >= 2
    return out_dir


@pytest.fixture
def folder(reference: Path, tmp_path: Path) -> Path:
    """A copy of the reference folder to damage."""
    return Path(shutil.copytree(reference, tmp_path / "prepared"))


def contents(root: Path) -> dict[str, bytes]:
    return {str(path.relative_to(root)): path.read_bytes() for path in sorted(root.rglob("*.bin"))} | {
        layout.MANIFEST: (root / layout.MANIFEST).read_bytes()}


def first_shard(root: Path) -> tuple[Path, layout.Shard]:
    shard = layout.read_manifest(root).splits["train"].shards[0]
    return root / shard.name, shard


def unsampled_offset(path: Path, shard: layout.Shard) -> int:
    """A byte offset (of a whole uint16 id) that the sampled check does not read."""
    read = {block // layout.SAMPLE_BLOCK for block, _ in layout.sample_ranges(path.stat().st_size, shard.sha256)}
    return min(set(range(path.stat().st_size // layout.SAMPLE_BLOCK)) - read) * layout.SAMPLE_BLOCK + 100


def write_id(path: Path, offset: int, token: int) -> None:
    with open(path, "r+b") as handle:
        handle.seek(offset)
        handle.write(np.uint16(token).tobytes())


def connected(root: Path, tokenizer, verify: bool = False, micro_batch_size: int = 2) -> Prepared:
    data = Prepared(path=root, **({"verify": True} if verify else {}))  # the flag is new
    data.validate()
    data.connect(tokenizer, micro_batch_size=micro_batch_size, max_seq_length=64)
    return data


def setup_error(root: Path, tokenizer, verify: bool = False) -> str:
    with pytest.raises(ValueError) as caught:
        connected(root, tokenizer, verify).setup()
    assert "\n" not in str(caught.value)
    return str(caught.value)


def test_an_edited_manifest_sha256_is_caught_by_the_sampled_and_the_full_check(folder: Path, tokenizer) -> None:
    path, shard = first_shard(folder)
    manifest = (folder / layout.MANIFEST).read_text()
    (folder / layout.MANIFEST).write_text(manifest.replace(shard.sha256, "0" * 64))
    for verify in (False, True):
        message = setup_error(folder, tokenizer, verify)
        assert str(path) in message and "prepare_data" in message


def test_flipped_bytes_are_caught_where_a_check_reads_them(folder: Path, tokenizer) -> None:
    path, shard = first_shard(folder)
    original = path.read_bytes()
    write_id(path, 10, 7 if original[10] != 7 else 8)  # in the first block, which the sampled check reads
    assert "sampled checksum" in setup_error(folder, tokenizer) and str(path) in setup_error(folder, tokenizer)
    path.write_bytes(original)
    write_id(path, unsampled_offset(path, shard), 7 if original[unsampled_offset(path, shard)] != 7 else 8)
    connected(folder, tokenizer).setup()  # the sampled check misses it; the full one does not
    message = setup_error(folder, tokenizer, verify=True)
    assert str(path) in message and "sha256" in message and "--verify true" in message


def test_token_ids_outside_the_vocabulary_stop_the_batch_naming_the_shard(folder: Path, tokenizer) -> None:
    path, shard = first_shard(folder)
    write_id(path, unsampled_offset(path, shard), 65535)
    data = connected(folder, tokenizer, micro_batch_size=64)
    data.setup()  # the sampled check does not read that block
    loader = data.train_dataloader()
    with pytest.raises(ValueError, match="token id 65535, outside the vocabulary") as caught:
        for _ in range(loader.samples_per_epoch // 64 + 1):
            next(loader)
    assert str(path) in str(caught.value) and "--verify true" in str(caught.value)


def test_a_damaged_folder_names_the_repair_and_prepare_data_does_it(folder: Path, reference: Path, corpus: Path,
                                                                    tokenizer, clean_launch_env: None,
                                                                    capsys: pytest.CaptureFixture) -> None:
    path, shard = first_shard(folder)
    path.write_bytes(path.read_bytes()[:1000])  # truncated
    message = setup_error(folder, tokenizer)
    assert str(path) in message and "truncated" in message
    assert "run the prepare_data command that made the folder again" in message
    prepare(corpus, tokenizer, folder)  # that command, which used to refuse with the same advice
    assert "1 damaged shard(s)" in capsys.readouterr().out
    assert contents(folder) == contents(reference)

    flipped = unsampled_offset(path, shard)
    write_id(path, flipped, 7 if path.read_bytes()[flipped] != 7 else 8)  # same size, outside the sampled blocks
    prepare(corpus, tokenizer, folder)
    assert "sizes and sampled blocks checked); nothing to do" in capsys.readouterr().out
    prepare(corpus, tokenizer, folder, verify=True)
    assert "sha256" in capsys.readouterr().out
    assert contents(folder) == contents(reference)


def test_each_rank_checks_its_share_of_the_shards(folder: Path) -> None:
    manifest = layout.read_manifest(folder)
    shards = [shard for split in manifest.splits.values() for shard in split.shards]
    for shard in shards[:2]:
        (folder / shard.name).unlink()
    found = [[shard.name for shard, _ in layout.damaged_shards(folder, manifest, rank=rank, world=2)]
             for rank in range(2)]
    assert found == [[shards[0].name], [shards[1].name]]


@pytest.mark.multiproc
def test_the_rank_whose_share_holds_a_damaged_shard_names_it(folder: Path, tokenizer, tmp_path: Path) -> None:
    """A run on two ranks: shard 1 is rank 1's to check (rank 0 checks shards 0, 2, ...)."""
    shard = layout.read_manifest(folder).splits["train"].shards[1]
    write_id(folder / shard.name, 10, 7 if (folder / shard.name).read_bytes()[10] != 7 else 8)
    env = {name: value for name, value in os.environ.items()
           if name not in LAUNCHER_VARS and not name.startswith(LAUNCHER_PREFIXES)}
    done = subprocess.run(
        [sys.executable, "-m", "llmtrain", "pretrain", "--model_config", str(write_tiny_model(tmp_path / "tiny.yaml")),
         "--out_dir", str(tmp_path / "out"), "--tokenizer_dir", str(tokenizer.checkpoint_dir), "--devices", "2",
         "--train.max_steps", "1", "--train.global_batch_size", "4", "--train.micro_batch_size", "2",
         "--train.max_seq_length", "16", "--data", "Prepared", "--data.path", str(folder)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
        env=dict(env, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", LLMTRAIN_CACHE_DIR=str(tmp_path / "cache")))
    # An input error found by one rank is told as in a single process: one line, exit 2 (llmtrain.errors).
    assert done.returncode == 2, done.stderr[-3000:]
    assert f"error: rank 1 of 2: --data.path {folder}: {folder / shard.name} does not match its sampled " \
           "checksum" in done.stderr, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and done.stderr.count("error:") == 1, done.stderr[-3000:]


@pytest.mark.multiproc
def test_a_50_mb_instruction_record_is_cut_before_it_is_tokenized(tmp_path: Path, tokenizer) -> None:
    """Peak memory of a process that reads and tokenizes it, under a 3 GB data limit (the whole record tokenized
    used to take 15 GB and two minutes)."""
    record = {"instruction": "Summarize. " + "the cat sat on a mat " * 2_500_000, "output": "A cat sat."}
    (tmp_path / "big.json").write_text(json.dumps([record]))
    script = ("import sys; from pathlib import Path; from llmtrain.tokenizer import Tokenizer; "
              "from llmtrain.data.instruct import read_json_records, record_to_conversation, tokenize_conversations; "
              "from llmtrain.prompts import PromptStyle; "
              "records = read_json_records(Path(sys.argv[1])); "
              "samples, truncated, _ = tokenize_conversations([record_to_conversation(*r) for r in records], "
              "PromptStyle.from_name('alpaca'), Tokenizer(sys.argv[2]), 64); "
              "assert len(samples.inputs[0]) == 64 and truncated == 1; "
              "print(next(line.split()[1] for line in open('/proc/self/status') if line.startswith('VmHWM:')))")

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_DATA, (3 << 30, 3 << 30))

    done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "big.json"), str(tokenizer.checkpoint_dir)],
                          capture_output=True, text=True, timeout=120, preexec_fn=limit, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    # NOTE: the child's own peak, VmHWM of its image: getrusage's maxrss keeps, across the exec, the RSS of the
    # forked copy of this pytest worker (and RUSAGE_CHILDREN the largest of every earlier child)
    peak_kib = int(done.stdout.split()[-1])
    assert peak_kib < 1 << 20, f"peak RSS {peak_kib / 1024:.0f} MiB"


def test_a_cut_record_tokenizes_as_the_whole_record_truncated(tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ordinary records, some far longer than the samples: the tokenizer sees a bounded text, and each sample is the
    one the whole record gives, truncated."""
    rng = np.random.default_rng(1)
    records = [{"instruction": " ".join(rng.choice(WORDS, size=int(n))), "output": " ".join(rng.choice(WORDS, size=9))}
               for n in rng.integers(1, 400, size=40)]
    conversations = [record_to_conversation(record, "test") for record in records]
    style = PromptStyle.from_name("alpaca")
    whole, _, _ = tokenize_conversations(conversations, style, tokenizer, 10**9)
    seen: list[int] = []
    encode_batch = tokenizer.encode_batch
    monkeypatch.setattr(tokenizer, "encode_batch", lambda texts, **kw: seen.extend(map(len, texts)) or
                        encode_batch(texts, **kw))
    for length in (8, 32, 64):
        seen.clear()
        cut, truncated, _ = tokenize_conversations(conversations, style, tokenizer, length)
        assert 0 < truncated and max(seen) <= 2 * (length + 1) * tokenizer.max_token_chars
        assert [ids.tolist() for ids in cut.inputs] == [ids[:length].tolist() for ids in whole.inputs]
        assert [ids.tolist() for ids in cut.labels] == [ids[:length].tolist() for ids in whole.labels]


def test_json_nested_100000_deep_is_one_line_naming_the_file(tmp_path: Path) -> None:
    deep = "[" * 100_000 + "]" * 100_000
    for name, text in (("deep.json", deep), ("deep.jsonl", json.dumps({"instruction": "a", "output": "b"}) + "\n"
                                                                       + deep + "\n")):
        (tmp_path / name).write_text(text)
        with pytest.raises(ValueError, match="deeper than Python's reader goes") as caught:
            read_json_records(tmp_path / name)
        assert str(tmp_path / name) in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.multiproc
def test_broken_tokenizer_files_are_one_line_naming_the_file(tmp_path: Path, tokenizer, corpus: Path) -> None:
    cases = {}
    for name, damage in (("tokenizer.json", lambda text: text[: len(text) // 2]),
                         ("tokenizer_config.json", lambda text: text[:-5]),
                         ("tokenizer_config.json", lambda text: "[" * 100_000 + "]" * 100_000)):
        folder = Path(shutil.copytree(tokenizer.checkpoint_dir, tmp_path / f"tok{len(cases)}"))
        (folder / name).write_text(damage((folder / name).read_text()))
        cases[folder / name] = ["prepare_data", "--data", "TextFiles", "--data.train_data_path", str(corpus),
                                "--tokenizer_dir", str(folder), "--out_dir", str(tmp_path / f"out{len(cases)}")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LLMTRAIN_CACHE_DIR": str(tmp_path / "cache")}
    for path, done in zip(cases, run_forked(list(cases.values()), tmp_path / "logs", env, timeout_s=300)):
        assert done.returncode == 2, done.stderr
        assert "Traceback" not in done.stderr
        error = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
        assert len(error) == 1 and str(path) in error[0], done.stderr


def test_a_chat_template_in_a_broken_tokenizer_config_names_the_file(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text('{"chat_template": "{{ messages }}", "eos_token": ')
    with pytest.raises(ValueError, match="tokenizer_config.json is not a JSON file") as caught:
        read_chat_template(tmp_path)
    assert str(tmp_path / "tokenizer_config.json") in str(caught.value)
