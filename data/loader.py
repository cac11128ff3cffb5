"""Batches for the trainer: length-grouped, token-budgeted, data-parallel, resumable from a step number.

The batch list of an epoch is a pure function of (samples, token budget, seed, epoch, world size): every rank
computes the same global list and takes batches rank, rank + world, ... . The count is made divisible by the world
size by splitting the largest batches, so each rank runs the same number of steps and every training sample is read
exactly once per epoch. Resuming at step s replays the same function from s.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Iterator

from torch.utils.data import DataLoader, Dataset

from eagle3.batching import group_by_length
from eagle3.data.batch import collate
from eagle3.data.dumps import DumpSet, SampleRef


def length_grouped_batches(lengths: list[int], token_budget: int, seed: int, epoch: int, world_size: int,
                           window: int = 512, shuffle: bool = True) -> list[list[int]]:
    """Global batches (lists of positions into `lengths`) for one epoch; padded size B*max_len <= token_budget."""
    rng = random.Random(seed * 1_000_003 + epoch)
    order = list(range(len(lengths)))
    if shuffle:
        rng.shuffle(order)
    batches: list[list[int]] = []
    # Group by length inside windows of the shuffled order: little padding, yet different mixes every epoch.
    for w in range(0, len(order), window):
        batches += group_by_length(sorted(order[w:w + window]), lengths, token_budget)
    if shuffle:
        rng.shuffle(batches)
    while len(batches) % world_size:
        j = max(range(len(batches)), key=lambda k: (len(batches[k]), -k))
        if len(batches[j]) < 2:
            raise ValueError(f"{len(lengths)} samples cannot fill {world_size} data-parallel ranks equally")
        half = len(batches[j]) // 2
        batches[j:j + 1] = [batches[j][:half], batches[j][half:]]
    return batches


@dataclass
class BatchPlan:
    """Which batches a rank runs at which global step: the rank's share of epoch 0, then of epoch 1, ..."""
    lengths: list[int]
    token_budget: int
    seed: int
    rank: int
    world_size: int
    shuffle: bool = True

    def __post_init__(self):
        self._cache: dict[int, list[list[int]]] = {}

    def epoch(self, e: int) -> list[list[int]]:
        if e not in self._cache:
            self._cache = {e: length_grouped_batches(self.lengths, self.token_budget, self.seed, e,
                                                     self.world_size, shuffle=self.shuffle)[self.rank::self.world_size]}
        return self._cache[e]

    def position(self, step: int) -> tuple[int, int]:
        """(epoch, batch within the epoch) of a global step. Epochs can differ by a batch or two in length
        (grouping depends on the shuffle), so this walks the epochs' counts."""
        e = 0
        while step >= len(self.epoch(e)):
            step -= len(self.epoch(e))
            e += 1
        return e, step

    def batches_from(self, step: int, num_steps: int | None = None) -> Iterator[list[int]]:
        e, k = self.position(step)
        produced = 0
        while num_steps is None or produced < num_steps:
            batches = self.epoch(e)
            while k < len(batches) and (num_steps is None or produced < num_steps):
                yield batches[k]
                k += 1
                produced += 1
            e, k = e + 1, 0


class _Samples(Dataset):
    def __init__(self, dumps: DumpSet, refs: list[SampleRef]):
        self.dumps, self.refs = dumps, refs

    def __len__(self):
        return len(self.refs)

    def __getitem__(self, i: int) -> dict:
        return self.dumps.standardized(self.refs[i], concat=False)  # collate places the parts


def make_loader(dumps: DumpSet, refs: list[SampleRef], plan: BatchPlan, start_step: int = 0,
                num_steps: int | None = None, num_workers: int = 2, pin_memory: bool = False) -> DataLoader:
    """Batches of this rank from `start_step` on, read by worker processes (the trainer never waits on I/O)."""
    return DataLoader(_Samples(dumps, refs), batch_sampler=plan.batches_from(start_step, num_steps),
                      collate_fn=collate, num_workers=num_workers, pin_memory=pin_memory,
                      prefetch_factor=4 if num_workers else None, persistent_workers=False)
