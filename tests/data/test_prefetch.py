"""Prefetched batches: making the next batch hides behind the step, and the loader keeps its exact position."""

import torch


def counting_loader(prefetch, made=None):
    """A TrainLoader whose batches are row windows; each batch made is noted in ``made``."""
    import numpy as np

    from llmtrain.data.base import TrainLoader

    def make_batch(indices):
        if made is not None:
            made.append(indices.tolist())
        rows = torch.as_tensor(np.stack([np.arange(i, i + 9) for i in indices.tolist()]))
        return {"input_ids": rows[:, :-1], "labels": rows[:, 1:]}

    loader = TrainLoader(50, make_batch, micro_batch_size=2, dp_rank=1, dp_size=2, seed=3)
    loader.prefetch = prefetch
    return loader


def test_prefetch_hides_batch_making_and_keeps_the_exact_position():
    import time

    made = {"eager": [], "ahead": []}
    eager, ahead = counting_loader(0, made["eager"]), counting_loader(2, made["ahead"])
    for name, loader in (("eager", eager), ("ahead", ahead)):
        batches = []
        for index in range(30):
            batches.append(next(loader))
            if name == "eager":
                assert len(made["eager"]) == index + 1  # made when asked for, never ahead
            elif index == 0:
                # While the first batch trains, the background thread makes the next two without being asked.
                hang_guard = time.monotonic() + 60
                while len(made["ahead"]) < 3 and time.monotonic() < hang_guard:
                    time.sleep(0.01)
                assert len(made["ahead"]) == 3
            if index == 11:
                state = loader.state_dict()  # a checkpoint: only the batches handed out count
                assert state["samples_consumed"] == 12 * 4
        assert loader.samples_consumed == 30 * 4
        if name == "ahead":
            for mine, reference in zip(batches, eager_batches):
                assert torch.equal(mine["input_ids"], reference["input_ids"])
            resumed = counting_loader(2)
            resumed.load_state_dict(state)
            for reference in eager_batches[12:16]:
                assert torch.equal(next(resumed)["input_ids"], reference["input_ids"])
            ahead.load_state_dict(state)  # a loader that moved back drops what it made for later positions
            assert torch.equal(next(ahead)["input_ids"], eager_batches[12]["input_ids"])
        eager_batches = batches
