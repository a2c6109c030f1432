import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Optional

import pytest
import torch

from llmtrain.data import (
    JSON, LIMA, REGISTRY, Alpaca, Alpaca2k, BuiltinInstruct, DataModule, Dolly, InstructDataModule,
)
from llmtrain.data.builtin_instruct import TASK_NAMES, TASKS, check, generate_tasks, solve
from llmtrain.data.instruct import pad_multiple, padded_width
from llmtrain.hub import HubError
from llmtrain.prompts import ChatML, ChatTemplate, PromptStyle
from llmtrain.tokenizer import BPE_EOS_TOKEN, Tokenizer

ALPACA_RECORDS = [
    {"instruction": "What is 17 + 25?", "input": "", "output": "42"},
    {"instruction": "Reverse the word.", "input": "apple", "output": "elppa"},
    {"instruction": "How many letters are in 'banana'?", "input": "", "output": "6"},
    {"instruction": "Write the word in capital letters.", "input": "tiger", "output": "TIGER"},
    {"instruction": "Sort these numbers from smallest to largest: 5, 2, 9.", "input": "", "output": "2, 5, 9"},
    {"instruction": "Name an animal that lives on a farm.", "input": "", "output": "A cow lives on a farm."},
    {"instruction": "What is the first letter of 'moon'?", "input": "", "output": "m"},
    {"instruction": "Which number is larger, 12 or 31?", "input": "", "output": "31"},
]
CHAT_RECORD = {"messages": [
    {"role": "system", "content": "You answer in one word."},
    {"role": "user", "content": "Which animal says moo?"},
    {"role": "assistant", "content": "Cow."},
    {"role": "user", "content": "And which one says baa?"},
    {"role": "assistant", "content": "Sheep."},
]}


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer) -> Tokenizer:
    corpus = [json.dumps(r) for r in ALPACA_RECORDS] + [PromptStyle.from_name("alpaca").apply("x", input="y")]
    return tiny_tokenizer(corpus * 10)


@pytest.fixture
def hf_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    datasets = pytest.importorskip("datasets")
    import huggingface_hub

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True, raising=False)
    datasets.disable_progress_bars()


def write_json(path: Path, records: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(records, indent=1))
    return path


