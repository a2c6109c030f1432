"""A built-in instruction set that needs no download, with answers a program can check.

Small tasks (arithmetic, reversing and spelling words, sorting, capitals, comparisons), generated
from seeded random streams, so the data is the same on every machine. `solve()` computes the right
answer of any prompt these tasks produce, and `check()` grades a model's answer, so a test or a
tutorial can measure how often generations are right after fine-tuning.
"""

import random
import re
from dataclasses import dataclass
from typing import Callable, Collection, Optional

from llmtrain.data.instruct import Conversation, InstructDataModule, record_to_conversation

GENERATOR_VERSION = 1
"""Bump whenever the generated tasks change."""

WORDS = [
    "apple", "ball", "banana", "bird", "boat", "book", "bread", "cake", "car", "cat", "chair", "cloud", "cow",
    "cup", "dog", "door", "duck", "egg", "farm", "fish", "flower", "frog", "garden", "hat", "horse", "house",
    "kite", "lamp", "leaf", "lemon", "lion", "milk", "moon", "mouse", "orange", "park", "pear", "pencil",
    "rabbit", "rain", "river", "robot", "sand", "sheep", "shell", "shoe", "sock", "star", "stone", "sun",
    "table", "tiger", "tree", "train", "water", "window", "yellow", "zebra",
]
ADJECTIVES = ["big", "small", "happy", "red", "blue", "green", "quiet", "fast", "old", "new", "warm", "soft"]

# A task is (name, make(rng) -> instruction, pattern, solve(match) -> answer). The pattern must
# recognize every instruction `make` writes, so that `solve` works on prompts from anywhere.
Task = tuple[str, Callable[[random.Random], str], "re.Pattern[str]", Callable[["re.Match[str]"], str]]


def _numbers(text: str) -> list[int]:
    return [int(n) for n in re.findall(r"-?\d+", text)]


def _subtraction(rng: random.Random) -> str:
    a, b = sorted((rng.randint(0, 50), rng.randint(0, 50)), reverse=True)
    return f"What is {a} - {b}?"


def _comparison(rng: random.Random) -> str:
    a, b = rng.sample(range(1, 100), 2)
    return f"Which number is larger, {a} or {b}?"


TASKS: list[Task] = [
    ("addition", lambda rng: f"What is {rng.randint(0, 50)} + {rng.randint(0, 50)}?",
     re.compile(r"What is (\d+) \+ (\d+)\?"), lambda m: str(int(m[1]) + int(m[2]))),
    ("subtraction", _subtraction,
     re.compile(r"What is (\d+) - (\d+)\?"), lambda m: str(int(m[1]) - int(m[2]))),
    ("reverse", lambda rng: f"Reverse the word '{rng.choice(WORDS)}'.",
     re.compile(r"Reverse the word '([^']*)'\."), lambda m: m[1][::-1]),
    ("count_letters", lambda rng: f"How many letters are in '{rng.choice(WORDS)}'?",
     re.compile(r"How many letters are in '([^']*)'\?"), lambda m: str(len(m[1]))),
    ("first_letter", lambda rng: f"What is the first letter of '{rng.choice(WORDS)}'?",
     re.compile(r"What is the first letter of '([^']*)'\?"), lambda m: m[1][:1]),
    ("sort", lambda rng: "Sort these numbers from smallest to largest: "
                         + ", ".join(str(rng.randint(1, 99)) for _ in range(rng.randint(3, 5))) + ".",
     re.compile(r"Sort these numbers from smallest to largest: ([\d, ]+)\."),
     lambda m: ", ".join(str(n) for n in sorted(_numbers(m[1])))),
    ("uppercase", lambda rng: f"Write '{rng.choice(ADJECTIVES)} {rng.choice(WORDS)}' in capital letters.",
     re.compile(r"Write '([^']*)' in capital letters\."), lambda m: m[1].upper()),
    ("larger", _comparison,
     re.compile(r"Which number is larger, (\d+) or (\d+)\?"), lambda m: str(max(int(m[1]), int(m[2])))),
]
TASK_NAMES = [task[0] for task in TASKS]


