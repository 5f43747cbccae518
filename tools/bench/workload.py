"""A seeded, mixed workload for the load generator: prompt and output lengths drawn from given
choices, Poisson arrival times for an open loop. The same seed gives the same requests."""

from __future__ import annotations

import random
from dataclasses import dataclass

# Common one-token English words: a prompt of n words is close to n tokens for a BPE vocabulary.
WORDS = (
    "the of and to in is it you that he was for on are with as his they be at one have this "
    "from or had by word but what some we can out other were all there when up use your how "
    "said an each she which do their time if will way about many then them write would like so "
    "these her long make thing see him two has look more day could go come did number sound no "
    "most people my over know water than call first who may down side been now find"
).split()


@dataclass(frozen=True, kw_only=True)
class WorkItem:
    index: int
    prompt: str
    num_prompt_words: int
    max_tokens: int
    seed: int


@dataclass(frozen=True, kw_only=True)
class Workload:
    """`prompt_words` / `output_tokens`: the lengths to mix (uniformly); outputs are exact
    (`ignore_eos`), so every request decodes exactly its drawn length."""

    seed: int = 0
    prompt_words: tuple[int, ...] = (16, 64, 256)
    output_tokens: tuple[int, ...] = (16, 32, 64)
    temperature: float = 0.0

    def __post_init__(self) -> None:
        if not self.prompt_words or min(self.prompt_words) < 1:
            raise ValueError(f"prompt_words={self.prompt_words}: give lengths >= 1")
        if not self.output_tokens or not all(1 <= n <= 8192 for n in self.output_tokens):
            raise ValueError(f"output_tokens={self.output_tokens}: give lengths in 1..8192")

    def items(self, count: int) -> list[WorkItem]:
        rng = random.Random(self.seed)
        out = []
        for i in range(count):
            n = rng.choice(self.prompt_words)
            words = " ".join(rng.choice(WORDS) for _ in range(n))
            out.append(
                WorkItem(
                    index=i,
                    prompt=f"Continue this text: {words}",
                    num_prompt_words=n,
                    max_tokens=rng.choice(self.output_tokens),
                    seed=rng.randrange(2**31),
                )
            )
        return out


def poisson_arrivals(rate: float, count: int, seed: int) -> list[float]:
    """Offsets in seconds of `count` arrivals of a Poisson process at `rate` per second (the
    first at 0)."""
    if rate <= 0:
        raise ValueError(f"rate={rate}: arrivals per second must be > 0")
    rng = random.Random(seed ^ 0x5EED)
    t, out = 0.0, []
    for _ in range(count):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def parse_lengths(text: str, what: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ValueError(
            f"{what} {text!r}: give comma-separated integers, e.g. 16,64,256"
        ) from None
    if not values:
        raise ValueError(f"{what} is empty: give comma-separated integers, e.g. 16,64,256")
    return values
