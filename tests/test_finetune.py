"""Fine-tuning: masks from the chat template, packing, LoRA (grouped experts against peft), QLoRA,
partial unfreezing, merging, and `marinlm finetune` end to end."""

from __future__ import annotations

import copy
import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from marinlm.config import from_dict, load_config, to_dict
from marinlm.finetune.adapters import (
    ExpertsBox,
    GroupedLoraExperts,
    apply_method,
    load_peft_state,
    merge_adapters,
    peft_state,
    peft_twin,
    save_peft_adapter,
)
from marinlm.finetune.config import FinetuneConfig
from marinlm.finetune.data import ChatRenderer, Examples, SFTDataError, pack, render_all
from marinlm.hf.export import MANIFEST, verify
from marinlm.model.experts import RoutedExperts
from marinlm.tokenizer import CHAT_TEMPLATE, MarinTokenizer, train_bpe
from marinlm.train.config import TrainConfig
from marinlm.train.run_folder import save_run

from conftest import CONFIGS, SAMPLE_TEXTS, build, randomize_identity_inits, shared_data, tiny_config, torchrun_command

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

TWO_TURNS = [
    {"role": "system", "content": "You add numbers."},
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "2 + 3 = 5."},
    {"role": "user", "content": "And 4 + 4?"},
    {"role": "assistant", "content": "It is 8."},
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    MarinTokenizer(train_bpe(SAMPLE_TEXTS * 20 + ["What is 2 + 3? It is 8. And 4 + 4?"] * 20, 450)).save(folder)
    return folder


@pytest.fixture(scope="module")
def tokenizer(tok_dir):
    return MarinTokenizer.load(tok_dir)


def sft_config(**overrides) -> FinetuneConfig:
    data = {"base": "unused", "sft": {"train_files": ["unused.jsonl"]}, "model": to_dict(tiny_config(num_layers=2))}
    for key, value in overrides.items():
        data[key] = value
    return from_dict(FinetuneConfig, data)


