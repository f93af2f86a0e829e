"""Which weights fine-tuning trains: LoRA (peft for linear layers, a grouped LoRA of our own for the
routed experts, finetune/grouped_lora.py), QLoRA (bitsandbytes NF4 base, finetune/nf4.py for the
experts) and partial unfreezing; merging and saving adapters."""

from __future__ import annotations

import fnmatch
from pathlib import Path

import torch
from torch import nn

from marinlm.finetune.config import FinetuneConfig
from marinlm.finetune.grouped_lora import EXPERT_PROJECTIONS, GroupedLoraExperts
from marinlm.finetune.nf4 import quantize_experts, restore_experts
from marinlm.model.experts import RoutedExperts
from marinlm.model.router import Router

VOCAB_ROWS = ("embed.weight", "lm_head.weight")  # [vocab_size, d_model]


def matches(name: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def lora_targets(model: nn.Module, config: FinetuneConfig) -> list[str]:
    """Names of the nn.Linear modules the LoRA config adapts."""
    patterns = list(config.lora.target_modules) + (["lm_head"] if config.lora.lm_head else [])
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and matches(n, patterns)]
    if not names and not config.lora.experts:
        raise ValueError(f"lora.target_modules: {patterns} match no linear layer of the model")
    return names


def quantize_base(model: nn.Module, skip: tuple[str, ...] = ("lm_head",)) -> int:
    """QLoRA: every frozen nn.Linear (not the LM head) becomes bitsandbytes NF4 with bf16 compute.
    The routed experts become bf16 here, so that their adapters are bf16 like the linears'; they are
    packed into NF4 once those adapters exist (finetune/nf4.py)."""
    import bitsandbytes as bnb

    count = 0
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if type(child) is not nn.Linear or full in skip:
                continue
            q = bnb.nn.Linear4bit(
                child.in_features, child.out_features, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4"
            )
            q.weight = bnb.nn.Params4bit(child.weight.data.to(torch.bfloat16), requires_grad=False, quant_type="nf4")
            q = q.to(child.weight.device)  # quantises on the move
            # In eval mode on AVX512-BF16 CPUs bitsandbytes repacks the weight in place for its CPU
            # kernel, which needs out_features % 32 == 0 (not the head gate's) and changes the
            # tensors a checkpoint or merge reads; the plain dequantise-and-matmul path is kept.
            q.support_avx512bf16_for_cpu = False
            setattr(module, child_name, q)
            count += 1
    for name, p in model.named_parameters():
        if "experts." in name and p.ndim == 3:
            p.data = p.data.to(torch.bfloat16)
    return count


def freeze_patterns(config: FinetuneConfig) -> list[str]:
    """The parameter-name globs that `method: freeze` trains."""
    n, last = config.model.num_layers, config.freeze.last_layers
    keep = [f"layers.{i}.*" for i in range(n - last, n)] + ["final_norm.*", "lm_head.*"] if last else []
    return keep + list(config.freeze.patterns)


def trains_whole(name: str, ndim: int, config: FinetuneConfig) -> bool:
    """Whether LoRA trains parameter `name` whole, beside the adapters: a router's, a norm's gain or
    the vocabulary rows (new tokens' among them), as `lora.train_router/train_norms/train_embeddings` ask."""
    lora = config.lora
    return bool(
        lora.train_router
        and ".router." in name
        or lora.train_norms
        and "norm" in name
        and ndim == 1
        or lora.train_embeddings
        and name in VOCAB_ROWS
    )


def apply_method(model: nn.Module, config: FinetuneConfig) -> dict:
    """Freeze, adapt or quantise `model` in place for `config.method`; returns what was done."""
    method = config.method
    info: dict = {"method": method}
    if method == "full":
        return info
    for p in model.parameters():
        p.requires_grad_(False)
    if method == "freeze":
        keep = freeze_patterns(config)
        trained = [n for n, p in model.named_parameters() if matches(n, keep)]
        if not trained:
            raise ValueError(f"freeze: {keep} match no parameter of the model")
        for n, p in model.named_parameters():
            p.requires_grad_(n in trained)
        info["trained"] = trained
        return info
    lora = config.lora
    info["lora"] = {"r": lora.r, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout}
    targets = lora_targets(model, config)
    if method == "qlora":
        info["quantized_linears"] = quantize_base(model, skip=tuple(n for n in ("lm_head",) if not lora.lm_head))
    if targets:
        from peft import LoraConfig, inject_adapter_in_model

        peft_config = LoraConfig(
            r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=targets, bias="none"
        )
        inject_adapter_in_model(peft_config, model)
        info["peft_config"] = peft_config
    if lora.experts:
        for module in model.modules():
            if isinstance(module, RoutedExperts):
                module.__class__ = GroupedLoraExperts
                module.add_lora(lora.r, lora.alpha, lora.dropout)
    if method == "qlora":
        info["quantized_experts"] = quantize_experts(model)
    info["lora_targets"] = targets
    for n, p in model.named_parameters():
        if "lora_" in n or trains_whole(n, p.ndim, config):
            p.requires_grad_(True)
    return info


