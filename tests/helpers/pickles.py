"""A hostile pickle for the tests that prove nothing a user hands us is ever unpickled."""

from __future__ import annotations

from pathlib import Path


class RunsCode:
    """A pickle that, if anything ever unpickled it, would leave a file behind."""

    def __init__(self, sentinel: Path) -> None:
        self.sentinel = sentinel

    def __reduce__(self):
        return (Path.touch, (self.sentinel,))