def test_the_loss_mask_is_transformers_assistant_mask_token_for_token(tok_dir, tokenizer):
    """Two assistant turns under the shipped template: the mask is HF's return_assistant_tokens_mask,
    the ids are those marinlm's own renderer encodes, the labels of a packed row follow the mask
    shifted by one, and the first answer token is a label (no off-by-one)."""
    shipped = (CONFIGS / "chat" / "marin.jinja").read_text().rstrip("\n")
    assert shipped == CHAT_TEMPLATE
    hf = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
    expected = hf.apply_chat_template(
        TWO_TURNS, chat_template=shipped, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    ids, mask = ChatRenderer(tok_dir, shipped, "marin.jinja").render(TWO_TURNS)
    assert ids == list(expected["input_ids"]) and mask == list(expected["assistant_masks"])
    assert ids == tokenizer.encode(tokenizer.apply_chat_template(TWO_TURNS), allow_special=True)
    # the masked tokens spell the two answers and their end-of-turn tokens, nothing else
    masked = tokenizer.decode([t for t, m in zip(ids, mask) if m])
    assert masked == "2 + 3 = 5.<|end|>It is 8.<|end|>"
    rows = pack(Examples([ids], [mask]), 128, tokenizer.pad_id)
    labels = rows["labels"][0, : len(ids) - 1].tolist()
    assert labels == [t if m else -100 for t, m in zip(ids[1:], mask[1:])]
    first = mask.index(1)
    assert labels[first - 1] == ids[first]  # predicted from the token before it


def test_a_template_without_generation_markers_is_refused_naming_it(tok_dir):
    plain = CHAT_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    with pytest.raises(SFTDataError, match=r"my.jinja: the chat template has no \{% generation %\} block"):
        ChatRenderer(tok_dir, plain, "my.jinja")


def test_examples_with_nothing_to_learn_are_skipped_and_mostly_empty_data_is_refused(tok_dir):
    # a template whose markers cover system turns only: examples without one train nothing
    plain = CHAT_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    wrong = plain.replace(
        "{% else %}{{ '<|' + message['role']",
        "{% elif message['role'] == 'system' %}{% generation %}{{ message['content'] }}{% endgeneration %}"
        "{% else %}{{ '<|' + message['role']",
    )
    renderer = ChatRenderer(tok_dir, wrong, "wrong.jinja")
    config = sft_config().sft

    def records(with_system: int, without: int):
        pair = {"prompt": "What is 2 + 3?", "completion": "5"}
        chat = {"messages": TWO_TURNS}
        return [(f"f:{i}", chat) for i in range(with_system)] + [(f"g:{i}", pair) for i in range(without)]

    kept = render_all(records(9, 1), config, renderer, 256, "train")
    assert (len(kept.ids), kept.empty) == (9, 1)
    with pytest.raises(
        SFTDataError, match=r"7 of 10 examples have no trainable token under the chat template wrong.jinja"
    ):
        render_all(records(3, 7), config, renderer, 256, "train")


def test_a_packed_row_has_the_token_weighted_loss_of_its_examples_run_one_by_one(tok_dir, tokenizer):
    renderer = ChatRenderer(tok_dir, CHAT_TEMPLATE, "marin")
    chats = [
        TWO_TURNS,
        [{"role": "user", "content": "Shall I compare thee?"}, {"role": "assistant", "content": "To a summer's day."}],
        [{"role": "user", "content": "def f(x):"}, {"role": "assistant", "content": "    return x + 1"}],
    ]
    rendered = [renderer.render(c) for c in chats]
    examples = Examples([r[0] for r in rendered], [r[1] for r in rendered])
    model = build(tiny_config(num_layers=2, vocab_size=512, attention={"sliding_window": 8}), seed=0).eval()
    randomize_identity_inits(model)
    row = pack(examples, 200, tokenizer.pad_id)
    assert row["input_ids"].shape[0] == 1  # all three in one row
    with torch.no_grad():
        packed = model(row["input_ids"], row["segment_ids"], row["labels"])
        total, count = 0.0, 0
        for ex in rendered:
            alone = pack(Examples([ex[0]], [ex[1]]), len(ex[0]), tokenizer.pad_id)
            out = model(alone["input_ids"], None, alone["labels"])
            total += float(out.ce_loss) * int(out.num_tokens)
            count += int(out.num_tokens)
    assert int(packed.num_tokens) == count
    assert float(packed.ce_loss) == pytest.approx(total / count, rel=1e-5)


def grouped_and_peft(E=4, D=16, F=8, r=4, alpha=8.0):
    """Our grouped expert LoRA (random adapters) and peft's target_parameters twin of it."""
    torch.manual_seed(0)
    experts = RoutedExperts(E, D, F, 0.02, impl="loop")
    experts.reset_parameters()
    experts.__class__ = GroupedLoraExperts
    experts.add_lora(r, alpha, 0.0)
    with torch.no_grad():
        for name, p in experts.named_parameters():
            p.requires_grad_("lora_" in name)  # the base frozen, as apply_method leaves it
            if "lora_" in name:
                p.normal_(0, 0.3)
    box = ExpertsBox(experts)
    twin = peft_twin(box)
    state = {k.replace(".default", ""): v for k, v in twin.state_dict().items() if "lora_" in k}
    # and back: peft's tensors load into ours (as a saved adapter does)
    again = ExpertsBox(copy.deepcopy(experts))
    load_peft_state(again, dict(state))
    for (name, a), (_, b) in zip(box.named_parameters(), again.named_parameters()):
        assert torch.equal(a, b), name
    return box, twin, state


@pytest.mark.parametrize("impl", ["loop", "grouped_mm"])
def test_grouped_expert_lora_matches_peft_target_parameters(impl):
    """Same adapters (moved into our layout by the same mapping that saves them in peft's), same
    outputs and gradients, on either expert path."""
    ours, theirs, state = grouped_and_peft()
    ours.experts.impl = impl
    g = torch.Generator().manual_seed(1)
    x = torch.randn(12, 16, generator=g)
    experts = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(12)])
    weights = torch.rand(12, 2, generator=g)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = ours(xa, experts, weights), theirs(xb, experts, weights)
    torch.testing.assert_close(ya, yb, rtol=1e-5, atol=1e-6)
    (ya.square().sum()).backward()
    (yb.square().sum()).backward()
    torch.testing.assert_close(xa.grad, xb.grad, rtol=1e-5, atol=1e-6)
    # the adapters' gradients, read back in peft's layout
    grads_ours = peft_state(_grads_as_params(ours))
    grads_theirs = {k.replace(".default", ""): p.grad for k, p in theirs.named_parameters() if "lora_" in k}
    assert sorted(grads_ours) == sorted(grads_theirs) == sorted(state)
    for key, grad in grads_theirs.items():  # fp32 sums in another order: relative to the largest entry
        assert (grads_ours[key] - grad).abs().max() <= 1e-5 * grad.abs().max(), key


def _grads_as_params(box):
    """A copy of `box` whose adapter parameters hold their gradients (for peft_state's layout)."""
    twin = copy.deepcopy(box)
    with torch.no_grad():
        for (_, p), (_, q) in zip(box.named_parameters(), twin.named_parameters()):
            if p.grad is not None:
                q.copy_(p.grad)
    return twin


