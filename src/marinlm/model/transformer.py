"""MarinForCausalLM: the Marin 535B-A23B block stack, configurable down to a CPU toy.

Shape legend: B batch, T sequence, D d_model, V vocabulary.

    x0  = GatedNorm(RMSNorm(embed(tokens)))                 # embed_norm, gated_norm_rank > 0
    per layer:
      a = GatedNorm(RMSNorm(x));  x = x + SConv_attn(Attention(a))
      m = GatedNorm(RMSNorm(x));  x = x + SConv_mlp(MoE(m) or DenseFFN(m))
    logits = LMHead(GatedNorm(RMSNorm(x)))

The model holds no parallelism and no collectives; `marinlm.parallel` shards it. Build it on the
`meta` device, move it with `to_empty()`, then call `init_weights()` once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from marinlm.model.attention import Attention, LayerCache
from marinlm.model.config import MarinConfig
from marinlm.model.context import ForwardContext
from marinlm.model.layers import GatedNorm, RMSNorm, SConv, SwiGLU, doc_ids_and_positions, trunc_normal_
from marinlm.model.loss import NextTokenLoss, reference_loss
from marinlm.model.moe import MoE
from marinlm.model.router import RouterStats


def _norm(config: MarinConfig) -> nn.Module:
    """RMSNorm, followed by GatedNorm when the config enables it."""
    rms = RMSNorm(config.d_model, config.norm_eps)
    if config.gated_norm_rank == 0:
        return rms
    return nn.Sequential(rms, GatedNorm(config.d_model, config.gated_norm_rank, config.init_std))


class Block(nn.Module):
    def __init__(self, config: MarinConfig, layer: int):
        super().__init__()
        sites, kernel = config.sconv.sites, config.sconv.kernel_size
        self.is_global = config.is_global_layer(layer)
        self.attn_norm = _norm(config)
        self.attn = Attention(
            config.attention,
            config.d_model,
            is_global=self.is_global,
            sconv_sites=sites,
            sconv_kernel=kernel,
            init_std=config.init_std,
        )
        self.sconv_attn = SConv(config.d_model, kernel) if "attn" in sites else None
        self.mlp_norm = _norm(config)
        if config.is_moe_layer(layer):
            self.mlp = MoE(config.moe, config.d_model, config.norm_eps, config.init_std)
        else:
            self.mlp = SwiGLU(config.d_model, config.moe.dense_ffn_dim, config.init_std)
        self.sconv_mlp = SConv(config.d_model, kernel) if "mlp" in sites else None

    def forward(self, x_BTD, ctx: ForwardContext, cache: LayerCache | None = None):
        h_BTD = self.attn(self.attn_norm(x_BTD), ctx, cache)
        if self.sconv_attn is not None:
            h_BTD, state = self.sconv_attn(h_BTD, ctx, None if cache is None else cache.conv_attn)
            if cache is not None:
                cache.conv_attn = state
        x_BTD = x_BTD + h_BTD
        m_BTD = self.mlp_norm(x_BTD)
        routing = None
        if isinstance(self.mlp, MoE):
            h_BTD, routing = self.mlp(m_BTD)
        else:
            h_BTD = self.mlp(m_BTD)
        if self.sconv_mlp is not None:
            h_BTD, state = self.sconv_mlp(h_BTD, ctx, None if cache is None else cache.conv_mlp)
            if cache is not None:
                cache.conv_mlp = state
        return x_BTD + h_BTD, routing

    def empty_cache(self, batch: int, device, dtype) -> LayerCache:
        cache = self.attn.empty_cache(batch, device, dtype)
        if self.sconv_attn is not None:
            cache.conv_attn = self.sconv_attn.empty_state(batch, device, dtype)
        if self.sconv_mlp is not None:
            cache.conv_mlp = self.sconv_mlp.empty_state(batch, device, dtype)
        return cache


def named_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(index, block) of `model.layers`: a ModuleList, or the ModuleDict a pipeline stage keeps
    (`marinlm.parallel.pipeline_parallel`), whose keys are the layers' indices in the whole model."""
    if isinstance(model.layers, nn.ModuleDict):
        return list(model.layers.items())
    return [(str(i), block) for i, block in enumerate(model.layers)]


@dataclass
class CausalLMOutput:
    """`loss` = lm_loss + aux_loss, with lm_loss = ce_loss + z_loss, each a mean over tokens whose
    label is not ignored. On the fused kernel's training path (kernels/loss.py) only `lm_loss` and
    `loss` carry gradients; `ce_loss` and `z_loss` are values for logging."""

    logits: torch.Tensor | None
    loss: torch.Tensor | None = None
    lm_loss: torch.Tensor | None = None
    ce_loss: torch.Tensor | None = None
    z_loss: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None
    # Tokens that count towards the loss: a 0-dim tensor on the model's device, so that a training
    # step does not wait for the device to read it (`int()` it when the number is needed).
    num_tokens: torch.Tensor | int = 0
    # [B, T] cross-entropy of each token (0 where its label is ignored), for scoring: detached (no
    # gradient flows through it; a view that did would trip FSDP2's hooks). None on the fused loss
    # kernel's training path (kernels/loss.py), which never forms it.
    token_ce: torch.Tensor | None = None
    router_stats: list[RouterStats] = field(default_factory=list)  # one per MoE layer


