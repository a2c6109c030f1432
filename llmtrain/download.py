"""``llmtrain download ORG/NAME``: a model from the Hugging Face Hub into ``checkpoints/ORG/NAME``, ready to use.

Only the files llmtrain reads come down: the safetensors weights (and their index), config.json,
generation_config.json, the tokenizer's files and the chat template. Pickled weights (``*.bin``, ``*.pth``, ...)
never do, and a repository that has no others is refused: llmtrain does not unpickle what it is handed.

The folder is a transformers folder, which ``finetune_*``, ``generate``, ``chat`` and ``convert from_hf`` take as
it is. `huggingface_hub` does the transfer: a connection that drops mid-file is resumed where it stopped, and a run
that was stopped keeps the files it finished, so running the command again fetches only the rest.
"""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path
from typing import Optional

from llmtrain.config import MODEL_ZOO
from llmtrain.hub import HubError, endpoint, explain, reach

HF_CONFIG = "config.json"
WEIGHT_PATTERNS = ("model.safetensors", "model-*-of-*.safetensors", "model.safetensors.index.json")
"""transformers' safetensors weights: one file, or shards and their index."""
TOKENIZER_NAMES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "chat_template.jinja", "chat_template.json")
"""The tokenizer's files (llmtrain reads tokenizer.json, and its settings from the others) and the chat template."""
PICKLE_SUFFIXES = (".bin", ".pth", ".pt", ".ckpt", ".pkl", ".pickle")
REPO_ID = re.compile(r"[A-Za-z0-9][\w.\-]*/[\w.\-]+")


def download(repo_id: str, *, checkpoint_dir: Path = Path("checkpoints"), access_token: Optional[str] = None,
             tokenizer_only: bool = False) -> None:
    """Download a model from the Hugging Face Hub into CHECKPOINT_DIR/REPO_ID (`download list`: the zoo's models).

    Only safetensors weights, config.json, generation_config.json, the tokenizer files and the chat template are
    fetched; a repository whose weights are pickled only (pytorch_model.bin, *.pth) is refused. An interrupted
    download continues where it stopped when run again. HF_ENDPOINT and HF_HUB_OFFLINE apply as in huggingface_hub.

    Args:
        repo_id: The repository, ORG/NAME as on the Hub (e.g. meta-llama/Llama-3.2-1B), or `list` for the zoo's.
        checkpoint_dir: The parent folder: the model goes to CHECKPOINT_DIR/ORG/NAME.
        access_token: A Hugging Face access token, for gated or private repositories. Default: the HF_TOKEN
            variable, else the token of `hf auth login`.
        tokenizer_only: Fetch the tokenizer files and config.json only (e.g. to pretrain with a model's tokenizer).
    """
    if repo_id == "list":
        print("\n".join(zoo_repo_ids()))
        return
    if not REPO_ID.fullmatch(repo_id):
        raise ValueError(f"REPO_ID {repo_id!r} is not a Hub repository id: pass ORG/NAME as on its Hub page (e.g. "
                         "meta-llama/Llama-3.2-1B); `llmtrain download list` lists the zoo's models")
    target = Path(checkpoint_dir) / repo_id
    fix = (f"download it where the Hub can be reached and copy {target} here, or check the network "
           "(HF_ENDPOINT, proxy) and run this again")
    info = reach(repo_id, token=access_token, fix=fix)
    names = files_to_fetch(repo_id, [sibling.rfilename for sibling in info.siblings or []], tokenizer_only)
    if not tokenizer_only and HF_CONFIG in names:
        _fetch(repo_id, info.sha, [HF_CONFIG], target, access_token, fix, progress=False)
        _check_architecture(target, repo_id)  # before the weights: an architecture llmtrain lacks fails now
    _fetch(repo_id, info.sha, names, target, access_token, fix)
    _remove_stale_parts(target)
    size = sum((target / name).stat().st_size for name in names)
    print(f"downloaded {repo_id} to {target} ({len(names)} files, {size / 1e6:,.1f} MB)")
    print("next: " + (f"llmtrain pretrain MODEL --tokenizer_dir {target}" if tokenizer_only else
                      f"llmtrain finetune_lora {target} --data JSON --data.json_path DATA.json  (or: llmtrain "
                      f"generate {target} --prompt \"...\", llmtrain chat {target})"))