def write_jsonl(path: Path, records: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def prepared(module: InstructDataModule, tokenizer: Tokenizer, micro_batch_size: int = 2, max_seq_length: int = 256,
             prompt_style=None, dp_rank: int = 0, dp_size: int = 1, seed: int = 42) -> InstructDataModule:
    module.validate()
    module.connect(tokenizer, micro_batch_size, max_seq_length, seed, prompt_style=prompt_style)
    module.prepare_data()
    module.setup(dp_rank, dp_size)
    return module


def samples(module: InstructDataModule, split: str = "train") -> list[tuple[list[int], list[int]]]:
    """Every (input_ids, labels) of a split, unpadded, in dataset order."""
    padded = module._split(split)
    return [(padded.inputs[i].tolist(), padded.labels[i].tolist()) for i in range(len(padded))]


def unpadded(batch: dict, pad_label: int = -100) -> list[tuple[list[int], list[int]]]:
    """Rows of a batch without their padding (padding has pad inputs and ignored labels at the end)."""
    rows = []
    for ids, labels in zip(batch["input_ids"].tolist(), batch["labels"].tolist()):
        length = len(labels)
        while length and labels[length - 1] == pad_label:
            length -= 1
        rows.append((ids[:length], labels[:length]))
    return rows


def expected_sample(tokenizer: Tokenizer, segments: list[tuple[str, bool]], mask_prompt: bool = True):
    """Inputs and labels built by hand: bos, each segment's tokens, eos; labels shifted, prompts masked."""
    ids, keep = [tokenizer.bos_id], [False]
    for text, is_response in segments:
        segment_ids = tokenizer.encode(text, bos=False)
        ids += segment_ids
        keep += [is_response] * len(segment_ids)
    ids.append(tokenizer.eos_id)
    keep.append(True)
    labels = [token if (k or not mask_prompt) else -100 for token, k in zip(ids[1:], keep[1:])]
    return ids[:-1], labels


# ------------------------------------------------------------------------------------- loading


def test_json_list_jsonl_and_jsonl_named_json_load_the_same(tmp_path: Path, tokenizer: Tokenizer) -> None:
    as_list = write_json(tmp_path / "list.json", ALPACA_RECORDS)
    as_lines = write_jsonl(tmp_path / "lines.jsonl", ALPACA_RECORDS)
    lines_named_json = write_jsonl(tmp_path / "lines.json", ALPACA_RECORDS)
    loaded = [samples(prepared(JSON(json_path=path, val_split_fraction=0), tokenizer))
              for path in (as_list, as_lines, lines_named_json)]
    assert len(loaded[0]) == len(ALPACA_RECORDS) and loaded[0] == loaded[1] == loaded[2]


def test_folder_with_train_and_val_files(tmp_path: Path, tokenizer: Tokenizer) -> None:
    write_jsonl(tmp_path / "data" / "train.jsonl", ALPACA_RECORDS[:6])
    write_json(tmp_path / "data" / "val.json", ALPACA_RECORDS[6:])
    data = prepared(JSON(json_path=tmp_path / "data"), tokenizer)
    write_json(tmp_path / "train_only.json", ALPACA_RECORDS[:6])
    write_json(tmp_path / "val_only.json", ALPACA_RECORDS[6:])
    train = prepared(JSON(json_path=tmp_path / "train_only.json", val_split_fraction=0), tokenizer)
    val = prepared(JSON(json_path=tmp_path / "val_only.json", val_split_fraction=0), tokenizer)
    assert samples(data, "train") == samples(train) and samples(data, "val") == samples(val)
    assert train.val_dataloader() is None
    (tmp_path / "no_val").mkdir()
    write_json(tmp_path / "no_val" / "train.json", ALPACA_RECORDS)  # no val file: split off a fraction
    assert len(samples(prepared(JSON(json_path=tmp_path / "no_val", val_split_fraction=0.25), tokenizer), "val")) == 2
    with pytest.raises(ValueError, match=f"--data.val_split_fraction 0.25 .*--data.json_path {tmp_path / 'data'} "
                                         r"has a validation file of its own \(val.json\)"):
        JSON(json_path=tmp_path / "data", val_split_fraction=0.25).validate()


def test_val_split_is_random_seeded_and_disjoint(tmp_path: Path, tokenizer: Tokenizer) -> None:
    records = [{"instruction": f"Say {i}.", "output": str(i)} for i in range(40)]
    path = write_json(tmp_path / "data.json", records)
    everything = samples(prepared(JSON(json_path=path, val_split_fraction=0), tokenizer))

    def split(**kwargs):
        data = prepared(JSON(json_path=path, val_split_fraction=0.25, **kwargs), tokenizer)
        return samples(data, "train"), samples(data, "val")

    train, val = split()
    assert len(val) == 10 and len(train) == 30
    assert sorted(train + val) == sorted(everything) and not [s for s in val if s in train]
    assert val != everything[-10:]  # drawn at random, not the tail
    assert split() == (train, val) and split(split_seed=1)[1] != val


# ------------------------------------------------------------------------------------- samples


@pytest.mark.parametrize("mask_prompt", [True, False])
def test_alpaca_record_tokens_and_masking(tmp_path: Path, tokenizer: Tokenizer, mask_prompt: bool) -> None:
    path = write_json(tmp_path / "one.json", ALPACA_RECORDS[1:2])
    data = prepared(JSON(json_path=path, val_split_fraction=0, mask_prompt=mask_prompt), tokenizer, 1)
    prompt = PromptStyle.from_name("alpaca").apply("Reverse the word.", input="apple")
    ids, labels = expected_sample(tokenizer, [(prompt, False), ("elppa", True)], mask_prompt)
    batch = next(data.train_dataloader())
    assert batch["input_ids"].dtype == batch["labels"].dtype == torch.long
    assert batch["input_ids"].tolist() == [ids] and batch["labels"].tolist() == [labels]
    response = tokenizer.encode("elppa", bos=False) + [tokenizer.eos_id]
    if mask_prompt:  # the loss sees exactly the response and the eos
        assert [t for t in labels if t != -100] == response and labels[-len(response):] == response
    else:
        assert labels == ids[1:] + [tokenizer.eos_id]


def test_chat_record_trains_on_every_assistant_turn(tmp_path: Path, tokenizer: Tokenizer) -> None:
    path = write_jsonl(tmp_path / "chat.jsonl", [CHAT_RECORD])
    data = prepared(JSON(json_path=path, val_split_fraction=0), tokenizer, 1, prompt_style="chatml")
    segments = [(s.text, s.is_response) for s in ChatML().render(CHAT_RECORD["messages"])]
    assert [s for s in segments if s[1]] == [("Cow.<|im_end|>", True), ("Sheep.<|im_end|>", True)]
    assert samples(data) == [expected_sample(tokenizer, segments)]
    labels = samples(data)[0][1]
    kept = [t for t in labels if t != -100]
    assert kept == tokenizer.encode("Cow.<|im_end|>", bos=False) + tokenizer.encode("Sheep.<|im_end|>", bos=False) + [
        tokenizer.eos_id]


def test_llama_31_system_block_is_masked(tmp_path: Path, tokenizer: Tokenizer) -> None:
    # Llama 3.1's template adds a system block (knowledge cutoff, date) to every conversation: part of the prompt.
    path = write_jsonl(tmp_path / "chat.jsonl", [CHAT_RECORD])
    data = prepared(JSON(json_path=path, val_split_fraction=0), tokenizer, 1, 1024, prompt_style="llama3.1")
    segments = [(s.text, s.is_response) for s in PromptStyle.from_name("llama3.1").render(CHAT_RECORD["messages"])]
    assert segments[0][0].startswith("<|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date")
    assert [t for t in samples(data)[0][1] if t != -100] == (
        tokenizer.encode("Cow.<|eot_id|>", bos=False) + tokenizer.encode("Sheep.<|eot_id|>", bos=False)
        + [tokenizer.eos_id])


def test_a_chat_template_trains_on_the_answers_only(tmp_path: Path, tokenizer: Tokenizer) -> None:
    template = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}{{ '<bot>' + m['content'] + eos_token }}"
                "{% else %}{{ '<' + m['role'] + '>' + m['content'] }}{% endif %}{% endfor %}"
                "{% if add_generation_prompt %}{{ '<bot>' }}{% endif %}")
    style = ChatTemplate(template=template, special_tokens={"bos_token": "<|bos|>", "eos_token": BPE_EOS_TOKEN})
    path = write_jsonl(tmp_path / "chat.jsonl", [CHAT_RECORD])
    data = prepared(JSON(json_path=path, val_split_fraction=0), tokenizer, 1, 1024, prompt_style=style)
    ids, labels = samples(data)[0]
    assert tokenizer.decode(ids) == ("<|bos|><system>You answer in one word.<user>Which animal says moo?<bot>Cow."
                                     "<|endoftext|><user>And which one says baa?<bot>Sheep.")
    # The template's own eos ends each answer, and none is added after the last.
    assert [t for t in labels if t != -100] == (tokenizer.encode("Cow.", bos=False) + [tokenizer.eos_id]
                                                + tokenizer.encode("Sheep.", bos=False) + [tokenizer.eos_id])


