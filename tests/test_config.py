from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Literal

import pytest
import yaml

from marinlm.config import ConfigError, from_dict, load_config, parse_overrides, read_yaml, save_config, to_dict
from marinlm.model import MarinConfig, QBRouterConfig, SoftmaxTopKRouterConfig

from conftest import CONFIGS, tiny_config


def test_every_shipped_yaml_parses():
    """Each YAML under configs/ loads into the config class its folder names."""
    from marinlm.cli import config_class_for

    files = sorted(CONFIGS.rglob("*.yaml"))
    assert files
    for path in files:
        cls = config_class_for(path)
        config = load_config(cls, path)
        assert from_dict(cls, to_dict(config)) == config, path


def test_save_and_reload_is_lossless(tmp_path):
    config = load_config(MarinConfig, CONFIGS / "model" / "marin-535b-a23b.yaml")
    save_config(config, tmp_path / "resolved.yaml")
    assert load_config(MarinConfig, tmp_path / "resolved.yaml") == config


def test_overrides_nested_and_typed():
    config = load_config(
        MarinConfig,
        CONFIGS / "model" / "tiny.yaml",
        ["--moe.top_k=4", "--attention.qk_mult=2", "--moe.router.type=softmax_topk", "--z_loss_weight=3e-4"],
    )
    assert config.moe.top_k == 4
    assert config.attention.qk_mult == 2.0 and isinstance(config.attention.qk_mult, float)
    assert isinstance(config.moe.router, SoftmaxTopKRouterConfig)
    assert config.z_loss_weight == 3e-4


def test_parse_overrides_shapes():
    assert parse_overrides(["--a.b=1", "--a.c", "x", "--d=[1, 2]"]) == {"a": {"b": 1, "c": "x"}, "d": [1, 2]}
    with pytest.raises(ConfigError, match="no value"):
        parse_overrides(["--a.b"])


@pytest.mark.parametrize(
    "overrides, key, fragment",
    [
        (["--moe.bogus=1"], "moe.bogus", "unknown key"),
        (["--num_layers=two"], "num_layers", "expected an integer"),
        (["--attention.xsa=1"], "attention.xsa", "true or false"),
        (["--attention.num_kv_heads=3"], "attention.num_kv_heads", "must divide num_heads=4"),
        (["--moe.top_k=16"], "moe.top_k", "[1, num_experts-1=15]"),
        (["--moe.latent_dim=256"], "moe.latent_dim", "[1, d_model=128]"),
        (["--moe.router.type=nope"], "moe.router.type", "must be one of"),
        (["--sconv.sites=[q]"], "sconv.sites", "unknown site"),
        (["--attention.rope_fraction=0.3"], "attention.rope_fraction", "must be even"),
    ],
)
def test_bad_values_name_the_key(overrides, key, fragment):
    with pytest.raises(ConfigError) as info:
        load_config(MarinConfig, CONFIGS / "model" / "tiny.yaml", overrides)
    assert info.value.key == key
    assert fragment in str(info.value)


def test_a_bad_kernel_choice_names_the_key():
    from marinlm.train.config import TrainConfig

    with pytest.raises(ConfigError) as info:
        load_config(TrainConfig, CONFIGS / "train" / "tiny.yaml", ["--kernels.experts=cuda"])
    assert info.value.key == "kernels.experts" and "must be one of" in str(info.value)
    with pytest.raises(ConfigError, match="is a kernel; with modules: reference"):
        load_config(
            TrainConfig, CONFIGS / "train" / "tiny.yaml", ["--kernels.modules=reference", "--kernels.experts=bmm"]
        )


