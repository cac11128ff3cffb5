"""The draft vocabulary: the N most frequent target tokens at loss-masked positions of the training data.

Sorted by id; `d2t[i] = id_i - i` (SGLang: target_id = draft_id + d2t[draft_id]) and `t2d[id] = True` for those
ids. Ties break by token id (the smaller id wins), and N beyond the distinct tokens fills with the remaining ids in
id order, so the result is deterministic.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from eagle3 import contract as C
from eagle3.data.dumps import DumpSet, SampleRef, split
from eagle3.heldout import HELD_OUT_FRACTION, SPLIT_SEED
from eagle3.options import opt
from eagle3.vocab_map import vocab_map, vocab_map_problem


def count_tokens(dumps: DumpSet, refs: list[SampleRef], progress: bool = False) -> torch.Tensor:
    """counts[id] = occurrences of id at loss-masked positions of the samples `refs`."""
    V = dumps.manifest.target.vocab_size
    counts = torch.zeros(V, dtype=torch.int64)
    by_shard: dict[tuple[int, int], list[SampleRef]] = {}
    for r in refs:
        by_shard.setdefault((r.dump, r.shard), []).append(r)
    for (d, s), rs in tqdm(sorted(by_shard.items()), desc="count tokens", unit="shard", disable=not progress):
        f = dumps._shard(d, s)
        ids = f.get_tensor(C.INPUT_IDS).long()
        mask = f.get_tensor(C.LOSS_MASK).bool()
        keep = torch.zeros_like(mask)
        for r in rs:
            keep[r.start:r.start + r.length] = True
        sel = ids[mask & keep]
        if sel.numel() and int(sel.max()) >= V:
            raise C.ContractError(f"{dumps.where(rs[0])}: token id {int(sel.max())} >= vocab_size {V}")
        counts += torch.bincount(sel, minlength=V)
    return counts


def select_draft_vocab(counts: torch.Tensor, n: int) -> torch.Tensor:
    """Ids of the n most frequent tokens (ties: smaller id first), returned sorted by id."""
    V = counts.numel()
    if not 0 < n <= V:
        raise ValueError(f"--draft-vocab-size {n} must be in 1..{V} (the target vocab)")
    key = counts.to(torch.int64) * V + (V - 1 - torch.arange(V))  # count first, then smaller id
    return torch.sort(torch.topk(key, n).indices).values


def coverage(counts: torch.Tensor, t2d: torch.Tensor) -> float:
    total = int(counts.sum())
    return float(counts[t2d].sum()) / total if total else 0.0


def build_vocab(dumps: DumpSet, refs: list[SampleRef], n: int, progress: bool = False,
                counts: torch.Tensor | None = None) -> dict:
    """The map from the `refs` samples' loss-masked token counts (`counts`, when the caller has them: a spool counts
    its plan's tokens before any shard is written, data/stream.py)."""
    if counts is None:
        counts = count_tokens(dumps, refs, progress=progress)
    if int(counts.sum()) == 0:  # a vocabulary of nothing, and a training run with nothing to learn
        raise C.ContractError(f"{', '.join(dumps.dirs) if hasattr(dumps, 'dirs') else 'the dumps'}: no token of "
                              f"the {len(refs)} samples counted is in the loss (every loss_mask is 0): nothing to "
                              "build a draft vocabulary from or to train on; check the chat template's assistant "
                              "spans (eagle3 inspect shows the dump's masks)")
    d2t, t2d = vocab_map(select_draft_vocab(counts, n), counts.numel())
    m = dumps.manifest
    meta = {"draft_vocab_size": n, "vocab_size": counts.numel(), "coverage": coverage(counts, t2d),
            "counted_tokens": int(counts.sum()), "distinct_tokens": int((counts > 0).sum()),
            "samples": len(refs), "dumps": [str(d) for d in dumps.dirs],
            "identity": m.identity()}
    return {"d2t": d2t, "t2d": t2d, "meta": meta}


def describe_vocab(meta: dict) -> str:
    """One line on a built vocabulary (its size and what it covers), as the vocab command, the trainer and the
    quickstart report it."""
    return (f"{meta['draft_vocab_size']} of {meta['vocab_size']} ids: coverage {meta['coverage']:.2%} of "
            f"{meta['counted_tokens']:,} loss-masked tokens in {meta['samples']:,} training samples "
            f"({meta['distinct_tokens']:,} distinct)")


def save_vocab(path: str, vocab: dict) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    save_file({"d2t": vocab["d2t"], "t2d": vocab["t2d"]}, tmp,
              metadata={"eagle3_vocab": json.dumps(vocab["meta"], sort_keys=True)})
    os.replace(tmp, path)


def load_vocab(path: str) -> dict:
    """d2t / t2d and their record from an `eagle3 vocab` file; a file that is not one (a pickle, a .jsonl, a
    truncated or foreign safetensors file) is a ContractError naming it."""
    from safetensors import SafetensorError
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such vocabulary file (eagle3 vocab --out)")
    try:
        with safe_open(path, "pt") as f:
            meta = json.loads((f.metadata() or {}).get("eagle3_vocab", "{}"))
            missing = [k for k in ("d2t", "t2d") if k not in f.keys()]
            if missing:
                raise C.ContractError(f"{path}: a safetensors file without {missing}: not an eagle3 vocabulary")
            d2t, t2d = f.get_tensor("d2t"), f.get_tensor("t2d")
    except (SafetensorError, OSError, ValueError, UnicodeDecodeError) as e:
        if isinstance(e, C.ContractError):
            raise
        raise C.ContractError(f"{path}: not a safetensors vocabulary file ({type(e).__name__}: {str(e)[:200]}); "
                              "make one with `eagle3 vocab`") from None
    if not isinstance(meta, dict):
        raise C.ContractError(f"{path}: its eagle3_vocab record is not a JSON object")
    problem = vocab_map_problem(d2t, t2d)
    if problem:
        raise C.ContractError(f"{path}: {problem}")
    return {"d2t": d2t, "t2d": t2d, "meta": meta}


@dataclass
class VocabConfig:
    """`eagle3 vocab`: a draft vocabulary file from the training split of dumps (the split `eagle3 train` makes with
    the same --held-out-fraction and --seed)."""
    dump: list[str] = opt(help="dump directories (their training split is counted)")
    draft_vocab_size: int = opt(help="tokens in the draft vocabulary: the most frequent loss tokens of the training "
                                     "split")
    out: str = opt(help="output .safetensors file")
    verify: bool = opt(True, "skip the shard sha256 check")
    held_out_fraction: float = opt(HELD_OUT_FRACTION, "share of samples (by sample_index) kept out of training for "
                                                      "evaluation")
    seed: int = opt(SPLIT_SEED, "seed of the held-out split")


def make_vocab_file(cfg: VocabConfig) -> dict:
    ds = DumpSet(cfg.dump, verify=cfg.verify, progress=True)
    train, _ = split(ds.refs, cfg.held_out_fraction, cfg.seed)
    vocab = build_vocab(ds, train, cfg.draft_vocab_size, progress=True)
    save_vocab(cfg.out, vocab)
    return vocab