def test_eos_is_not_doubled_when_the_style_ends_turns_with_it(tmp_path: Path, tokenizer: Tokenizer) -> None:
    @dataclass(frozen=True)
    class EndsWithEos(ChatML):  # no name: not registered
        name: ClassVar[str] = ""

        def assistant(self, content: str) -> str:
            return content + BPE_EOS_TOKEN

    path = write_json(tmp_path / "one.json", ALPACA_RECORDS[:1])
    data = prepared(JSON(json_path=path, val_split_fraction=0), tokenizer, 1, prompt_style=EndsWithEos())
    ids, labels = samples(data)[0]
    assert labels[-1] == tokenizer.eos_id and labels[-2] != tokenizer.eos_id and tokenizer.eos_id not in ids


def test_prompt_style_flag_beats_the_models_style(tmp_path: Path, tokenizer: Tokenizer) -> None:
    path = write_json(tmp_path / "data.json", ALPACA_RECORDS)
    assert prepared(JSON(json_path=path), tokenizer).resolved_prompt_style.name == "alpaca"  # neither given
    assert prepared(JSON(json_path=path), tokenizer, prompt_style="llama3").resolved_prompt_style.name == "llama3"
    data = prepared(JSON(json_path=path, prompt_style="phi"), tokenizer, prompt_style=ChatML(system="x"))
    assert data.resolved_prompt_style.name == "phi"
    first = tokenizer.decode(samples(data)[0][0])
    assert "Instruct: What is 17 + 25?\nOutput: 42" in first
    with pytest.raises(ValueError, match="Unknown prompt style 'nope'"):
        JSON(json_path=path, prompt_style="nope").validate()


