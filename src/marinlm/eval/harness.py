"""lm-evaluation-harness adapter: run any of its tasks on a marinlm checkpoint.

    import marinlm.eval.harness  # registers the "marinlm" model type
    lm_eval.simple_evaluate(model="marinlm", model_args="pretrained=runs/quickstart/train", tasks=[...])

or from the shell, `lm_eval --model marinlm --model_args pretrained=RUN --tasks ... --include_path ...`
after importing this module (e.g. via `python -m marinlm.eval.harness ...`, which forwards to lm_eval).
Requires `pip install lm_eval`; nothing here is imported unless you ask for it.
"""

from __future__ import annotations

import sys

from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from marinlm.eval.lm import Request, Scorer
from marinlm.train.inference import document_start_id, load_model


@register_model("marinlm")
class MarinHarnessLM(LM):
    """The harness's LM interface over marinlm's batched scorer."""

    def __init__(
        self,
        pretrained: str,
        device: str = "cpu",
        batch_size: int | str = 32,
        max_length: int | None = None,
        loaded=None,
    ):
        super().__init__()
        self.loaded = loaded if loaded is not None else load_model(pretrained, device=device)
        batch = int(batch_size) if str(batch_size).isdigit() else 32  # "auto" -> our default
        self.scorer = Scorer(
            self.loaded.model,
            self.loaded.tokenizer,
            max_length=max_length and int(max_length),
            batch_size=batch,
            start_id=document_start_id(self.loaded),
        )

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        return self.scorer.loglikelihood([Request(*req.args) for req in requests])

    def loglikelihood_rolling(self, requests) -> list[float]:
        return [ll for ll, _ in self.scorer.loglikelihood_rolling([req.args[0] for req in requests])]

    def generate_until(self, requests) -> list[str]:
        out = []
        for req in requests:
            context, kwargs = req.args
            until = kwargs.get("until", []) or []
            until = [until] if isinstance(until, str) else list(until)
            out.append(self.scorer.generate_until(context, until, int(kwargs.get("max_gen_toks", 64))))
        return out


if __name__ == "__main__":  # `python -m marinlm.eval.harness --model marinlm ...`: lm_eval's CLI, adapter loaded
    from lm_eval.__main__ import cli_evaluate

    sys.exit(cli_evaluate())
