"""How a Trainer makes its model and what its checkpoints hold, as a part it is given:
`FromScratch` (pretraining: the initialised model, every tensor saved) or, from marinlm.finetune,
`Finetuning` (the base run's weights, adapted; only the trained tensors saved). A part may also
act at the start and the end of `fit`."""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions


class FromScratch:
    state_dict_options = StateDictOptions()  # a checkpoint holds everything

    def prepare(self, model: torch.nn.Module, config, info) -> torch.nn.Module:
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
