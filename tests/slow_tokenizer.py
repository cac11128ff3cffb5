"""A slow (pure Python) byte-level BPE tokenizer, built offline from a fast tokenizer's ``tokenizer.json``.

It stands in for Kimi-K2.5's ``tokenization_kimi.TikTokenTokenizer``: a ``transformers.PreTrainedTokenizer``
(``is_fast`` False, no offsets) whose ``_tokenize`` splits text with a regex and merges bytes by BPE rank, with the
special tokens split out by transformers' own added-token trie. Here the regex and the merges are GPT-2's byte-level
ones (those of ``tokenizers.pre_tokenizers.ByteLevel(use_regex=True)`` + ``models.BPE``), read from the same
``tokenizer.json`` as the fast tokenizer, so both give the same ids (tests/test_conversations.py checks it) and the
slow path of the loss mask can be compared with the offsets path on one vocabulary.

Self-contained (only ``regex`` and ``transformers``): tests also copy this file into a target directory as the
tokenizer code a target ships (``auto_map`` in tokenizer_config.json, loaded with ``trust_remote_code``).
"""

from __future__ import annotations

import json

import regex
from transformers.convert_slow_tokenizer import bytes_to_unicode  # GPT-2's byte -> character map
from transformers import AddedToken, PreTrainedTokenizer

# GPT-2's pre-tokenization regex, as tokenizers' ByteLevel(use_regex=True) applies it
PAT = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")


class SlowByteLevelBPE(PreTrainedTokenizer):
    vocab_files_names = {"vocab_file": "tokenizer.json"}
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, vocab_file=None, tokenizer_json: str | None = None, **kwargs):
        if tokenizer_json is None:
            with open(vocab_file, encoding="utf-8") as f:
                tokenizer_json = f.read()
        spec = json.loads(tokenizer_json)
        self.encoder = dict(spec["model"]["vocab"])
        self.decoder = {i: t for t, i in self.encoder.items()}
        merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in spec["model"]["merges"]]
        self.bpe_ranks = {m: r for r, m in enumerate(merges)}
        self.byte_encoder = bytes_to_unicode()
        self.byte_decoder = {c: b for b, c in self.byte_encoder.items()}
        added = {t["id"]: AddedToken(t["content"], special=t["special"], normalized=False, lstrip=t["lstrip"],
                                     rstrip=t["rstrip"], single_word=t["single_word"]) for t in spec["added_tokens"]}
        kwargs["added_tokens_decoder"] = {**added, **(kwargs.get("added_tokens_decoder") or {})}
        kwargs.setdefault("clean_up_tokenization_spaces", False)
        super().__init__(**kwargs)

    @property
    def vocab_size(self) -> int:
        return len(self.encoder)

    def get_vocab(self) -> dict[str, int]:
        return {**self.encoder, **self._added_tokens_encoder}

    def _bpe(self, word: str) -> list[str]:
        parts = list(word)
        while len(parts) > 1:
            pairs = [(self.bpe_ranks.get(p, float("inf")), k) for k, p in enumerate(zip(parts, parts[1:]))]
            rank, k = min(pairs)
            if rank == float("inf"):
                break
            parts[k:k + 2] = [parts[k] + parts[k + 1]]
        return parts

    def _tokenize(self, text: str, **kwargs) -> list[str]:
        out = []
        for piece in PAT.findall(text):
            out.extend(self._bpe("".join(self.byte_encoder[b] for b in piece.encode("utf-8"))))
        return out

    def _convert_token_to_id(self, token: str) -> int:
        return self.encoder[token]

    def _convert_id_to_token(self, index: int) -> str:
        return self.decoder[index]

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        out = bytearray()
        for t in tokens:
            if t in self._added_tokens_encoder:
                out += t.encode("utf-8")
            else:
                out += bytes(self.byte_decoder[c] for c in t)
        return out.decode("utf-8", errors="replace")