class MarinForCausalLM(nn.Module):
    def __init__(self, config: MarinConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.embed_norm = _norm(config) if config.embed_norm else None
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.num_layers))
        self.final_norm = _norm(config)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.loss = NextTokenLoss(config.z_loss_weight)  # chunks: a run's kernels.loss_chunk_tokens
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Initialise every parameter and buffer, following the spec:

        - every matrix (embedding, projections, experts, router, GatedNorm, LM head): truncated
          normal N(0, init_std) cut at +-3 std;
        - RMSNorm gains (and Qwen-style QK-norm gains): 1;
        - head gate: 0, so g = 2*sigmoid(0) = 1;
        - SConv: identity (w[0] = 1, other taps 0);
        - router bias: 0.
        """
        if seed is not None:
            torch.manual_seed(seed)
        # A pipeline stage holds the embedding, the head, both or neither.
        if self.config.tie_embeddings and self.lm_head is not None and self.embed is not None:
            self.lm_head.weight = self.embed.weight  # to_empty() gives each module its own tensor; re-tie
        if self.embed is not None:
            trunc_normal_(self.embed.weight, self.config.init_std)
        if self.lm_head is not None and not self.config.tie_embeddings:
            trunc_normal_(self.lm_head.weight, self.config.init_std)
        for module in self.modules():
            if (
                module is not self
                and hasattr(module, "reset_parameters")
                and not isinstance(module, (nn.Linear, nn.Embedding))
            ):
                module.reset_parameters()

    def forward(
        self,
        input_ids: torch.Tensor,
        segment_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        *,
        return_logits: bool = True,
        logits_to_keep: int = 0,
        caches: list[LayerCache] | None = None,
        doc_ids: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> CausalLMOutput:
        """Run the model.

        Args:
            input_ids: [B, T] token ids.
            segment_ids: [B, T] packed-document ids; attention and SConv never cross a change of
                id, and positions restart at 0 in each document. None = one document per row.
            labels: [B, T] next-token targets aligned with `input_ids` (labels[t] is the token
                after position t), IGNORE_INDEX (-100) where no loss is taken.
            return_logits: set False to skip keeping the [B, T, V] logits. With labels, grad
                enabled and `self.loss.chunk_tokens > 0`, the LM head and loss then run in
                chunks, and the logits never exist as a whole (model/loss.py).
            logits_to_keep: without labels, compute the logits of the last N positions only
                (0 = all), as HF's `logits_to_keep`: a prefill that samples or scores the next
                token needs one position, not [B, T, V] (4,096 x 128k bf16 = 1 GB a row).
            caches, doc_ids, positions: incremental decoding state, used by `generate`.
        """
        B, T = input_ids.shape
        ctx = self.context(input_ids, segment_ids, caches, doc_ids, positions)
        x_BTD = self.embed(input_ids)
        if self.embed_norm is not None:
            x_BTD = self.embed_norm(x_BTD)
        stats, aux_losses = [], []
        for i, layer in enumerate(self.layers):
            x_BTD, routing = layer(x_BTD, ctx, None if caches is None else caches[i])
            if routing is not None:
                stats.append(routing.stats)
                if routing.aux_loss is not None:
                    aux_losses.append(routing.aux_loss)
        h_BTD = self.final_norm(x_BTD)
        out = CausalLMOutput(logits=None, router_stats=stats)
        if labels is not None and not return_logits and self.loss.chunk_tokens > 0:
            out.lm_loss, out.ce_loss, out.z_loss, count, token_ce = self.loss(
                h_BTD.reshape(B * T, -1), self.lm_head.weight, labels.reshape(-1)
            )
        else:
            if logits_to_keep:
                if labels is not None:
                    raise ValueError("logits_to_keep: the loss needs every position's logits; pass no labels")
                h_BTD = h_BTD[:, -logits_to_keep:]
            logits_BTV = self.lm_head(h_BTD)
            if return_logits:
                out.logits = logits_BTV
            if labels is None:
                return out
            out.ce_loss, out.z_loss, count, token_ce = reference_loss(
                logits_BTV.reshape(B * T, -1), labels.reshape(-1), self.config.z_loss_weight
            )
            out.lm_loss = out.ce_loss + out.z_loss
        out.aux_loss = torch.stack(aux_losses).mean() if aux_losses else torch.zeros((), device=out.lm_loss.device)
        out.loss, out.num_tokens = out.lm_loss + out.aux_loss, count
        out.token_ce = None if token_ce is None else token_ce.detach().view(B, T)
        return out

    def context(self, input_ids, segment_ids, caches, doc_ids, positions) -> ForwardContext:
        """The forward's document ids and positions: passed in (decoding), derived from
        `segment_ids` (packed rows), or one document a row."""
        B, T = input_ids.shape
        derived = doc_ids is None
        packed = segment_ids is not None or doc_ids is not None
        if doc_ids is None:
            if segment_ids is None:
                doc_ids = torch.zeros(B, T, dtype=torch.long, device=input_ids.device)
                positions = torch.arange(T, device=input_ids.device).expand(B, T)
            else:
                doc_ids, positions = doc_ids_and_positions(segment_ids)
        window = self.config.attention.sliding_window
        return ForwardContext(
            doc_ids, positions, packed=packed, decoding=caches is not None, derived=derived, window=window
        )

    @torch.no_grad()
    def update_router_biases(self, stats: list[RouterStats]) -> None:
        """Apply one optimizer step's reduced router statistics (one entry per MoE layer)."""
        routers = [m.router for m in self.modules() if isinstance(m, MoE)]  # layer order
        if len(stats) != len(routers):
            raise ValueError(f"expected router stats for {len(routers)} MoE layers, got {len(stats)}")
        for router, layer_stats in zip(routers, stats):
            router.update_bias(layer_stats)

    def empty_caches(self, batch: int) -> list[LayerCache]:
        p = self.lm_head.weight
        return [layer.empty_cache(batch, p.device, p.dtype) for layer in self.layers]
