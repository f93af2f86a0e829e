"""`marinlm export` / `marinlm import`: runs to Hugging Face folders and back."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from marinlm.config import load_config, save_config
from marinlm.hf.export import export, parity_check, verify
from marinlm.hf.importer import import_hf, save_run
from marinlm.hf.remote_code import _strip_own_imports, modeling_source
from marinlm.loading import load_model
from marinlm.model import MarinConfig
from marinlm.tokenizer import MarinTokenizer, train_bpe
from marinlm.train.config import TrainConfig

from conftest import CONFIGS, SAMPLE_TEXTS, build, randomize_identity_inits, train_config

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tokenizer():
    return MarinTokenizer(train_bpe(SAMPLE_TEXTS * 20, vocab_size=400))


def preset_config(name: str, **overrides) -> MarinConfig:
    args = [f"--{k}={v}" for k, v in {"vocab_size": 512, **overrides}.items()]
    return load_config(MarinConfig, CONFIGS / "model" / f"{name}.yaml", args)


def make_run(path, config: MarinConfig, tokenizer, seed: int = 0, identity_inits: bool = True):
    model = build(config, seed=seed)
    if identity_inits:
        randomize_identity_inits(model)
    save_run(path, replace(TrainConfig(model=config), run_dir=str(path)), model.state_dict(), tokenizer, {})
    return model


def assert_same_tensors(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sorted(sa) == sorted(sb)
    for name, tensor in sa.items():
        assert torch.equal(tensor, sb[name]), name


# Every preset the issue names; widths kept, the layer count cut where it only repeats.
PRESETS = {
    "tiny": {},
    "small": {"num_layers": 4},
    "qwen3-moe-style": {"num_layers": 2},
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PRESETS))
def test_an_export_computes_what_marinlm_computes_in_transformers(tmp_path, tokenizer, name):
    """fp32 logits within 1e-5 on a left-padded batch of three documents, next-token KL below 1e-6,
    the same 32 greedy tokens; then back to marinlm bit for bit."""
    config = preset_config(name, **PRESETS[name])
    # qwen3-moe-style must stay native: its router bias is zero, as HF's has none
    model = make_run(tmp_path / "run", config, tokenizer, identity_inits=name != "qwen3-moe-style")
    report = export(tmp_path / "run", tmp_path / "hf", max_shard_size="4MB", quiet=True)
    assert report.format == ("native" if name == "qwen3-moe-style" else "remote")
    assert verify(tmp_path / "hf") == []
    check = parity_check(tmp_path / "hf")
    print(f"{name}: {check}")
    assert check["max_abs_logit_diff"] < 1e-5
    assert check["max_kl"] < 1e-6
    assert check["greedy_equal"]
    import_hf(tmp_path / "hf", tmp_path / "back")
    back = load_model(tmp_path / "back")
    assert_same_tensors(model, back.model)
    assert back.tokenizer.hash == tokenizer.hash
    assert back.config.model == config


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny", "qwen3-moe-style"], ids=["remote", "native"])
def test_an_adjacent_pairs_rope_model_exports_and_comes_back_bit_for_bit(tmp_path, tokenizer, name):
    """`attention.rope_pairs: interleaved` (Marin's hero): remote code carries the pairing in its
    config; native Qwen3-MoE, whose RoPE is split-half, gets each head's q/k rows and QK-norm gains
    permuted (evens, then odds), and import permutes them back. transformers computes the same
    logits (1e-5, KL < 1e-9) and the round trip is bit-exact, the pairing included."""
    config = preset_config(name, **PRESETS[name], **{"attention.rope_pairs": "interleaved"})
    model = make_run(tmp_path / "run", config, tokenizer, identity_inits=name == "tiny")
    report = export(tmp_path / "run", tmp_path / "hf", quiet=True)
    assert report.format == ("remote" if name == "tiny" else "native")
    check = parity_check(tmp_path / "hf")
    assert check["max_abs_logit_diff"] < 1e-5 and check["max_kl"] < 1e-9 and check["greedy_equal"], check
    import_hf(tmp_path / "hf", tmp_path / "back")
    back = load_model(tmp_path / "back")
    assert_same_tensors(model, back.model)
    assert back.config.model.attention.rope_pairs == "interleaved" and back.config.model == config


def test_a_config_without_qk_norm_exports_as_native_mixtral_and_back(tmp_path, tokenizer):
    config = preset_config(
        "qwen3-moe-style", num_layers=2, **{"attention.qk_norm": "false", "attention.qk_norm_gain": "false"}
    )
    model = make_run(tmp_path / "run", config, tokenizer, identity_inits=False)
    report = export(tmp_path / "run", tmp_path / "hf", quiet=True)
    assert report.format == "native"
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == ["MixtralForCausalLM"]
    check = parity_check(tmp_path / "hf")
    assert check["hf_class"] == "MixtralForCausalLM" and check["max_abs_logit_diff"] < 1e-5 and check["greedy_equal"]
    import_hf(tmp_path / "hf", tmp_path / "back")
    assert_same_tensors(model, load_model(tmp_path / "back").model)


def test_the_export_carries_what_other_tools_need_to_score_alike(tmp_path, tokenizer):
    """BOS convention, context length, chat template, generation config; the tokenizer prepends the
    token every training document began with, as `marinlm eval` does."""
    config = preset_config("tiny", num_layers=2)
    make_run(tmp_path / "run", config, tokenizer)
    export(tmp_path / "run", tmp_path / "hf", quiet=True)
    hf_config = json.loads((tmp_path / "hf" / "config.json").read_text())
    tok_config = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())
    assert hf_config["bos_token_id"] == tokenizer.bos_id and hf_config["eos_token_id"] == tokenizer.eos_id
    assert hf_config["max_position_embeddings"] == config.max_seq_len == tok_config["model_max_length"]
    assert hf_config["auto_map"]["AutoModelForCausalLM"] == "modeling_marin.MarinHFForCausalLM"
    assert tok_config["add_bos_token"] is True and "chat_template" in tok_config
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"), trust_remote_code=True)
    assert hf_tok("a quick fox").input_ids == [tokenizer.bos_id, *tokenizer.encode("a quick fox")]
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert hf_tok.apply_chat_template(messages, tokenize=False) == tokenizer.apply_chat_template(messages)
    generation = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert generation["eos_token_id"] == tokenizer.eos_id
    # no marinlm needed to read it: the modeling file imports only torch, transformers and the stdlib
    source = (tmp_path / "hf" / "modeling_marin.py").read_text()
    assert "import marinlm" not in source and "from marinlm" not in source
    assert "class MarinForCausalLM" in source and "class QBRouter" in source


def test_a_router_bias_on_the_sigmoid_scores_would_pick_other_experts(tmp_path, tokenizer):
    """Marin adds the router bias to the logits; DeepSeek-V3 (and so transformers) to the sigmoid
    scores. With these biases the two choose different experts for most tokens, so an export that
    biased the scores could not pass the logit check that this export passes."""
    config = preset_config("tiny", num_layers=2)
    model = make_run(tmp_path / "run", config, tokenizer, identity_inits=False)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("router.bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=g) * 2.0)
    save_run(tmp_path / "run", TrainConfig(model=config), model.state_dict(), tokenizer, {})
    export(tmp_path / "run", tmp_path / "hf", overwrite=True, quiet=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), trust_remote_code=True).eval()
    router = next(m for n, m in hf.named_modules() if n.endswith("mlp.router"))
    inputs = []
    router.register_forward_hook(lambda mod, args, out: inputs.append(args[0]))
    ids = torch.randint(0, 400, (2, 40), generator=g)
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model.eval()(ids).logits, rtol=0, atol=1e-5)
        s = router.logits(inputs[0])
    k = config.moe.top_k
    on_logits = torch.topk(s + router.bias, k).indices.sort(-1).values
    on_scores = torch.topk(torch.sigmoid(s) + router.bias, k).indices.sort(-1).values
    differ = (on_logits != on_scores).any(-1).float().mean()
    assert differ > 0.5, f"only {differ:.0%} of tokens would route differently: the test would not catch it"


def test_native_export_refuses_a_router_bias_and_names_it(tmp_path, tokenizer):
    config = preset_config("qwen3-moe-style", num_layers=1)
    make_run(tmp_path / "run", config, tokenizer)  # randomize_identity_inits sets router biases
    with pytest.raises(ValueError, match="layers.0.mlp.router.bias: the router bias is not zero"):
        export(tmp_path / "run", tmp_path / "hf", fmt="native", quiet=True)
    tiny = preset_config("tiny", num_layers=1)
    make_run(tmp_path / "tiny", tiny, tokenizer)
    with pytest.raises(ValueError, match="--format native: gated_norm_rank"):
        export(tmp_path / "tiny", tmp_path / "hf", fmt="native", quiet=True)
    assert not (tmp_path / "hf").exists()


def foreign_tokenizer_files(path) -> None:
    """A tokenizer marinlm did not train, as a public checkpoint ships it: its own special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(SAMPLE_TEXTS * 20, trainer)
    tok.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>"}
    (path / "tokenizer_config.json").write_text(json.dumps(config))


def _hf_folder(model, tokenizer, path, foreign: bool = False):
    model.save_pretrained(str(path))
    if foreign:
        foreign_tokenizer_files(path)
    else:
        tokenizer.save(path)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_a_public_moe_family_imports_with_equal_logits(tmp_path, tokenizer, family):
    common = dict(
        vocab_size=512,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts_per_tok=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
    )
    torch.manual_seed(0)
    if family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(moe_intermediate_size=32, num_experts=8, norm_topk_prob=True, **common)
        hf = transformers.Qwen3MoeForCausalLM(config)
    else:
        config = transformers.MixtralConfig(intermediate_size=32, num_local_experts=8, **common)
        hf = transformers.MixtralForCausalLM(config)
    with torch.no_grad():  # norm gains of 1 would hide a swapped norm
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    _hf_folder(hf.eval(), tokenizer, tmp_path / "hf", foreign=family == "mixtral")
    import_hf(tmp_path / "hf", tmp_path / "run")
    loaded = load_model(tmp_path / "run")
    ids = torch.randint(0, 400, (2, 33))
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(ids).logits, hf(ids).logits, rtol=1e-4, atol=1e-5)
    if family == "mixtral":  # its tokenizer's own special tokens, and no pad token: EOS pads
        tok = loaded.tokenizer
        assert (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 1)
        assert tok.decode(tok.encode("a quick fox")) == "a quick fox"


