"""What a Trainer trains on, as a part it is given: `TokenData` (pretraining's tokenized sources)
or, from marinlm.finetune, `SFTData`. A data source opens its data and its tokenizer, deals the
loader, names the held-out splits and says what the run folder records of them; `write_run_record`
writes that record."""

from __future__ import annotations

import sys
from pathlib import Path

from marinlm.config import dump_config
from marinlm.dataset.loader import build_loader, open_dataset, validation_sources
from marinlm.train.provenance import copy_tokenizer, data_record, software_environment
from marinlm.train.step import validate_sources
from marinlm.utils.io import write_json_atomic, write_text_atomic


class TokenData:
    """Pretraining's data: `data.sources`, token shards made by `marinlm tokenize`."""

    def open(self, config, info) -> None:
        """The training data's tokenizer (its hash, the folder to copy into the run), checked
        against the model."""
        self.config, self.info = config, info
        first = open_dataset(config.data, 0, verify="size") if config.data.sources else None
        if first is None:
            raise ValueError("data.sources: give at least one tokenized dataset")
        self.tokenizer_hash = first.manifest["tokenizer"]["hash"]
        model = config.model
        padded = -(-first.vocab_size // 128) * 128  # a multiple of 128 above the tokenizer's is usual padding
        if model.vocab_size > padded and info.is_main:
            unused = model.vocab_size - first.vocab_size
            params = unused * model.d_model * (1 if model.tie_embeddings else 2)
            print(
                f"note: model.vocab_size {model.vocab_size:,} is larger than the tokenizer's {first.vocab_size:,}: "
                f"{unused:,} rows of the embedding and the output layer ({params / 1e6:.2f}M parameters) are never "
                f"used; set model.vocab_size={first.vocab_size} (or a multiple of 128 above it)",
                flush=True,
            )
        # Copied into the run: the folder tokenize used, else the copy the tokens carry (the recorded
        # path may be relative to another folder, or gone).
        recorded, carried = first.manifest["tokenizer"].get("path"), Path(config.data.sources[0].path) / "tokenizer"
        self.tokenizer_source = next((p for p in (recorded, str(carried)) if p and Path(p).is_dir()), recorded)
        self.tokenizer_manifest = Path(config.data.sources[0].path) / "manifest.json"

    def loader(self, rows_per_deal: int, rank: int, world: int, run_dir: Path):
        """The loader deals micro-batches of `rows_per_deal` rows over the data-parallel ranks."""
        c = self.config
        return build_loader(
            c.data,
            rows_per_deal,
            rank,
            world,
            self.tokenizer_hash,
            c.model.vocab_size,
            index_dir=run_dir / "data-index",
            rows_per_step=c.train.global_batch,
        )

    def val_sources(self) -> dict:
        """Each source's validation split by name; empty when the data has none (a corrupt one is an
        error). A source without one is left out, with a warning."""
        c = self.config
        found, empty = validation_sources(c.data, self.tokenizer_hash, c.model.vocab_size)
        if self.info.is_main and c.validation.every_steps:
            for e in empty:
                off = "validation is off" if not found else f"validating on the others ({', '.join(found)})"
                print(f"warning: {e}; {off} (tokenize with a larger val_fraction to have one)", flush=True)
        return found

    def planned_epochs(self, loader) -> list[float]:
        """Passes over each source that `train.steps` reads; more than one is said once at start."""
        c = self.config
        epochs = loader.planned_epochs(c.train.steps * c.train.global_batch)
        for spec, src, e in zip(c.data.sources, loader.sources, epochs, strict=True):
            if e > 1 and self.info.is_main:
                print(
                    f"note: {spec.path}: {src.rows_per_epoch:,} rows of {c.data.seq_len} tokens per epoch; "
                    f"{c.train.steps:,} steps read it {e:,.1f} times",
                    flush=True,
                )
        return epochs

    def record(self, loader, epochs: list[float]) -> list[dict]:
        return data_record(self.config.data.sources, epochs)

    def validate(self, model, val_sources: dict, rank: int, world: int, **where) -> dict[str, float] | None:
        """Loss and bits per byte on each source's held-out split (`validation.max_rows` rows of each)."""
        if not val_sources:
            return None
        v = self.config.validation
        return validate_sources(model, val_sources, v.batch_size, v.max_rows, rank, world, **where)

    def write_extras(self, run_dir: Path) -> None:
        """Files of the data's own that the run folder keeps (none for token shards)."""


def write_run_record(trainer, resumed_from) -> None:
    """The run folder's config.yaml, run_info.json and tokenizer, from the trainer's parts."""
    data = trainer.data
    write_text_atomic(trainer.run_dir / "config.yaml", dump_config(trainer.config))
    record = {
        **software_environment(),
        "world_size": trainer.world,
        "device": str(trainer.device),
        "precision": trainer.precision,
        "tokenizer_hash": data.tokenizer_hash,
        "data": data.record(trainer.loader, trainer.epochs_planned),
        "command": sys.argv,
        "resumed_from": str(resumed_from) if resumed_from else None,
        "initialized_from": trainer.state.initialized_from,
        "peak_flops_measured": trainer.peak_flops,
    }
    write_json_atomic(trainer.run_dir / "run_info.json", record)
    copy_tokenizer(data.tokenizer_source, trainer.run_dir, data.tokenizer_manifest)
    data.write_extras(trainer.run_dir)