def test_a_run_folder_written_before_kernels_left_the_model_still_loads(tmp_path):
    """Run folders and checkpoints written before `kernels:` kept its keys under `model:`: they load
    with the keys moved (a value under `kernels:` wins), and the model section no longer knows them."""
    from marinlm.train.config import TrainConfig

    data = to_dict(load_config(TrainConfig, CONFIGS / "train" / "tiny.yaml"))
    del data["kernels"]
    data["model"] |= {"kernels": "reference", "loss_chunk_tokens": 64}
    data["model"]["moe"]["impl"] = "loop"
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(data))
    config = load_config(TrainConfig, tmp_path / "config.yaml")
    assert (config.kernels.modules, config.kernels.experts, config.kernels.loss_chunk_tokens) == (
        "reference",
        "loop",
        64,
    )
    config = load_config(TrainConfig, tmp_path / "config.yaml", ["--kernels.loss_chunk_tokens=0"])
    assert config.kernels.loss_chunk_tokens == 0
    with pytest.raises(ConfigError, match="unknown key"):
        load_config(MarinConfig, CONFIGS / "model" / "tiny.yaml", ["--loss_chunk_tokens=64"])


def test_bad_yaml_file_names_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("d_model: [unclosed\n")
    with pytest.raises(ConfigError, match="bad.yaml"):
        load_config(MarinConfig, bad)
    with pytest.raises(ConfigError, match="not found"):
        load_config(MarinConfig, tmp_path / "missing.yaml")
    bad.write_text("d_model: 64\n  num_layers: 2\n")
    with pytest.raises(ConfigError) as info:
        load_config(MarinConfig, bad)
    assert f'in "{bad}", line 2' in str(info.value)  # YAML's own position, with the real file name
    bad.write_bytes(b'd_model: 64\nname: "\xff"\n')
    with pytest.raises(ConfigError, match="bad.yaml: not UTF-8 text"):
        load_config(MarinConfig, bad)


def test_a_key_given_twice_in_a_file_is_an_error(tmp_path):
    # PyYAML keeps the last of two equal keys in silence: a `lr:` edited further down would win.
    path = tmp_path / "twice.yaml"
    path.write_text("d_model: 64\nattention:\n  num_heads: 4\n  num_kv_heads: 2\n  num_heads: 8\n")
    with pytest.raises(ConfigError, match=r"twice.yaml: .*'num_heads' given twice \(first on line 3, again on line 5"):
        load_config(MarinConfig, path)
    # A merge key's fields may still be overridden: that is what `<<:` is for.
    path.write_text("base: &b {num_heads: 4, num_kv_heads: 2}\nattention:\n  <<: *b\n  num_heads: 8\n")
    assert read_yaml(path)["attention"] == {"num_heads": 8, "num_kv_heads": 2}


def test_errors_say_whether_the_file_or_the_command_line_set_the_key(tmp_path):
    path = CONFIGS / "model" / "tiny.yaml"
    with pytest.raises(ConfigError, match=r"moe.top_k: .* \(set on the command line\)$"):
        load_config(MarinConfig, path, ["--moe.top_k=999"])
    with pytest.raises(ConfigError, match=r"unknown key .* \(set on the command line\)$"):
        load_config(MarinConfig, path, ["--moe.topk=2"])
    # The file's num_kv_heads no longer divides the overridden num_heads: both sources are named.
    with pytest.raises(ConfigError, match=r"num_kv_heads: .*tiny.yaml, with the command-line overrides\)$"):
        load_config(MarinConfig, path, ["--attention.num_heads=3"])
    from marinlm.train.config import TrainConfig

    with pytest.raises(ConfigError, match=r"data.sources\[0\].weight: .* \(set on the command line\)$"):
        load_config(TrainConfig, CONFIGS / "train" / "tiny.yaml", ["--data.sources=[{path: x, weight: -1}]"])
    bad = tmp_path / "bad.yaml"
    bad.write_text(path.read_text().replace("top_k: 2", "top_k: 999"))
    with pytest.raises(ConfigError, match=r"moe.top_k: .*bad.yaml\)$"):
        load_config(MarinConfig, bad)


