"""The `transformers` face of the reference model: MarinHFForCausalLM, with a KV cache for generate().

`marinlm export` writes this file into the export folder below the reference model's own source
(marinlm/hf/remote_code.py assembles it, dropping the marinlm imports), so the folder loads with
`trust_remote_code=True` where marinlm is not installed. Imported from the package it wraps the
same classes, which is how the tests check it.

HF conventions met here: `labels` are the inputs (the model shifts them), `attention_mask` marks
left padding with 0, and `cache` carries decoding state between generate() steps.
"""

from __future__ import annotations

import torch
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from marinlm.config.typed import from_dict
from marinlm.hf.configuration_marin import MarinHFConfig
from marinlm.model.config import MarinConfig
from marinlm.model.transformer import MarinForCausalLM


class MarinCache:
    """Decoding state for generate(): each layer's LayerCache, and each row's next position.

    Not a `transformers.Cache`: our caches also hold SConv states and per-token document ids, which
    a key/value cache has no place for. generate() only hands it back to forward()."""

    is_compileable = False

    def __init__(self, layers: list, next_pos_B1: torch.Tensor):
        self.layers, self.next_pos_B1, self.seen = layers, next_pos_B1, 0

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    def reorder_cache(self, rows: torch.Tensor) -> None:
        """Keep (and repeat) the given batch rows: beam search."""
        self.layers = [layer.select(rows) for layer in self.layers]
        self.next_pos_B1 = self.next_pos_B1[rows]


def _doc_and_positions(mask_BT: torch.Tensor):
    """Padding is document 0 and real tokens document 1; positions count real tokens only."""
    T = mask_BT.shape[1]
    doc_BT = mask_BT.long()
    pos_BT = torch.where(mask_BT.bool(), doc_BT.cumsum(1) - 1, torch.arange(T, device=mask_BT.device))
    return doc_BT, pos_BT


class MarinHFForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = MarinHFConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _no_split_modules = ["Block"]
    _tied_weights_keys = {"model.lm_head.weight": "model.embed.weight"}

    def __init__(self, config: MarinHFConfig):
        super().__init__(config)
        self.model = MarinForCausalLM(from_dict(MarinConfig, config.marin))
        self.post_init()

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # forward() makes its own MarinCache

    def _init_weights(self, module) -> None:
        # Weights come from the checkpoint; a fresh model takes the reference initialisation.
        if module is self:
            self.model.init_weights()

    def get_input_embeddings(self):
        return self.model.embed

    def set_input_embeddings(self, value) -> None:
        self.model.embed = value

    def get_output_embeddings(self):
        return self.model.lm_head

    def set_output_embeddings(self, value) -> None:
        self.model.lm_head = value

    def prepare_inputs_for_generation(self, input_ids, cache=None, attention_mask=None, **kwargs):
        if cache is not None:
            input_ids = input_ids[:, cache.seen :]  # only the tokens the cache has not seen
        return {"input_ids": input_ids, "attention_mask": attention_mask, "cache": cache, "use_cache": True}

    def forward(
        self,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        cache: MarinCache | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int = 0,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        B, T = input_ids.shape
        if attention_mask is not None and bool(attention_mask.all()):
            attention_mask = None  # no padding: the plain causal path
        if use_cache and not isinstance(cache, MarinCache):
            zero = torch.zeros(B, 1, dtype=torch.long, device=input_ids.device)
            cache = MarinCache(self.model.empty_caches(B), zero)
        doc_BT = pos_BT = None
        if cache is not None:
            if cache.seen == 0:
                mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask[:, -T:]
                doc_BT, pos_BT = _doc_and_positions(mask)
                cache.next_pos_B1 = mask.long().sum(1, keepdim=True)
            else:
                doc_BT = torch.ones_like(input_ids)
                pos_BT = cache.next_pos_B1 + torch.arange(T, device=input_ids.device)
                cache.next_pos_B1 = cache.next_pos_B1 + T
            cache.seen += T
        elif attention_mask is not None:
            doc_BT, pos_BT = _doc_and_positions(attention_mask)
        out = self.model(
            input_ids,
            caches=None if cache is None else cache.layers,
            doc_ids=doc_BT,
            positions=pos_BT,
            logits_to_keep=logits_to_keep,
        )
        loss = None
        if labels is not None:
            shifted = torch.full_like(labels, -100)
            shifted[:, :-1] = labels[:, 1:]
            logits = out.logits.float().reshape(B * T, -1)
            loss = torch.nn.functional.cross_entropy(logits, shifted.reshape(-1), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=out.logits, cache=cache)
