"""Offline synonyms for PreServe's augmentation, and `perturb`, which swaps about 15% of a prompt's words.

Source 1 (default): WordNet 3.0 as Debian's `wordnet-base` installs it (/usr/share/wordnet). The `data.<pos>`
synset lines are parsed directly (NLTK's reader also wants a `lexnames` file that package lacks): a word's
synonyms are the other single-word lemmas of its most frequent senses, in the sense order of `index.<pos>`
(rare senses give "dog" -> "cad"; the first two do not). Without the index files every synset counts.
Source 2 (fallback, when the WordNet files are absent): nearest neighbours by cosine in the encoder's own
word-embedding table (MiniLM's 30522 WordPiece rows), whole-word entries only (no "##" pieces, alphabetic, 3+
letters). These are "related words" more than synonyms (inflections, siblings), which is enough for an
augmentation whose job is to make near-copies of a prompt.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Protocol

WORDNET_DIR = Path("/usr/share/wordnet")
POS_FILES = ("noun", "verb", "adj", "adv")
# Whole words of 3+ letters: identifiers (foo_bar, x2), contractions ("Walker's" -> "s") and "go" are left alone.
_WORD = re.compile(r"(?<![\w'])[A-Za-z]{3,}(?![\w'])")
_LEMMA_MARKER = re.compile(r"\([a-z]+\)$")  # adjective position markers: "outback(a)"

# Function words WordNet still lists ("a" -> "angstrom", "it" -> "information technology", "can" -> "toilet").
STOPWORDS = frozenset(
    """a an the and or but if then else of in on at to for from by with about as into onto over under up down out
    off is am are was were be been being do does did doing have has had having can could will would shall should
    may might must i me my mine we us our you your he him his she her it its they them their this that these those
    what which who whom whose when where why how not no nor so too very just also only than there here all any
    each few more most other some such own same both either neither one two three""".split()  # noqa: SIM905
)


class SynonymSource(Protocol):
    def synonyms(self, word: str) -> Sequence[str]: ...


class WordNetSynonyms:
    """Single-word synonyms from the WordNet 3.0 `data.*` (and, if present, `index.*`) files."""

    def __init__(self, root: str | Path = WORDNET_DIR, senses: int = 2) -> None:
        self.root = Path(root)
        self.senses = senses
        self._table: dict[str, tuple[str, ...]] = {}
        for pos in POS_FILES:
            data = self.root / f"data.{pos}"
            if data.exists():
                self._add_pos(data, self.root / f"index.{pos}")
        if not self._table:
            raise FileNotFoundError(f"no WordNet data.* files under {self.root}")

    def _add_pos(self, data: Path, index: Path) -> None:
        offset_to_lemmas = parse_data_file(data)
        word_to_offsets: dict[str, list[str]] = {}
        if index.exists():
            word_to_offsets = parse_index_file(index)
        else:
            for offset, lemmas in offset_to_lemmas.items():
                for lemma in lemmas:
                    word_to_offsets.setdefault(lemma, []).append(offset)
        for word, offsets in word_to_offsets.items():
            if " " in word or word in STOPWORDS:
                continue
            found = dict.fromkeys(self._table.get(word, ()))
            for offset in offsets[: self.senses]:
                for lemma in offset_to_lemmas.get(offset, ()):
                    if lemma != word and " " not in lemma and "-" not in lemma:
                        found[lemma] = None
            if found:
                self._table[word] = tuple(found)

    def synonyms(self, word: str) -> Sequence[str]:
        return self._table.get(word.lower(), ())

    def __len__(self) -> int:
        return len(self._table)


def parse_data_file(path: Path) -> dict[str, list[str]]:
    """synset offset -> lemmas (lowercase, underscores to spaces, adjective markers dropped).

    A synset line: `offset lex_filenum ss_type w_cnt(hex) word lex_id [word lex_id ...] p_cnt ... | gloss`;
    the licence header lines start with two spaces.
    """
    out: dict[str, list[str]] = {}
    with path.open(encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.startswith(" "):
                continue
            fields = line.split(" ", 4 + 2 * 255)
            count = int(fields[3], 16)
            lemmas = []
            for k in range(count):
                lemma = _LEMMA_MARKER.sub("", fields[4 + 2 * k]).replace("_", " ").lower()
                lemmas.append(lemma)
            out[fields[0]] = lemmas
    return out


def parse_index_file(path: Path) -> dict[str, list[str]]:
    """lemma -> synset offsets, most frequent sense first.

    An index line: `lemma pos synset_cnt p_cnt [ptr_symbol ...] sense_cnt tagsense_cnt offset ...`.
    """
    out: dict[str, list[str]] = {}
    with path.open(encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.startswith(" "):
                continue
            fields = line.split()
            synset_cnt = int(fields[2])
            out[fields[0].replace("_", " ").lower()] = fields[-synset_cnt:]
    return out


class EmbeddingSynonyms:
    """Nearest whole-word neighbours in a word-embedding table (cosine), looked up lazily per word."""

    def __init__(self, vocab: Sequence[str], embeddings, k: int = 5, min_cosine: float = 0.35) -> None:
        import numpy as np

        keep = [
            i
            for i, w in enumerate(vocab)
            if w.isalpha() and w.isascii() and len(w) >= 3 and w not in STOPWORDS
        ]
        self._words = [vocab[i] for i in keep]
        self._index = {w: j for j, w in enumerate(self._words)}
        table = np.asarray(embeddings, dtype=np.float32)[keep]
        self._unit = table / np.maximum(np.linalg.norm(table, axis=1, keepdims=True), 1e-12)
        self.k = k
        self.min_cosine = min_cosine
        self._cache: dict[str, tuple[str, ...]] = {}

    def synonyms(self, word: str) -> Sequence[str]:
        import numpy as np

        word = word.lower()
        hit = self._cache.get(word)
        if hit is not None:
            return hit
        j = self._index.get(word)
        found: tuple[str, ...] = ()
        if j is not None:
            sims = self._unit @ self._unit[j]
            sims[j] = -1.0
            top = np.argpartition(-sims, self.k)[: self.k]
            top = top[np.argsort(-sims[top])]
            found = tuple(self._words[t] for t in top if sims[t] >= self.min_cosine)
        self._cache[word] = found
        return found

    @classmethod
    def from_minilm(cls, **kwargs) -> EmbeddingSynonyms:
        from safetensors.numpy import load_file

        from switchyard.router.predictor.convert import minilm_dir

        root = minilm_dir()
        vocab = (root / "vocab.txt").read_text(encoding="utf-8").splitlines()
        state = load_file(str(root / "model.safetensors"))
        key = next(k for k in state if k.endswith("word_embeddings.weight"))
        return cls(vocab, state[key], **kwargs)


@lru_cache(maxsize=4)
def load_synonyms(source: str = "auto") -> SynonymSource:
    """ "wordnet", "embedding", or "auto" (WordNet when its files are installed, else the embedding neighbours)."""
    if source == "wordnet" or (source == "auto" and (WORDNET_DIR / "data.noun").exists()):
        return WordNetSynonyms()
    if source in ("embedding", "auto"):
        return EmbeddingSynonyms.from_minilm()
    raise ValueError(f"unknown synonym source {source!r}")


def _match_case(template: str, word: str) -> str:
    if template.isupper() and len(template) > 1:
        return word.upper()
    if template[:1].isupper():
        return word[:1].upper() + word[1:]
    return word


def perturb(
    text: str, frac: float = 0.15, rng: random.Random | None = None, source: SynonymSource | None = None
) -> str:
    """Replace round(frac * words) words (whitespace-separated) by a random synonym, keeping everything else
    (punctuation, spacing, line breaks, case pattern) byte for byte. Only words that have a synonym can change,
    so a prompt with few of them changes less than `frac`.
    """
    rng = rng or random.Random()
    source = source or load_synonyms()
    num_words = len(text.split())
    want = round(frac * num_words)
    if want <= 0:
        return text
    candidates = [
        (m.start(), m.end(), syns) for m in _WORD.finditer(text) if (syns := source.synonyms(m.group()))
    ]
    if not candidates:
        return text
    chosen = sorted(rng.sample(candidates, min(want, len(candidates))))
    parts: list[str] = []
    pos = 0
    for start, end, syns in chosen:
        parts.append(text[pos:start])
        parts.append(_match_case(text[start:end], rng.choice(syns)))
        pos = end
    parts.append(text[pos:])
    return "".join(parts)