def zoo_repo_ids() -> list[str]:
    """The Hub repositories of the zoo's models (ORG/NAME), sorted; the zoo's own sizes have none."""
    found = {f"{entry['hf_config']['org']}/{entry['hf_config']['name']}" for entry in MODEL_ZOO
             if entry.get("hf_config")}
    return sorted(found, key=str.lower)


def files_to_fetch(repo_id: str, names: list[str], tokenizer_only: bool) -> list[str]:
    """The repository's files that llmtrain reads, from its list of ``names``; refuses one with pickled weights
    only, or with no weights at all."""
    top = [name for name in names if "/" not in name]
    tokenizer = [name for name in top if name in TOKENIZER_NAMES]
    config = [name for name in top if name == HF_CONFIG]
    if tokenizer_only:
        if "tokenizer.json" not in tokenizer:
            raise ValueError(f"{repo_id} has no tokenizer.json, the tokenizer file llmtrain reads"
                             + (" (only a SentencePiece tokenizer.model)" if "tokenizer.model" in top else ""))
        return config + tokenizer
    weights = [name for name in top if any(fnmatch.fnmatchcase(name, pattern) for pattern in WEIGHT_PATTERNS)]
    if not any(name.endswith(".safetensors") for name in weights):
        pickled = [name for name in names if name.endswith(PICKLE_SUFFIXES)]
        if pickled:
            raise ValueError(f"{repo_id} has its weights only as pickles ({', '.join(pickled[:3])}), which llmtrain "
                             "never loads (unpickling can run code): choose a repository with safetensors weights "
                             "(model.safetensors), e.g. a newer revision or another upload of the model")
        raise ValueError(f"{repo_id} has no model weights llmtrain reads (model.safetensors or "
                         "model-*-of-*.safetensors with model.safetensors.index.json); its files: "
                         f"{', '.join(names[:8])}{' ...' if len(names) > 8 else ''}")
    if not config:
        raise ValueError(f"{repo_id} has no config.json: it is not a transformers model repository")
    if "tokenizer.json" not in top and "tokenizer.model" in top:  # llmtrain then says what to do about it
        tokenizer.append("tokenizer.model")
    return config + weights + tokenizer


def _fetch(repo_id: str, revision: str, names: list[str], target: Path, token: Optional[str], fix: str,
           progress: bool = True) -> None:
    """Files ``names`` of the repository at commit ``revision`` into ``target``, with progress bars if asked."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    from llmtrain.hub import TIMEOUT_S

    quiet = not progress and not are_progress_bars_disabled()
    if quiet:
        disable_progress_bars()
    try:
        snapshot_download(repo_id, revision=revision, local_dir=target, allow_patterns=names, token=token,
                          endpoint=endpoint(), etag_timeout=TIMEOUT_S)
    except Exception as error:  # noqa: BLE001  (told in one line; --debug shows the traceback)
        raise HubError(explain(error, repo_id, fix=fix)) from error
    finally:
        if quiet:
            enable_progress_bars()


def _check_architecture(target: Path, repo_id: str) -> None:
    from llmtrain.convert.hf import read_hf_config

    try:
        read_hf_config(target)
    except ValueError as error:
        raise ValueError(f"{repo_id} cannot be used by llmtrain, so its weights were not downloaded: {error}") from None


def _remove_stale_parts(target: Path) -> None:
    """Partial files of a download that was killed (huggingface_hub names each process's own, and cannot resume
    another's)."""
    for part in (target / ".cache" / "huggingface" / "download").rglob("*.incomplete"):
        part.unlink(missing_ok=True)