def test_a_config_given_to_the_wrong_command_says_what_it_is(tmp_path):
    from marinlm.commands import config_kinds
    from marinlm.data.pipeline import PipelineConfig
    from marinlm.train.config import TrainConfig

    kinds = config_kinds()  # the commands' table, as the CLI passes it (config/ knows no commands)

    with pytest.raises(
        ConfigError, match=r"that file is a data curation config \(for `marinlm data run`\), not a Train"
    ):
        load_config(TrainConfig, CONFIGS / "data" / "python-corpus.yaml", kinds=kinds)
    with pytest.raises(
        ConfigError, match=r"that file is a training config \(for `marinlm train`\), not a PipelineConfig"
    ):
        load_config(PipelineConfig, CONFIGS / "train" / "tiny.yaml", kinds=kinds)
    with pytest.raises(ConfigError, match=r"that file is a model config"):
        load_config(TrainConfig, CONFIGS / "model" / "tiny.yaml", kinds=kinds)
    # A typo in a file of the right kind is only the unknown key, with no guess at another kind.
    typo = tmp_path / "typo.yaml"
    typo.write_text((CONFIGS / "model" / "tiny.yaml").read_text() + "d_modle: 64\n")
    with pytest.raises(ConfigError, match=r"^d_modle: unknown key for MarinConfig; .*typo.yaml\)$"):
        load_config(MarinConfig, typo)


def test_choice_round_trip_keeps_variant():
    config = tiny_config(moe={"router": {"type": "qb", "weight_sum": 1.5}})
    data = to_dict(config)
    assert data["moe"]["router"]["type"] == "qb" and data["moe"]["router"]["weight_sum"] == 1.5
    again = from_dict(MarinConfig, yaml.safe_load(yaml.safe_dump(data)))
    assert isinstance(again.moe.router, QBRouterConfig) and again.moe.router.weight_sum == 1.5


def test_sub_config_can_be_a_file_reference(tmp_path):
    @dataclass(kw_only=True)
    class Run:
        model: MarinConfig = field(default_factory=MarinConfig)
        name: str = "x"

    run_file = tmp_path / "run.yaml"
    run_file.write_text(f"model: {CONFIGS / 'model' / 'tiny.yaml'}\nname: demo\n")
    run = load_config(Run, run_file, ["--model.num_layers=2"])
    assert run.model.d_model == 128 and run.model.num_layers == 2 and run.name == "demo"

    # A file given on the command line, with some of its keys changed, in either order. This was
    # "model.num_layers: conflicts with another override", and the other order dropped the edit.
    qwen = CONFIGS / "model" / "qwen3-moe-style.yaml"
    for overrides in ([f"--model={qwen}", "--model.num_layers=2"], ["--model.num_layers=2", f"--model={qwen}"]):
        run = load_config(Run, run_file, overrides)
        assert run.model.d_model == 384 and run.model.num_layers == 2 and run.name == "demo", overrides
    # A whole config (a run's config.yaml) given for a section: that section of it, which is how a
    # run continues from another run's model (checkpoint.init_from).
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.yaml").write_text(f"name: other\nmodel: {qwen}\n")
    run = load_config(Run, run_file, [f"--model={tmp_path / 'other' / 'config.yaml'}", "--model.num_layers=2"])
    assert run.model.d_model == 384 and run.model.num_layers == 2 and run.name == "demo"
    # The same in a file: `include:` in a sub-config's mapping, relative to that file.
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "run.yaml").write_text("model:\n  include: ../model.yaml\n  num_layers: 3\n")
    (tmp_path / "model.yaml").write_text(qwen.read_text())
    run = load_config(Run, tmp_path / "sub" / "run.yaml")
    assert run.model.d_model == 384 and run.model.num_layers == 3
    with pytest.raises(ConfigError) as info:
        load_config(Run, run_file, [f"--model={tmp_path / 'none.yaml'}", "--model.num_layers=2"])
    assert info.value.key == "model" and "not found" in str(info.value)


@pytest.mark.parametrize(
    "override, key",
    [
        ("--eval.every_n_steps=5", "eval.tasks"),
        ("--eval.limit=0", "eval.limit"),
        ("--eval.every_n_steps=-1", "eval.every_n_steps"),
        ("--validation.every_steps=-1", "validation.every_steps"),
        ("--validation.batch_size=0", "validation.batch_size"),
        ("--profile.num_steps=-2", "profile.num_steps"),
        ("--optim.betas=[1.5, 0.9]", "optim.betas"),
        ("--optim.eps=0", "optim.eps"),
        ("--optim={type: adamw, weight_decay: -1}", "optim.weight_decay"),
    ],
)
def test_bad_train_settings_fail_at_load(override, key):
    from marinlm.train.config import TrainConfig

    with pytest.raises(ConfigError) as info:
        load_config(TrainConfig, CONFIGS / "train" / "tiny.yaml", [override])
    assert info.value.key == key


