"""`marinlm import`: a Hugging Face model folder as a marinlm run.

Accepted: a marinlm export (either format), Qwen3-MoE, and Mixtral (Qwen3-MoE's layout without
QK-norm). Refused, with the reason: OLMoE, whose QK-norm spans all heads at once ([H * Dh] gains)
where ours is per head, and every other family. The run gets one checkpoint, step 0, that
`train --checkpoint.init_from`, `generate`, `eval` and `export` accept, and the model's tokenizer.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import torch

from marinlm.config import from_dict, load_config
from marinlm.dataset.loader import DataConfig
from marinlm.hf import qwen3_moe
from marinlm.kernels.config import move_model_keys
from marinlm.model.config import MarinConfig, SoftmaxTopKRouterConfig
from marinlm.presets import preset
from marinlm.train.config import TrainConfig
from marinlm.train.run_folder import save_run
from marinlm.utils.io import read_utf8, refuse_overlap
from marinlm.utils.progress import progress_bar

REFUSED = {
    "olmoe": "OLMoE normalises q and k over all heads together (q_norm gains of size heads x head_dim); "
    "marinlm's QK-norm is per head, so the logits would differ",
    "deepseek_v3": "DeepSeek-V3 adds the router bias to the sigmoid scores, Marin to the logits, and uses MLA "
    "attention, which marinlm does not implement",
}


def _rope_theta(hf: dict, key: str) -> float:
    rope = hf.get("rope_parameters") or {}
    if hf.get("rope_scaling") or rope.get("rope_type", "default") != "default":
        raise ValueError(f"{key}: rope scaling {rope or hf.get('rope_scaling')} has no marinlm equivalent")
    return float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))


def marin_config_from_hf(hf: dict, where: str) -> MarinConfig:
    """The MarinConfig of a Qwen3-MoE or Mixtral config.json (a dict), or a ValueError naming the key."""
    kind = hf.get("model_type")
    if kind not in ("qwen3_moe", "mixtral"):
        raise ValueError(f"{where}: model_type {kind!r} is not supported ({REFUSED.get(kind, 'no mapping')})")

    def refuse(key, ok):
        if not ok:
            raise ValueError(f"{where}: {key}={hf.get(key)!r} has no marinlm equivalent")

    refuse("hidden_act", hf.get("hidden_act", "silu") == "silu")
    refuse("attention_bias", not hf.get("attention_bias", False))
    refuse("use_sliding_window", not hf.get("use_sliding_window", False))
    refuse("sliding_window", kind == "qwen3_moe" or hf.get("sliding_window") is None)
    refuse("decoder_sparse_step", hf.get("decoder_sparse_step", 1) == 1)
    refuse("mlp_only_layers", not hf.get("mlp_only_layers"))
    refuse("router_jitter_noise", not hf.get("router_jitter_noise"))
    base = load_config(MarinConfig, preset("model", "qwen3-moe-style"))
    heads = hf["num_attention_heads"]
    attention = replace(
        base.attention,
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        rope_theta=_rope_theta(hf, where),
        qk_norm=kind == "qwen3_moe",
        qk_norm_gain=kind == "qwen3_moe",
        # A marinlm export of an adjacent-pairs model: its q/k weights were permuted to split-half
        rope_pairs=hf.get("marinlm_rope_pairs", "half"),
    )
    experts = hf.get("num_local_experts") or hf.get("num_experts")
    router = SoftmaxTopKRouterConfig(
        normalize_topk=bool(hf.get("norm_topk_prob", kind == "mixtral")),
        aux_loss_weight=float(hf.get("router_aux_loss_coef", 0.0)),
    )
    width = hf.get("moe_intermediate_size") or hf["intermediate_size"]
    moe = replace(base.moe, num_experts=experts, top_k=hf["num_experts_per_tok"], expert_dim=width, router=router)
    return replace(
        base,
        vocab_size=hf["vocab_size"],
        d_model=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        max_seq_len=hf.get("max_position_embeddings", base.max_seq_len),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        init_std=float(hf.get("initializer_range", 0.02)),
        attention=attention,
        moe=moe,
    )


INDEX = "model.safetensors.index.json"


def weight_files(folder: Path) -> list[Path]:
    """The weight files transformers would load from `folder`: those its index names, else
    model.safetensors. Other .safetensors files (an older export left beside it) are not read."""
    index = folder / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(read_utf8(index))["weight_map"]
            names = sorted(set(weight_map.values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{index}: not a safetensors index (a weight_map of tensor -> file): {e}") from None
        bad = [n for n in names if not isinstance(n, str) or Path(n).name != n]
        if bad:
            raise ValueError(f"{index}: weight_map names {bad[0]!r}, not a file in {folder}")
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise FileNotFoundError(f"{index}: names {missing[0]}, which is not in {folder}")
        return [folder / n for n in names]
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    others = sorted(p.name for p in folder.glob("*.safetensors"))
    if others:
        raise FileNotFoundError(
            f"{folder}: no model.safetensors and no {INDEX} saying which of {', '.join(others[:4])} hold the model"
        )
    raise FileNotFoundError(f"{folder}: no .safetensors weights (pytorch_model.bin is not read: it is a pickle)")


def read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the model in `folder` (`weight_files`); each file checked as it is read, and
    against its index: every tensor the index names, in the file it names, and no tensor twice."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    files = weight_files(folder)
    index = folder / INDEX
    weight_map = json.loads(read_utf8(index))["weight_map"] if index.is_file() else None
    state: dict[str, torch.Tensor] = {}
    size = sum(f.stat().st_size for f in files)
    with progress_bar(total=size, desc="import: weights", unit="B", unit_scale=True, quiet_start=True) as bar:
        for file in files:
            try:
                tensors = load_file(str(file))
            except (SafetensorError, OSError, ValueError) as e:
                raise ValueError(f"{file}: not a readable safetensors file ({e}); truncated or corrupt?") from None
            twice = sorted(set(tensors) & set(state))
            if twice:
                raise ValueError(f"{file}: holds {twice[0]} again, which another weight file already holds")
            if weight_map is not None:
                stray = sorted(n for n in tensors if weight_map.get(n) != file.name)
                if stray:
                    raise ValueError(f"{file}: holds {stray[0]}, which {index} places in {weight_map.get(stray[0])}")
            state.update(tensors)
            bar.update(file.stat().st_size)
    if weight_map is not None:
        absent = sorted(set(weight_map) - set(state))
        if absent:
            raise ValueError(f"{folder / weight_map[absent[0]]}: lacks {absent[0]}, which {index} places there")
    return state


def import_hf(hf_dir: str | Path, run_dir: str | Path, *, overwrite: bool = False) -> Path:
    """Write run `run_dir` from HF folder `hf_dir`; returns its checkpoint folder."""
    from marinlm.tokenizer import MarinTokenizer

    hf_dir, run_dir = Path(hf_dir), Path(run_dir)
    refuse_overlap(run_dir, {"the model folder": hf_dir}, "the run folder")
    config_path = hf_dir / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{hf_dir}: no config.json; not a Hugging Face model folder")
    try:
        hf = json.loads(read_utf8(config_path))
    except json.JSONDecodeError as e:
        raise ValueError(f"{config_path}: not valid JSON ({e})") from None
    if not isinstance(hf, dict):
        raise ValueError(f"{config_path}: not a model config (a JSON object)")
    if (run_dir / "checkpoints").exists() and not overwrite:
        raise ValueError(f"{run_dir}: already holds a run; pass --overwrite to replace it")
    state = read_safetensors(hf_dir)
    if hf.get("model_type") == "marin":
        # exports before kernels: left the model kept its keys (kernels/config.py); a run takes its own
        model = from_dict(MarinConfig, move_model_keys({"model": hf["marin"]})["model"])
        ours = {k.removeprefix("model."): v for k, v in state.items()}
        if model.tie_embeddings:
            ours["lm_head.weight"] = ours["embed.weight"]
    else:
        model = marin_config_from_hf(hf, str(config_path))
        ours = qwen3_moe.from_hf_state_dict(state, model)
    tokenizer = MarinTokenizer.load(hf_dir)
    tok_path = hf_dir / "tokenizer_config.json"
    tok_config = json.loads(tok_path.read_text()) if tok_path.is_file() else {}
    add_bos = tok_config.get("marinlm_data_add_bos")
    if add_bos is not None:  # a marinlm export: its post-processor was added on export (marinlm never applies one)
        tokenizer.backend.post_processor = None
    if tokenizer.vocab_size > model.vocab_size:
        raise ValueError(f"{hf_dir}: the tokenizer has {tokenizer.vocab_size} tokens, the model {model.vocab_size}")
    data = DataConfig()
    data = replace(data, seq_len=min(data.seq_len, model.max_seq_len), add_bos=add_bos is not False)
    train = TrainConfig(model=model, data=data, run_dir=str(run_dir))
    _check_tensors(ours, model, hf_dir)

    if overwrite:
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    return save_run(run_dir, train, ours, tokenizer, {"imported_from": str(hf_dir.resolve())})


def _check_tensors(ours: dict[str, torch.Tensor], model: MarinConfig, where: Path) -> None:
    """Every tensor of the model, with its shape: a wrong config would otherwise import in silence."""
    from marinlm.model.transformer import MarinForCausalLM

    with torch.device("meta"):
        expected = MarinForCausalLM(model).state_dict()
    missing = sorted(set(expected) - set(ours))
    extra = sorted(set(ours) - set(expected))
    if missing or extra:
        raise ValueError(f"{where}: tensors do not match the config: missing {missing[:3]}, unexpected {extra[:3]}")
    for name, tensor in expected.items():
        if tuple(ours[name].shape) != tuple(tensor.shape):
            raise ValueError(f"{where}: {name} is {list(ours[name].shape)}, the config needs {list(tensor.shape)}")
