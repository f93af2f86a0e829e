"""The `transformers` config of an exported marinlm model (copied verbatim into the export folder).

The architecture travels as the run's own model config, a plain dict under `marin`, so every switch
of the Marin architecture survives without a field-by-field translation; the usual HF fields
(vocab_size, hidden_size, ...) are filled from it for tools that read them.
"""

from transformers import PretrainedConfig


class MarinHFConfig(PretrainedConfig):
    model_type = "marin"
    keys_to_ignore_at_inference = ["cache"]

    def __init__(self, marin: dict | None = None, **kwargs):
        self.marin = dict(marin or {})
        attention = self.marin.get("attention", {})
        defaults = {
            "vocab_size": self.marin.get("vocab_size"),
            "hidden_size": self.marin.get("d_model"),
            "num_hidden_layers": self.marin.get("num_layers"),
            "num_attention_heads": attention.get("num_heads"),
            "num_key_value_heads": attention.get("num_kv_heads"),
            "head_dim": attention.get("head_dim"),
            "max_position_embeddings": self.marin.get("max_seq_len"),
            "tie_word_embeddings": bool(self.marin.get("tie_embeddings", False)),
        }
        for key, value in defaults.items():
            kwargs.setdefault(key, value)
        super().__init__(**kwargs)
