"""Progress bars: redrawn in place on a terminal, whole rate-limited lines in a log."""

import io
import re

import pytest
import torch

from marinlm.utils import progress
from marinlm.utils.progress import INTERVAL_ENV, progress_bar


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def run(stream, steps: int) -> list[str]:
    bar = progress_bar(total=steps, desc="train", unit="step", file=stream)
    for i in range(steps):
        bar.set_postfix(loss=f"{1 / (i + 1):.3f}", refresh=False)
        bar.update(1)
    bar.close()
    return stream.getvalue().split("\n")


def test_a_log_gets_few_whole_lines_with_count_rate_and_postfix(monkeypatch):
    monkeypatch.delenv(INTERVAL_ENV, raising=False)  # the default: a line at most every 30 s
    lines = run(io.StringIO(), 1000)
    assert lines[-1] == ""  # every line is terminated
    lines = lines[:-1]
    assert "\r" not in "".join(lines)
    assert len(lines) <= 3  # the opening state, at most one more, the final state
    assert lines[0].startswith("train:") and "0/1000" in lines[0]
    final = lines[-1]
    assert "1000/1000" in final and "step/s" in final and "loss=0.001" in final
    assert len(final) < 160  # a fixed width, not a bar stretched over an unknown terminal


def test_the_log_interval_is_configurable(monkeypatch):
    monkeypatch.setenv(INTERVAL_ENV, "0")
    lines = run(io.StringIO(), 50)[:-1]
    assert len(lines) == 52  # the opening state, one line per update, the final state at close()
    assert all(line.startswith("train:") and "\r" not in line for line in lines)
    assert [f"{i}/50" in line for i, line in enumerate(lines[:51])] == [True] * 51
    assert "50/50" in lines[51]


@pytest.mark.parametrize("raw", ["soon", "-1"])
def test_a_bad_interval_names_the_variable(monkeypatch, raw):
    monkeypatch.setenv(INTERVAL_ENV, raw)
    with pytest.raises(ValueError, match=INTERVAL_ENV):
        progress_bar(total=3, file=io.StringIO())


def test_a_terminal_gets_the_ordinary_bar_redrawn_in_place(monkeypatch):
    monkeypatch.setenv(INTERVAL_ENV, "3600")  # ignored on a terminal
    text = "\n".join(run(Terminal(), 200))
    assert text.count("\r") >= 2  # redrawn over itself, as tqdm does
    assert "200/200" in text


def test_a_disabled_bar_writes_nothing():
    stream = io.StringIO()
    bar = progress_bar(total=10, file=stream, disable=True)
    bar.update(10)
    bar.close()
    assert stream.getvalue() == ""


def _eta_line(text: str, desc: str) -> str:
    """The last line of the `desc` bar in `text`: its count and its ETA ("[elapsed<left").
    Off a terminal, every update is a line at interval 0."""
    lines = [line for line in text.splitlines() if line.startswith(desc)]
    assert lines, text[-2000:]
    assert re.search(r"\[\d\d:\d\d<\d\d:\d\d", lines[-1]), lines[-1]
    return lines[-1]


def test_long_stages_show_progress_with_an_eta(token_data, tmp_path, monkeypatch, capsys):
    """The quickstart's evaluation printed nothing for 292 s on a busy host. The stages that take
    minutes on a big model or split (validation over a whole split, export, import, plan search)
    each draw a bar with an ETA."""
    from marinlm.config import load_config
    from marinlm.dataset.loader import DataConfig, SourceConfig, open_sources
    from marinlm.hf.export import export
    from marinlm.hf.importer import import_hf
    from marinlm.plan import run_plan
    from marinlm.presets import preset
    from marinlm.tokenizer import MarinTokenizer
    from marinlm.train.config import TrainConfig
    from marinlm.train.step import validate_sources

    from conftest import build, tiny_config

    monkeypatch.setenv(INTERVAL_ENV, "0")
    monkeypatch.setattr(progress, "QUIET_SECONDS", 0.0)  # export and import show a bar after 2 s
    tok = MarinTokenizer.load(token_data.parent / "tokenizer")
    data = DataConfig(sources=[SourceConfig(path=str(token_data))], seq_len=64)
    val = open_sources(data, "val", tok.hash, tok.vocab_size)[0]
    model = build(tiny_config(vocab_size=tok.vocab_size), seed=0)
    validate_sources(model, {"val": val}, 4, None, 0, 1, device=torch.device("cpu"), precision="fp32", progress=True)
    batches = -(-val.rows_per_epoch // 4)
    assert f"{batches}/{batches}" in _eta_line(capsys.readouterr().err, "validation")

    from test_hf_export import make_run

    make_run(tmp_path / "run", tiny_config(vocab_size=tok.vocab_size), tok)
    export(tmp_path / "run", tmp_path / "hf")
    _eta_line(capsys.readouterr().err, "export: weights")
    import_hf(tmp_path / "hf", tmp_path / "back")
    _eta_line(capsys.readouterr().err, "import: weights")

    train = load_config(TrainConfig, preset("train", "tiny"))
    # A GPU profile: `--hardware cpu` would time each candidate layout in gloo processes (~40 s).
    run_plan(train, "h100-sxm", "dp_shard=4", True, tmp_path / "plan", gpus=4)
    _eta_line(capsys.readouterr().err, "plan: search")