def test_a_family_that_cannot_be_expressed_is_refused_naming_why(tmp_path, tokenizer):
    config = transformers.OlmoeConfig(
        vocab_size=512, hidden_size=32, intermediate_size=16, num_hidden_layers=1, num_attention_heads=4, num_experts=4
    )
    _hf_folder(transformers.OlmoeForCausalLM(config), tokenizer, tmp_path / "hf")
    with pytest.raises(ValueError, match="OLMoE normalises q and k over all heads together"):
        import_hf(tmp_path / "hf", tmp_path / "run")
    (tmp_path / "hf" / "config.json").write_text(
        json.dumps({**config.to_dict(), "model_type": "qwen3_moe", "hidden_act": "gelu"})
    )
    with pytest.raises(ValueError, match="hidden_act='gelu' has no marinlm equivalent"):
        import_hf(tmp_path / "hf", tmp_path / "run")


def test_a_damaged_export_is_found_by_its_manifest(tmp_path, tokenizer):
    make_run(tmp_path / "run", preset_config("tiny", num_layers=1), tokenizer)
    export(tmp_path / "run", tmp_path / "hf", quiet=True)
    weights = tmp_path / "hf" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    assert verify(tmp_path / "hf") == ["model.safetensors"]
    with pytest.raises(ValueError, match="exists and is not empty; pass --overwrite"):
        export(tmp_path / "run", tmp_path / "hf", quiet=True)


