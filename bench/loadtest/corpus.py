"""Real English text for the benchmark's workloads, read at run time from CPython's own
documentation: `pydoc_data.topics`, the help texts `help("assert")` shows, shipped with every
CPython (3.10+) under the PSF License Agreement (Python Software Foundation). Nothing is copied
into this repository and nothing is downloaded; a different Python minor version reads a slightly
different text, so reports record `source()`.

Paragraphs are the prose blocks of the help texts (indented code, grammar and headings dropped).
Passages are what a paragraph-aware chunker for retrieval cuts from them: a topic's consecutive
paragraphs packed up to CHUNK_WORDS words (a longer paragraph stands alone and the server
truncates it), so their lengths spread continuously with a long tail. Sentences are the
paragraphs split at sentence ends: queries of everyday length.
"""
from __future__ import annotations

import functools
import hashlib
import platform
import re

SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"(])")
MIN_WORDS = 3
CHUNK_WORDS = 180  # ~230 tokens of this text: a chunk the model (256 tokens) reads whole


@functools.lru_cache(maxsize=1)
def topics() -> tuple[tuple[str, ...], ...]:
    """Each help topic's prose paragraphs, in a fixed order, each as one line."""
    from pydoc_data.topics import topics as texts

    return tuple(filter(None, (_prose(texts[key]) for key in sorted(texts))))


def _prose(text: str) -> tuple[str, ...]:
    out = []
    for block in re.split(r"\n\s*\n", text):
        lines = block.split("\n")
        if any(line.startswith((" ", "\t")) for line in lines):  # code, grammar, tables, lists
            continue
        if re.fullmatch(r"[*=\-~^]+", lines[-1].strip() or "-"):  # a heading and its underline
            continue
        text = " ".join(line.strip() for line in lines)
        if len(text.split()) >= MIN_WORDS and sum(c.isalpha() for c in text) > 0.6 * len(text):
            out.append(text)
    return tuple(out)


def paragraphs() -> tuple[str, ...]:
    return tuple(p for topic in topics() for p in topic)


@functools.lru_cache(maxsize=1)
def passages() -> tuple[str, ...]:
    """Each topic's consecutive paragraphs packed into chunks of at most CHUNK_WORDS words."""
    out = []
    for topic in topics():
        chunk: list[str] = []
        for p in topic:
            if chunk and len(" ".join(chunk + [p]).split()) > CHUNK_WORDS:
                out.append(" ".join(chunk))
                chunk = []
            chunk.append(p)
        out.append(" ".join(chunk))
    return tuple(out)


@functools.lru_cache(maxsize=1)
def sentences() -> tuple[str, ...]:
    """The paragraphs split into sentences of at least MIN_WORDS words."""
    return tuple(s for p in paragraphs() for s in SENTENCE_END.split(p) if len(s.split()) >= MIN_WORDS)


def source() -> dict:
    """Which text was read: the Python it came with and a digest of the paragraphs."""
    digest = hashlib.sha256("\n".join(paragraphs()).encode()).hexdigest()[:12]
    return {"corpus": "CPython's pydoc_data.topics (help texts), PSF License Agreement",
            "python": platform.python_version(), "paragraphs": len(paragraphs()),
            "passages": len(passages()), "sentences": len(sentences()), "sha256_12": digest}
