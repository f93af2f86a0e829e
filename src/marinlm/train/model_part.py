"""How a Trainer makes its model and what its checkpoints hold, as a part it is given:
`FromScratch` (pretraining: the initialised model, every tensor saved) or, from marinlm.finetune,
`Finetuning` (the base run's weights, adapted; only the trained tensors saved). A part may also
act at the start and the end of `fit`."""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions

from marinlm.kernels import apply_kernels
from marinlm.kernels.fp8 import apply_fp8
from marinlm.model.summary import summarize
from marinlm.model.transformer import MarinForCausalLM
from marinlm.parallel import parallelize


def build_model(config, device: torch.device, precision: str, dims, part, rows: int) -> torch.nn.Module:
    """The run's model on `device`: built on meta, the kernels swapped in, `part` prepared and
    parallelized on `dims`, the layout (under pipeline parallel, this rank's stages:
    parallel/pipeline_parallel.py, cut for `rows`, a data-parallel rank's rows a step).
    `train.init: full` initialises the whole model on every rank alike (same seed: as one
    process), then shards it; `sharded` shards on meta and initialises each rank's shards."""
    with torch.device("meta"):
        model = MarinForCausalLM(config.model)
    if precision == "fp64":
        model.to(torch.float64)
    apply_kernels(model, device, precision, config.kernels, compiled=config.parallel.compile)
    if config.train.fp8:
        apply_fp8(model, device, precision, config.parallel.tensor_parallel)
    init = config.train.init
    if init == "auto":
        init = "full" if summarize(config.model).total < 2e9 else "sharded"
    layout = dict(device=device, rows=rows, seq_len=config.data.seq_len)
    if init == "full":
        model.to_empty(device=device)
        model.init_weights(seed=config.train.seed)
        model = part.prepare(model, config, dims)
        return parallelize(model, config.parallel, dims, **layout)
    model = parallelize(model, config.parallel, dims, **layout)
    model.to_empty(device=device)
    model.init_weights(seed=config.train.seed)
    return model


class FromScratch:
    state_dict_options = StateDictOptions()  # a checkpoint holds everything

    def prepare(self, model: torch.nn.Module, config, dims) -> torch.nn.Module:
        """The whole, initialised model before it is sharded."""
        return model

    def trainer_state(self) -> dict:
        """What this part adds to a checkpoint's trainer_state.json."""
        return {}

    def before_fit(self, trainer) -> None:
        """At the start of `fit`, before the first step."""

    def after_fit(self, trainer, summary: dict) -> dict:
        """At the end of `fit`: the summary it returns, with this part's additions."""
        return summary
