"""A built-in corpus that needs no download: short, simple, procedurally generated stories.

Every story is drawn from its own seeded random stream, so the corpus is the same on every
machine and any document can be generated alone. The text is structured enough for a tiny
model to learn quickly: a cast with consistent names and pronouns, places with the things
found there, animals with their sounds, and counts that add up ("... so now she had five shells").
"""

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

from llmtrain.checkpoint.layout import TOKENIZER_FILE
from llmtrain.data.base import PretrainDataModule, TokenFiles
from llmtrain.data.tokens import Piece, cache_dir, cache_key, exclusive_lock, tokenize_to_cache, whole_documents
from llmtrain.data.units import WorkUnit
from llmtrain.tokenizer import Tokenizer, train_bpe_tokenizer

GENERATOR_VERSION = 1
"""Bump whenever the generated text changes, so cached tokens and tokenizers are rebuilt."""
TOKENIZER_TRAINING_DOCUMENTS = 4000
"""Stories the tokenizer is trained on; the vocabulary is small, so more adds time but no words."""
STORY_CHARS = 700
"""About how long a story is."""


@dataclass
class BuiltinStories(PretrainDataModule):
    """Generated short stories with their own tokenizer; no download, the same on every machine."""

    num_documents: int = 10_000
    """Training stories to generate (about STORY_CHARS = 700 characters each)."""
    num_val_documents: int = 500
    """Validation stories, drawn from a separate random stream."""
    vocab_size: int = 4096
    """Upper bound on the size of the BPE vocabulary trained on the stories (the corpus may need fewer)."""
    generator_seed: int = 0
    """Seed of the story generator (not of the training order, which --seed controls)."""

    def validate(self) -> None:
        if self.num_documents < 1:
            raise ValueError(f"--data.num_documents must be at least 1, got {self.num_documents}")
        if self.num_val_documents < 0:
            raise ValueError(f"--data.num_val_documents must be 0 (no validation) or more, got {self.num_val_documents}")
        if self.vocab_size < 300:  # 256 bytes + special tokens + a few merges
            raise ValueError(f"--data.vocab_size must be at least 300, got {self.vocab_size}")

    def default_tokenizer(self) -> Optional[Tokenizer]:
        """A byte-level BPE trained on the stories once, then reused from the cache."""
        key = cache_key("builtin-stories-tokenizer", GENERATOR_VERSION, self.generator_seed, self.vocab_size,
                        TOKENIZER_TRAINING_DOCUMENTS)
        directory = cache_dir() / "tokenizers" / f"builtin-stories-{key}"
        with exclusive_lock(directory.with_name(directory.name + ".lock")):
            if (directory / TOKENIZER_FILE).is_file():
                return Tokenizer(directory)
            texts = generate_stories(self.generator_seed, "train", TOKENIZER_TRAINING_DOCUMENTS)
            return train_bpe_tokenizer(texts, self.vocab_size, directory)

    def prepare_data(self) -> None:
        tokenizer = self._require_connected()
        train = self._tokenize("train", self.num_documents, tokenizer)
        name = f"BuiltinStories (--data.num_documents {self.num_documents})"
        if self.num_val_documents == 0:
            self._files = TokenFiles(train, name)
            return
        val = self._tokenize("val", self.num_val_documents, tokenizer)
        self._files = TokenFiles(train, name, val, f"BuiltinStories (--data.num_val_documents {self.num_val_documents})")

    def work_units(self, split: str, unit_bytes: int) -> list[WorkUnit]:
        count = self.num_documents if split == "train" else self.num_val_documents
        per_unit = max(1, unit_bytes // STORY_CHARS)
        return [StoryRange(self.generator_seed, split, start, min(start + per_unit, count))
                for start in range(0, count, per_unit)]

    def _tokenize(self, split: str, count: int, tokenizer: Tokenizer) -> Path:
        key = cache_key("builtin-stories", GENERATOR_VERSION, self.generator_seed, split, count, tokenizer.fingerprint)
        return tokenize_to_cache(
            whole_documents(generate_stories(self.generator_seed, split, count)), tokenizer, key,
            description=f"{count:,} generated {split} stories",
        )


@dataclass(frozen=True)
class StoryRange(WorkUnit):
    """Stories ``start`` to ``stop`` (exclusive) of a split."""

    generator_seed: int
    split: str
    start: int
    stop: int

    @property
    def size(self) -> int:
        return (self.stop - self.start) * STORY_CHARS

    def pieces(self) -> Iterator[Piece]:
        return whole_documents(generate_stories(self.generator_seed, self.split, self.stop, start=self.start))


def generate_stories(seed: int, split: str, count: int, start: int = 0) -> Iterator[str]:
    """Stories `start` to `count` - 1 of a split (the first `count` by default). Each split is its own random
    stream, so train and val never share a story draw, and each story its own, so it is the same in any range."""
    writer = StoryWriter()
    for index in range(start, count):
        # NOTE: string seeds hash with SHA-512, so they are stable across processes and Python versions.
        yield writer.story(random.Random(f"stories-v{GENERATOR_VERSION}:{seed}:{split}:{index}"))


# ----------------------------------------------------------------------------- the story world

GIRLS = ["Lily", "Mia", "Emma", "Sara", "Anna", "Lucy", "Zoe", "Ella", "Amy", "Nora", "Ruby", "Maya", "Ivy", "Rosa"]
BOYS = ["Tom", "Ben", "Max", "Sam", "Leo", "Jack", "Tim", "Finn", "Noah", "Omar", "Eli", "Luke", "Hugo", "Dan"]
RELATIVES = ["mom", "dad", "grandma", "grandpa", "aunt", "uncle"]
ADJECTIVES = ["kind", "curious", "brave", "happy", "clever", "little", "funny", "shy"]
COLORS = ["red", "blue", "green", "yellow", "purple", "golden", "pink", "white"]
TOYS = ["kite", "ball", "boat", "balloon", "hat", "toy car"]
NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
           "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen", "twenty"]
# (kind, sound, pet names)
ANIMALS = [
    ("dog", "Woof", ["Spot", "Buddy", "Rex"]), ("cat", "Meow", ["Coco", "Misty", "Tiger"]),
    ("duck", "Quack", ["Daisy", "Puddles"]), ("frog", "Ribbit", ["Hopper", "Pip"]),
    ("bird", "Tweet", ["Sunny", "Kiwi"]), ("sheep", "Baa", ["Fluffy", "Cloud"]),
]
TIMES = ["One sunny morning", "One windy afternoon", "On a warm summer day", "One cold winter morning",
         "On a bright Saturday", "One quiet evening"]


@dataclass(frozen=True)
class Place:
    name: str
    activities: tuple[str, ...]
    things: tuple[tuple[str, str], ...]  # (singular, plural) of what can be found there
    where: str  # where in the place things are found


PLACES = [
    Place("park", ("played on the swings", "ran on the grass", "slid down the big slide"),
          (("leaf", "leaves"), ("acorn", "acorns"), ("feather", "feathers")), "under a tree"),
    Place("beach", ("built a sand castle", "splashed in the waves", "walked along the sea"),
          (("shell", "shells"), ("stone", "stones"), ("crab", "crabs")), "in the sand"),
    Place("forest", ("walked under the tall trees", "listened to the birds", "jumped over a log"),
          (("pinecone", "pinecones"), ("mushroom", "mushrooms"), ("stick", "sticks")), "near an old tree"),
    Place("garden", ("watered the flowers", "dug in the soil", "looked at the bees"),
          (("flower", "flowers"), ("strawberry", "strawberries"), ("snail", "snails")), "behind the bushes"),
    Place("farm", ("fed the cows", "rode on a tractor", "helped in the barn"),
          (("egg", "eggs"), ("carrot", "carrots"), ("apple", "apples")), "next to the barn"),
    Place("market", ("looked at the fruit", "listened to the music", "bought some bread"),
          (("orange", "oranges"), ("coin", "coins"), ("pear", "pears")), "on a small table"),
]


