"""The fine-tuning config: a training config plus the base model, the SFT data and the method."""

from __future__ import annotations

from dataclasses import dataclass, field

from marinlm.config import check
from marinlm.train.config import TrainConfig

METHODS = ("full", "lora", "qlora", "freeze")
# The linear layers LoRA adapts by default: attention and the shared experts (and the latent
# projections of latent MoE). Patterns are fnmatch globs on module names (model.named_modules()).
DEFAULT_TARGETS = [
    "*.attn.q_proj",
    "*.attn.k_proj",
    "*.attn.v_proj",
    "*.attn.o_proj",
    "*.mlp.shared.*_proj",
    "*.mlp.latent_*",
]


@dataclass(kw_only=True)
class SFTDataConfig:
    """Chat or prompt/completion examples in .jsonl, .json or .parquet files."""

    train_files: list[str] = field(default_factory=list)
    val_files: list[str] = field(default_factory=list)
    val_fraction: float = 0.0  # without val_files: this share of the training examples is held out
    format: str = "auto"  # messages | prompt_completion | auto (messages if the field is there)
    messages_field: str = "messages"
    prompt_field: str = "prompt"
    completion_field: str = "completion"
    system_prompt: str | None = None  # put first in prompt/completion examples
    chat_template: str | None = None  # a .jinja file; None = the tokenizer's own
    # A tokenizer folder extending the base run's (`marinlm tokenizer template --add-special-tokens`):
    # every base id unchanged, the new ones below model.vocab_size. None = the base run's.
    tokenizer: str | None = None
    max_examples: int = 0  # the first N training examples (0 = all)
    max_val_examples: int = 0
    # Share of examples with no trainable token above which the data is refused (a template
    # whose markers miss the assistant turns, or prompts longer than seq_len).
    max_empty_fraction: float = 0.5

    def __post_init__(self):
        check(self.format in ("auto", "messages", "prompt_completion"), "format", f"unknown format {self.format!r}")
        check(0.0 <= self.val_fraction < 1.0, "val_fraction", f"must be in [0, 1), got {self.val_fraction}")
        check(self.max_examples >= 0, "max_examples", f"must be >= 0 (0 = all), got {self.max_examples}")
        check(0.0 <= self.max_empty_fraction <= 1.0, "max_empty_fraction", "must be in [0, 1]")


@dataclass(kw_only=True)
class LoraConfig:
    r: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: list(DEFAULT_TARGETS))
    experts: bool = True  # grouped LoRA on the routed experts' gate/up/down stacks
    lm_head: bool = False
    train_router: bool = False  # routers and norms stay frozen unless asked
    train_norms: bool = False
    # The embedding and the LM head trained whole, as peft's modules_to_save: what the rows of
    # tokens that sft.tokenizer adds need to learn.
    train_embeddings: bool = False

    def __post_init__(self):
        check(self.r >= 1, "r", f"must be >= 1, got {self.r}")
        check(self.alpha > 0, "alpha", f"must be positive, got {self.alpha}")
        check(0.0 <= self.dropout < 1.0, "dropout", f"must be in [0, 1), got {self.dropout}")


@dataclass(kw_only=True)
class FreezeConfig:
    """method: freeze trains only these; everything else is frozen and has no optimizer state."""

    last_layers: int = 0  # the last N blocks (and the final norm and LM head)
    patterns: list[str] = field(default_factory=list)  # parameter-name globs trained besides

    def __post_init__(self):
        check(self.last_layers >= 0, "last_layers", f"must be >= 0, got {self.last_layers}")


@dataclass(kw_only=True)
class FinetuneConfig(TrainConfig):
    base: str = ""  # a marinlm run or checkpoint folder (an imported HF model is one)
    # Which of the base run's checkpoints a new fine-tune starts from: a step number, or a checkpoint
    # folder; empty: the newest good one. A resumed fine-tune keeps the one it began on.
    base_checkpoint: str = ""
    method: str = "lora"
    sft: SFTDataConfig = field(default_factory=SFTDataConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    freeze: FreezeConfig = field(default_factory=FreezeConfig)

    def __post_init__(self):
        super().__post_init__()
        check(bool(self.base), "base", "name the run or checkpoint to fine-tune")
        check(self.method in METHODS, "method", f"must be one of {list(METHODS)}, got {self.method!r}")
        check(bool(self.sft.train_files), "sft.train_files", "give at least one file of examples")
        check(
            self.method != "freeze" or self.freeze.last_layers or self.freeze.patterns,
            "freeze",
            "method freeze needs freeze.last_layers or freeze.patterns",
        )
        check(
            not (self.parallel.tensor_parallel > 1 and self.method == "lora" and self.lora.lm_head),
            "lora.lm_head",
            "an adapter on the vocabulary-split LM head is not written for parallel.tensor_parallel; set it false",
        )
        check(
            not (self.lora.lm_head and self.lora.train_embeddings),
            "lora.lm_head",
            "lora.train_embeddings trains the LM head whole; an adapter on it as well is one too many: set it false",
        )


def check_processes(config: FinetuneConfig, world_size: int) -> None:
    """Raise ConfigError for a method that cannot run on `world_size` processes: QLoRA's 4-bit
    weights (bitsandbytes) neither shard under FSDP2 nor split under tensor parallel."""
    check(
        config.method != "qlora" or world_size == 1,
        "method",
        f"qlora runs in one process, not {world_size}: bitsandbytes' 4-bit weights do not shard under FSDP2 "
        "or split under tensor parallel; use lora on several",
    )