def test_the_modeling_file_is_assembled_from_the_reference_source_or_not_at_all():
    text = modeling_source("test")
    assert text.count("class MarinForCausalLM(") == 1 and "class MarinHFForCausalLM(" in text
    with pytest.raises(ImportError, match="imports \\['fused_thing'\\] from marinlm.kernels"):
        _strip_own_imports("from marinlm.kernels import fused_thing\n", "marinlm.model.new", set())


def remote_code_breaches(sources: dict[str, str]) -> list[str]:
    """What in `sources` (module -> text, in pasting order) the flat remote-code file cannot take:
    a marinlm import inside a function or class, `import marinlm...`, an import of a name that no
    module pasted before defines, a top-level name defined twice."""
    import ast

    from marinlm.hf.remote_code import CONFIG_MODULE, _top_level_names

    found, names = [], {}
    for module, text in sources.items():
        tree = ast.parse(text)
        top = set(map(id, tree.body))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import) and any(a.name.startswith("marinlm") for a in node.names):
                found.append(f"{module}:{node.lineno}: import marinlm...")
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("marinlm"):
                if id(node) not in top:
                    found.append(f"{module}:{node.lineno}: a marinlm import inside a function")
                elif node.module != CONFIG_MODULE and any(a.name not in names for a in node.names):
                    found.append(f"{module}:{node.lineno}: imports from {node.module} what is not pasted before it")
        for name in _top_level_names(tree):
            if name in names:
                found.append(f"{module}: defines {name}, as {names[name]} does")
            names[name] = module
    return found


