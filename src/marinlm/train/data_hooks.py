"""The training data side of the Trainer: the tokenized sources, the loader, the held-out splits and
what the run folder records of them. Fine-tuning (marinlm.finetune) overrides these hooks."""

from __future__ import annotations

import sys
from pathlib import Path

from marinlm.config import dump_config
from marinlm.dataset.loader import build_loader, open_dataset, validation_sources
from marinlm.train.provenance import copy_tokenizer, data_record, software_environment
from marinlm.utils.io import write_json_atomic, write_text_atomic


class TrainingData:
    def _open_data(self) -> None:
        """The training data's tokenizer (its hash, the folder to copy into the run), checked against
        the model. Fine-tuning (marinlm.finetune) reads other data and overrides the data hooks:
        this, `_make_loader`, `_val_sources`, `_epochs_planned`, `_data_record` and `validate`."""
        c = self.config
        first = open_dataset(c.data, 0, verify="size") if c.data.sources else None
        if first is None:
            raise ValueError("data.sources: give at least one tokenized dataset")
        self.tokenizer_hash = first.manifest["tokenizer"]["hash"]
        padded = -(-first.vocab_size // 128) * 128  # a multiple of 128 above the tokenizer's is usual padding
        if c.model.vocab_size > padded and self.info.is_main:
            unused = c.model.vocab_size - first.vocab_size
            params = unused * c.model.d_model * (1 if c.model.tie_embeddings else 2)
            print(
                f"note: model.vocab_size {c.model.vocab_size:,} is larger than the tokenizer's {first.vocab_size:,}: "
                f"{unused:,} rows of the embedding and the output layer ({params / 1e6:.2f}M parameters) are never "
                f"used; set model.vocab_size={first.vocab_size} (or a multiple of 128 above it)",
                flush=True,
            )
        # Copied into the run: the folder tokenize used, else the copy the tokens carry (the recorded
        # path may be relative to another folder, or gone).
        recorded, carried = first.manifest["tokenizer"].get("path"), Path(c.data.sources[0].path) / "tokenizer"
        self._tokenizer_source = next((p for p in (recorded, str(carried)) if p and Path(p).is_dir()), recorded)

    def _make_loader(self):
        c = self.config
        # The loader deals micro-batches: `accum` of them (x data-parallel ranks) make one global batch.
        return build_loader(
            c.data,
            self.micro_batch * self.data_world,
            self.data_rank,
            self.data_world,
            self.tokenizer_hash,
            c.model.vocab_size,
            index_dir=self.run_dir / "data-index",
            rows_per_step=c.train.global_batch,
        )

    def _val_sources(self) -> dict:
        """Each source's validation split by name; empty when the data has none (a corrupt one is an
        error). A source without one is left out, with a warning."""
        found, empty = validation_sources(self.config.data, self.tokenizer_hash, self.config.model.vocab_size)
        if self.info.is_main and self.config.validation.every_steps:
            for e in empty:
                off = "validation is off" if not found else f"validating on the others ({', '.join(found)})"
                print(f"warning: {e}; {off} (tokenize with a larger val_fraction to have one)", flush=True)
        return found

    def _epochs_planned(self) -> list[float]:
        """Passes over each source that `train.steps` reads; more than one is said once at start."""
        c, loader = self.config, self.loader
        epochs = loader.planned_epochs(c.train.steps * c.train.global_batch)
        for spec, src, e in zip(c.data.sources, loader.sources, epochs, strict=True):
            if e > 1 and self.info.is_main:
                print(
                    f"note: {spec.path}: {src.rows_per_epoch:,} rows of {c.data.seq_len} tokens per epoch; "
                    f"{c.train.steps:,} steps read it {e:,.1f} times",
                    flush=True,
                )
        return epochs

    def _write_run_record(self, resumed_from) -> None:
        write_text_atomic(self.run_dir / "config.yaml", dump_config(self.config))
        record = {
            **software_environment(),
            "world_size": self.world,
            "device": str(self.device),
            "precision": self.precision,
            "tokenizer_hash": self.tokenizer_hash,
            "data": self._data_record(),
            "command": sys.argv,
            "resumed_from": str(resumed_from) if resumed_from else None,
            "initialized_from": self.initialized_from,
            "peak_flops_measured": self.peak_flops,
        }
        write_json_atomic(self.run_dir / "run_info.json", record)
        copy_tokenizer(self._tokenizer_source, self.run_dir, self._tokenizer_manifest())

    def _data_record(self) -> list[dict]:
        return data_record(self.config.data.sources, self.epochs_planned)

    def _tokenizer_manifest(self) -> Path:
        return Path(self.config.data.sources[0].path) / "manifest.json"