def test_micro_batches_pad_to_their_longest_sample(tmp_path: Path, tokenizer: Tokenizer) -> None:
    write_json(tmp_path / "data" / "train.json", ALPACA_RECORDS)
    write_json(tmp_path / "data" / "val.json", ALPACA_RECORDS[:3])
    data = prepared(JSON(json_path=tmp_path / "data"), tokenizer, micro_batch_size=3)
    lengths = [len(ids) for ids, _ in samples(data, "val")]
    assert len(set(lengths)) > 1
    (batch,) = list(data.val_dataloader())
    assert batch["input_ids"].shape == batch["labels"].shape == (3, max(lengths))
    for row, length in enumerate(lengths):
        assert batch["input_ids"][row, length:].eq(tokenizer.eos_id).all()  # no pad token: eos pads
        assert batch["labels"][row, length:].eq(-100).all()
    assert unpadded(batch) == samples(data, "val")
    for batch in [next(data.train_dataloader()) for _ in range(3)]:
        assert batch["input_ids"].shape[1] == max(len(ids) for ids, _ in unpadded(batch))


def test_padded_width_rounds_up_to_the_multiple_within_the_length() -> None:
    assert pad_multiple(compile=True) == 64 and pad_multiple(compile=False) == 1
    # Sequence parallelism splits each sequence over the tensor-parallel ranks.
    assert pad_multiple(compile=False, sequence_shards=4) == 4 and pad_multiple(compile=True, sequence_shards=2) == 64
    assert [padded_width(n, 64, max_width=100) for n in (1, 64, 65, 99, 100)] == [64, 64, 100, 100, 100]
    assert [padded_width(n, 1, max_width=100) for n in (1, 37, 100)] == [1, 37, 100]
    assert padded_width(130, 64) == 192


def test_a_compiled_run_gets_batches_padded_to_multiples_of_64(tmp_path: Path, tokenizer: Tokenizer) -> None:
    from types import SimpleNamespace

    from llmtrain.recipes.run import _connect_data

    records = [{"instruction": "Hi.", "output": "Fine. " * n} for n in range(8)]
    write_json(tmp_path / "train.json", records)
    widths = {}
    for compile, tp in ((False, 1), (True, 1), (False, 4)):  # tp 4: sequence parallelism splits every batch in 4
        data = JSON(json_path=tmp_path / "train.json", val_split_fraction=0)
        spec = SimpleNamespace(data=data, seq_len=100, seed=1, compile=compile, prompt_style="alpaca",
                               initial_checkpoint_dir=None, config=None,
                               plan=SimpleNamespace(tp=tp, sequence_parallel=tp > 1))
        _connect_data(spec, tokenizer, micro_batch_size=2)
        data.prepare_data()
        data.setup()
        loader = data.train_dataloader()
        batches = [next(loader) for _ in range(8)]
        widths[compile, tp] = {batch["input_ids"].shape[1] for batch in batches}
        for batch in batches:  # the same samples, only more padding
            assert all(row in samples(data) for row in unpadded(batch))
            assert int(batch["real_tokens"]) == sum(len(ids) for ids, _ in unpadded(batch))  # what MFU counts
    assert widths[True, 1] <= {64, 100} and len(widths[False, 1]) > len(widths[True, 1])
    assert all(width % 4 == 0 for width in widths[False, 4]) and widths[False, 4] != widths[False, 1]


