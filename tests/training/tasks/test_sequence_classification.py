"""The sequence-classification task's embedded default: was this line of Python corrupted? Its rows come from the
standard library's lines and zero_shot's corruptions, balanced, the same every build; the lexical control
(`package_docstrings`) stays as it was."""

import random
from collections import Counter

from coreformer.training.corpora import EMBEDDED_PACKAGES
from coreformer.training.tasks.sequence_classification import (
    EMBEDDED_ROWS,
    SEQUENCE_CLASSIFICATION,
    corrupted_lines,
    package_docstrings,
    package_lines,
)
from coreformer.training.zero_shot import CORRUPTIONS, LEXEME


def _one_corruption_apart(original: str, corrupted: str) -> str | None:
    """Which corruption turns `original` into `corrupted`: two adjacent lexemes exchanged in place ("swap"), or one
    lexeme replaced by another word ("replace"); None when neither does."""
    lexemes = list(LEXEME.finditer(original))
    for a, b in zip(lexemes, lexemes[1:], strict=False):
        swapped = original[: a.start()] + b.group() + original[a.end() : b.start()] + a.group() + original[b.end() :]
        if swapped == corrupted != original:
            return "swap"
    for lexeme in lexemes:
        before, after = original[: lexeme.start()], original[lexeme.end() :]
        middle = corrupted[len(before) : len(corrupted) - len(after)]
        if (
            corrupted.startswith(before)
            and corrupted.endswith(after)
            and middle.isidentifier()
            and middle != lexeme.group()
        ):
            return "replace"
    return None


def test_corrupted_lines_alternate_a_line_as_written_and_the_next_with_one_corruption_in_turn():
    lines = [line for file_lines in package_lines(random.Random(0)) for line in file_lines]
    rows = corrupted_lines(60, random.Random(0))
    assert [row["label"] for row in rows] == ["original", "corrupted"] * 30
    position = 0  # walk the lines: each row takes the next one (a line its corruption cannot change is passed over)
    for index, row in enumerate(rows):
        if row["label"] == "original":
            assert row["text"] == lines[position]
            position += 1
            continue
        kind = list(CORRUPTIONS)[(index // 2) % len(CORRUPTIONS)]
        while _one_corruption_apart(lines[position], row["text"]) is None:
            position += 1
        found = _one_corruption_apart(lines[position], row["text"])
        assert found == ("swap" if kind == "swap" else "replace"), (kind, lines[position], row["text"])
        position += 1
    assert position <= len(lines)


def test_embedded_default_is_balanced_seeded_and_holds_each_line_in_one_split():
    splits = SEQUENCE_CLASSIFICATION.embedded_data()
    assert splits["train"].num_rows + splits["validation"].num_rows == EMBEDDED_ROWS
    for split in splits.values():
        counts = Counter(split["label"])
        assert counts["original"] == counts["corrupted"] == split.num_rows // 2
    assert not set(splits["train"]["text"]) & set(splits["validation"]["text"])
    assert len(set(splits["train"]["text"])) == splits["train"].num_rows
    again = SEQUENCE_CLASSIFICATION.embedded_data()  # the same rows whatever the run's seed
    assert again["validation"]["text"] == splits["validation"]["text"]
    assert SEQUENCE_CLASSIFICATION.columns == {"text_column": "text", "text_pair_column": "", "label_column": "label"}


def test_package_docstrings_stay_the_balanced_lexical_control():
    rows = package_docstrings(per_package=10)
    assert Counter(row["label"] for row in rows) == {package: 10 for package in EMBEDDED_PACKAGES}