@pytest.mark.parametrize(
    "override, key, fragment",
    [
        ("--train.steps=1.5", "train.steps", "expected an integer, got 1.5"),
        ("--train.steps=null", "train.steps", "expected an integer, got None"),
        ("--train.grad_clip=abc", "train.grad_clip", "expected float | None, got 'abc'"),
        ("--optim.betas=[0.9, 0.95, 0.99]", "optim.betas", "expected 2 items, got 3"),
        ("--data.sources=runs/tokens", "data.sources", "expected a list"),
        ("--data.sources=[{path: a, weight: x}]", "data.sources[0].weight", "expected a number"),
        ("--data=3", "data", "expected a mapping for DataConfig"),
        ("--run_dir=[a]", "run_dir", "expected a string"),
        ("--checkpoint.async_save=2", "checkpoint.async_save", "expected true or false, got 2"),
    ],
)
def test_wrong_types_name_the_key_and_the_value(override, key, fragment):
    from marinlm.train.config import TrainConfig

    with pytest.raises(ConfigError) as info:
        load_config(TrainConfig, CONFIGS / "train" / "tiny.yaml", [override])
    assert info.value.key == key
    assert fragment in str(info.value)


def test_list_items_are_overridden_by_index():
    """`--data.sources.0.path=runs/tokens`, as the tiny config's comment says to point it, was
    "expected a list, got {'0': ...}": a list could only be replaced whole."""
    from marinlm.train.config import TrainConfig

    path = CONFIGS / "train" / "tiny.yaml"
    base = load_config(TrainConfig, path)
    config = load_config(
        TrainConfig,
        path,
        ["--data.sources.0.path=mine", "--data.sources.1.path=other", "--data.sources.1.weight=0.25"],
    )
    assert [(s.path, s.weight) for s in config.data.sources] == [("mine", base.data.sources[0].weight), ("other", 0.25)]
    assert config.data.seq_len == base.data.seq_len  # the rest of `data` is kept
    cases = [
        ("--data.sources.2.path=x", "data.sources.2", "index must be 0..1"),  # a gap: not an append
        ("--data.sources.0.weight=x", "data.sources[0].weight", "expected a number"),
        ("--data.sources.0.nope=1", "data.sources[0].nope", "unknown key"),
        ("--data.mixture_phases.0.step=3", "data.mixture_phases", "give the whole list"),  # not in the file
    ]
    for override, key, fragment in cases:
        with pytest.raises(ConfigError) as info:
            load_config(TrainConfig, path, [override])
        assert info.value.key == key, override
        assert fragment in str(info.value) and "set on the command line" in str(info.value), override