def test_truncation_is_counted_in_one_warning(tmp_path: Path, tokenizer: Tokenizer) -> None:
    records = [{"instruction": "Hi.", "output": "Fine. " * n} for n in (1, 2, 30, 40)]
    records.append({"instruction": "A very long question, " * 40, "output": "Short."})
    path = write_json(tmp_path / "data.json", records)
    module = JSON(json_path=path, val_split_fraction=0, prompt_style="default")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        data = prepared(module, tokenizer, micro_batch_size=2, max_seq_length=48)
        loader = data.train_dataloader()
        batches = [next(loader) for _ in range(6)]
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1
    assert "3 of 5 train samples (1 of them kept no response token to learn from)" in messages[0]
    assert "--train.max_seq_length 48" in messages[0] and str(path) in messages[0]
    assert [len(ids) for ids, _ in samples(data)] == [
        min(48, len(ids)) for ids, _ in samples(prepared(JSON(json_path=path, val_split_fraction=0,
                                                              prompt_style="default"), tokenizer, max_seq_length=2048))]
    assert all(batch["input_ids"].shape[1] <= 48 for batch in batches)
    with warnings.catch_warnings(record=True) as caught:  # a second rank says nothing
        warnings.simplefilter("always")
        prepared(JSON(json_path=path, val_split_fraction=0, prompt_style="default"), tokenizer, max_seq_length=48,
                 dp_rank=1, dp_size=2)
    assert not caught


def test_no_sample_left_to_learn_from_is_an_error(tmp_path: Path, tokenizer: Tokenizer) -> None:
    """Every prompt longer than the sequence: a run would train on nothing (loss 0, grad norm 0) and write a model."""
    path = write_json(tmp_path / "data.json", [{"instruction": "A very long question, " * 40, "output": "Short."}] * 4)
    with pytest.raises(ValueError, match="no training sample keeps a response token .* raise --train.max_seq_length"):
        prepared(JSON(json_path=path, val_split_fraction=0, prompt_style="default"), tokenizer, max_seq_length=48)
    assert samples(prepared(JSON(json_path=path, val_split_fraction=0, prompt_style="default"), tokenizer,
                            max_seq_length=2048))


def test_no_validation_sample_left_to_score_is_an_error(tmp_path: Path, tokenizer: Tokenizer) -> None:
    """Every validation prompt longer than the sequence: the run logged val_loss 0 (perplexity 1), a loss over no
    tokens, at every evaluation."""
    write_json(tmp_path / "train.json", ALPACA_RECORDS)
    write_json(tmp_path / "val.json", [{"instruction": "A very long question, " * 40, "output": "Short."}] * 4)
    with pytest.raises(ValueError, match="no validation sample keeps a response token .* raise --train.max_seq_length"):
        prepared(JSON(json_path=tmp_path, prompt_style="default"), tokenizer, max_seq_length=48)
    assert len(prepared(JSON(json_path=tmp_path, prompt_style="default"), tokenizer,
                        max_seq_length=2048).val_dataloader()) == 2


# ------------------------------------------------------------------------------------- loaders


@pytest.mark.parametrize("stop_after", [0, 3, 5])
def test_restored_position_continues_exactly(tmp_path: Path, tokenizer: Tokenizer, stop_after: int) -> None:
    path = write_json(tmp_path / "data.json", ALPACA_RECORDS + [CHAT_RECORD])  # 9 samples: epochs straddle steps

    def loader():
        return prepared(JSON(json_path=path, val_split_fraction=0), tokenizer, micro_batch_size=2).train_dataloader()

    reference = loader()
    uninterrupted = [next(reference) for _ in range(8)]
    interrupted = loader()
    for _ in range(stop_after):
        next(interrupted)
    restored = loader()
    restored.load_state_dict(json.loads(json.dumps(interrupted.state_dict())))
    for expected in uninterrupted[stop_after:]:
        actual = next(restored)
        assert torch.equal(expected["input_ids"], actual["input_ids"])
        assert torch.equal(expected["labels"], actual["labels"])


def test_ranks_share_the_global_order(tmp_path: Path, tokenizer: Tokenizer) -> None:
    path = write_json(tmp_path / "data.json", ALPACA_RECORDS)
    single = prepared(JSON(json_path=path, val_split_fraction=0), tokenizer, micro_batch_size=4).train_dataloader()
    ranks = [prepared(JSON(json_path=path, val_split_fraction=0), tokenizer, micro_batch_size=2, dp_rank=rank,
                      dp_size=2).train_dataloader() for rank in (0, 1)]
    for _ in range(5):
        assert unpadded(next(ranks[0])) + unpadded(next(ranks[1])) == unpadded(next(single))


