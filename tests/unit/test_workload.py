"""The benchmark's workloads (bench/loadtest/workload.py, corpus.py): real text read offline,
lengths that spread, and short or long decided by the model's tokenizer."""
from __future__ import annotations

import pytest

from bench.loadtest import corpus
from bench.loadtest.workload import SHORT_TOKENS, WORKLOADS, histogram, token_counter, workload


def words(text: str) -> int:
    return len(text.split())


def test_the_corpus_is_prose_with_no_code_or_headings():
    paragraphs = corpus.paragraphs()
    assert len(paragraphs) > 500 and len(corpus.sentences()) > len(paragraphs)
    assert not [p for p in paragraphs if "\n" in p or p.startswith(" ")]
    assert not [p for p in paragraphs if set(p) <= set("*=-~^ ")]
    assert not [s for s in corpus.sentences() if words(s) < corpus.MIN_WORDS]


def test_passages_pack_a_topics_paragraphs_up_to_the_chunk_size():
    passages = corpus.passages()
    joined = [p for p in passages if p not in set(corpus.paragraphs())]
    assert joined, "some passages are several paragraphs"
    assert all(words(p) <= corpus.CHUNK_WORDS for p in joined)
    # nothing lost: every paragraph is in some passage
    text = " ".join(passages)
    assert all(p in text for p in corpus.paragraphs()[:200])


def test_source_names_the_text_and_its_digest_is_stable():
    first, again = corpus.source(), corpus.source()
    assert first == again and "PSF" in first["corpus"] and len(first["sha256_12"]) == 12


def test_each_workload_is_reproducible_and_classes_follow_the_token_count():
    tokens = lambda text: words(text) + 2  # noqa: E731 - a stand-in tokenizer: one token a word
    for name in WORKLOADS:
        make = workload(name, tokens)
        first, again = make(300, 5), make(300, 5)
        assert first == again and first != make(300, 6)
        if name != "two-cluster":
            assert all((r.kind == "short") == (tokens(r.text) <= SHORT_TOKENS) for r in first)


def test_the_workloads_have_the_shapes_they_are_named_for():
    tokens = token_counter()
    short = [tokens(r.text) for r in workload("short", tokens)(400, 1)]
    search = [tokens(r.text) for r in workload("search", tokens)(2000, 1)]
    long = [tokens(r.text) for r in workload("long", tokens)(400, 1)]
    assert max(short) <= SHORT_TOKENS
    long_share = lambda lengths: sum(n > SHORT_TOKENS for n in lengths) / len(lengths)  # noqa: E731
    assert 0.15 < long_share(search) < 0.5 and long_share(long) > 0.6
    # a continuous spread, not two clusters: every histogram bin of the search mix is used
    assert all(n > 0 for n in histogram([r.text for r in workload("search", tokens)(2000, 1)], tokens)["bins"].values())


def test_histogram_counts_every_text_once():
    hist = histogram(["a"] * 3 + ["b c"] * 2, lambda t: {"a": 10, "b c": 300}[t])
    assert hist["bins"] == {"1-16": 3, "17-32": 0, "33-64": 0, "65-128": 0, "129-256": 0, ">256": 2}
    assert hist["texts"] == 5 and hist["max"] == 300 and hist["p50"] == 10 and hist["short_share"] == 0.6


def test_an_unknown_workload_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown workload 'web'"):
        workload("web", len)
