"""Work units: a pretraining source cut into parts that fresh processes tokenize independently.

``llmtrain prepare_data`` hands each unit to one process of one rank, which tokenizes it into the unit's own
shards. A unit is small, plain data (it is pickled into a spawned process) and produces its documents itself,
as :class:`~llmtrain.data.tokens.Piece` objects, so nothing but its description crosses a process boundary.
A module's list of units depends only on its source, never on how many processes prepare it, and read one
after another, the units give exactly the documents, in the order, that the module's token cache holds.
"""

from __future__ import annotations

from typing import Iterator, Sequence, TypeVar

from llmtrain.data.tokens import Piece

UNIT_BYTES = 16 * 2**20
"""About how much text one unit holds: a few million tokens, seconds of work for one core. Small enough
for every core to get several units of a corpus of a few hundred megabytes, large enough that a corpus of
terabytes stays at a manageable number of units (and shards)."""

T = TypeVar("T")


class WorkUnit:
    """A part of a source that a fresh process can tokenize alone. Subclasses are frozen dataclasses."""

    size: int
    """About how many bytes of text the unit holds (for progress and balance, not exact)."""

    def pieces(self) -> Iterator[Piece]:
        """The unit's documents, in order, as the token cache reads them."""
        raise NotImplementedError


def contiguous_groups(items: Sequence[T], sizes: Sequence[int], target: int) -> list[list[T]]:
    """``items`` in order, cut into consecutive groups of about ``target`` bytes (an item larger than that
    is a group of its own); the cuts depend on the sizes alone."""
    groups: list[list[T]] = []
    group: list[T] = []
    size = 0
    for item, item_size in zip(items, sizes):
        if group and size + item_size > target:
            groups.append(group)
            group, size = [], 0
        group.append(item)
        size += item_size
    if group:
        groups.append(group)
    return groups