def test_validation_needs_a_sample_per_rank(tmp_path: Path, tokenizer: Tokenizer) -> None:
    write_json(tmp_path / "data" / "train.json", ALPACA_RECORDS)
    write_json(tmp_path / "data" / "val.json", ALPACA_RECORDS[:1])
    with pytest.raises(ValueError, match="validation split has 1 samples.*2 data-parallel ranks"):
        prepared(JSON(json_path=tmp_path / "data"), tokenizer, dp_size=2)


# ------------------------------------------------------------------------------------- errors


def test_bad_paths_name_the_flag(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=f"--data.json_path {tmp_path / 'missing.json'} does not exist"):
        JSON(json_path=tmp_path / "missing.json").validate()
    (tmp_path / "data.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="must be a .json or .jsonl file"):
        JSON(json_path=tmp_path / "data.csv").validate()
    (tmp_path / "folder").mkdir()
    with pytest.raises(FileNotFoundError, match="folder without train.json or train.jsonl"):
        JSON(json_path=tmp_path / "folder").validate()
    write_json(tmp_path / "folder" / "train.json", ALPACA_RECORDS)
    write_jsonl(tmp_path / "folder" / "train.jsonl", ALPACA_RECORDS)
    with pytest.raises(ValueError, match="both train.json and train.jsonl"):
        JSON(json_path=tmp_path / "folder").validate()
    with pytest.raises(ValueError, match="--data.val_split_fraction"):
        JSON(json_path=tmp_path / "folder" / "train.json", val_split_fraction=1.0).validate()


@pytest.mark.parametrize("name, content, error", [
    ("empty.json", "", "empty.json is empty"),
    ("blank.jsonl", "\n  \n", "blank.jsonl is empty"),
    ("empty_list.json", "[]", "empty_list.json holds an empty list"),
    ("object.json", '{"instruction": "a", "output": "b"}', "object.json must hold a list of records, not a dict"),
    ("broken.json", '[{"instruction": "a",, }]', "broken.json is not valid JSON: .* line 1, column 22"),
    ("broken.jsonl", '{"instruction": "a", "output": "b"}\n\n{"instruction": "a" "output": "b"}\n',
     r"broken.jsonl line 3 is not valid JSON"),
    ("neither.json", '[{"instruction": "a", "output": "b"}, {"prompt": "a", "completion": "b"}]',
     r"neither.json record 1 is neither an Alpaca-style record .* its keys are \['completion', 'prompt'\]"),
    ("not_object.jsonl", '{"instruction": "a", "output": "b"}\n"just text"\n', r"line 2 \(record 1\) is a str"),
    ("bad_role.jsonl", '{"instruction": "a", "output": "b"}\n' + json.dumps(
        {"messages": [{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}]}) + "\n",
     r"bad_role.jsonl line 2 \(record 1\): message 1 has role 'bot'"),
    ("no_reply.json", json.dumps([{"messages": [{"role": "user", "content": "a"}]}]),
     "no_reply.json record 0: the conversation ends with a user message"),
    ("number.json", json.dumps([{"instruction": "a", "output": 42}]), "record 0: 'output' must be text, not int"),
])
def test_bad_records_name_the_file_and_record(tmp_path: Path, tokenizer: Tokenizer, name: str, content: str,
                                              error: str) -> None:
    (tmp_path / name).write_text(content)
    module = JSON(json_path=tmp_path / name)
    module.validate()  # cheap checks pass: the records are read by prepare_data
    module.connect(tokenizer, 2, 64)
    with pytest.raises(ValueError, match=error) as raised:
        module.prepare_data()
    assert str(tmp_path / name) in str(raised.value)


# ------------------------------------------------------------------------------------- named datasets


def test_named_datasets_from_local_files(tmp_path: Path, tokenizer: Tokenizer, hf_offline: None) -> None:
    reference = samples(prepared(JSON(json_path=write_json(tmp_path / "ref.json", ALPACA_RECORDS),
                                      val_split_fraction=0), tokenizer))
    alpaca_file = write_json(tmp_path / "alpaca_data_cleaned.json", ALPACA_RECORDS)  # the original's layout
    dolly_file = write_jsonl(tmp_path / "dolly" / "databricks-dolly-15k.jsonl", [
        {"instruction": r["instruction"], "context": r["input"], "response": r["output"], "category": "open_qa"}
        for r in ALPACA_RECORDS])
    parquet_folder = tmp_path / "alpaca_2k_test" / "data"
    parquet_folder.mkdir(parents=True)
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(ALPACA_RECORDS), parquet_folder / "train-00000-of-00001.parquet")
    for module in (Alpaca(path=str(alpaca_file), val_split_fraction=0),
                   Dolly(path=str(dolly_file.parent), val_split_fraction=0),  # a folder, like a Hub snapshot
                   Alpaca2k(path=str(parquet_folder.parent), val_split_fraction=0)):
        assert samples(prepared(module, tokenizer)) == reference, type(module).__name__

    lima_file = write_jsonl(tmp_path / "lima.jsonl", [
        {"conversations": [m["content"] for m in CHAT_RECORD["messages"][1:]], "source": "test"},
        {"conversations": ["Which animal says moo?", "Cow.", "A question left unanswered"], "source": "test"}])
    lima = prepared(LIMA(path=str(lima_file), val_split_fraction=0), tokenizer, prompt_style="chatml")
    chat = {"messages": CHAT_RECORD["messages"][1:]}
    expected = prepared(JSON(json_path=write_jsonl(tmp_path / "chat.jsonl", [chat, {"messages": chat["messages"][:2]}]),
                             val_split_fraction=0), tokenizer, prompt_style="chatml")
    assert samples(lima) == samples(expected)


