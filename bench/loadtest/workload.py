"""The benchmark's workload: a realistic length mix, most inputs short and some near the maximum.

Texts are built from common one-token English words, so a text of n words is about n + 2 tokens
for BERT-style tokenizers; the server reports the real count and the report uses that.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

WORDS = ("the of and to in is was for on that with as by at from his her they this have had "
         "one all were when there can more some time very about into than them these two may "
         "first water been call who oil now find long down day did get come made part over new "
         "sound take only little work know place year live back give most good man think say "
         "great where help through much before line right too mean old any same tell boy follow "
         "came want show also around form three small set put end does another well large must "
         "big even such because turn here why ask went men read need land different home us move "
         "try kind hand picture again change off play spell air away animal house point page").split()


@dataclass(frozen=True)
class Request:
    text: str
    kind: str  # "short" or "long"


@dataclass(frozen=True)
class Mix:
    long_share: float = 0.15
    short_median_words: int = 14
    short_max_words: int = 60
    long_min_words: int = 200
    long_max_words: int = 254


def make_requests(count: int, mix: Mix = Mix(), seed: int = 0) -> list[Request]:
    rng = random.Random(seed)
    requests = []
    for _ in range(count):
        if rng.random() < mix.long_share:
            kind, words = "long", rng.randint(mix.long_min_words, mix.long_max_words)
        else:
            kind = "short"
            words = int(round(rng.lognormvariate(math.log(mix.short_median_words), 0.6)))
            words = max(2, min(mix.short_max_words, words))
        requests.append(Request(" ".join(rng.choice(WORDS) for _ in range(words)), kind))
    return requests