def test_merged_lora_computes_what_the_adapters_did(tokenizer):
    config = sft_config(method="lora", lora={"r": 4, "alpha": 8.0, "experts": True})
    model = build(config.model, seed=0).eval()
    randomize_identity_inits(model)
    info = apply_method(model, config)
    assert info["lora_targets"] and any(isinstance(m, GroupedLoraExperts) for m in model.modules())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    ids = torch.randint(0, 400, (2, 40))
    with torch.no_grad():
        adapted = model(ids).logits
        assert merge_adapters(model) == len(info["lora_targets"]) + config.model.num_layers
        merged = model(ids).logits
    assert not any("lora_" in n for n, _ in model.named_parameters())
    torch.testing.assert_close(merged, adapted, rtol=0, atol=1e-5)


def test_a_qlora_merge_folds_its_bf16_adapters_exactly():
    """QLoRA's adapters are bf16; peft's get_delta_weight rounds B A to bf16 too, which moved the
    merged (and so the exported-merged) logits by ~5e-3 from what the peft adapter computes."""
    pytest.importorskip("bitsandbytes")
    import bitsandbytes.functional as bnbF
    from peft.tuners.lora import LoraLayer

    config = sft_config(method="qlora", lora={"r": 4, "alpha": 8.0})
    model = build(config.model, seed=0).eval()
    apply_method(model, config)
    expected = {}
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, LoraLayer):
                a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
                assert a.dtype == torch.bfloat16
                b.normal_(0, 0.05)
                weight = module.get_base_layer().weight
                base = bnbF.dequantize_4bit(weight.data, weight.quant_state).double()
                expected[name] = base + module.scaling["default"] * (b.double() @ a.double())
    assert expected
    merge_adapters(model)
    for name, weight in expected.items():
        torch.testing.assert_close(model.get_submodule(name).weight.double(), weight, rtol=0, atol=1e-6)


@pytest.mark.parametrize("rank", [4, 8], ids=["loop", "grouped_mm"])  # r=4 in bf16 is unaligned for grouped_mm
def test_qlora_experts_in_nf4_compute_what_their_dequantised_stacks_do_and_keep_none(rank):
    """QLoRA packs the routed experts into NF4 (4.5 bits a weight, none of it in a checkpoint): the
    loss and every gradient equal the same model's with the stacks dequantised into bf16 parameters,
    and no dequantised stack lives from forward to backward."""
    import gc
    import weakref

    pytest.importorskip("bitsandbytes")
    from marinlm.finetune.nf4 import NF4Experts, restore_experts

    config = sft_config(method="qlora", lora={"r": rank, "alpha": 8.0})
    model = build(config.model, seed=0)
    randomize_identity_inits(model)
    info = apply_method(model, config)
    experts = [m for m in model.modules() if isinstance(m, NF4Experts)]
    assert info["quantized_experts"] == len(experts) == config.model.num_layers
    assert not any(n.endswith((".gate_proj", ".up_proj", ".down_proj")) for n, _ in model.named_parameters())
    assert not any(k.endswith(("_proj_nf4", "_proj_absmax")) for k in model.state_dict())
    weights = sum(E * a * b for m in experts for E, a, b in m._nf4_shapes.values())
    stored = sum(b.numel() * b.element_size() for m in experts for n, b in m.named_buffers() if "_proj_" in n)
    assert stored == weights * (0.5 + 4 / 64)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    plain = copy.deepcopy(model)
    assert restore_experts(plain) == len(experts)
    assert all(m.gate_proj.dtype == torch.bfloat16 for m in plain.modules() if isinstance(m, GroupedLoraExperts))

    alive = []
    for module in experts:

        def dequantize(name, dtype=torch.bfloat16, _module=module, _fn=module.dequantize):
            stack = _fn(name, dtype)
            alive.append(weakref.ref(stack))
            return stack

        module.dequantize = dequantize
    ids = torch.randint(0, 400, (2, 40))
    loss = model(ids, labels=ids).loss
    gc.collect()
    assert alive and all(ref() is None for ref in alive)  # each was dropped after its layer's forward
    loss.backward()
    reference = plain(ids, labels=ids).loss
    reference.backward()
    assert loss.item() == reference.item()
    grads = {n: p.grad for n, p in plain.named_parameters() if p.requires_grad}
    for name, p in model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p.grad, grads[name], rtol=0, atol=0, msg=name)