def freeze_router_biases(model: nn.Module) -> None:
    """Routers frozen: their load-balancing bias stays as the base model left it. Set on each router,
    so that it holds in every copy of a layer (a pipeline stage updates its own routers)."""
    routers = [m for m in model.modules() if isinstance(m, Router)]
    if not any(r.weight.requires_grad for r in routers):
        for router in routers:
            router.update_bias = lambda stats: None


@torch.no_grad()
def merge_adapters(model: nn.Module, fold: bool = True) -> int:
    """Fold every LoRA adapter into its base weight, leaving the plain model; returns how many.
    `fold=False` drops the adapters instead: the base they were trained on (a 4-bit base
    dequantised), which an exported peft adapter applies to."""
    from peft.tuners.lora import LoraLayer

    restore_experts(model)
    merged = 0
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, LoraLayer):
                setattr(module, child_name, _merged_linear(child, fold))
                merged += 1
    for module in model.modules():
        if isinstance(module, GroupedLoraExperts):
            module.merge(fold)
            merged += 1
    return merged


def _merged_linear(layer, fold: bool = True) -> nn.Linear:
    """W + scale * B A as a plain fp32 nn.Linear; a 4-bit base is dequantised first (peft's own merge
    would quantise the sum again, and the merged model would not compute what the adapter did)."""
    base = layer.get_base_layer()
    weight = base.weight
    if type(weight).__name__ == "Params4bit":
        import bitsandbytes.functional as bnbF

        weight = bnbF.dequantize_4bit(weight.data, weight.quant_state)
    out = nn.Linear(base.in_features, base.out_features, bias=False, device=weight.device)
    out.weight.data = weight.float().contiguous()
    if fold:  # B A in fp32: peft's get_delta_weight rounds it to a QLoRA adapter's bf16
        for name in (a for a in layer.active_adapters if a in layer.lora_A):
            a, b = layer.lora_A[name].weight.float(), layer.lora_B[name].weight.float()
            out.weight.data += layer.scaling[name] * (b @ a)
    return out


@torch.no_grad()
def dequantize_base(model: nn.Module) -> int:
    """Every remaining 4-bit linear layer as a plain fp32 nn.Linear holding its dequantised weight
    (what QLoRA training computed with), and NF4 experts as bf16 stacks; returns how many."""
    count = restore_experts(model)
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if type(getattr(child, "weight", None)).__name__ == "Params4bit":
                import bitsandbytes.functional as bnbF

                out = nn.Linear(child.in_features, child.out_features, bias=False, device=child.weight.device)
                out.weight.data = bnbF.dequantize_4bit(child.weight.data, child.weight.quant_state).float()
                setattr(module, child_name, out)
                count += 1
    return count


def _whole(p: torch.Tensor) -> torch.Tensor:
    """A parameter as one CPU tensor; a DTensor shard is gathered (a collective: every rank calls)."""
    p = p.detach()
    return (p.full_tensor() if hasattr(p, "full_tensor") else p).cpu()


def whole_trained_modules(model: nn.Module) -> list[str]:
    """The modules that train whole beside the LoRA factors (lora.train_router, train_norms,
    train_embeddings)."""
    names = {n.rpartition(".")[0] for n, p in model.named_parameters() if p.requires_grad and "lora_" not in n}
    return sorted(names)