def test_yaml_words_and_numbers_given_for_strings_are_read_as_written(tmp_path):
    """YAML 1.1 reads the Norwegian language code `no` as false and `007` as 7: where the field is a
    string these were "expected a string, got False". Other fields still take the YAML value."""
    from marinlm.data.pipeline import PipelineConfig
    from marinlm.train.config import TrainConfig

    data = CONFIGS / "data" / "shared-corpus.yaml"
    cli = load_config(PipelineConfig, data, ["--langid.allowed=[en, no, 'on']", "--output_dir=2026-11-30"])
    assert cli.langid.allowed == ["en", "no", "on"] and cli.output_dir == "2026-11-30"  # not a date
    (tmp_path / "d.yaml").write_text(f"include: {data}\nlangid:\n  allowed: [no, zh]\n  threshold: 1\n")
    from_file = load_config(PipelineConfig, tmp_path / "d.yaml")
    assert from_file.langid.allowed == ["no", "zh"] and from_file.langid.threshold == 1.0
    save_config(from_file, tmp_path / "saved.yaml")
    assert load_config(PipelineConfig, tmp_path / "saved.yaml") == from_file

    @dataclass(kw_only=True)
    class Choices:
        number: Literal[1, 2] = 1
        word: Literal["on", "off"] = "on"

    choices = load_config(Choices, None, ["--number=2", "--word=off"])
    assert (choices.number, choices.word) == (2, "off") and type(choices.number) is int  # values, not wrappers

    train = CONFIGS / "train" / "tiny.yaml"
    config = load_config(TrainConfig, train, ["--train.steps=1e3", "--checkpoint.async_save=yes", "--run_dir=1.50"])
    assert (config.train.steps, config.checkpoint.async_save, config.run_dir) == (1000, True, "1.50")
    for override, fragment in [
        ("--train.steps=no", "expected an integer, got False"),
        ("--train.steps=1.5e3x", "expected an integer, got '1.5e3x'"),
        ("--train.steps=[1", "not a YAML value"),
        # The word as written, not False:
        ("--kernels.experts=no", "must be one of ['auto', 'grouped_mm', 'chunked', 'bmm', 'loop'], got 'no'"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(fragment)):
            load_config(TrainConfig, train, [override])


def test_lossless_conversions_are_accepted():
    """YAML reads `3e-4` as a string and `8.0` as a float: both are what the user meant."""
    from marinlm.train.config import TrainConfig

    config = load_config(TrainConfig, CONFIGS / "train" / "tiny.yaml", ["--optim.lr=3e-4", "--train.steps=8.0"])
    assert config.optim.lr == 3e-4 and config.train.steps == 8 and isinstance(config.train.steps, int)


def test_shipped_configs_load_from_any_folder_and_a_local_file_wins(tmp_path, monkeypatch):
    """With a plain `pip install` there is no configs/ folder: the README's `configs/train/tiny.yaml`
    was 'config file not found' everywhere but in a checkout."""
    from marinlm.train.config import TrainConfig

    monkeypatch.chdir(tmp_path)
    shipped = load_config(TrainConfig, CONFIGS / "train" / "tiny.yaml")
    for spelling in ("configs/train/tiny.yaml", "train/tiny.yaml", "train/tiny"):
        assert load_config(TrainConfig, spelling) == shipped, spelling
    (tmp_path / "configs" / "train").mkdir(parents=True)
    # The user's own file wins. It includes the shipped one, whose `model: ../model/tiny.yaml` is
    # relative to the shipped file (it was taken relative to the including file: not found).
    (tmp_path / "configs" / "train" / "tiny.yaml").write_text(
        f"include: {CONFIGS / 'train' / 'tiny.yaml'}\noptim:\n  lr: 0.125\n"
    )
    mine = load_config(TrainConfig, "configs/train/tiny.yaml")
    assert mine.optim.lr == 0.125 and mine.model == shipped.model
    with pytest.raises(ConfigError, match=r"config file not found: train/tny \(shipped configs: .*train/tiny\.yaml"):
        load_config(TrainConfig, "train/tny")


def test_sub_config_files_fall_back_to_the_shipped_copy_and_a_bare_name_says_how(tmp_path, monkeypatch):
    """The README's `--model=configs/model/small.yaml` was 'config file not found' outside a
    checkout, though `marinlm train configs/train/tiny.yaml` found the shipped copy; and `model:
    model/tiny` in a YAML read 'expected a mapping for MarinConfig'."""
    from marinlm.train.config import TrainConfig

    monkeypatch.chdir(tmp_path)  # no configs/ here
    small = load_config(MarinConfig, CONFIGS / "model" / "small.yaml")
    config = load_config(TrainConfig, "train/tiny", ["--model=configs/model/small.yaml", "--model.num_layers=3"])
    assert config.model.d_model == small.d_model and config.model.num_layers == 3
    # In a file: relative to the file first, then the shipped copy.
    (tmp_path / "run.yaml").write_text("include: configs/train/tiny.yaml\nmodel: configs/model/small.yaml\n")
    assert load_config(TrainConfig, "run.yaml").model == small
    (tmp_path / "configs" / "model").mkdir(parents=True)
    (tmp_path / "configs" / "model" / "small.yaml").write_text(
        f"include: {CONFIGS / 'model' / 'small.yaml'}\nnum_layers: 2\n"
    )
    assert load_config(TrainConfig, "run.yaml").model.num_layers == 2  # the file beside it wins
    with pytest.raises(ConfigError, match=r"^model: expected a mapping, or a YAML file's path ending in \.yaml"):
        load_config(TrainConfig, "train/tiny", ["--model=model/tiny"])
    # A nested sub-config's error names its whole key.
    with pytest.raises(ConfigError, match=r"^model\.moe: expected a mapping, or a YAML file's path"):
        load_config(TrainConfig, "train/tiny", ["--model.moe=small"])
    with pytest.raises(ConfigError, match=r"^model\.moe: expected a mapping, or a YAML file's path"):
        load_config(TrainConfig, "train/tiny", ["--model=configs/model/small.yaml", "--model.moe=small"])
    with pytest.raises(ConfigError, match=r"^model\.moe: config file not found: .*nope\.yaml"):
        load_config(TrainConfig, "train/tiny", ["--model.moe=nope.yaml"])


def test_a_copy_of_a_shipped_config_elsewhere_finds_the_shipped_configs_it_names(tmp_path):
    """`configs/train/tiny.yaml` copied into one's own folder names `../model/tiny.yaml`, which is
    not beside the copy: the shipped one is meant (it failed with 'config file not found')."""
    import shutil

    from marinlm.train.config import TrainConfig

    copy = tmp_path / "mine" / "tiny.yaml"
    copy.parent.mkdir()
    shutil.copy(CONFIGS / "train" / "tiny.yaml", copy)
    assert load_config(TrainConfig, copy).model == load_config(TrainConfig, CONFIGS / "train" / "tiny.yaml").model
    (tmp_path / "model").mkdir()  # one's own sibling, where it exists, still wins
    own = load_config(MarinConfig, CONFIGS / "model" / "tiny.yaml", ["--num_layers=2"])
    save_config(own, tmp_path / "model" / "tiny.yaml")
    assert load_config(TrainConfig, copy).model.num_layers == 2


def test_a_file_given_for_a_section_replaces_it():
    """`--model=FILE` on a training config is FILE's model, not tiny's with FILE's keys merged in
    (which kept tiny's num_global_kv_heads: 1 in a "qwen3-moe-style" run); keys after it edit it."""
    from marinlm.train.config import TrainConfig

    qwen = load_config(MarinConfig, CONFIGS / "model" / "qwen3-moe-style.yaml")
    swapped = load_config(TrainConfig, CONFIGS / "train" / "tiny.yaml", ["--model=configs/model/qwen3-moe-style.yaml"])
    assert swapped.model == qwen
    edited = load_config(
        TrainConfig,
        CONFIGS / "train" / "tiny.yaml",
        ["--model=configs/model/qwen3-moe-style.yaml", "--model.num_layers=2"],
    )
    assert edited.model == replace(qwen, num_layers=2)
    # the rest of the training config stays the file's
    assert swapped.optim == load_config(TrainConfig, CONFIGS / "train" / "tiny.yaml").optim


def test_training_eval_tasks_under_a_pipeline_or_tensor_parallel_are_refused_naming_the_key():
    """They crashed at the first evaluation, after the steps before it (no logits from a pipeline; a
    collective mismatch in tensor-parallel decoding)."""
    from marinlm.train.config import TrainConfig

    hook = ["--eval.every_n_steps=4", "--eval.tasks=[hellaswag]"]
    for layout in ("--parallel.pipeline_parallel=2", "--parallel.tensor_parallel=2"):
        with pytest.raises(ConfigError) as info:
            load_config(TrainConfig, None, [*hook, layout])
        assert info.value.key == "eval.every_n_steps"
    load_config(TrainConfig, None, [*hook, "--parallel.expert_parallel=2"])