def test_an_experts_only_adapter_says_its_rank_and_alpha_to_peft(tmp_path):
    """With no linear layer adapted there is no peft config to copy: the adapter still states r and
    alpha (peft would read its defaults, r 8 and alpha 8, and scale the deltas wrongly)."""
    from peft import LoraConfig

    config = sft_config(method="lora", lora={"r": 4, "alpha": 12.0, "experts": True, "target_modules": []})
    model = build(config.model, seed=0)
    info = apply_method(model, config)
    assert info["lora_targets"] == [] and info.get("peft_config") is None
    save_peft_adapter(peft_state(model), info, tmp_path, "base")
    saved = LoraConfig.from_pretrained(str(tmp_path))
    assert (saved.r, saved.lora_alpha) == (4, 12.0)
    assert saved.target_parameters == [f"experts.{p}" for p in ("gate_proj", "up_proj", "down_proj")]


def test_what_tensor_parallel_cannot_fine_tune_is_refused_naming_the_key():
    from marinlm.config import ConfigError

    with pytest.raises(ConfigError) as info:
        sft_config(lora={"lm_head": True}, parallel={"tensor_parallel": 2})
    assert info.value.key == "lora.lm_head"
    sft_config(lora={"lm_head": True}, parallel={"expert_parallel": 2})  # the head is whole there
    # QLoRA on several processes failed with bitsandbytes' "quant_state is required" (FSDP2, EP, PP).
    from marinlm.finetune.config import check_processes

    with pytest.raises(ConfigError) as info:
        check_processes(sft_config(method="qlora"), 2)
    assert info.value.key == "method" and "qlora runs in one process, not 2" in str(info.value)
    check_processes(sft_config(method="qlora"), 1)
    check_processes(sft_config(method="lora"), 2)


def expected_lora_count(config: FinetuneConfig, model) -> int:
    """r * (in + out) for each adapted linear layer (attention, shared experts, latent projections:
    the default targets), and per expert for each of the three routed stacks."""
    r, n = config.lora.r, 0
    adapted = r"\.attn\.[qkvo]_proj$|\.mlp\.shared\.\d+\.(gate|up|down)_proj$|\.mlp\.latent_(down|up)$"
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and re.search(adapted, name):
            n += r * (m.in_features + m.out_features)
        if isinstance(m, RoutedExperts):
            E, D, F = m.gate_proj.shape
            n += 3 * E * r * (D + F)
    return n


# --- end to end ------------------------------------------------------------------------------------


def gsm8k_slice(tmp_path, train: int, test: int):
    out = {}
    for split, n in (("train", train), ("test", test)):
        lines = shared_data("sft", f"gsm8k_{split}.jsonl").read_text().splitlines()[:n]
        (tmp_path / f"gsm8k_{split}.jsonl").write_text("\n".join(lines) + "\n")
        out[split] = str(tmp_path / f"gsm8k_{split}.jsonl")
    return out


@pytest.fixture(scope="module")
def base_run(tmp_path_factory):
    """A tiny base model trained for nothing: random weights, a tokenizer that knows some digits."""
    root = tmp_path_factory.mktemp("base")
    texts = SAMPLE_TEXTS * 20 + [json.loads(line)["answer"] for line in _gsm8k_lines(200)]
    tok = MarinTokenizer(train_bpe(texts, 800))
    # Dropless experts: capacity would depend on the rows per forward, which differ between layouts.
    # Global layers read both KV heads, so that tensor parallel 2 splits them.
    config = tiny_config(
        num_layers=2,
        vocab_size=896,
        attention={"sliding_window": 64, "num_global_kv_heads": 2},
        moe={"capacity_factor": None},
    )
    model = build(config, seed=0)
    save_run(root / "run", replace(TrainConfig(model=config), run_dir=str(root / "run")), model.state_dict(), tok, {})
    return root / "run"


def _gsm8k_lines(n):
    return shared_data("sft", "gsm8k_train.jsonl").read_text().splitlines()[-n:]


def finetune_args(base_run, files, run_dir, method, steps=12, **extra):
    args = [
        f"--base={base_run}",
        f"--run_dir={run_dir}",
        f"--method={method}",
        f"--sft.train_files=[{files['train']}]",
        f"--sft.val_files=[{files['test']}]",
        f"--train.steps={steps}",
        "--train.global_batch=4",
        "--validation.every_steps=0",
        "--checkpoint.every_steps=6",
        "--logging.every_steps=1",
        "--logging.tensorboard=false",
    ]
    return args + [f"--{k}={v}" for k, v in extra.items()]


MODES = {
    "full": {"optim.lr": 1e-3},
    "lora": {"optim.lr": 1e-2, "lora.r": 8},
    "qlora": {"optim.lr": 1e-2, "lora.r": 8},
    "freeze": {"optim.lr": 3e-3, "freeze.last_layers": 2},
}