@dataclass(kw_only=True)
class BuiltinInstruct(InstructDataModule):
    """Generated instructions with checkable answers ("What is 17 + 25?" → "42"); no download.

    It brings no tokenizer: the fine-tuned model's own is used.
    """

    num_train: int = 5000
    """Training examples to generate."""
    num_val: int = 100
    """Validation examples, all different, none of them among the training examples. 0: no validation."""
    tasks: Optional[list[str]] = None
    """Tasks to draw from: addition, subtraction, reverse, count_letters, first_letter, sort, uppercase, larger. None: all."""
    generator_seed: int = 0
    """Seed of the task generator (not of the training order, which --seed controls)."""

    def validate(self) -> None:
        super().validate()
        if self.num_train < 1:
            raise ValueError(f"--data.num_train must be at least 1, got {self.num_train}")
        if self.num_val < 0:
            raise ValueError(f"--data.num_val must be 0 (no validation) or more, got {self.num_val}")
        unknown = sorted(set(self.tasks or []) - set(TASK_NAMES))
        if unknown or self.tasks == []:
            raise ValueError(f"--data.tasks {self.tasks}: choose one or more of {TASK_NAMES} (unknown: {unknown})")

    def examples(self, split: str) -> list[dict[str, str]]:
        """The records of "train" or "val": {"instruction", "output"}."""
        val = generate_tasks(self.generator_seed, "val", self.num_val, self.tasks, unique=True)
        if split == "val":
            return val
        if split != "train":
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        held_out = {record["instruction"] for record in val}
        return generate_tasks(self.generator_seed, "train", self.num_train, self.tasks, exclude=held_out)

    def load_conversations(self) -> tuple[list[Conversation], Optional[list[Conversation]], str]:
        conversations = {
            split: [record_to_conversation(r, f"BuiltinInstruct {split} example {i}")
                    for i, r in enumerate(self.examples(split))]
            for split in ("train", "val")
        }
        return conversations["train"], conversations["val"] or None, "BuiltinInstruct"

    @staticmethod
    def check(prompt: str, answer: str) -> bool:
        """Whether `answer` is the right answer to `prompt` (an instruction, or any text that contains one)."""
        return check(prompt, answer)


def generate_tasks(seed: int, split: str, count: int, tasks: Optional[list[str]] = None,
                   exclude: Collection[str] = (), unique: bool = False) -> list[dict[str, str]]:
    """`count` records {"instruction", "output"}, the same for the same arguments on any machine.

    Instructions in `exclude` are skipped; with `unique`, none repeats.
    """
    chosen = [task for task in TASKS if tasks is None or task[0] in tasks]
    # NOTE: string seeds hash with SHA-512, so they are stable across processes and Python versions.
    rng = random.Random(f"builtin-instruct-v{GENERATOR_VERSION}:{seed}:{split}")
    records: list[dict[str, str]] = []
    seen = set(exclude)
    attempts = 0
    while len(records) < count:
        attempts += 1
        if attempts > 100 * count + 1000:
            raise ValueError(f"Cannot draw {count} distinct {split} examples from tasks {[t[0] for t in chosen]}; "
                             "lower the count or add tasks")
        name, make, _, _ = rng.choice(chosen)
        instruction = make(rng)
        if instruction in seen:
            continue
        if unique:
            seen.add(instruction)
        records.append({"instruction": instruction, "output": solve(instruction)})
    return records


def solve(prompt: str) -> str:
    """The right answer to the first task instruction found in `prompt`."""
    found = [(match.start(), solver(match)) for _, _, pattern, solver in TASKS
             for match in [pattern.search(prompt)] if match]
    if not found:
        raise ValueError(f"No BuiltinInstruct task found in {prompt!r}")
    return min(found)[1]


def check(prompt: str, answer: str) -> bool:
    """Whether `answer` matches `solve(prompt)`, ignoring surrounding space and a final period."""
    return _normalize(answer) == _normalize(solve(prompt))


def _normalize(answer: str) -> str:
    return " ".join(answer.strip().removesuffix(".").split())