def test_named_dataset_errors(tmp_path: Path, tokenizer: Tokenizer, hf_offline: None) -> None:
    with pytest.raises(FileNotFoundError, match="--data.path ./nowhere.json does not exist"):
        Alpaca(path="./nowhere.json").validate()
    wrong = write_jsonl(tmp_path / "wrong.jsonl", [{"prompt": "a", "completion": "b"}])
    module = Dolly(path=str(wrong))
    module.connect(tokenizer, 2, 64)
    with pytest.raises(ValueError, match=r"columns \['prompt', 'completion'\].*missing: \['instruction', 'context'"):
        module.prepare_data()
    module = Alpaca()  # the Hub, which this test keeps offline
    module.connect(tokenizer, 2, 64)
    with pytest.raises(HubError, match="--data Alpaca: .*Hugging Face Hub.* yahma/alpaca-cleaned.*--data.path"):
        module.prepare_data()


# ------------------------------------------------------------------------------------- BuiltinInstruct


def test_builtin_instruct_is_deterministic_and_held_out() -> None:
    first = BuiltinInstruct(num_train=300, num_val=50)
    assert first.examples("train") == BuiltinInstruct(num_train=300, num_val=50).examples("train")
    assert first.examples("val") == generate_tasks(0, "val", 50, unique=True)
    assert first.examples("val") != BuiltinInstruct(num_val=50, generator_seed=1).examples("val")
    val = {r["instruction"] for r in first.examples("val")}
    train = [r["instruction"] for r in first.examples("train")]
    assert len(val) == 50 and not val & set(train) and len(train) == 300
    drawn = {name for r in first.examples("train") for name, _, pattern, _ in TASKS if pattern.search(r["instruction"])}
    assert drawn == set(TASK_NAMES)
    assert all(solve(r["instruction"]) == r["output"] for r in first.examples("train"))
    only = BuiltinInstruct(num_train=20, num_val=0, tasks=["reverse"]).examples("train")
    assert all(r["instruction"].startswith("Reverse the word '") for r in only)
    assert BuiltinInstruct().default_tokenizer() is None
    with pytest.raises(ValueError, match="--data.tasks.*unknown: \\['juggle'\\]"):
        BuiltinInstruct(tasks=["juggle"]).validate()
    with pytest.raises(ValueError, match="Cannot draw 500 distinct val examples"):
        generate_tasks(0, "val", 500, ["first_letter"], unique=True)