@pytest.mark.slow
@pytest.mark.parametrize("method", list(MODES))
def test_finetuning_lowers_the_held_out_answer_loss(tmp_path, base_run, method, capsys):
    """Each mode, a few steps of SFT on GSM8K answers: the held-out answer loss falls below the base
    model's; the trainable count printed at start is the one the method implies; the run generates
    with its chat template, evaluates and exports."""
    from marinlm.cli import main
    from marinlm.loading import load_model

    files = gsm8k_slice(tmp_path, 64, 16)
    config_file = CONFIGS / "finetune" / "gsm8k-lora.yaml"
    run = tmp_path / "run"
    assert main(["finetune", str(config_file), *finetune_args(base_run, files, run, method, **MODES[method])]) == 0
    out = capsys.readouterr().out
    base = float(re.search(r"base model: held-out answer loss ([\d.]+)", out).group(1))
    final = float(re.search(r"^held-out answer loss ([\d.]+)", out, re.M).group(1))
    assert final < base - 0.1, (base, final)
    trainable = int(re.search(r"trainable parameters: ([\d,]+)", out).group(1).replace(",", ""))
    model = build(load_model(base_run).config.model, seed=0)
    if method == "full":
        assert trainable == sum(p.numel() for p in model.parameters())
    elif method == "freeze":
        expected = sum(
            p.numel() for n, p in model.named_parameters() if n.startswith(("layers.", "final_norm", "lm_head"))
        )
        assert trainable == expected  # 2 layers of 2: every block, the final norm and the head
    else:
        config = replace(sft_config(), lora=replace(sft_config().lora, r=8))
        assert trainable == expected_lora_count(config, model)
        saved = json.loads((run / "adapter" / "adapter_config.json").read_text())
        assert saved["r"] == 8 and saved["target_parameters"] == [
            f"experts.{p}" for p in ("gate_proj", "up_proj", "down_proj")
        ]
    # the fine-tuned run, merged on load, computes what the merged run does
    loaded = load_model(run)
    assert main(["finetune", "merge", str(run)]) == 0
    merged = load_model(run / "merged")
    ids = torch.randint(0, 800, (1, 30))
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(ids).logits, merged.model(ids).logits, rtol=0, atol=1e-5)
    assert main(["generate", str(run), "--chat", "--prompt", "What is 2 + 3?", "--max-new-tokens", "4"]) == 0
    assert (run / "tokenizer" / "chat_template.jinja").read_text() == CHAT_TEMPLATE
    # The base and the adapter, loaded by transformers and peft, compute what the merged run does
    # (--check exits 1 on a next-token KL over 1e-6 or another greedy decoding).
    hf = tmp_path / "hf"
    capsys.readouterr()
    if method in ("lora", "qlora"):
        assert main(["export", str(run), str(hf), "--adapter", "--check"]) == 0
        assert "check (PeftModel(MarinHFForCausalLM) in transformers" in capsys.readouterr().out
        assert (
            verify(hf) == [] and "adapter/adapter_model.safetensors" in json.loads((hf / MANIFEST).read_text())["files"]
        )
    else:
        assert main(["export", str(run), str(hf), "--adapter"]) != 0
        assert "trains no adapter" in capsys.readouterr().err


