"""Offline synonyms: the WordNet data.* parser, the embedding-neighbour fallback, and perturb()."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from switchyard.router.predictor.synonyms import (
    WORDNET_DIR,
    EmbeddingSynonyms,
    WordNetSynonyms,
    load_synonyms,
    parse_data_file,
    perturb,
)

HEADER = "  1 This software and database is being provided to you, the LICENSEE, by  \n"


def _mini_wordnet(root: Path, with_index: bool = True) -> Path:
    # Two senses of "quick": the frequent one (offset 2) and a rare one (offset 1).
    (root / "data.adj").write_text(
        HEADER
        + "00000001 00 a 02 quick 0 agile(a) 0 000 | rare sense\n"
        + "00000002 00 a 03 quick 0 fast 0 speedy 0 000 | moving fast\n"
        + "00000003 00 s 02 big_deal 0 large 0 000 | multiword lemma\n"
    )
    if with_index:
        (root / "index.adj").write_text(
            HEADER + "quick a 2 0 2 0 00000002 00000001  \nlarge a 1 0 1 0 00000003  \n"
        )
    return root


def test_parse_data_file_reads_lemma_groups(tmp_path) -> None:
    table = parse_data_file(_mini_wordnet(tmp_path) / "data.adj")
    assert table == {
        "00000001": ["quick", "agile"],  # the "(a)" marker dropped
        "00000002": ["quick", "fast", "speedy"],
        "00000003": ["big deal", "large"],  # underscores to spaces
    }


def test_wordnet_synonyms_follow_sense_order_and_skip_multiword(tmp_path) -> None:
    one_sense = WordNetSynonyms(_mini_wordnet(tmp_path), senses=1)
    assert list(one_sense.synonyms("quick")) == ["fast", "speedy"]  # only the most frequent sense
    assert list(one_sense.synonyms("Quick")) == ["fast", "speedy"]
    assert list(one_sense.synonyms("large")) == []  # its only synonym is multiword
    two = WordNetSynonyms(tmp_path, senses=2)
    assert list(two.synonyms("quick")) == ["fast", "speedy", "agile"]


def test_wordnet_without_index_uses_every_synset(tmp_path) -> None:
    wn = WordNetSynonyms(_mini_wordnet(tmp_path, with_index=False), senses=5)
    assert set(wn.synonyms("quick")) == {"agile", "fast", "speedy"}


def test_missing_wordnet_raises(tmp_path) -> None:
    with pytest.raises(FileNotFoundError):
        WordNetSynonyms(tmp_path)


@pytest.mark.skipif(
    not (WORDNET_DIR / "data.noun").exists(), reason="Debian wordnet-base not installed (make sysdeps)"
)
def test_real_wordnet_synonyms() -> None:
    wn = WordNetSynonyms()
    assert len(wn) > 30000
    assert "rapidly" in wn.synonyms("quickly")
    assert "large" in wn.synonyms("big")
    assert wn.synonyms("the") == () and wn.synonyms("can") == ()  # function words are never replaced


def test_embedding_neighbours_whole_words_by_cosine() -> None:
    vocab = ["[PAD]", "cat", "kitten", "##cat", "car", "dog", "it"]
    emb = np.array([[0, 0], [1, 0.1], [1, 0.2], [1, 0.1], [0, 1], [0.9, 0.5], [1, 0.1]], dtype=np.float32)
    src = EmbeddingSynonyms(vocab, emb, k=2, min_cosine=0.5)
    # "##cat" (a piece) and "it" (a stopword) are identical to "cat" but not candidates
    assert list(src.synonyms("cat")) == ["kitten", "dog"]
    assert list(src.synonyms("unknownword")) == []


def test_embedding_fallback_from_the_encoder_table() -> None:
    src = load_synonyms("embedding")
    assert isinstance(src, EmbeddingSynonyms)
    assert len(src.synonyms("happy")) > 0 and all("##" not in w for w in src.synonyms("happy"))


class _Everything:
    """Every word has one synonym: itself reversed and prefixed, so changes are easy to count."""

    def synonyms(self, word: str) -> tuple[str, ...]:
        return ("zz" + word.lower()[::-1],)


def test_perturb_replaces_15_percent_and_keeps_layout() -> None:
    words = [
        chr(97 + i % 26) * 3 + chr(97 + i // 26) for i in range(40)
    ]  # "aaaa", "bbba", ...: 40 distinct words
    text = " ".join(w.capitalize() if i % 5 == 0 else w for i, w in enumerate(words)) + ".\n"
    out = perturb(text, 0.15, random.Random(1), _Everything())
    before, after = text.split(), out.split()
    assert len(after) == len(before)
    changed = [i for i, (a, b) in enumerate(zip(before, after, strict=True)) if a != b]
    assert len(changed) == 6  # round(0.15 * 40)
    assert out.endswith(".\n") and out.count(" ") == text.count(" ")
    for i in changed:
        assert after[i].rstrip(".").lower().startswith("zz")
        assert after[i][0].isupper() == before[i][0].isupper()  # case pattern kept
    assert perturb(text, 0.15, random.Random(1), _Everything()) == out  # seeded: reproducible


def test_perturb_leaves_identifiers_contractions_and_short_texts() -> None:
    src = _Everything()
    assert perturb("foo_bar x2 don't it's", 1.0, random.Random(0), src) == "foo_bar x2 don't it's"
    assert perturb("hello", 0.15, random.Random(0), src) == "hello"  # round(0.15 * 1) = 0 words


@pytest.mark.skipif(
    not (WORDNET_DIR / "data.noun").exists(), reason="Debian wordnet-base not installed (make sysdeps)"
)
def test_perturb_with_wordnet_changes_about_15_percent() -> None:
    text = (
        "Please write a detailed essay explaining how modern marketing strategies help small companies grow "
        "their business quickly, and describe the main problems they usually face when they begin selling "
        "products online to new customers in different countries around the world today."
    )
    out = perturb(text, 0.15, random.Random(0), load_synonyms("wordnet"))
    before, after = text.split(), out.split()
    changed = sum(a != b for a, b in zip(before, after, strict=True))
    assert changed == round(0.15 * len(before))
