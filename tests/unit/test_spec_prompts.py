"""`benchmarks.spec_prompts`: copy-heavy prompts, fresh per seed, with typos that stay words."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

from benchmarks.spec_prompts import (
    FIX,
    PASSAGE_SENTENCES,
    REPEAT,
    SENTENCES,
    TYPOS_PER_PASSAGE,
    copy_prompts,
    misspell,
    write_sharegpt_dataset,
)


def _sentences(text: str) -> list[str]:
    return re.findall(r"[^.]+\.", text)


def _texts(num: int, seed: int) -> list[str]:
    return [p.prompt for p in copy_prompts(num, seed)]


def test_prompts_alternate_repeat_and_fix_and_a_seed_fixes_them() -> None:
    prompts = _texts(6, seed=3)
    assert prompts == _texts(6, seed=3)
    assert [p.startswith(REPEAT) for p in prompts] == [True, False] * 3
    assert all(p.startswith(FIX) for p in prompts[1::2])
    # Another seed (another rate) draws other passages, and no passage comes twice.
    assert not set(prompts) & set(_texts(6, seed=4))
    many = _texts(64, seed=3)
    assert len({p.removeprefix(REPEAT).removeprefix(FIX) for p in many}) == 64


def test_a_repeat_passage_is_distinct_shipped_sentences() -> None:
    for copy in copy_prompts(8, seed=1)[::2]:
        assert copy.prompt == REPEAT + copy.answer
        found = [s.strip() for s in _sentences(copy.answer)]
        assert len(found) == len(set(found)) == PASSAGE_SENTENCES
        assert set(found) <= set(SENTENCES)


def test_a_fix_passage_has_its_typos_and_nothing_else_changed() -> None:
    copy = copy_prompts(2, seed=5)[1]
    words, right = copy.prompt.removeprefix(FIX).split(), copy.answer.split()
    assert len(words) == len(right)
    changed = [(w, r) for w, r in zip(words, right, strict=True) if w != r]
    assert len(changed) == TYPOS_PER_PASSAGE
    assert all(w[0] == r[0] and w[-1] == r[-1] for w, r in changed)


def test_misspell_keeps_the_ends_and_changes_the_word() -> None:
    rng = random.Random(0)
    for word in ("harbour", "chestnut", "lighthouse", "apples", "sledge"):
        for _ in range(20):
            typo = misspell(word, rng)
            assert typo != word
            assert typo[0] == word[0] and typo[-1] == word[-1]
            assert abs(len(typo) - len(word)) <= 1


def test_the_dataset_file_is_sharegpt_json(tmp_path: Path) -> None:
    prompts = copy_prompts(3, seed=0)
    entries = json.loads(write_sharegpt_dataset(prompts, tmp_path / "copy.json").read_text())
    assert [e["conversations"] for e in entries] == [
        [{"from": "human", "value": p.prompt}, {"from": "gpt", "value": p.answer}] for p in prompts
    ]
