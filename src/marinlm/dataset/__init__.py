"""Token shards (`marinlm tokenize`) and the packing, mixing, resumable loader."""

from marinlm.dataset.loader import DataConfig, SourceConfig, TokenLoader, build_loader, validation_batches
from marinlm.dataset.shards import EmptySplitError, ShardError, TokenDataset

__all__ = [
    "DataConfig",
    "EmptySplitError",
    "ShardError",
    "SourceConfig",
    "TokenDataset",
    "TokenLoader",
    "build_loader",
    "validation_batches",
]
