"""The tokenizer shared by the router and the simulated workers (one per model), loaded offline.

Default: the Mistral-7B SentencePiece model (32k vocab, LLaMA-family counts) shipped in `workers/data/`. Any
SentencePiece `.model` file can be given by path. The router applies the chat template here so its block hashes
match what the engine caches.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import sentencepiece as spm

DEFAULT_TOKENIZER = Path(__file__).parent / "data" / "mistral-7b-v1.model"


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str  # "system" | "user" | "assistant"
    content: str


def same_tokenizer(a: str, b: str) -> bool:
    """Whether two `tokenizer_id`s are one tokenizer: the same kind and contents, whatever the file's name (a model
    directory's `tokenizer.model` and the router's copy of it under another name tokenize alike)."""
    def kind_and_digest(tokenizer_id: str) -> tuple[str, str]:
        return tokenizer_id.partition(":")[0], tokenizer_id.rpartition(":")[2]

    return a.count(":") >= 2 and kind_and_digest(a) == kind_and_digest(b)


class Tokenizer:
    """SentencePiece encode/decode plus the Mistral v1 ([INST]) chat template."""

    def __init__(self, path: str | Path | None = None) -> None:
        self.path = Path(path) if path else DEFAULT_TOKENIZER
        data = self.path.read_bytes()
        self._sp = spm.SentencePieceProcessor(model_proto=data)
        self.tokenizer_id = f"sentencepiece:{self.path.name}:{hashlib.sha256(data).hexdigest()[:12]}"
        self.bos_id = self._sp.bos_id()
        self.eos_id = self._sp.eos_id()
        self.vocab_size = self._sp.get_piece_size()

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = self._sp.encode(text)
        return [self.bos_id, *ids] if add_bos else ids

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._sp.decode(list(token_ids))

    def id_to_piece(self, token_id: int) -> str:
        return self._sp.id_to_piece(token_id)

    def apply_chat_template(self, messages: Sequence[ChatMessage]) -> list[int]:
        """Mistral v1: <s>[INST] {system}\\n\\n{user} [/INST] {assistant}</s>[INST] {user} [/INST]

        Tokenized turn by turn (as mistral-common does), so a conversation's earlier turns are a token prefix
        of its later requests: multi-turn chats share prefix-cache blocks.
        """
        if not messages:
            raise ValueError("chat input has no messages")
        system = [m.content for m in messages if m.role == "system"]
        turns = [m for m in messages if m.role != "system"]
        if not turns or turns[-1].role != "user":
            raise ValueError("the last chat message must be from the user")
        ids = [self.bos_id]
        first_user = True
        for m in turns:
            if m.role == "user":
                content = m.content
                if first_user and system:
                    content = "\n\n".join([*system, content])
                first_user = False
                ids += self._sp.encode(f"[INST] {content} [/INST]")
            elif m.role == "assistant":
                ids += self._sp.encode(m.content) + [self.eos_id]
            else:
                raise ValueError(f"unknown chat role {m.role!r}")
        return ids


@lru_cache(maxsize=8)
def load_tokenizer(path: str | None = None) -> Tokenizer:
    """One shared instance per path."""
    return Tokenizer(path)
