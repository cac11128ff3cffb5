"""The held-out split: which source samples are kept out of training, by sample_index alone.

Below every stage: the trainer and `eagle3 vocab` split dumps with it (data/dumps.split), and a spooled dump
(dump/spool.py) writes the held-out samples into shards of their own with it, so both sides agree on the set.
"""

from __future__ import annotations


def _mix64(x: int) -> int:
    """splitmix64: a fixed, platform-independent hash (Python's hash() is salted per process)."""
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def is_held_out(sample_index: int, fraction: float, seed: int) -> bool:
    """Deterministic by (seed, sample_index): a source sample is on the same side in every dump and every run."""
    return _mix64(_mix64(seed) ^ sample_index) < fraction * 2.0**64


# The held-out split's defaults (eagle3 train and eagle3 vocab take them from here)
HELD_OUT_FRACTION = 0.02
SPLIT_SEED = 0