def test_the_reference_modules_keep_the_remote_code_contract():
    """model/__init__.py's contract, checked on the modules the export pastes, and on a planted
    breach of each kind."""
    from marinlm.hf.remote_code import SOURCE_MODULES, module_path

    sources = {m: module_path(m).read_text() for m in SOURCE_MODULES}
    assert remote_code_breaches(sources) == []
    planted = dict(sources)
    planted["marinlm.model.moe"] += "\n\ndef _late():\n    from marinlm.kernels import experts\n"
    planted["marinlm.model.loss"] += "\n\nclass RouterStats:\n    pass\n"
    planted["marinlm.model.layers"] = "from marinlm.model.moe import MoE\n" + planted["marinlm.model.layers"]
    found = remote_code_breaches(planted)
    assert any("inside a function" in f for f in found) and any("defines RouterStats" in f for f in found)
    assert any("imports from marinlm.model.moe what is not pasted before it" in f for f in found)


@pytest.mark.slow
@pytest.mark.distributed
def test_a_checkpoint_written_by_two_ranks_exports_and_matches(token_data, tmp_path):
    from test_layouts import torchrun

    config = train_config(
        token_data,
        tmp_path / "run",
        train={"steps": 2, "global_batch": 4, "precision": "fp32"},
        checkpoint={"every_steps": 2},
        validation={"every_steps": 0},
    )
    save_config(config, tmp_path / "run.yaml")
    torchrun(tmp_path / "run.yaml", 2)
    report = export(tmp_path / "run", tmp_path / "hf", quiet=True)
    assert report.checkpoint.name == "step-00000002"
    check = parity_check(tmp_path / "hf")
    assert check["max_abs_logit_diff"] < 1e-5 and check["max_kl"] < 1e-6 and check["greedy_equal"], check


@pytest.mark.slow
def test_lm_eval_on_the_export_scores_every_item_as_marinlm_eval_does(tmp_path, tokenizer):
    """A slice of bench/lm_eval_crosscheck.py: lm-eval's hf backend on the exported folder and
    `marinlm eval` on the run, the first items of each local task, through the shipped task YAMLs."""
    pytest.importorskip("lm_eval")
    from marinlm.eval.crosscheck import crosscheck

    from conftest import shared_data

    data = shared_data("eval")
    make_run(tmp_path / "run", preset_config("tiny", num_layers=2), tokenizer)
    export(tmp_path / "run", tmp_path / "hf", quiet=True)
    rows = crosscheck(
        tmp_path / "run", tmp_path / "hf", data, tasks=("arc_easy", "piqa", "winogrande", "lambada_openai"), limit=4
    )
    for row in rows:
        assert row["items"] == 4 and row["marinlm_acc"] == row["lm_eval_acc"], row
        assert row["max_ll_diff"] < 1e-4, row


@pytest.mark.slow
def test_marinlm_lm_eval_runs_the_harness_with_our_model_on_the_cpu(tmp_path, tokenizer, capsys):
    pytest.importorskip("lm_eval")
    from marinlm.cli import main

    from conftest import shared_data

    data = shared_data("eval")
    make_run(tmp_path / "run", preset_config("tiny", num_layers=1), tokenizer)
    argv = ["lm-eval", "--data-dir", str(data), "--model", "marinlm", "--model_args", f"pretrained={tmp_path / 'run'}"]
    assert main([*argv, "--tasks", "local_arc_easy", "--limit", "3", "--device", "cuda"]) == 0
    out = capsys.readouterr()
    assert "local_arc_easy" in out.out and "no CUDA device here: running on the CPU" in out.err
