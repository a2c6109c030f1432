"""The Hugging Face Hub, reached with a bounded wait: one question before a download, and one line when it fails.

``huggingface_hub`` and ``datasets`` retry an unreachable Hub with backoff (about 25 s) and then raise errors whose
text runs over many lines; a command that needs the Hub asks it once here first (`reach`), with `TIMEOUT_S`, and
says in one line what went wrong and what to do (`HubError`, an input error: exit 2).
"""

from __future__ import annotations

import os
from typing import Any, Optional

TIMEOUT_S = 10.0
"""The longest wait for the Hub's first answer (connect and read)."""

OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")


class HubError(OSError):
    """The Hub could not give what a command needs: unreachable, offline, gated, missing. Told in one line."""


def offline_variable() -> Optional[str]:
    """The variable that forbids reaching the Hub (``HF_HUB_OFFLINE=1``, ...), as it was set; None if none is."""
    for name in OFFLINE_VARIABLES:
        if os.environ.get(name, "").strip().upper() in ("1", "ON", "YES", "TRUE"):
            return f"{name}={os.environ[name]}"
    return None


def endpoint() -> str:
    """The Hub's address: ``HF_ENDPOINT``, else huggingface.co."""
    from huggingface_hub import constants

    return (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


def reach(repo_id: str, *, repo_type: str = "model", token: Optional[str] = None, fix: str) -> Any:
    """The repository's info from the Hub (``repo_info``), asked once with `TIMEOUT_S`; a `HubError` saying why not
    and ending with ``fix`` (what to do instead) when the Hub is offline, unreachable or answers no."""
    variable = offline_variable()
    if variable is not None:
        raise HubError(f"{variable} forbids reaching the Hugging Face Hub for {repo_id}: {fix}")
    from huggingface_hub import HfApi

    try:
        return HfApi(endpoint=endpoint(), token=token).repo_info(repo_id, repo_type=repo_type, timeout=TIMEOUT_S)
    except Exception as error:  # noqa: BLE001  (every failure is told in one line; --debug shows the traceback)
        raise HubError(explain(error, repo_id, repo_type=repo_type, fix=fix)) from error


def dataset_fix(how_local: str) -> str:
    """What to do when a Hub dataset cannot be had; ``how_local`` says how to pass a local copy instead."""
    if offline_variable() is not None:
        return f"datasets has no copy of it cached: download it where the Hub can be reached and {how_local}"
    return (f"without network, download it elsewhere and {how_local}; HF_HUB_OFFLINE=1 uses a copy that datasets "
            "cached before")


def explain(error: BaseException, repo_id: str, *, repo_type: str = "model", fix: str) -> str:
    """One line for a failure of huggingface_hub (or of datasets, which wraps it) with repository ``repo_id``."""
    import httpx2
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, OfflineModeIsEnabled,
                                        RepositoryNotFoundError)

    where = endpoint()
    page = f"{where}/{'datasets/' if repo_type == 'dataset' else ''}{repo_id}"
    # `download` takes a token as a flag; the data modules read the one huggingface_hub finds
    token = "the HF_TOKEN variable (or `hf auth login`)" if repo_type == "dataset" else \
        "--access_token TOKEN or the HF_TOKEN variable"
    causes = _causes(error)
    for cause in causes:
        if isinstance(cause, GatedRepoError):
            return (f"{repo_id} is gated: accept its conditions on {page} with your account, then pass an access "
                    f"token of that account with {token} ({_status(cause)} from the Hub)")
        if isinstance(cause, RepositoryNotFoundError):
            return (f"{repo_id} is not a {repo_type} repository on {where} ({_status(cause)}): check its spelling "
                    f"(ORG/NAME, as on its Hub page); a private one needs a token: {token}")
        if isinstance(cause, OfflineModeIsEnabled) or offline_variable() is not None:
            return f"{offline_variable() or 'offline mode'} forbids reaching the Hugging Face Hub for {repo_id}: {fix}"
    for cause in causes:
        if isinstance(cause, (httpx2.TransportError, ConnectionError, TimeoutError)):
            reason = str(cause).splitlines()[0] if str(cause) else type(cause).__name__
            return f"could not reach the Hugging Face Hub at {where} for {repo_id} ({reason}): {fix}"
        if isinstance(cause, HfHubHTTPError):
            return f"the Hugging Face Hub at {where} answered {_status(cause)} for {repo_id}: {fix}"
    first = str(error).splitlines()[0] if str(error) else ""
    return f"could not get {repo_id} from the Hugging Face Hub at {where} ({type(error).__name__}: {first}): {fix}"


def _causes(error: BaseException) -> list[BaseException]:
    """``error`` and the errors it was raised from, outermost first."""
    found: list[BaseException] = []
    while error is not None and error not in found:
        found.append(error)
        error = error.__cause__ or error.__context__
    return found


def _status(error: BaseException) -> str:
    response = getattr(error, "response", None)
    code = getattr(response, "status_code", None)
    return f"HTTP {code}" if code is not None else type(error).__name__
