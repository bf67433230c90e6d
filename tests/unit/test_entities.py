"""tsbatch.handlers.models.entities: per-token labels become entity spans of the original text."""
from __future__ import annotations

import pytest

from tsbatch.handlers.models.entities import group_entities

pytestmark = pytest.mark.unit

TEXT = "Angela Merkel visited New York City"
#       0     6 7    13 14   21 22  25 26  30 31  35


def entity(word, label, score, start, end):
    return {"word": word, "label": label, "score": pytest.approx(score), "start": start, "end": end}


@pytest.mark.parametrize(
    "tokens, expected",
    [
        pytest.param([], [], id="no tokens"),
        pytest.param([("O", 0.9, 0, 6), ("O", 0.8, 7, 13)], [], id="all O dropped"),
        pytest.param(
            [("B-PER", 0.9, 0, 6), ("I-PER", 0.7, 7, 13), ("O", 0.99, 14, 21),
             ("B-LOC", 0.8, 22, 25), ("I-LOC", 0.6, 26, 30), ("I-LOC", 0.4, 31, 35)],
            [entity("Angela Merkel", "PER", 0.8, 0, 13),
             entity("New York City", "LOC", 0.6, 22, 35)],
            id="B- then I- merge, score is the mean",
        ),
        pytest.param(
            [("B-PER", 0.9, 0, 6)],
            [entity("Angela", "PER", 0.9, 0, 6)],
            id="single token",
        ),
        pytest.param(
            [("B-PER", 0.9, 0, 6), ("B-PER", 0.5, 7, 13)],
            [entity("Angela", "PER", 0.9, 0, 6), entity("Merkel", "PER", 0.5, 7, 13)],
            id="B- starts a new entity even of the same type",
        ),
        pytest.param(
            [("B-PER", 0.9, 0, 6), ("I-LOC", 0.5, 7, 13)],
            [entity("Angela", "PER", 0.9, 0, 6), entity("Merkel", "LOC", 0.5, 7, 13)],
            id="a different type starts a new entity",
        ),
        pytest.param(
            [("I-LOC", 0.5, 22, 25), ("I-LOC", 0.7, 26, 30)],
            [entity("New York", "LOC", 0.6, 22, 30)],
            id="I- without B- starts an entity",
        ),
        pytest.param(
            [("B-LOC", 0.5, 22, 25), ("O", 0.9, 26, 30), ("I-LOC", 0.7, 31, 35)],
            [entity("New", "LOC", 0.5, 22, 25), entity("City", "LOC", 0.7, 31, 35)],
            id="O breaks an entity",
        ),
        pytest.param(
            [("LOC", 0.5, 22, 25), ("LOC", 0.9, 26, 30)],
            [entity("New York", "LOC", 0.7, 22, 30)],
            id="labels without a prefix merge",
        ),
        pytest.param(
            [("B-LOC", 0.4, 22, 24), ("I-LOC", 0.8, 24, 25)],
            [entity("New", "LOC", 0.6, 22, 25)],
            id="adjacent word pieces merge",
        ),
        pytest.param(
            [("B-PER", 0.9, 0, 6), ("I-PER", 0.5, 14, 21)],
            [entity("Angela", "PER", 0.9, 0, 6), entity("visited", "PER", 0.5, 14, 21)],
            id="a gap of more than one character breaks an entity",
        ),
        pytest.param(
            [("B-MISC-X", 0.3, 0, 6), ("I-MISC-X", 0.5, 7, 13)],
            [entity("Angela Merkel", "MISC-X", 0.4, 0, 13)],
            id="only the first dash splits prefix and type",
        ),
        pytest.param(
            [("B-PER", 1.0, 0, 6), ("I-PER", 0.0, 7, 13), ("B-PER", 0.25, 22, 25)],
            [entity("Angela Merkel", "PER", 0.5, 0, 13), entity("New", "PER", 0.25, 22, 25)],
            id="scores do not leak from one entity to the next",
        ),
    ],
)
def test_group_entities(tokens, expected):
    assert group_entities(tokens, TEXT) == expected


def test_word_is_the_text_slice_not_the_tokens():
    text = "  Zoë   Saldaña!"
    tokens = [("B-PER", 0.9, 2, 5), ("I-PER", 0.9, 8, 15)]
    # the gap of three spaces separates them; each word is exactly the slice of the text
    assert [e["word"] for e in group_entities(tokens, text)] == ["Zoë", "Saldaña"]
    # one space between them: one entity, spanning the space
    [merged] = group_entities([("B-PER", 0.9, 2, 5), ("I-PER", 0.9, 6, 13)], "  Zoë Saldaña!")
    assert merged["word"] == "Zoë Saldaña"


def test_entity_keys_and_types():
    [only] = group_entities([("B-ORG", 0.75, 0, 6)], TEXT)
    assert list(only) == ["word", "label", "score", "start", "end"]
    assert isinstance(only["score"], float)


@pytest.mark.parametrize("gap, merged", [(0, True), (1, True), (2, False), (3, False)])
def test_tokens_merge_across_at_most_one_character(gap, merged):
    text = "Rio" + " " * gap + "Bravo"
    tokens = [("B-LOC", 0.5, 0, 3), ("I-LOC", 0.5, 3 + gap, 8 + gap)]
    words = [e["word"] for e in group_entities(tokens, text)]
    assert words == ([text] if merged else ["Rio", "Bravo"])