@pytest.mark.slow
def test_routers_and_norms_that_lora_trains_travel_in_the_adapter(tmp_path, base_run, capsys):
    """With lora.train_router and train_norms, RUN/adapter held the LoRA factors only, and the
    exported --adapter base carried the trained routers and norms: neither was the pair peft
    users expect. Both now go in the adapter as peft's modules_to_save, over the base run's base."""
    from safetensors.torch import load_file

    from marinlm.cli import main
    from marinlm.loading import load_model

    files = gsm8k_slice(tmp_path, 16, 4)
    run = tmp_path / "run"
    extra = {"optim.lr": 1e-2, "lora.r": 4, "lora.train_router": "true", "lora.train_norms": "true"}
    config_file = CONFIGS / "finetune" / "gsm8k-lora.yaml"
    assert main(["finetune", str(config_file), *finetune_args(base_run, files, run, "lora", steps=3, **extra)]) == 0
    saved = json.loads((run / "adapter" / "adapter_config.json").read_text())
    assert {"layers.0.mlp.router", "layers.1.attn_norm.0", "final_norm.0"} <= set(saved["modules_to_save"])
    tensors = load_file(run / "adapter" / "adapter_model.safetensors")
    base = load_model(base_run).model.state_dict()
    trained = tensors["base_model.model.layers.0.mlp.router.weight"]
    assert not torch.equal(trained, base["layers.0.mlp.router.weight"])  # it trained
    hf = tmp_path / "hf"
    capsys.readouterr()
    assert main(["export", str(run), str(hf), "--adapter", "--check"]) == 0
    assert "greedy decoding the same" in capsys.readouterr().out
    exported = load_file(hf / "model.safetensors")
    assert torch.equal(exported["model.layers.0.mlp.router.weight"], base["layers.0.mlp.router.weight"])
    assert torch.equal(exported["model.final_norm.0.weight"], base["final_norm.0.weight"])
    assert "model.final_norm.0" in json.loads((hf / "adapter" / "adapter_config.json").read_text())["modules_to_save"]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_a_finetune_resumes_exactly(tmp_path, base_run, method):
    """A second run resumed from the first one's step-4 checkpoint takes steps 5-8 exactly as the
    first did: the trained tensors, the optimizer, the schedule and the SFT loader's position.
    (Both runs share this process; a resumed process's first step once differed, from torch's
    first-call math race: tests/test_cpu_math.py.)"""
    from marinlm.cli import main
    from marinlm.train.metrics import read_metrics

    if method == "qlora":
        pytest.importorskip("bitsandbytes")
    files = gsm8k_slice(tmp_path, 48, 8)
    config_file = str(CONFIGS / "finetune" / f"gsm8k-{method}.yaml")
    straight = finetune_args(base_run, files, tmp_path / "a", method, steps=8, **{"checkpoint.every_steps": 4})
    assert main(["finetune", config_file, *straight, "--checkpoint.keep_last=2"]) == 0
    resumed = finetune_args(base_run, files, tmp_path / "b", method, steps=8, **{"checkpoint.every_steps": 4})
    assert (
        main(["finetune", config_file, *resumed, "--resume", str(tmp_path / "a" / "checkpoints" / "step-00000004")])
        == 0
    )

    def losses(run):
        return {m["step"]: m["train/loss"] for m in read_metrics(run) if "train/loss" in m}

    a, b = losses(tmp_path / "a"), losses(tmp_path / "b")
    assert sorted(b) == [5, 6, 7, 8] and all(a[step] == b[step] for step in b), (a, b)


# Norms, embedding and head trained whole too: peft's modules_to_save, gathered like the adapters.
LORA_ON_RANKS = {
    "checkpoint.every_steps": 3,
    "optim.lr": 1e-2,
    "lora.train_norms": "true",
    "lora.train_embeddings": "true",
}