def test_builtin_instruct_checker() -> None:
    for prompt, answer in [("What is 17 + 25?", "42"), ("Reverse the word 'apple'.", "elppa"),
                           ("How many letters are in 'banana'?", "6"), ("What is 40 - 15?", "25"),
                           ("Sort these numbers from smallest to largest: 5, 12, 2, 9.", "2, 5, 9, 12"),
                           ("Write 'happy tiger' in capital letters.", "HAPPY TIGER"),
                           ("Which number is larger, 12 or 31?", "31"), ("What is the first letter of 'moon'?", "m")]:
        assert check(prompt, answer) and check(prompt, f"  {answer}.\n") and BuiltinInstruct.check(prompt, answer)
        assert not check(prompt, answer + "0") and not check(prompt, "")
    assert not check("Write 'happy tiger' in capital letters.", "happy tiger")
    rendered = PromptStyle.from_name("alpaca").apply("What is 17 + 25?")
    assert check(rendered, "42")  # a rendered prompt works too
    for record in BuiltinInstruct(num_train=200, num_val=0).examples("train"):
        assert check(record["instruction"], record["output"])
    with pytest.raises(ValueError, match="No BuiltinInstruct task"):
        check("Tell me a joke.", "no")


def test_builtin_instruct_end_to_end(tokenizer: Tokenizer) -> None:
    data = prepared(BuiltinInstruct(num_train=64, num_val=8), tokenizer, micro_batch_size=4, max_seq_length=128)
    assert len(samples(data, "train")) == 64 and len(samples(data, "val")) == 8
    batch = next(data.train_dataloader())
    assert batch["input_ids"].shape[0] == 4 and batch["input_ids"].shape[1] <= 128
    first_val = next(iter(data.val_dataloader()))
    record = data.examples("val")[0]
    ids, labels = unpadded(first_val)[0]
    answer = [t for t in labels if t != -100]
    assert tokenizer.decode(answer[:-1]) == record["output"] and answer[-1] == tokenizer.eos_id
    assert BuiltinInstruct(num_val=0).load_conversations()[1] is None


# ------------------------------------------------------------------------------------- registry and CLI


def test_registry_and_cli(tmp_path: Path) -> None:
    for module in (JSON, Alpaca, Alpaca2k, Dolly, LIMA, BuiltinInstruct):
        assert REGISTRY[module.__name__] is module and issubclass(module, InstructDataModule)
    jsonargparse = pytest.importorskip("jsonargparse")
    parser = jsonargparse.ArgumentParser()
    parser.add_argument("--data", type=Optional[DataModule])
    args = parser.parse_args(["--data", "JSON", "--data.json_path", str(tmp_path), "--data.mask_prompt", "false",
                              "--data.prompt_style", "chatml"])
    data = parser.instantiate(args).data
    assert isinstance(data, JSON) and data.json_path == tmp_path and not data.mask_prompt
    assert data.prompt_style == "chatml"
    args = parser.parse_args(["--data", "BuiltinInstruct", "--data.tasks", "[addition, reverse]"])
    assert parser.instantiate(args).data.tasks == ["addition", "reverse"]


def test_samples_are_the_tokens_of_the_whole_text(tmp_path: Path, tokenizer: Tokenizer) -> None:
    # The response finishes the prompt's last word, so the two tokenized alone would split "banana" apart.
    prompt, response = "How many letters are in 'bana", "na'?"
    whole = tokenizer.encode(prompt + response)  # with bos, as generation would encode it
    assert whole[: len(tokenizer.encode(prompt))] != tokenizer.encode(prompt)  # the boundary is inside a token
    path = write_json(tmp_path / "one.json", [{"instruction": prompt, "output": response}])
    data = prepared(JSON(json_path=path, val_split_fraction=0, prompt_style="default"), tokenizer, 1)
    ((ids, labels),) = samples(data)
    assert ids == whole
    kept = [t for t in labels if t != -100]
    assert labels == [-100] * (len(labels) - len(kept)) + kept  # the response is one run at the end
    assert kept == (whole[1:] + [tokenizer.eos_id])[-len(kept):]
    assert tokenizer.decode(kept[:-1]).endswith(response) and len(tokenizer.decode(kept[:-1])) < len(prompt)
