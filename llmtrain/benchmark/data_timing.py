"""The training loader handed to the loop inside a thin proxy that times every ``next()``: the loop's wait for data."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Optional


class TimedData:
    """A data module that behaves as ``inner`` but times every batch the training loop asks for.

    Rank 0 appends one line per ``next()`` (seconds waited) to ``wait_log``. Plain attributes, so the
    spawned workers of a multi-process run receive it with the rest of the run's spec.
    """

    def __init__(self, inner: Any, wait_log: Path) -> None:
        self.inner = inner
        self.wait_log = Path(wait_log)
        self.dp_rank = 0

    def validate(self) -> None:
        self.inner.validate()

    def default_tokenizer(self) -> Any:
        return self.inner.default_tokenizer()

    def connect(self, *args: Any, **kwargs: Any) -> None:
        self.inner.connect(*args, **kwargs)

    def prepare_data(self) -> None:
        self.inner.prepare_data()

    def setup(self, dp_rank: int = 0, dp_size: int = 1) -> None:
        self.dp_rank = dp_rank
        self.inner.setup(dp_rank, dp_size)

    def train_dataloader(self) -> "TimedLoader":
        return TimedLoader(self.inner.train_dataloader(), self.wait_log if self.dp_rank == 0 else None)

    def val_dataloader(self) -> Any:
        return self.inner.val_dataloader()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "inner":  # unpickling looks these up before inner exists
            raise AttributeError(name)
        return getattr(self.inner, name)


class TimedLoader:
    """Passes every attribute through to the training loader; ``next()`` is also timed and logged."""

    def __init__(self, loader: Any, wait_log: Optional[Path]) -> None:
        object.__setattr__(self, "_loader", loader)
        object.__setattr__(self, "_log", open(wait_log, "a", buffering=1) if wait_log is not None else None)

    def __iter__(self) -> "TimedLoader":
        object.__setattr__(self, "_iterator", iter(self._loader))
        return self

    def __next__(self) -> Any:
        start = time.perf_counter()
        batch = next(self._iterator)
        waited = time.perf_counter() - start
        if self._log is not None:
            self._log.write(f"{waited:.9f}\n")
        return batch

    def __getattr__(self, name: str) -> Any:
        return getattr(object.__getattribute__(self, "_loader"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._loader, name, value)  # e.g. the loop's pin_memory switch reaches the real loader

