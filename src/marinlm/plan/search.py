"""`marinlm plan --search`: other layouts of the same config on the same cluster, ranked.

Candidates: pipeline degrees 1-8, tensor parallel within an NVLink domain, expert groups of powers
of two within an NVLink domain, FSDP over the largest group that stays in a domain, the other ranks
data-parallel replicas; full activation checkpointing, with and without optimizer offload. Each is
first planned from shards computed by rule (`rule_shards`, no process group: fast), and the fastest
that fit are planned again from the real parallelize() under the fake process group.
"""

from __future__ import annotations

import dataclasses
import math
import re

from marinlm.config import ConfigError
from marinlm.parallel.mesh import ParallelDims
from marinlm.plan.estimate import plan_layout
from marinlm.utils.progress import progress_bar

# Which dim tensor and expert parallelism split, by parameter name (as parallel/ applies them).
TP_SPLITS = (
    (r"^(embed|lm_head)\.weight$|attn\.[qkv]_proj\.weight$|attn\.gate\.weight$", 0),
    (r"attn\.o_proj\.weight$|attn\.sconv_[kv]\.weight$|shared\.\d+\.down_proj\.weight$|experts\.down_proj$", 1),
    (r"shared\.\d+\.(gate|up)_proj\.weight$|mlp\.(gate|up)_proj\.weight$", 0),
    (r"mlp\.down_proj\.weight$", 1),
    (r"experts\.(gate|up)_proj$", 2),
)


def rule_shards(model_config, parallel, world, rank, rows, seq_len) -> dict[str, dict]:
    """`plan.shards.local_shards` by rule, without building meshes: tensor-parallel splits, experts
    over ep, FSDP2's dim-0 chunks over the data axes, the pipeline stage's layers only."""
    import torch

    from marinlm.model.transformer import MarinForCausalLM

    dims = ParallelDims.resolve(parallel, world)
    dims.check_model(model_config, seq_len)
    with torch.device("meta"):
        model = MarinForCausalLM(model_config)
    keep = None
    if dims.pp > 1:
        from marinlm.parallel.pipeline_parallel import pipeline_layout, stage_ids

        layout = pipeline_layout(model_config, parallel, dims.pp, rows, seq_len)
        stages = stage_ids(rank // (world // dims.pp), dims.pp, layout.schedule, layout.per_rank)
        last = dims.pp * layout.per_rank - 1
        keep = set()
        for s in stages:
            keep |= {f"layers.{i}." for i in layout.stages[s]}
            keep |= {"embed.", "embed_norm."} if s == 0 else set()
            keep |= {"final_norm.", "lm_head."} if s == last else set()
    shards = {}
    for name, p in model.named_parameters():
        if keep is not None and not any(name.startswith(prefix) for prefix in keep):
            continue
        shape = list(p.shape)
        experts = ".experts." in name
        # With expert parallelism the MoE layers run on each tp rank's own tokens, unsplit by tp.
        moe_on_shard = dims.ep > 1 and ".mlp." in name and model_config.is_moe_layer(int(name.split(".")[1]))
        if dims.tp > 1 and not moe_on_shard:
            for pattern, dim in TP_SPLITS:
                if re.search(pattern, name):
                    shape[dim] //= dims.tp
                    break
        if experts and dims.ep > 1:
            shape[0] //= dims.ep
        unsharded = math.prod(shape)
        shape[0] = math.ceil(shape[0] / (dims.efsdp if experts and dims.ep > 1 else dims.dp_shard * dims.cp))
        shards[name] = {"shape": tuple(shape), "full": tuple(p.shape), "unsharded": unsharded}
    return shards


def candidates(model_config, gpus: int, hardware) -> list[dict]:
    domain = hardware.gpus_per_nvlink_domain
    experts = model_config.moe.num_experts
    found = []
    for pp in (1, 2, 4, 8):
        for tp in (1, 2, 4, 8):
            if gpus % (pp * tp) or pp > model_config.num_layers or tp > domain:
                continue
            rest = gpus // (pp * tp)
            shard = max(d for d in range(1, rest + 1) if rest % d == 0 and d * tp <= domain)
            eps = [1] + [e for e in (8, 16, 32, 64, 128) if experts % e == 0 and e <= domain]
            for ep in eps:
                if (shard * tp) % ep:
                    continue
                for offload in ("optimizer", "none"):
                    found.append(
                        {
                            "data_parallel_replicate": rest // shard,
                            "data_parallel_shard": shard,
                            "tensor_parallel": tp,
                            "expert_parallel": ep,
                            "pipeline_parallel": pp,
                            "offload": offload,
                            "activation_checkpointing": "full",
                        }
                    )
    return found


def search_layouts(train, gpus: int, hardware, efficiency, chosen, top: int = 3, routing=None) -> list:
    """The `top` fastest layouts that fit, planned from the real parallelize(), fastest first
    (`routing`: a routing histogram, plan/routing.py). A candidate that does not fit is planned
    again with its checkpointed blocks' inputs on the host (`offload_activations`)."""
    from marinlm.plan.activations import inventory
    from marinlm.plan.estimate import plan_layout as plan

    precision = "bf16" if train.train.precision in ("bf16", "auto") else train.train.precision
    inv = inventory(train.model, precision, train.kernels, kernels_device="cuda" if hardware.name != "cpu" else "cpu")
    quick = []
    layouts = list(candidates(train.model, gpus, hardware))
    for layout in progress_bar(iterable=layouts, desc="plan: search", unit="layout"):
        parallel = dataclasses.replace(train.parallel, **layout)
        try:
            # A quick pass: no gloo group timed for each candidate (`--hardware cpu`); the best are.
            how = dict(shards_of=rule_shards, inv=inv, gloo_group=False, routing=routing)
            estimate = plan(train, parallel, gpus, hardware, efficiency, **how)
            if not estimate.fits and parallel.activation_checkpointing != "none" and not parallel.offload_activations:
                parallel = dataclasses.replace(parallel, offload_activations=True)
                estimate = plan(train, parallel, gpus, hardware, efficiency, **how)
        except (ConfigError, ValueError):
            continue  # a degree that does not divide the model, the batch or the stages
        quick.append((estimate.step["total"] if estimate.fits and estimate.host_fits else math.inf, parallel))
    quick.sort(key=lambda item: item[0])
    best = [parallel for seconds, parallel in quick[:top] if seconds < math.inf]
    return [plan_layout(train, parallel, gpus, hardware, efficiency, inv=inv, routing=routing) for parallel in best]
