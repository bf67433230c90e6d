"""Token-classification output: per-token labels merged into entity spans of the original text."""
from __future__ import annotations

from typing import Sequence


def group_entities(tokens: Sequence[tuple[str, float, int, int]], text: str) -> list[dict]:
    """Merge consecutive tokens of one entity type (B-/I- prefixes stripped, "O" dropped)."""
    entities: list[dict] = []
    current: dict | None = None
    scores: list[float] = []
    for label, score, start, end in tokens:
        prefix, _, kind = label.partition("-") if "-" in label else ("", "", label)
        if kind == "O" or label == "O":
            current = None
            continue
        continues = (
            current is not None
            and current["label"] == kind
            and prefix != "B"
            and start <= current["end"] + 1
        )
        if continues:
            current["end"] = end
            scores.append(score)
        else:
            current = {"label": kind, "start": start, "end": end}
            scores = [score]
            entities.append(current)
        current["score"] = sum(scores) / len(scores)
    return [
        {"word": text[e["start"] : e["end"]], "label": e["label"], "score": e["score"],
         "start": e["start"], "end": e["end"]}
        for e in entities
    ]
