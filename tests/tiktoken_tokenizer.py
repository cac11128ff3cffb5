"""A slow tokenizer over a ``tiktoken.model`` file, run by the real ``tiktoken`` package.

Kimi-K2.5 ships ``tokenization_kimi.TikTokenTokenizer``: a ``transformers.PreTrainedTokenizer`` (``is_fast`` False,
no offsets) whose vocabulary is a ``tiktoken.model`` file (one ``base64(token bytes) rank`` line per token, read by
``tiktoken.load.load_tiktoken_bpe``) and whose BPE runs inside ``tiktoken.Encoding``; token strings are the
tokens' bytes through GPT-2's byte -> printable character map, and the special tokens come from
``tokenizer_config.json``'s ``added_tokens_decoder``. This file is our own stand-in of that shape (not Moonshot's
code): tests copy it into a target directory as the tokenizer code the target ships (``auto_map``, loaded only
with ``trust_remote_code``) next to a ``tiktoken.model`` written from a tiny fast tokenizer by ``write_tiktoken_model``
(rank = the fast tokenizer's id), with GPT-2's split regex instead of Moonshot's CJK-aware one so that both give
the same ids on the tests' text (checked in tests/test_conversations.py).

Self-contained (``tiktoken`` and ``transformers`` only).
"""

from __future__ import annotations

import base64
import json

import tiktoken
from tiktoken.load import load_tiktoken_bpe
from transformers.convert_slow_tokenizer import bytes_to_unicode  # GPT-2's byte -> character map
from transformers import PreTrainedTokenizer

# GPT-2's split regex (tiktoken's r50k_base uses the same one)
PAT_STR = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def write_tiktoken_model(tokenizer_json: str, path: str) -> None:
    """The byte-level BPE vocabulary of a tokenizer.json as a tiktoken.model file, rank = id (special tokens are
    not in it: they travel in tokenizer_config.json, as Kimi's do)."""
    decode = {c: b for b, c in bytes_to_unicode().items()}
    spec = json.loads(tokenizer_json)
    added = {t["content"] for t in spec["added_tokens"]}
    with open(path, "w") as f:
        for token, rank in sorted(spec["model"]["vocab"].items(), key=lambda kv: kv[1]):
            if token in added:
                continue
            f.write(f"{base64.b64encode(bytes(decode[c] for c in token)).decode()} {rank}\n")


class TiktokenBPE(PreTrainedTokenizer):
    vocab_files_names = {"vocab_file": "tiktoken.model"}
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, vocab_file: str, **kwargs):
        ranks = load_tiktoken_bpe(vocab_file)
        self.model = tiktoken.Encoding(name="tiny", pat_str=PAT_STR, mergeable_ranks=ranks, special_tokens={})
        byte_encoder = bytes_to_unicode()
        self.encoder = {"".join(byte_encoder[b] for b in token): rank for token, rank in ranks.items()}
        self.decoder = {rank: token for token, rank in self.encoder.items()}
        self.byte_decoder = {c: b for b, c in byte_encoder.items()}
        self.vocab_file = vocab_file
        kwargs.setdefault("clean_up_tokenization_spaces", False)
        super().__init__(**kwargs)

    @property
    def vocab_size(self) -> int:
        return len(self.encoder)

    def get_vocab(self) -> dict[str, int]:
        return {**self.encoder, **self._added_tokens_encoder}

    def _tokenize(self, text: str, **kwargs) -> list[str]:
        # special tokens were already split out by transformers' added-token trie: the rest is ordinary text
        return [self.decoder[r] for r in self.model.encode_ordinary(text)]

    def _convert_token_to_id(self, token: str) -> int:
        return self.encoder[token]

    def _convert_id_to_token(self, index: int) -> str:
        return self.decoder[index]

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        out = bytearray()
        for t in tokens:
            out += t.encode("utf-8") if t in self._added_tokens_encoder else bytes(self.byte_decoder[c] for c in t)
        return out.decode("utf-8", errors="replace")

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None) -> tuple[str]:
        import os
        import shutil
        path = os.path.join(save_directory, (filename_prefix + "-" if filename_prefix else "") + "tiktoken.model")
        if os.path.abspath(path) != os.path.abspath(self.vocab_file):
            shutil.copyfile(self.vocab_file, path)
        return (path,)
