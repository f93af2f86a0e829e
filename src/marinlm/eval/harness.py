"""lm-evaluation-harness adapter: run any of its tasks on a marinlm checkpoint.

    import marinlm.eval.harness  # registers the "marinlm" model type
    lm_eval.simple_evaluate(model="marinlm", model_args="pretrained=runs/quickstart/train", tasks=[...])

or from the shell: `marinlm lm-eval --model marinlm --model_args pretrained=RUN --tasks ...`, which is
lm-eval's own command line with this model registered (lm-eval 0.4 finds models only in its own
registry: it has no plugin entry point, so a plain `lm_eval --model marinlm` cannot see it) and the
local task YAMLs (eval/lm_eval_tasks/, `local_hellaswag` ...) on its include path. Requires the
`eval` extra; nothing here is imported unless you ask for it.
"""

from __future__ import annotations

import os
import sys

# lm-eval's own models register on importing lm_eval.models: without it, once marinlm is
# registered, `--model hf` finds only "marinlm".
import lm_eval.models  # noqa: F401
import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from marinlm.eval.lm import Request, Scorer
from marinlm.loading import document_start_id, load_model


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
        if str(device).startswith("cuda") and not torch.cuda.is_available():
            # lm-eval's CLI passes --device cuda unless told otherwise; on a machine without one, the CPU.
            print(f"note: --device {device}, but no CUDA device here: running on the CPU", file=sys.stderr)
            device = "cpu"
        self.loaded = loaded if loaded is not None else load_model(pretrained, device=device or "cpu")
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


def run_cli(argv: list[str], data_dir: str | None = None) -> int:
    """lm-eval's command line with the marinlm model registered, the local tasks on the include path
    (unless one is given) and the CPU as the device where there is no GPU."""
    import tempfile

    from lm_eval.__main__ import cli_evaluate

    from marinlm.eval.lm_eval_tasks import write_task_dir
    from marinlm.eval.runner import DATA_ENV, DEFAULT_DATA_DIR

    argv = list(argv)
    if not any(a.startswith("--device") for a in argv) and not torch.cuda.is_available():
        argv += ["--device", "cpu"]
    with tempfile.TemporaryDirectory() as tmp:
        if not any(a.startswith("--include_path") for a in argv):
            folder = data_dir or os.environ.get(DATA_ENV) or str(DEFAULT_DATA_DIR)
            argv += ["--include_path", str(write_task_dir(folder, tmp))]
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
        old, sys.argv = sys.argv, ["lm_eval", *argv]
        try:
            cli_evaluate()
        finally:
            sys.argv = old
    return 0


if __name__ == "__main__":  # `python -m marinlm.eval.harness --model marinlm ...`, as `marinlm lm-eval`
    sys.exit(run_cli(sys.argv[1:]))