@pytest.fixture(scope="module")
def lora_one_process(tmp_path_factory, base_run):
    """The one-process LoRA run of 3 steps that each layout below is held to, trained once, and its
    data files."""
    from marinlm.cli import main

    root = tmp_path_factory.mktemp("lora-one")
    files = gsm8k_slice(root, 48, 8)
    args = finetune_args(base_run, files, root / "one", "lora", steps=3, **LORA_ON_RANKS)
    assert main(["finetune", str(CONFIGS / "finetune" / "gsm8k-lora.yaml"), *args]) == 0
    return root / "one", files


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize(
    "layout",
    [[], ["--parallel.expert_parallel=2"], ["--parallel.pipeline_parallel=2"], ["--parallel.tensor_parallel=2"]],
    ids=["fsdp", "ep", "pp", "tp"],
)
def test_lora_on_two_ranks_trains_as_one_process_and_resumes_at_one(tmp_path, base_run, lora_one_process, layout):
    """FSDP, expert, pipeline and tensor parallel: the losses and the whole adapter of one process.
    Expert parallelism once dropped the grouped expert adapters' forward, a pipeline moved the
    frozen router biases and wrote the first stage's adapters only, and tensor parallel split the
    base layers under the adapters but not the adapters."""
    import subprocess

    from safetensors.torch import load_file

    from marinlm.cli import main
    from marinlm.train.metrics import read_metrics

    from conftest import ROOT

    one_run, files = lora_one_process
    config_file = str(CONFIGS / "finetune" / "gsm8k-lora.yaml")
    two = finetune_args(base_run, files, tmp_path / "two", "lora", steps=3, **LORA_ON_RANKS) + layout
    done = subprocess.run(
        [*torchrun_command(2), "-m", "marinlm", "finetune", config_file, *two],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    def losses(run):
        return {m["step"]: m["train/loss"] for m in read_metrics(run) if "train/loss" in m}

    one, two_ranks = losses(one_run), losses(tmp_path / "two")
    assert sorted(one) == sorted(two_ranks) == [1, 2, 3]
    for step, loss in one.items():
        assert two_ranks[step] == pytest.approx(loss, rel=1e-5), step
    adapters = [load_file(str(run / "adapter" / "adapter_model.safetensors")) for run in (one_run, tmp_path / "two")]
    assert sorted(adapters[0]) == sorted(adapters[1])
    for key, tensor in adapters[0].items():
        # Adam's first steps turn fp32 rounding in a near-zero gradient into up to lr (1e-2) a step:
        # a few elements differ. An adapter that did not train, or trained otherwise, differs in most.
        diff = (adapters[1][key] - tensor).abs()
        assert float((diff > 1e-4).float().mean()) < 0.01 and float(diff.max()) < 2 * 1e-2 * 3, key
    # the 2-rank checkpoint goes on in one process
    more = finetune_args(base_run, files, tmp_path / "two", "lora", steps=4, **LORA_ON_RANKS)
    assert main(["finetune", config_file, *more]) == 0
    assert 4 in losses(tmp_path / "two")


def test_answers_cut_off_by_seq_len_are_blamed_on_the_length_not_the_template(tok_dir):
    renderer = ChatRenderer(tok_dir, CHAT_TEMPLATE, "marin")
    long = {"prompt": "What is two plus three? " * 30, "completion": "5"}
    with pytest.raises(SFTDataError, match=r"in 3 of 3 examples the answer starts past data.seq_len=32 tokens"):
        render_all([(f"f:{i}", long) for i in range(3)], sft_config().sft, renderer, 32, "train")
    kept = render_all(
        [("f:0", {"prompt": "What is 2 + 3?", "completion": "It is five. " * 20})], sft_config().sft, renderer, 32, "t"
    )
    assert kept.truncated == 1 and len(kept.ids[0]) == 32


def test_tokenizer_template_adds_a_template_and_special_tokens_keeping_every_id(tok_dir, tokenizer, tmp_path):
    from marinlm.cli import main

    template = tmp_path / "t.jinja"
    template.write_text(CHAT_TEMPLATE.replace("<|end|>", "<|end|><|tool|>"))
    out = tmp_path / "ext"
    assert (
        main(
            [
                "tokenizer",
                "template",
                str(tok_dir),
                "--template",
                str(template),
                "--add-special-tokens",
                "<|tool|>",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    ext = MarinTokenizer.load(out)
    assert ext.vocab_size == tokenizer.vocab_size + 1 and ext.special_ids["<|tool|>"] == tokenizer.vocab_size
    assert all(ext.backend.get_vocab()[t] == i for t, i in tokenizer.backend.get_vocab().items())
    assert ext.chat_template == template.read_text()
    assert ext.encode("<|tool|>", allow_special=True) == [tokenizer.vocab_size]
    hf = transformers.AutoTokenizer.from_pretrained(str(out))
    assert hf("<|tool|>", add_special_tokens=False).input_ids == [tokenizer.vocab_size]
    assert (
        main(["tokenizer", "template", str(tok_dir), "--add-special-tokens", "<|user|>", "--out", str(tmp_path / "x")])
        == 2
    )


def test_a_larger_vocab_takes_the_base_rows_and_starts_new_rows_at_their_mean(tmp_path, base_run):
    """--model.vocab_size above the base's makes room for the tokens sft.tokenizer adds, as
    transformers' resize_token_embeddings does; a smaller one, or too little room, is an error
    that names the size to set."""
    from marinlm.finetune.loading import load_base_weights
    from marinlm.loading import load_model

    base = load_model(base_run).model.state_dict()
    config = replace(load_model(base_run).config.model, vocab_size=1024)
    model = build(config, seed=1)
    load_base_weights(model, base_run / "checkpoints" / "step-00000000")
    for key in ("embed.weight", "lm_head.weight"):
        grown = model.state_dict()[key]
        assert grown.shape[0] == 1024 and torch.equal(grown[:896], base[key])
        torch.testing.assert_close(grown[896:], base[key].mean(0).expand(128, -1))
    with pytest.raises(ValueError, match="model.vocab_size 512 is smaller than the base's 896"):
        load_base_weights(build(replace(config, vocab_size=512), seed=1), base_run / "checkpoints" / "step-00000000")


@pytest.mark.slow
def test_new_special_tokens_train_their_rows_and_export_with_the_adapter(tmp_path, base_run, capsys):
    """A tokenizer with a new turn-end token, a vocabulary grown for it, and LoRA that trains the
    embedding and the LM head whole: the new token's rows learn, and the adapter (with them as peft's
    modules_to_save) over the exported base computes what the merged model does."""
    from safetensors.torch import load_file

    from marinlm.cli import main
    from marinlm.finetune.trainer import frozen_new_rows
    from marinlm.loading import load_model
    from marinlm.train.checkpoint import checkpoint_tokenizer, resolve_checkpoint

    template = tmp_path / "t.jinja"
    template.write_text(
        CHAT_TEMPLATE.replace("'<|end|>' }}{% endgeneration %}", "'<|end|><|tool|>' }}{% endgeneration %}")
    )
    ext = tmp_path / "ext"
    base_tok = checkpoint_tokenizer(resolve_checkpoint(base_run))
    args = ["tokenizer", "template", str(base_tok), "--template", str(template), "--add-special-tokens", "<|tool|>"]
    assert main([*args, "--out", str(ext)]) == 0
    tool = MarinTokenizer.load(ext).special_ids["<|tool|>"]
    files = gsm8k_slice(tmp_path, 16, 4)
    run = tmp_path / "run"
    extra = {"optim.lr": 1e-2, "lora.r": 4, "sft.tokenizer": str(ext), "model.vocab_size": 1024}
    capsys.readouterr()
    config_file = CONFIGS / "finetune" / "gsm8k-lora.yaml"
    assert main(["finetune", str(config_file), *finetune_args(base_run, files, run, "lora", steps=1, **extra)]) == 0
    assert "sft.tokenizer adds 1 token(s) whose embedding and LM-head rows stay frozen" in capsys.readouterr().out
    extra["lora.train_embeddings"] = "true"
    run = tmp_path / "run2"
    assert main(["finetune", str(config_file), *finetune_args(base_run, files, run, "lora", steps=3, **extra)]) == 0
    assert "stay frozen" not in capsys.readouterr().out
    saved = json.loads((run / "adapter" / "adapter_config.json").read_text())
    assert {"embed", "lm_head"} <= set(saved["modules_to_save"])
    trained = load_file(run / "adapter" / "adapter_model.safetensors")["base_model.model.lm_head.weight"]
    start = load_model(base_run).model.state_dict()["lm_head.weight"].mean(0).to(trained.dtype)
    assert trained.shape[0] == 1024 and not torch.allclose(trained[tool], start)  # the new row learned
    hf = tmp_path / "hf"
    assert main(["export", str(run), str(hf), "--adapter", "--check"]) == 0
    assert "greedy decoding the same" in capsys.readouterr().out
    assert json.loads((hf / "config.json").read_text())["vocab_size"] == 1024
    freeze = replace(sft_config(), method="freeze", freeze=replace(sft_config().freeze, patterns=["embed.*"]))
    assert "freeze.patterns=[embed.*, lm_head.*]" in frozen_new_rows(1, freeze)


def test_a_bad_value_is_traced_to_the_command_line_or_the_file(tmp_path):
    """A bad `--lora.r=0` was blamed on the YAML file ("(in configs/finetune/...)")."""
    from marinlm.commands.finetune import load_finetune_config
    from marinlm.config import ConfigError

    config_file = str(CONFIGS / "finetune" / "gsm8k-lora.yaml")
    model = f"--model={CONFIGS / 'model' / 'tiny.yaml'}"  # no base run to read
    with pytest.raises(ConfigError, match=r"^lora.r: .* \(set on the command line\)$"):
        load_finetune_config(config_file, ["--base=runs/x", model, "--lora.r=0"])
    (tmp_path / "bad.yaml").write_text(Path(config_file).read_text().replace("r: 16", "r: 0"))
    with pytest.raises(ConfigError, match=r"^lora.r: .* \(in .*bad.yaml, with the command-line overrides\)$"):
        load_finetune_config(str(tmp_path / "bad.yaml"), ["--base=runs/x", model, "--train.steps=3"])


def test_a_model_file_on_the_command_line_replaces_the_base_runs_model(base_run):
    """`--model=FILE` crashed with a traceback (a string merged as a section); it now stands for that
    file's model (what `marinlm plan` of a fine-tuning config for another base needs), and plain
    keys still edit the base run's."""
    from marinlm.commands.finetune import load_finetune_config
    from marinlm.model.config import MarinConfig

    config_file = str(CONFIGS / "finetune" / "gsm8k-lora.yaml")
    hero = load_finetune_config(
        config_file, [f"--base={base_run}", f"--model={CONFIGS / 'model' / 'marin-535b-a23b.yaml'}"]
    )
    assert hero.model == load_config(MarinConfig, CONFIGS / "model" / "marin-535b-a23b.yaml")
    edited = load_finetune_config(config_file, [f"--base={base_run}", "--model.vocab_size=1024"])
    assert edited.model.vocab_size == 1024 and edited.model.num_layers == 2  # the base run's, edited