def peft_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter tensors as peft names and lays them out: linear layers as
    `base_model.model.<module>.lora_A.weight`; each experts stack as the ParamWrappers that peft's
    `target_parameters=["experts.gate_proj", "experts.up_proj", "experts.down_proj"]` nests (gate
    innermost), A [E*r, in] and B [out, r*E], so peft loads our grouped adapters as its own. Modules
    trained whole (routers, norms, embeddings) go as `base_model.model.<module>.<name>`, their buffers too: peft's
    layout of `modules_to_save`."""
    out = {}
    for name, p in model.named_parameters():
        if ".lora_A.default." in name or ".lora_B.default." in name:
            key = name.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.")
            out[f"base_model.model.{key}"] = _whole(p).contiguous()
    modules = dict(model.named_modules())
    for name in whole_trained_modules(model):  # with their buffers (a router's bias), as peft saves them
        for key, tensor in modules[name].state_dict().items():
            out[f"base_model.model.{name}.{key}"] = _whole(tensor).clone()  # a copy: export restores the base
    for name, module in model.named_modules():
        if not isinstance(module, GroupedLoraExperts):
            continue
        for depth, proj in zip((2, 1, 0), EXPERT_PROJECTIONS):
            a, b = _whole(getattr(module, f"lora_A_{proj}")), _whole(getattr(module, f"lora_B_{proj}"))
            E, d_in, r = a.shape
            prefix = f"base_model.model.{name}." + "base_layer." * depth
            out[prefix + "lora_A.weight"] = a.permute(0, 2, 1).reshape(E * r, d_in).contiguous()
            out[prefix + "lora_B.weight"] = b.permute(2, 1, 0).reshape(b.shape[2], r * E).contiguous()
    return out


def load_peft_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """The inverse of `peft_state`, into a model adapted by `apply_method`."""
    params = dict(model.named_parameters()) | dict(model.named_buffers())
    for name, module in model.named_modules():
        if not isinstance(module, GroupedLoraExperts):
            continue
        for depth, proj in zip((2, 1, 0), EXPERT_PROJECTIONS):
            prefix = f"base_model.model.{name}." + "base_layer." * depth
            a, b = getattr(module, f"lora_A_{proj}"), getattr(module, f"lora_B_{proj}")
            E, d_in, r = a.shape
            with torch.no_grad():
                a.copy_(state.pop(prefix + "lora_A.weight").view(E, r, d_in).permute(0, 2, 1))
                b.copy_(state.pop(prefix + "lora_B.weight").view(b.shape[2], r, E).permute(2, 1, 0))
    for key, tensor in state.items():
        name = key.removeprefix("base_model.model.").replace(".lora_A.", ".lora_A.default.")
        name = name.replace(".lora_B.", ".lora_B.default.")
        with torch.no_grad():
            params[name].copy_(tensor)


class ExpertsBox(nn.Module):
    """One experts module as a model of its own: forward(x, experts, weights) -> y."""

    def __init__(self, experts: RoutedExperts):
        super().__init__()
        self.experts = experts

    def forward(self, x, experts_NK, weights_NK):
        return self.experts(x, experts_NK, weights_NK)[0]


def peft_twin(box: ExpertsBox) -> nn.Module:
    """The same base experts under peft's `target_parameters` LoRA, holding our grouped adapters'
    values (the `peft_state` layout): the peer that tests and bench/expert_lora.py compare with."""
    import copy

    from peft import LoraConfig, get_peft_model

    grouped = box.experts
    base = copy.deepcopy(grouped)
    for proj in EXPERT_PROJECTIONS:
        delattr(base, f"lora_A_{proj}")
        delattr(base, f"lora_B_{proj}")
    base.__class__ = RoutedExperts
    config = LoraConfig(
        r=grouped.lora_r,
        lora_alpha=grouped.lora_scale * grouped.lora_r,
        target_parameters=[f"experts.{p}" for p in EXPERT_PROJECTIONS],
    )
    twin = get_peft_model(ExpertsBox(base), config)
    ours = peft_state(box)
    with torch.no_grad():
        for name, p in twin.named_parameters():
            if "lora_" in name:
                p.copy_(ours[name.replace(".default", "")])
    return twin


def modules_to_save(state: dict[str, torch.Tensor]) -> list[str]:
    """The modules whose trained tensors `state` holds whole (not as LoRA factors), by full name: peft
    matches `modules_to_save` against the ends of module names, so a full name picks one module."""
    whole = [key.removeprefix("base_model.model.") for key in state if ".lora_" not in key]
    return sorted({key.rpartition(".")[0] for key in whole})


def save_peft_adapter(
    state: dict[str, torch.Tensor], info: dict, folder: Path, base: str, target_modules: list[str] | None = None
) -> None:
    """adapter_config.json + adapter_model.safetensors, as peft's save_pretrained writes them.
    `target_modules`: the adapted linear layers' full names in the model the adapter is for."""
    import json

    from peft import LoraConfig
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    # Without adapted linear layers (experts only) there is no peft config: r and alpha still count.
    config = info.get("peft_config") or LoraConfig(**info["lora"])
    data = {k: (sorted(v) if isinstance(v, set) else v) for k, v in config.to_dict().items()}
    data["base_model_name_or_path"] = base
    if target_modules is not None:
        data["target_modules"] = sorted(target_modules) or None
    if any(".experts." in k and ".lora_A." in k for k in state):
        data["target_parameters"] = [f"experts.{p}" for p in EXPERT_PROJECTIONS]
    data["modules_to_save"] = modules_to_save(state) or None
    (folder / "adapter_config.json").write_text(json.dumps(data, indent=2, default=str) + "\n")
    save_file(state, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
