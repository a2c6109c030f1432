import json
import shutil
from pathlib import Path

import pytest

from llmtrain.prompts import Alpaca
from llmtrain.tokenizer import BPE_BOS_TOKEN, BPE_EOS_TOKEN, Tokenizer, train_bpe_tokenizer

CORPUS = [
    "The cat sat on the mat. The dog sat on the log.",
    "A quick brown fox jumps over the lazy dog.",
    "Tom had 3 apples and got 2 more, so he had 5 apples.",
    "Lily went to the park with her mom, and she played on the swings.",
] * 20


@pytest.fixture(scope="module")
def trained_dir(tiny_tokenizer) -> Path:
    return tiny_tokenizer(CORPUS).checkpoint_dir


@pytest.fixture
def tokenizer(trained_dir: Path) -> Tokenizer:
    return Tokenizer(trained_dir)


def copy_with_config(trained_dir: Path, target: Path, **files: dict) -> Path:
    """A tokenizer folder with the same tokenizer.json but other side files (name_json=content)."""
    target.mkdir()
    shutil.copy(trained_dir / "tokenizer.json", target / "tokenizer.json")
    for name, content in files.items():
        (target / name.replace("_json", ".json")).write_text(json.dumps(content))
    return target


def test_train_bpe_writes_loadable_folder(trained_dir: Path, tokenizer: Tokenizer) -> None:
    assert {p.name for p in trained_dir.iterdir()} >= {"tokenizer.json", "tokenizer_config.json"}
    assert not [p for p in trained_dir.parent.iterdir() if ".tmp-" in p.name]  # staging dir renamed away
    config = json.loads((trained_dir / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert tokenizer.bos_id == tokenizer.token_to_id(BPE_BOS_TOKEN)
    assert tokenizer.eos_id == tokenizer.token_to_id(BPE_EOS_TOKEN)
    assert tokenizer.vocab_size == len(json.loads((trained_dir / "tokenizer.json").read_text())["model"]["vocab"])
    assert tokenizer.add_bos


def test_round_trip_including_unseen_characters(tokenizer: Tokenizer) -> None:
    for text in ["The cat sat on the mat.", "  spaces\tand\nnewlines ", "héllo wörld 🙂 日本"]:
        assert tokenizer.decode(tokenizer.encode(text, bos=False)) == text


def test_bos_and_eos(tokenizer: Tokenizer) -> None:
    plain = tokenizer.encode("the dog", bos=False)
    assert tokenizer.encode("the dog") == [tokenizer.bos_id] + plain  # the tokenizer's default adds bos
    assert tokenizer.encode("the dog", bos=True, eos=True) == [tokenizer.bos_id] + plain + [tokenizer.eos_id]
    assert tokenizer.encode(BPE_BOS_TOKEN + "the dog", bos=True) == [tokenizer.bos_id] + plain  # never doubled
    assert tokenizer.decode(tokenizer.encode("the dog", eos=True), skip_special_tokens=True) == "the dog"


def test_encode_batch_matches_encode(tokenizer: Tokenizer) -> None:
    texts = CORPUS[:4] + [""]
    assert tokenizer.encode_batch(texts, bos=True, eos=True) == [tokenizer.encode(t, True, True) for t in texts]
    assert tokenizer.encode_batch(texts) == [tokenizer.encode(t) for t in texts]


def test_reload_save_and_fingerprint(tokenizer: Tokenizer, tmp_path: Path) -> None:
    tokenizer.save(tmp_path / "checkpoint")
    copy = Tokenizer(tmp_path / "checkpoint")
    assert {p.name for p in (tmp_path / "checkpoint").iterdir()} == {
        "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"}
    assert copy.encode(CORPUS[2], eos=True) == tokenizer.encode(CORPUS[2], eos=True)
    assert copy.fingerprint == tokenizer.fingerprint
    no_bos = copy_with_config(tokenizer.checkpoint_dir, tmp_path / "no_bos",
                              tokenizer_config_json={"bos_token": BPE_BOS_TOKEN, "add_bos_token": False})
    assert Tokenizer(no_bos).fingerprint != tokenizer.fingerprint  # bos settings are part of the key
    # A chat template travels with the tokenizer, as transformers saves it: the checkpoint is prompted the same way.
    (no_bos / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    Tokenizer(no_bos).save(tmp_path / "with_template")
    assert (tmp_path / "with_template" / "chat_template.jinja").read_text() == "{{ messages[0]['content'] }}"


def test_special_tokens_from_each_config_file(trained_dir: Path, tmp_path: Path) -> None:
    bos_id, eos_id = Tokenizer(trained_dir).bos_id, Tokenizer(trained_dir).eos_id
    as_dicts = copy_with_config(trained_dir, tmp_path / "dicts", tokenizer_config_json={
        "bos_token": {"content": BPE_BOS_TOKEN, "lstrip": False}, "eos_token": {"content": BPE_EOS_TOKEN},
        "add_bos_token": False})
    tokenizer = Tokenizer(as_dicts)
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.add_bos) == (bos_id, eos_id, False)
    assert tokenizer.encode("dog")[0] != bos_id

    # No add_bos_token anywhere: the post-processor (which adds bos) decides.
    from_map = copy_with_config(trained_dir, tmp_path / "map", special_tokens_map_json={
        "bos_token": BPE_BOS_TOKEN, "eos_token": BPE_EOS_TOKEN})
    assert (Tokenizer(from_map).bos_id, Tokenizer(from_map).eos_id, Tokenizer(from_map).add_bos) == (bos_id, eos_id, True)

    from_generation = copy_with_config(trained_dir, tmp_path / "generation", generation_config_json={
        "bos_token_id": bos_id, "eos_token_id": [eos_id, 7]})
    tokenizer = Tokenizer(from_generation)
    assert (tokenizer.bos_id, tokenizer.eos_id) == (bos_id, eos_id)
    tokenizer.save(tmp_path / "saved")  # settings from generation_config.json survive the copy
    saved = Tokenizer(tmp_path / "saved")
    assert (saved.bos_id, saved.eos_id, saved.add_bos) == (bos_id, eos_id, tokenizer.add_bos)
    # Every eos_token_id it lists ends generation (Llama 3.1 and Qwen2.5 instruct list several), in the copy too.
    assert tokenizer.stop_ids == saved.stop_ids == (eos_id, 7)
    assert Alpaca().stop_tokens(saved) == ([eos_id], [7])
    assert Tokenizer(trained_dir).stop_ids == (eos_id,)
    # One eos_token_id that is not tokenizer_config.json's eos: transformers' generate stops on it, so it stops here too.
    other_eos = copy_with_config(trained_dir, tmp_path / "other_eos", tokenizer_config_json={
        "bos_token": BPE_BOS_TOKEN, "eos_token": BPE_EOS_TOKEN}, generation_config_json={"eos_token_id": 7})
    assert (Tokenizer(other_eos).eos_id, Tokenizer(other_eos).stop_ids) == (eos_id, (eos_id, 7))

    # tokenizer.json alone: its post-processor puts <|bos|> in front, and transformers' tokenizer(text) keeps it.
    nothing = copy_with_config(trained_dir, tmp_path / "nothing")
    assert (Tokenizer(nothing).bos_id, Tokenizer(nothing).eos_id, Tokenizer(nothing).add_bos) == (bos_id, None, True)
    assert Tokenizer(nothing).encode("dog") == Tokenizer(trained_dir).encode("dog")
    with pytest.raises(ValueError, match="no eos token"):
        Tokenizer(nothing).encode("dog", eos=True)
    transformers = pytest.importorskip("transformers")
    assert transformers.AutoTokenizer.from_pretrained(str(nothing))("dog")["input_ids"] == Tokenizer(nothing).encode("dog")


def test_missing_tokenizer_names_path_and_flag(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="--tokenizer_dir") as error:
        Tokenizer(tmp_path / "nope")
    assert str(tmp_path / "nope") in str(error.value)
    with pytest.raises(FileNotFoundError, match="--tokenizer_dir") as error:
        Tokenizer(tmp_path)
    assert str(tmp_path / "tokenizer.json") in str(error.value)


def test_sentencepiece_only_folder_is_refused_not_replaced(tmp_path: Path) -> None:
    """A model folder with only tokenizer.model (older Llama 2, Mistral, Gemma uploads) has a tokenizer llmtrain
    cannot read: say so, and never train its weights on a data module's own vocabulary instead."""
    from llmtrain.recipes.build import resolve_tokenizer

    (tmp_path / "tokenizer.model").write_bytes(b"\x0a\x0b<sentencepiece proto>")
    with pytest.raises(FileNotFoundError, match="SentencePiece tokenizer.model but no tokenizer.json") as error:
        Tokenizer(tmp_path)
    assert "save_pretrained" in str(error.value) and "--tokenizer_dir" in str(error.value)

    class DataWithItsOwnTokenizer:
        def default_tokenizer(self):
            raise AssertionError("the data module's tokenizer replaced the model's")

    with pytest.raises(ValueError, match=f"{tmp_path} holds a SentencePiece tokenizer.model"):
        resolve_tokenizer(None, DataWithItsOwnTokenizer(), None, tmp_path)


def test_retraining_replaces_an_existing_folder(trained_dir: Path, tmp_path: Path) -> None:
    out_dir = tmp_path / "tok"
    first = train_bpe_tokenizer(iter(CORPUS[:2]), vocab_size=300, out_dir=out_dir)
    second = train_bpe_tokenizer(iter(CORPUS), vocab_size=400, out_dir=out_dir)
    assert first.fingerprint != second.fingerprint == Tokenizer(out_dir).fingerprint
    assert [p.name for p in tmp_path.iterdir()] == ["tok"]


def test_transformers_opens_trained_tokenizer(tokenizer: Tokenizer) -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(tokenizer.checkpoint_dir))
    text = "Tom had 3 apples."
    assert hf(text)["input_ids"] == tokenizer.encode(text)
    assert (hf.bos_token_id, hf.eos_token_id) == (tokenizer.bos_id, tokenizer.eos_id)
