"""Stage 2: dump shards -> what the drafter trains on (standardize_data_v1, dataset, loader, draft vocab)."""

from eagle3.data.standardize import standardize_data_v1

__all__ = ["standardize_data_v1"]
