"""Reading DCP checkpoints safely: nothing executable is unpickled, and a checkpoint of another
model or optimizer is refused by name instead of loading partially.

DCP's metadata goes through an unpickler that resolves only DCP's own metadata classes (the
`weights_only` model; torch's own weights-only unpickler cannot read DCP's protocol-4 pickles),
and non-tensor items are read with `weights_only=True`. DCP alone loads what the target asks for
and ignores the rest, so `check_same_structure` compares the two first.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader

from marinlm.parallel.distributed import all_gather_object


class CheckpointError(ValueError):
    """A checkpoint folder that is incomplete, truncated or corrupt; the message names it."""


class CheckpointMismatch(ValueError):
    """A sound checkpoint of another model or optimizer than the one it is loaded into. Older
    checkpoints of the same run would not fit either, so nothing falls back past it."""

    def __init__(self, folder: Path, detail: str):
        super().__init__(f"{folder}: {detail}")
        self.folder, self.detail = folder, detail


def check_same_structure(folder: Path, tensors: dict) -> None:
    """Raise CheckpointMismatch unless the checkpoint holds every model tensor of `tensors` with its
    shape and nothing more, and the same optimizer state tensors. (DCP alone loads what the target
    asks for and ignores the rest: a model with a layer fewer would resume in silence.)"""
    metadata = SafeFileSystemReader(str(folder)).read_metadata().state_dict_metadata
    saved = {k: tuple(v.size) for k, v in metadata.items() if hasattr(v, "size")}
    wanted: dict[str, tuple | None] = {f"model.{k}": tuple(v.shape) for k, v in tensors.get("model", {}).items()}
    for param, state in tensors.get("optim", {}).get("state", {}).items():
        for k in state:
            wanted[f"optim.state.{param}.{k}"] = None  # presence only: a scalar may be saved as bytes
    # Pipeline stages each hold part of the model: the checkpoint must hold what all ranks together want.
    for other in all_gather_object(wanted)[1:] if torch.distributed.is_initialized() else ():
        wanted.update(other)
    problems = []
    for prefix in [p for p, top in (("model.", "model"), ("optim.state.", "optim")) if top in tensors]:
        have = {k for k in metadata if k.startswith(prefix)}
        want = {k for k in wanted if k.startswith(prefix)}
        if only_saved := sorted(have - want):
            problems.append(f"{len(only_saved)} entries only in the checkpoint, e.g. {only_saved[0]}")
        if only_wanted := sorted(want - have):
            problems.append(f"{len(only_wanted)} entries missing from it, e.g. {only_wanted[0]}")
    for k, shape in wanted.items():
        if shape is not None and k in saved and saved[k] != shape:
            problems.append(f"{k} is {list(saved[k])} in the checkpoint, {list(shape)} here")
            break
    if problems:
        what = "model and optimizer" if "optim" in tensors else "model"
        raise CheckpointMismatch(folder, f"not a checkpoint of this {what}: {'; '.join(problems)}")


def load_tensors(folder: Path, tensors: dict) -> None:
    """Load the DCP state dict `tensors` ({"model": ...} and optionally {"optim": ...}) in place from
    `folder`, after check_same_structure(); nothing in it is unpickled beyond DCP's metadata."""
    check_same_structure(folder, tensors)
    try:
        dcp.load(tensors, storage_reader=SafeFileSystemReader(str(folder)), planner=SafeLoadPlanner())
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
        raise CheckpointError(f"{folder}: could not load tensors: {_first_cause(e)}") from None


def _first_cause(error: BaseException) -> str:
    """The innermost error's type and first line, without torch's advice to load with
    `weights_only=False`: in a refused pickle that advice would run the payload."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))
        return _first_cause(inner[0] if isinstance(inner, tuple) else inner)
    lines = [line for line in str(error).strip().splitlines() if "weights_only" not in line]
    if isinstance(error, pickle.UnpicklingError) or "Weights only load failed" in str(error):
        return "it holds a pickled object that is not plain data, refused (nothing in it was run)"
    return f"{type(error).__name__}: {lines[0] if lines else ''}"[:300]


_DCP_METADATA_CLASSES = (
    "Metadata",
    "TensorStorageMetadata",
    "BytesStorageMetadata",
    "ChunkStorageMetadata",
    "TensorProperties",
    "MetadataIndex",
    "StorageMeta",
    "_MEM_FORMAT_ENCODING",
)


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only DCP's metadata classes and a few inert torch/pathlib names; anything else (a
    function, `os.system`, ...) is refused, so a crafted .metadata cannot run code."""

    def find_class(self, module: str, name: str):
        allowed = (
            (module == "torch.distributed.checkpoint.metadata" and name in _DCP_METADATA_CLASSES)
            or (module == "torch.distributed.checkpoint.filesystem" and name == "_StorageInfo")
            or (module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)))
            or (module == "torch.serialization" and name == "_get_layout")
            or (module == "pathlib" and name in ("PosixPath", "WindowsPath", "PurePosixPath", "Path"))
        )
        if not allowed:
            raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in checkpoint metadata")
        return super().find_class(module, name)


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader whose metadata goes through an allow-list unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            try:
                metadata = _MetadataUnpickler(f).load()
            except Exception as e:
                raise CheckpointError(f"{path}: refusing or unable to read DCP metadata: {e}") from None
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner that reads non-tensor items with `weights_only=True`."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj
