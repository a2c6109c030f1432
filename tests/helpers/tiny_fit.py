"""A tiny fit() in one process, with a loader and a logger of its own: for tests that count what a step does."""

import torch

from llmtrain.config import Config
from llmtrain.model import GPT

CONFIG = dict(name="hot", vocab_size=1000, padding_multiple=8, block_size=64, n_layer=2, n_head=2, n_embd=32,
              n_query_groups=1, intermediate_size=64)


class Batches:
    """Random token windows served as micro-batches, with a position like a data module's loader."""

    def __init__(self, micro_batch_size, length=16):
        self.generator = torch.Generator().manual_seed(1)
        self.micro_batch_size, self.length, self.position = micro_batch_size, length, 0

    epoch = property(lambda self: self.position / 1000)

    def __iter__(self):
        return self

    def __next__(self):
        self.position += self.micro_batch_size
        rows = torch.randint(0, 64, (self.micro_batch_size, self.length + 1), generator=self.generator)
        return {"input_ids": rows[:, :-1], "labels": rows[:, 1:]}

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


class Rows:
    def __init__(self):
        self.rows = []

    def log(self, metrics):
        self.rows.append(dict(metrics))

    def close(self):
        pass


def train_tiny(optimizer_kwargs, max_steps=8, log_interval=4):
    from llmtrain.args import EvalArgs, TrainArgs, batch_plan
    from llmtrain.distributed.runtime import Runtime
    from llmtrain.train.horizon import plan_horizon
    from llmtrain.train.loop import Fit
    from llmtrain.precision import Precision

    torch.manual_seed(0)
    model = GPT(Config(**{**CONFIG, "vocab_size": 64, "padding_multiple": 64, "block_size": 16}))
    model.init_weights()
    train = TrainArgs(global_batch_size=4, micro_batch_size=2, max_steps=max_steps, lr_warmup_steps=0,
                      save_interval=None, log_interval=log_interval, max_nonfinite_steps=3)
    rows = Rows()
    job = Fit(runtime=Runtime(), model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2,
                                                                          **optimizer_kwargs),
              train_loader=Batches(2), val_loader=None, train=train,
              eval=EvalArgs(initial_validation=False, final_validation=False), plan=batch_plan(train, 1),
              horizon=plan_horizon(train, 1, None), precision=Precision("32-true"),
              save_checkpoint=lambda state: None, save_final=lambda state: None, loggers=[rows])
    return job, rows