@dataclass
class Person:
    name: str
    girl: bool

    @property
    def subject(self) -> str:
        return "she" if self.girl else "he"

    @property
    def object(self) -> str:
        return "her" if self.girl else "him"

    @property
    def possessive(self) -> str:
        return "her" if self.girl else "his"

    @property
    def child(self) -> str:
        return "girl" if self.girl else "boy"


@dataclass
class Cast:
    """Everything a story keeps consistent from its first sentence to its last."""

    hero: Person
    friend: Person
    relative: str
    pet_kind: str
    pet_sound: str
    pet_name: str
    place: Place
    thing: tuple[str, str]
    toy: str
    color: str
    count: int = 0


class StoryWriter:
    """Writes one story from a random stream: an opening, a few events, an ending."""

    def story(self, rng: random.Random) -> str:
        cast = self._cast(rng)
        sentences = self._opening(rng, cast) + self._trip(rng, cast) + self._meet_friend(rng, cast)
        # A random subset of events, told in a fixed order so that cause comes before effect.
        events = [self._find_things, self._pet_speaks, self._lost_toy, self._rain, self._school_sum]
        chosen = set(rng.sample(range(len(events)), rng.randint(1, 3)))
        for index, event in enumerate(events):
            if index in chosen:
                sentences += event(rng, cast)
        if cast.count:
            sentences += self._count_question(rng, cast)
        sentences += self._ending(rng, cast)
        return " ".join(sentences)

    def _cast(self, rng: random.Random) -> Cast:
        hero_girl, friend_girl = rng.random() < 0.5, rng.random() < 0.5
        hero = Person(rng.choice(GIRLS if hero_girl else BOYS), hero_girl)
        friend_names = [n for n in (GIRLS if friend_girl else BOYS) if n != hero.name]
        kind, sound, names = rng.choice(ANIMALS)
        place = rng.choice(PLACES)
        return Cast(hero=hero, friend=Person(rng.choice(friend_names), friend_girl), relative=rng.choice(RELATIVES),
                    pet_kind=kind, pet_sound=sound, pet_name=rng.choice(names), place=place,
                    thing=rng.choice(place.things), toy=rng.choice(TOYS), color=rng.choice(COLORS))

    def _opening(self, rng: random.Random, c: Cast) -> list[str]:
        hero = c.hero
        first = rng.choice([
            f"Once upon a time, there was a {rng.choice(ADJECTIVES)} {hero.child} named {hero.name}.",
            f"{hero.name} was a {rng.choice(ADJECTIVES)} {hero.child} who lived in a small house with {hero.possessive} {c.relative}.",
            f"There once was a {rng.choice(ADJECTIVES)} {hero.child} called {hero.name}.",
        ])
        return [first, f"{hero.subject.capitalize()} had a {c.pet_kind} named {c.pet_name}."]

    def _trip(self, rng: random.Random, c: Cast) -> list[str]:
        hero = c.hero
        return [
            f"{rng.choice(TIMES)}, {hero.name} and {hero.possessive} {c.relative} went to the {c.place.name}.",
            f"{hero.name} {rng.choice(c.place.activities)}.",
        ]

    def _meet_friend(self, rng: random.Random, c: Cast) -> list[str]:
        hero, friend = c.hero, c.friend
        return [
            f"At the {c.place.name}, {hero.name} met {hero.possessive} friend {friend.name}.",
            f'"Hello, {hero.name}!" said {friend.name}. "Do you want to play with me?"',
            f'"Yes, I would love to!" said {hero.name}, and {hero.subject} smiled at {friend.object}.',
        ]

    def _find_things(self, rng: random.Random, c: Cast) -> list[str]:
        hero, friend = c.hero, c.friend
        found, more = rng.randint(2, 9), rng.randint(1, 5)
        c.count = found + more
        sentences = [
            f"{hero.name} found {_count(found, c.thing)} {c.place.where}.",
            f"Then {friend.name} found {NUMBERS[more]} more and gave {'it' if more == 1 else 'them'} to {hero.object}.",
            f"{NUMBERS[found].capitalize()} and {NUMBERS[more]} make {NUMBERS[c.count]}, "
            f"so now {hero.name} had {_count(c.count, c.thing)}.",
        ]
        if rng.random() < 0.5:
            given = rng.randint(1, c.count - 1)
            c.count -= given
            sentences += [
                f"{hero.name} gave {_count(given, c.thing)} to {hero.possessive} {c.relative}.",
                f"{hero.subject.capitalize()} had {_count(c.count, c.thing)} left.",
            ]
        return sentences

    def _pet_speaks(self, rng: random.Random, c: Cast) -> list[str]:
        return [
            f"{c.pet_name} the {c.pet_kind} had come along too.",
            f'{c.pet_name} was happy and said, "{c.pet_sound}! {c.pet_sound}!"',
            f"{c.hero.name} laughed and patted {c.pet_name} on the head.",
        ]

    def _lost_toy(self, rng: random.Random, c: Cast) -> list[str]:
        hero, friend = c.hero, c.friend
        return [
            f"{hero.name} had a {c.color} {c.toy}.",
            f"Suddenly, the wind blew the {c.color} {c.toy} into a tall tree.",
            f"{hero.name} was sad because {hero.subject} could not reach it.",
            f"{friend.name} climbed the tree and gave the {c.toy} back to {hero.object}.",
            f'"Thank you, {friend.name}!" said {hero.name}. {hero.subject.capitalize()} was happy again.',
        ]

    def _school_sum(self, rng: random.Random, c: Cast) -> list[str]:
        a, b = rng.randint(1, 10), rng.randint(1, 10)
        if rng.random() < 0.5:
            question, answer = f"{a} plus {b}", a + b
        else:
            a, b = max(a, b), min(a, b)
            question, answer = f"{a} minus {b}", a - b
        return [
            f'On the way home, {c.hero.possessive} {c.relative} asked, "What is {question}?"',
            f'{c.hero.name} thought for a moment and said, "{question} is {answer}."',
            f'"Well done, {c.hero.name}!" said {c.hero.possessive} {c.relative}.',
        ]

    def _rain(self, rng: random.Random, c: Cast) -> list[str]:
        hero, friend = c.hero, c.friend
        return [
            "Then dark clouds came, and it started to rain.",
            f"{hero.name} and {friend.name} ran under a big tree to stay dry.",
            f"When the rain stopped, {hero.subject} saw a rainbow in the sky.",
        ]

    def _count_question(self, rng: random.Random, c: Cast) -> list[str]:
        plural = c.thing[1]
        return [
            f'"How many {plural} do you have now?" asked {c.hero.possessive} {c.relative}.',
            f'"I have {NUMBERS[c.count]} {plural if c.count != 1 else c.thing[0]}," said {c.hero.name}.',
        ]

    def _ending(self, rng: random.Random, c: Cast) -> list[str]:
        hero = c.hero
        return [
            f"When the sun went down, {hero.name} went home with {hero.possessive} {c.relative}.",
            rng.choice([
                f"{hero.subject.capitalize()} was tired but very happy.",
                f"It was the best day ever, and {hero.subject} fell asleep with a smile.",
                f"{hero.subject.capitalize()} hoped to go back to the {c.place.name} soon.",
            ]),
        ]


def _count(number: int, thing: tuple[str, str]) -> str:
    """"one shell", "three shells"."""
    return f"{NUMBERS[number]} {thing[0] if number == 1 else thing[1]}"
