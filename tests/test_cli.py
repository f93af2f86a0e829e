"""The command line: overrides reach configs; commands without a config reject unknown flags."""

import pytest

from marinlm.cli import main

from conftest import CONFIGS


@pytest.mark.parametrize(
    "argv, named",
    [
        (["quickstart", "--bogus", "1"], "--bogus"),
        (["generate", "runs/x", "--prompt", "a", "--max_new_tokens", "3"], "--max_new_tokens"),
        (["eval", "runs/x", "--tasks", "val", "--limt", "3"], "--limt"),
        (["quickstart", "--minutes", "0"], "must be > 0"),
        (["quickstart", "--minutes", "ten"], "not a number"),
        (["model", "summary", str(CONFIGS / "model" / "tiny.yaml"), "--seq-len=-5"], "must be > 0"),
    ],
)
def test_bad_arguments_stop_before_any_work(argv, named, capsys):
    with pytest.raises(SystemExit) as exit:
        main(argv)
    assert exit.value.code == 2
    assert named in capsys.readouterr().err


def test_overrides_reach_the_config(capsys):
    assert main(["model", "summary", str(CONFIGS / "model" / "tiny.yaml")]) == 0
    full = capsys.readouterr().out
    assert main(["model", "summary", str(CONFIGS / "model" / "tiny.yaml"), "--num_layers=1"]) == 0
    one_layer = capsys.readouterr().out
    assert full != one_layer
    assert main(["model", "summary", str(CONFIGS / "model" / "tiny.yaml"), "--num_layerz=1"]) == 2
    assert "num_layerz" in capsys.readouterr().err
