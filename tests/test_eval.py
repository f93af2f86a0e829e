from __future__ import annotations

import copy
import json
import math
import random
import re
import statistics
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from marinlm.config import ConfigError
from marinlm.eval.lm import Request, Scorer
from marinlm.eval.runner import EvalOptions, markdown_table, prepare, run_eval
from marinlm.eval.tasks import BOOTSTRAP_ITERS, MMLU, Item, Lambada, TaskDataError, score, task_registry
from marinlm.loading import LoadedModel
from marinlm.tokenizer import MarinTokenizer, train_bpe
from marinlm.train.config import TrainConfig

from conftest import SAMPLE_TEXTS, build, shared_data, tiny_config, torchrun_command, train_config


@pytest.fixture(scope="module")
def loaded(tmp_path_factory) -> LoadedModel:
    tok = MarinTokenizer(train_bpe(SAMPLE_TEXTS * 30, vocab_size=600))
    model = build(tiny_config(attention={"sliding_window": 8}), seed=3).eval()
    return LoadedModel(model, tok, TrainConfig(), Path("memory"), tok.hash)


def reference_loglikelihood(loaded, scorer, context, continuation):
    """One full forward over [BOS] context continuation, no cache, no batching."""
    ctx, cont = scorer.encode_pair(context, continuation)
    ids = torch.tensor([ctx + cont])
    with torch.no_grad():
        logp = torch.log_softmax(loaded.model(ids).logits[0].float(), -1)
    rows = logp[len(ctx) - 1 : len(ctx) + len(cont) - 1]
    target = torch.tensor(cont)
    return float(rows.gather(-1, target.unsqueeze(-1)).sum()), bool((rows.argmax(-1) == target).all())


REQUESTS = [
    Request("The quick brown fox", " jumps over the lazy dog."),
    Request("The quick brown fox", " sleeps."),
    Request("The quick brown fox", " and a much longer ending that runs on for a while, doesn't it"),
    Request("def fibonacci(n):\n    ", "return n"),
    Request("天下大势，", "分久必合"),
    Request("Question: what is 2+2?\nAnswer:", " 4"),
    Request("x" * 300, " y"),  # longer than the window and than max_length after truncation
]


@pytest.mark.parametrize("batch_size, share", [(32, True), (3, True), (1, False)])
def test_loglikelihood_matches_brute_force(loaded, batch_size, share):
    scorer = Scorer(loaded.model, loaded.tokenizer, max_length=64, batch_size=batch_size, share_context=share)
    got = scorer.loglikelihood(REQUESTS)
    for req, (ll, greedy) in zip(REQUESTS, got):
        ref_ll, ref_greedy = reference_loglikelihood(loaded, scorer, req.context, req.continuation)
        assert ll == pytest.approx(ref_ll, abs=2e-3, rel=1e-4), req
        assert greedy == ref_greedy
    assert all(ll < 0 for ll, _ in got)
    assert scorer.loglikelihood([]) == [] and scorer.loglikelihood_rolling([]) == []


def test_a_continuation_longer_than_the_window_is_scored_in_windows(loaded):
    """PIQA has solutions longer than a 256-token model's window: `marinlm eval` stopped there with
    an error, after scoring the tasks before it. Such a continuation is scored as rolling windows
    score a text: each window predicts the next run of up to L tokens from the L tokens before it."""
    L = 16
    scorer = Scorer(loaded.model, loaded.tokenizer, max_length=L, batch_size=4)
    long = Request("The quick brown fox", " " + " ".join(SAMPLE_TEXTS)[:200])
    requests = [REQUESTS[0], long, REQUESTS[1]]
    ctx, cont = scorer.encode_pair(long.context, long.continuation)
    assert len(cont) > 2 * L and ctx[0] == loaded.tokenizer.bos_id  # three windows, all the context kept
    stream, expected, greedy = ctx + cont, 0.0, True
    with torch.no_grad():
        for start in range(len(ctx), len(stream), L):
            end = min(len(stream), start + L)
            inp = stream[max(0, end - 1 - L) : end - 1]
            logp = torch.log_softmax(loaded.model(torch.tensor([inp])).logits[0].float(), -1)[-(end - start) :]
            target = torch.tensor(stream[start:end])
            expected += float(logp.gather(-1, target.unsqueeze(-1)).sum())
            greedy = greedy and bool((logp.argmax(-1) == target).all())
    got = scorer.loglikelihood(requests)
    assert got[1][0] == pytest.approx(expected, rel=1e-5) and got[1][1] == greedy
    for req, (ll, _) in zip((requests[0], requests[2]), (got[0], got[2])):  # the others batched as before
        assert ll == pytest.approx(reference_loglikelihood(loaded, scorer, req.context, req.continuation)[0], abs=2e-3)


def test_a_contexts_forward_computes_the_first_continuation_tokens_logits_only(loaded):
    """Each context is run once for the logits of its last position; the continuation's own
    forward gives the rest. Never the [B, T, V] logits of the contexts ("x" * 300 is one)."""
    scorer = Scorer(loaded.model, loaded.tokenizer, max_length=64, batch_size=32)
    longest = max(len(scorer.encode_pair(r.context, r.continuation)[1]) for r in REQUESTS)
    positions = []
    hook = loaded.model.lm_head.register_forward_pre_hook(lambda module, args: positions.append(args[0].shape[1]))
    try:
        scorer.loglikelihood(REQUESTS)
    finally:
        hook.remove()
    assert positions[0] == 1 and max(positions) <= longest - 1 < 60


def test_progress_bars_count_requests_and_windows_without_changing_scores(loaded, capsys):
    quiet = Scorer(loaded.model, loaded.tokenizer, max_length=64, batch_size=3)
    loud = Scorer(loaded.model, loaded.tokenizer, max_length=64, batch_size=3, progress=True)
    assert loud.loglikelihood(REQUESTS, desc="mc") == quiet.loglikelihood(REQUESTS)
    text = " ".join(SAMPLE_TEXTS * 3)
    windows = math.ceil(len(loaded.tokenizer.encode(text)) / 64)
    assert windows > 3  # more than one batch of windows
    assert loud.loglikelihood_rolling([text, "short"], desc="bpb") == quiet.loglikelihood_rolling([text, "short"])
    err = capsys.readouterr().err
    assert "mc: 100%" in err and f"{len(REQUESTS)}/{len(REQUESTS)}" in err and "req/s" in err
    assert "bpb: 100%" in err and f"{windows + 1}/{windows + 1}" in err and "window/s" in err


def test_scoring_is_dealt_across_ranks_with_the_same_forwards_on_each(loaded, monkeypatch):
    """Under torchrun every rank used to score every request (and validation row): the time of one
    process. Two ranks are simulated here: each scores a disjoint share, both run the same number of
    forwards (a sharded model needs all ranks in each), and the gathered scores are the whole."""
    import marinlm.eval.lm as lm

    # Odd numbers of batches (7 and 3 here), so one rank runs out first; one-token continuations too.
    requests = REQUESTS * 3 + [Request(f"Number {i}:", " one") for i in range(5)]
    texts = [" ".join(SAMPLE_TEXTS * 2), "short", " ".join(SAMPLE_TEXTS[:3]), "a b"]
    single = Scorer(loaded.model, loaded.tokenizer, max_length=64, batch_size=3)
    want_ll, want_rolling = single.loglikelihood(requests), single.loglikelihood_rolling(texts)

    shares, forwards = {}, {}
    sizes = [len(requests), sum(math.ceil(len(loaded.tokenizer.encode(t)) / 64) for t in texts)]

    def gather_alone(obj, rank):  # a gather that keeps this rank's share; the rest filled with zeros
        mine = shares.setdefault(rank, [])
        mine.append(obj)
        return [obj, {i: 0.0 for i in range(sizes[len(mine) - 1]) if i not in obj}]

    for rank in (0, 1):
        count: list[int] = []
        monkeypatch.setattr(lm, "rank_and_world", lambda rank=rank: (rank, 2))
        monkeypatch.setattr(lm, "all_gather_object", lambda obj, rank=rank: gather_alone(obj, rank))
        handle = loaded.model.register_forward_pre_hook(lambda module, args, count=count: count.append(1))
        try:
            scorer = Scorer(loaded.model, loaded.tokenizer, max_length=64, batch_size=3)
            scorer.loglikelihood(requests)
            scorer.loglikelihood_rolling(texts)
        finally:
            handle.remove()
        forwards[rank] = len(count)
    assert forwards[0] == forwards[1] > 0
    (ll0, windows0), (ll1, windows1) = shares[0], shares[1]
    assert not set(ll0) & set(ll1) and set(ll0) | set(ll1) == set(range(len(requests)))
    assert abs(len(ll0) - len(ll1)) < len(requests) // 2  # a share each, not all on one rank
    assert not set(windows0) & set(windows1) and windows0 and windows1

    # Rank 0, given rank 1's scores by the gather, returns the one-process results.
    others = iter(shares[1])
    monkeypatch.setattr(lm, "rank_and_world", lambda: (0, 2))
    monkeypatch.setattr(lm, "all_gather_object", lambda obj: [obj, next(others)])
    scorer = Scorer(loaded.model, loaded.tokenizer, max_length=64, batch_size=3)
    for (ll, greedy), (want, want_greedy) in zip(scorer.loglikelihood(requests), want_ll, strict=True):
        assert ll == pytest.approx(want, abs=1e-5) and greedy == want_greedy
    for (total, n), (want, want_n) in zip(scorer.loglikelihood_rolling(texts), want_rolling, strict=True):
        assert total == pytest.approx(want, rel=1e-6) and n == want_n


@pytest.mark.parametrize(
    "field, value",
    [("tasks", []), ("limit", 0), ("limit", -3), ("batch_size", 0), ("num_fewshot", -1), ("num_fewshot", 3)],
)
def test_bad_eval_options_name_the_field(field, value):
    """`num_fewshot` is MMLU's: without mmlu among the tasks it was ignored, the report saying "3-shot"."""
    with pytest.raises(ConfigError) as info:
        EvalOptions(**{"tasks": ["hellaswag"], field: value})
    assert info.value.key == field
    assert EvalOptions(tasks=["hellaswag", "mmlu"], num_fewshot=3).num_fewshot == 3


def test_encode_pair_moves_trailing_space_to_continuation(loaded):
    scorer = Scorer(loaded.model, loaded.tokenizer)
    ctx, cont = scorer.encode_pair("Answer: ", "yes")
    assert loaded.tokenizer.decode(ctx[1:]) == "Answer:" and loaded.tokenizer.decode(cont) == " yes"
    assert ctx[0] == loaded.tokenizer.bos_id


def test_rolling_loglikelihood_windows(loaded):
    text = " ".join(SAMPLE_TEXTS)
    ids = loaded.tokenizer.encode(text)
    L = 16
    head_calls = []
    hook = loaded.model.lm_head.register_forward_pre_hook(lambda module, args: head_calls.append(args[0].shape))
    try:
        scorer = Scorer(loaded.model, loaded.tokenizer, max_length=L, batch_size=4)
        ((total, count),) = scorer.loglikelihood_rolling([text])
    finally:
        hook.remove()
    assert head_calls == []  # scored through the chunked LM head and loss: no [B, T, V] logits
    assert count == len(ids)
    stream = [loaded.tokenizer.bos_id, *ids]
    expected = 0.0
    with torch.no_grad():
        for start in range(0, len(ids), L):  # disjoint windows, each predicting up to L tokens
            end = min(len(ids), start + L)
            inp = stream[max(0, end - L) : end]
            logp = torch.log_softmax(loaded.model(torch.tensor([inp])).logits[0].float(), -1)
            n = end - start
            expected += float(logp[len(inp) - n :].gather(-1, torch.tensor(ids[start:end]).unsqueeze(-1)).sum())
    assert total == pytest.approx(expected, rel=1e-5)


def test_scoring_on_hand_made_items():
    task = task_registry()["hellaswag"]
    items = [
        Item([Request("c", " a"), Request("c", " bbbbbbbb")], gold=1, choice_lengths=[1, 8]),
        Item([Request("c", " a"), Request("c", " b")], gold=0, choice_lengths=[1, 1]),
    ]
    # item 1: raw argmax picks 0 (-2 > -4), per-character picks 1 (-0.5 > -2): acc 0, acc_norm 1
    results = [[(-2.0, False), (-4.0, False)], [(-1.0, True), (-3.0, False)]]
    metrics, preds = score(task, items, results)
    assert metrics["acc"] == 0.5 and metrics["acc_norm"] == 1.0
    assert metrics["acc_stderr"] == pytest.approx(0.5)
    assert [p["pred"] for p in preds] == [0, 0] and [p["pred_norm"] for p in preds] == [1, 0]
    lam_metrics, _ = score(Lambada(), [Item([Request("a", " b")])] * 2, [[(-1.0, True)], [(-3.0, False)]])
    assert lam_metrics["acc"] == 0.5 and lam_metrics["perplexity"] == pytest.approx(math.exp(2.0))
    mmlu_items = [
        Item([Request("q", f" {l}") for l in "ABCD"], g, [1] * 4, {"subject": s})
        for g, s in ((0, "a"), (1, "a"), (2, "a"), (3, "b"))
    ]
    mmlu_res = [[(-1.0, 0), (-2.0, 0), (-3.0, 0), (-4.0, 0)]] * 4  # always picks A
    m, _ = score(MMLU(), mmlu_items, mmlu_res)
    assert m["acc_micro"] == 0.25 and m["acc_macro"] == pytest.approx((1 / 3 + 0) / 2)
    assert m["subjects"] == {"a": {"acc": pytest.approx(1 / 3), "n": 3}, "b": {"acc": 0.0, "n": 1}}


def write_tasks(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "arc_easy.jsonl").write_text(
        json.dumps({"query": "Question: Which is a mammal?", "choices": ["whale", "shark"], "gold": 0}) + "\n"
    )
    (folder / "piqa_valid.jsonl").write_text(json.dumps({"goal": "Open a jar", "sol1": "twist", "sol2": "lick"}) + "\n")
    (folder / "piqa_valid_labels.lst").write_text("0\n")
    (folder / "winogrande.jsonl").write_text(
        json.dumps(
            {
                "context_options": ["Tom helped Bob because Tom", "Tom helped Bob because Bob"],
                "continuation": "needed help.",
                "gold": 1,
            }
        )
        + "\n"
    )
    (folder / "lambada_openai_test.jsonl").write_text(json.dumps({"text": "the cat sat on the mat"}) + "\n")
    (folder / "hellaswag_val.jsonl").write_text(
        json.dumps(
            {"ctx": "A man opens a door. he", "endings": ["walks in.", "eats it.", "flies.", "sings."], "label": 0}
        )
        + "\n"
    )
    for split in ("dev", "test"):
        (folder / "mmlu" / split).mkdir(parents=True, exist_ok=True)
        (folder / "mmlu" / split / f"astronomy_{split}.csv").write_text(
            '"What orbits Earth?",Moon,Sun,Mars,Venus,A\n"Hottest planet?",Mars,Venus,Earth,Pluto,B\n'
        )


def test_prompt_formats_follow_the_harness(tmp_path):
    write_tasks(tmp_path)
    reg = task_registry(num_fewshot=1)
    arc = reg["arc_easy"].load(tmp_path)[0]
    assert arc.requests[0] == Request("Question: Which is a mammal?\nAnswer:", " whale")
    piqa = reg["piqa"].load(tmp_path)[0]
    assert piqa.requests[1] == Request("Question: Open a jar\nAnswer:", " lick") and piqa.gold == 0
    wino = reg["winogrande"].load(tmp_path)[0]
    assert wino.requests[1] == Request("Tom helped Bob because Bob", " needed help.")
    lam = reg["lambada_openai"].load(tmp_path)[0]
    assert lam.requests == [Request("the cat sat on the", " mat")]
    mmlu = reg["mmlu"].load(tmp_path)
    assert mmlu[0].requests[0].context == (
        "The following are multiple choice questions (with answers) about astronomy.\n\n"
        "What orbits Earth?\nA. Moon\nB. Sun\nC. Mars\nD. Venus\nAnswer: A\n\n"
        "What orbits Earth?\nA. Moon\nB. Sun\nC. Mars\nD. Venus\nAnswer:"
    )
    assert [r.continuation for r in mmlu[1].requests] == [" A", " B", " C", " D"] and mmlu[1].gold == 1


def test_bad_task_input_fails_before_scoring(tmp_path, loaded):
    write_tasks(tmp_path)
    (tmp_path / "hellaswag_val.jsonl").write_text('{"ctx": "x", "endings": ["a", "b"], "label": 5}\n')
    with pytest.raises(TaskDataError, match=r"hellaswag_val.jsonl:1: label 5 is not a valid index"):
        prepare(EvalOptions(tasks=["arc_easy", "hellaswag"], data_dir=str(tmp_path)))
    (tmp_path / "arc_easy.jsonl").write_text('{"query": "Q", "gold": 0}\n')
    with pytest.raises(TaskDataError, match=r"arc_easy.jsonl:1: missing field 'choices'"):
        prepare(EvalOptions(tasks=["arc_easy"], data_dir=str(tmp_path)))
    with pytest.raises(TaskDataError, match="unknown task 'squad'"):
        prepare(EvalOptions(tasks=["squad"], data_dir=str(tmp_path)))
    out = tmp_path / "results.json"
    with pytest.raises(TaskDataError):
        run_eval(loaded, EvalOptions(tasks=["piqa", "arc_easy"], data_dir=str(tmp_path)), out)
    assert not out.exists()  # no partial results presented as complete


@pytest.mark.parametrize(
    "file, content, message",
    [
        (
            "hellaswag_val.jsonl",
            b'{"ctx": "x", "endings": ["a", 3], "label": 0}\n',
            r":1: field 'endings' should be a list of strings, element 1 is int",
        ),
        (
            "hellaswag_val.jsonl",
            b'{"ctx": "x", "endings": ["a", "b"], "label": true}\n',
            r":1: field 'label' should be int, got bool",
        ),
        ("hellaswag_val.jsonl", b'\n["not", "an", "object"]\n', r":2: expected a JSON object, got list"),
        ("hellaswag_val.jsonl", b'{"ctx": "x", "endings": ["a"], "label": 0}\n{"ctx": "\xff"}\n', r":2: invalid UTF-8"),
        ("hellaswag_val.jsonl", b"\n", r"task 'hellaswag' has no items"),
        (
            "winogrande.jsonl",
            b'{"context_options": ["a", null], "continuation": "c", "gold": 0}\n',
            r"'context_options' should be a list of strings, element 1 is NoneType",
        ),
        ("piqa_valid_labels.lst", b"0\n\xb2\n", r"piqa_valid_labels.lst:2: invalid UTF-8"),
        ("mmlu/test/astronomy_test.csv", b"q,a,b,c,d,A\n\xffq,a,b,c,d,B\n", r"astronomy_test.csv:2: invalid UTF-8"),
    ],
)
def test_malformed_task_files_name_file_and_line(tmp_path, file, content, message):
    """Element types, bools posing as ints, non-objects, bad UTF-8 and empty tasks are TaskDataErrors."""
    write_tasks(tmp_path)
    (tmp_path / file).write_bytes(content)
    task = {"hellaswag_val.jsonl": "hellaswag", "winogrande.jsonl": "winogrande"}.get(file, file.split("_")[0])
    with pytest.raises(TaskDataError, match=message):
        prepare(EvalOptions(tasks=[task.split("/")[0]], data_dir=str(tmp_path)))


def test_task_files_saved_with_a_byte_order_mark_read_as_without(tmp_path):
    """Excel saves CSV (and Notepad text) as UTF-8 with a leading BOM; it is not part of the first item."""
    write_tasks(tmp_path / "plain")
    write_tasks(tmp_path / "bom")
    for path in (tmp_path / "bom").rglob("*.*"):
        path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    tasks = ["hellaswag", "arc_easy", "piqa", "winogrande", "lambada_openai", "mmlu"]
    plain, bom = (
        prepare(EvalOptions(tasks=tasks, data_dir=str(tmp_path / folder), num_fewshot=1)) for folder in ("plain", "bom")
    )
    assert [(name, items) for name, _, items in bom] == [(name, items) for name, _, items in plain]


def test_mmlu_short_of_shots_or_subjects_and_empty_bpb_texts_are_errors(tmp_path):
    write_tasks(tmp_path)
    with pytest.raises(TaskDataError, match=r"astronomy_dev.csv: 2 dev examples, fewer than the 3 shots"):
        prepare(EvalOptions(tasks=["mmlu"], data_dir=str(tmp_path), num_fewshot=3))  # it ran 2-shot as "3-shot"
    for csv_file in (tmp_path / "mmlu" / "test").glob("*.csv"):
        csv_file.unlink()
    with pytest.raises(TaskDataError, match=r"mmlu/test: no SUBJECT_test.csv files"):
        prepare(EvalOptions(tasks=["mmlu"], data_dir=str(tmp_path)))
    (tmp_path / "texts.jsonl").write_text('\n{"text": "a b"}\n{"text": 7}\n')
    with pytest.raises(TaskDataError, match=r"texts.jsonl:3: field 'text' is int, not a string; bits per byte scores"):
        prepare(EvalOptions(tasks=[f"bpb:{tmp_path / 'texts.jsonl'}"]))
    (tmp_path / "blank.txt").write_text("  \n")
    with pytest.raises(TaskDataError, match=r"blank.txt: no text to score"):
        prepare(EvalOptions(tasks=[f"bpb:{tmp_path / 'blank.txt'}"]))


def test_bits_per_byte_of_a_one_word_text(tmp_path, loaded):
    """A text of fewer tokens than the SConv kernel is scored (the forward used to fail on it)."""
    (tmp_path / "word.jsonl").write_text('{"text": "a"}\n')
    report = run_eval(loaded, EvalOptions(tasks=[f"bpb:{tmp_path / 'word.jsonl'}"]))
    bpb = next(iter(report["results"].values()))
    assert bpb["tokens"] < 3 and math.isfinite(bpb["bits_per_byte"]) and bpb["bits_per_byte"] > 0


def test_limit_on_a_text_file_scores_the_lines_that_fill_its_first_windows(tmp_path, loaded):
    """`--limit N` on a `bpb:` text file (one document) scores about N windows of the model's context,
    cut at a line end, as that text alone would score; a line longer than that is cut at a token."""
    L = loaded.model.config.max_seq_len
    lines = "".join(f"{i}: {SAMPLE_TEXTS[i % len(SAMPLE_TEXTS)]}\n" for i in range(80)).splitlines(keepends=True)
    (tmp_path / "text.txt").write_text("".join(lines))
    task = f"bpb:{tmp_path / 'text.txt'}"
    whole = run_eval(loaded, EvalOptions(tasks=[task]))["results"][task]
    part = run_eval(loaded, EvalOptions(tasks=[task], limit=2))["results"][task]
    assert whole["tokens"] > 3 * L and 2 * L - 40 < part["tokens"] <= 2 * L + 1
    kept = [k for k in range(len(lines)) if len("".join(lines[:k]).encode()) == part["bytes"]]
    assert len(kept) == 1  # whole lines
    (tmp_path / "head.txt").write_text("".join(lines[: kept[0]]))
    head = run_eval(loaded, EvalOptions(tasks=[f"bpb:{tmp_path / 'head.txt'}"]))["results"]
    assert next(iter(head.values()))["bits_per_byte"] == pytest.approx(part["bits_per_byte"], rel=1e-6)
    line = " ".join(SAMPLE_TEXTS).replace("\n", " ") * 6
    (tmp_path / "line.txt").write_text(line)
    task = f"bpb:{tmp_path / 'line.txt'}"
    one = run_eval(loaded, EvalOptions(tasks=[task], limit=1))["results"][task]
    end = loaded.tokenizer.backend.encode(line).offsets[L - 1][1]  # of the L-th token, in characters
    assert one["tokens"] == L and one["bytes"] == len(line[:end].encode())
    (tmp_path / "greek.txt").write_text(" Ελληνικά" * 600)  # 9 characters a token: more than the first guess
    task = f"bpb:{tmp_path / 'greek.txt'}"
    one = run_eval(loaded, EvalOptions(tasks=[task], limit=1))["results"][task]
    assert loaded.tokenizer.encode(" Ελληνικά" * 3) == [loaded.tokenizer.encode(" Ελληνικά")[0]] * 3
    assert one["tokens"] == L and one["bytes"] == len((" Ελληνικά" * L).encode())


def test_bits_per_byte_reads_compressed_and_columnar_files_as_curation_does(tmp_path, loaded):
    """A curated shard (.jsonl.zst) or a .txt.gz was read as one UTF-8 text: 'invalid UTF-8 (byte 1 of the file)'."""
    import gzip

    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    records = "".join(json.dumps({"text": t}) + "\n" for t in SAMPLE_TEXTS[:4]).encode()
    (tmp_path / "r.jsonl").write_bytes(records)
    (tmp_path / "r.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(records))
    pq.write_table(pa.table({"text": SAMPLE_TEXTS[:4]}), tmp_path / "r.parquet")
    text = "\r\n".join(SAMPLE_TEXTS) * 4  # scored byte for byte, Windows line ends too, compressed or not
    (tmp_path / "t.txt").write_bytes(text.encode())
    (tmp_path / "t.txt.gz").write_bytes(gzip.compress(text.encode()))
    (tmp_path / "cut.txt.gz").write_bytes(gzip.compress(text.encode())[:50])
    with pytest.raises(TaskDataError, match=r"cut.txt.gz: truncated or corrupt stream: "):
        prepare(EvalOptions(tasks=[f"bpb:{tmp_path / 'cut.txt.gz'}"]))
    # A folder is one file per task: its readable files are named (it was "text file ... not found").
    (tmp_path / "tokens").mkdir()
    (tmp_path / "tokens" / "manifest.json").write_text("{}")
    (tmp_path / "tokens" / ".marinlm-job.json").write_text(json.dumps({"job": "tokenize"}))
    first = " ".join(f"bpb:{tmp_path / n}" for n in ["cut.txt.gz", "r.jsonl", "r.jsonl.zst"])
    with pytest.raises(TaskDataError, match=rf"^{tmp_path}: is a folder; bpb:PATH scores one file .*, e\.g\. {first};"):
        prepare(EvalOptions(tasks=[f"bpb:{tmp_path}"]))
    with pytest.raises(TaskDataError, match=r"tokens: is a folder; bpb:PATH scores one file of text \(.*token shards"):
        prepare(EvalOptions(tasks=[f"bpb:{tmp_path / 'tokens'}"]))
    names = ["r.jsonl", "r.jsonl.zst", "r.parquet", "t.txt", "t.txt.gz"]
    results = run_eval(loaded, EvalOptions(tasks=[f"bpb:{tmp_path / n}" for n in names]))["results"]
    score = {
        n: (results[f"bpb:{tmp_path / n}"]["tokens"], results[f"bpb:{tmp_path / n}"]["bits_per_byte"]) for n in names
    }
    assert score["r.jsonl"] == score["r.jsonl.zst"] == score["r.parquet"]
    assert score["t.txt"] == score["t.txt.gz"] and score["t.txt"][0] > loaded.model.config.max_seq_len
    limited = run_eval(loaded, EvalOptions(tasks=[f"bpb:{tmp_path / 't.txt.gz'}"], limit=1))["results"]
    assert next(iter(limited.values()))["tokens"] <= loaded.model.config.max_seq_len  # one text: its first window


def test_run_eval_writes_results_with_metadata(tmp_path, loaded):
    write_tasks(tmp_path)
    (tmp_path / "text.txt").write_text(" ".join(SAMPLE_TEXTS) * 3)
    tasks = ["hellaswag", "arc_easy", "piqa", "winogrande", "lambada_openai", "mmlu", f"bpb:{tmp_path / 'text.txt'}"]
    report = run_eval(loaded, EvalOptions(tasks=tasks, data_dir=str(tmp_path), predictions=True), tmp_path / "r.json")
    saved = json.loads((tmp_path / "r.json").read_text())
    assert set(saved["results"]) == set(tasks)
    assert saved["config"]["tokenizer_hash"] == loaded.tokenizer_hash
    assert any(k.endswith("hellaswag_val.jsonl") for k in saved["config"]["task_file_sha256"])
    assert 0 < saved["results"][tasks[-1]]["bits_per_byte"] < 20
    assert len(saved["predictions"]["mmlu"]) == 2
    assert "| hellaswag | acc |" in (tmp_path / "r.md").read_text()
    assert report["results"]["lambada_openai"]["perplexity"] > 1


def test_scores_move_with_the_batch_size_within_the_documented_bound(loaded):
    """Padding changes the shapes each row's products run in, so per-item scores move by about
    1e-5 with the batch size (docs/evaluation.md); more would be a batching bug."""
    from marinlm.kernels import apply_kernels

    rng = random.Random(0)
    words = " ".join(SAMPLE_TEXTS).split()
    requests = [
        Request(" ".join(rng.choices(words, k=rng.randint(5, 60))), " " + " ".join(rng.choices(words, k=3)))
        for _ in range(24)
    ]
    fast = copy.deepcopy(loaded.model)
    for model in (loaded.model, apply_kernels(fast, torch.device("cpu"), "fp32")):
        one, many = (Scorer(model, loaded.tokenizer, batch_size=b).loglikelihood(requests) for b in (1, 16))
        assert max(abs(a - b) for (a, _), (b, _) in zip(one, many)) < 1e-4


def test_lambada_perplexity_stderr_is_lm_evals_bootstrap(monkeypatch):
    """lm-eval bootstraps the standard error of a perplexity (not a mean); ours draws the same
    resamples, so on the same items both give the same number."""
    metrics = pytest.importorskip("lm_eval.api.metrics")
    monkeypatch.setenv("DISABLE_MULTIPROC", "1")  # lm-eval's one-process path: the same seeds
    rng = random.Random(5)
    lls = [-abs(rng.gauss(3.0, 4.0)) for _ in range(120)]
    items = [Item([Request("a", " b")])] * len(lls)
    ours, _ = score(Lambada(), items, [[(ll, False)] for ll in lls])
    theirs = metrics.bootstrap_stderr(metrics.perplexity, lls, iters=BOOTSTRAP_ITERS)
    assert ours["perplexity"] == pytest.approx(metrics.perplexity(lls), rel=1e-12)
    assert ours["perplexity_stderr"] == pytest.approx(theirs, rel=1e-9)
    # The delta method it replaces (perplexity x the log-likelihood's standard error) is not it.
    delta = ours["perplexity"] * statistics.stdev(lls) / math.sqrt(len(lls))
    assert abs(delta - theirs) > 0.02 * theirs


def test_local_lm_eval_tasks_carry_a_version():
    """lm-eval prints a task's `metadata.version`, and "Yaml" where a task has none."""
    import yaml

    from marinlm.eval.lm_eval_tasks import HERE, TASKS

    class Loader(yaml.SafeLoader):  # lm-eval's `!function utils.x` tags, read as their names
        pass

    Loader.add_constructor("!function", lambda loader, node: loader.construct_scalar(node))
    for name in TASKS:
        config = yaml.load((HERE / f"local_{name}.yaml").read_text(), Loader=Loader)  # noqa: S506
        assert config["task"] == f"local_{name}" and config["metadata"]["version"] == 1.0


def test_limit_takes_the_first_items_as_lm_eval_does_and_sample_a_seeded_subset(tmp_path):
    rows = [{"ctx": f"c{i}", "endings": ["a", "b"], "label": 0} for i in range(50)]
    (tmp_path / "hellaswag_val.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    def contexts(**kw):
        return [
            i.requests[0].context for i in prepare(EvalOptions(tasks=["hellaswag"], data_dir=str(tmp_path), **kw))[0][2]
        ]

    assert contexts(limit=7) == [f"c{i}" for i in range(7)]
    a = contexts(sample=7)
    assert a == contexts(sample=7) and len(a) == 7 and a != [f"c{i}" for i in range(7)]
    assert a == sorted(a, key=lambda c: int(c[1:]))  # in file order


@pytest.mark.slow
def test_lm_eval_adapter(tmp_path, loaded):
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance

    from marinlm.eval.harness import MarinHarnessLM

    lm = MarinHarnessLM(pretrained="", loaded=loaded)
    reqs = [Instance("loglikelihood", {}, (r.context, r.continuation), i) for i, r in enumerate(REQUESTS[:4])]
    scorer = Scorer(loaded.model, loaded.tokenizer)
    ours = lm.loglikelihood(reqs)
    ref = scorer.loglikelihood(REQUESTS[:4])
    assert [g for _, g in ours] == [g for _, g in ref]
    assert [ll for ll, _ in ours] == pytest.approx([ll for ll, _ in ref])
    rolling = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, ("some text here",), 0)])
    assert rolling[0] < 0
    gen = lm.generate_until([Instance("generate_until", {}, ("The quick", {"until": ["\n"], "max_gen_toks": 5}), 0)])
    assert isinstance(gen[0], str) and "\n" not in gen[0]
    # A local task through lm_eval itself (offline: a json dataset on disk).
    data = tmp_path / "toy.jsonl"
    data.write_text(
        "".join(json.dumps({"q": f"Is {i} even?", "choices": ["yes", "no"], "gold": i % 2}) + "\n" for i in range(6))
    )
    (tmp_path / "toy.yaml").write_text(
        "task: marinlm_toy\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: " + str(data) + "\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{q}}'\ndoc_to_choice: '{{choices}}'\n"
        "doc_to_target: '{{gold}}'\nmetric_list:\n  - metric: acc\n"
    )
    from lm_eval.tasks import TaskManager

    results = lm_eval.simple_evaluate(
        model=lm, tasks=["marinlm_toy"], task_manager=TaskManager(include_path=str(tmp_path))
    )
    assert 0.0 <= results["results"]["marinlm_toy"]["acc,none"] <= 1.0


def strip_checkpoint_tokenizer(folder: Path) -> None:
    """Make `folder` a checkpoint as saved before checkpoints kept the tokenizer."""
    import shutil

    shutil.rmtree(folder / "tokenizer")
    complete = json.loads((folder / "COMPLETE.json").read_text())
    complete["files"] = {k: v for k, v in complete["files"].items() if not k.startswith("tokenizer")}
    (folder / "COMPLETE.json").write_text(json.dumps(complete))


@pytest.mark.slow
def test_eval_hook_logs_during_training(token_data, tmp_path):
    from marinlm.jobs import run_training
    from marinlm.train.metrics import read_metrics

    write_tasks(tmp_path / "tasks")
    config = train_config(
        token_data,
        tmp_path / "run",
        train={"steps": 4},
        eval={"every_n_steps": 2, "tasks": ["arc_easy", "piqa"], "limit": 5, "data_dir": str(tmp_path / "tasks")},
    )
    run_training(config, resume="none")
    logged = [r for r in read_metrics(tmp_path / "run") if "eval/arc_easy/acc" in r]
    assert [r["step"] for r in logged] == [2, 4]
    # The run's model loads with its own tokenizer, and refuses another one.
    from marinlm.loading import load_model
    from marinlm.train.checkpoint import CheckpointError

    loaded = load_model(tmp_path / "run")
    assert loaded.checkpoint.name == "step-00000004"
    # A checkpoint without its own copy (saved before they kept one) reads the run's tokenizer.
    strip_checkpoint_tokenizer(loaded.checkpoint)
    MarinTokenizer(train_bpe([t.upper() for t in SAMPLE_TEXTS] * 30, vocab_size=600)).save(
        tmp_path / "run" / "tokenizer"
    )
    with pytest.raises(CheckpointError, match=r"run/tokenizer: tokenizer .* is not the one step-00000004 was trained"):
        load_model(tmp_path / "run")


@pytest.mark.slow
def test_eval_and_generate_skip_a_damaged_newest_checkpoint(token_data, tmp_path, capsys):
    """A run killed while its newest checkpoint was copied, or a disk that lost its tail: `marinlm
    eval/generate RUN` warn and use the newest good one; naming the damaged one is an error."""
    from marinlm.jobs import run_training
    from marinlm.loading import load_model
    from marinlm.train.checkpoint import CheckpointError, resolve_checkpoint

    run_training(train_config(token_data, tmp_path / "run", train={"steps": 4}, checkpoint={"every_steps": 2}))
    newest = tmp_path / "run" / "checkpoints" / "step-00000004"
    [weights] = newest.glob("*.distcp")
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size // 2)
    capsys.readouterr()
    loaded = load_model(tmp_path / "run")
    assert loaded.checkpoint.name == "step-00000002"
    assert f"warning: skipping unusable checkpoint: {newest}" in capsys.readouterr().err
    with pytest.raises(CheckpointError, match=str(weights)):
        load_model(newest)
    # The run's checkpoints/ folder given for the run: the same choice (it was "no usable checkpoint").
    assert resolve_checkpoint(tmp_path / "run" / "checkpoints").name == "step-00000002"


@pytest.mark.slow
def test_a_checkpoint_copied_out_of_its_run_still_loads_with_its_tokenizer(token_data, tmp_path):
    """`marinlm generate/eval CHECKPOINT` on a checkpoint copied elsewhere was "no tokenizer.json at
    tokenizer": the tokenizer lived in the run folder only. Each checkpoint now keeps a copy."""
    import shutil

    from marinlm.jobs import run_training
    from marinlm.loading import load_model

    run_training(train_config(token_data, tmp_path / "run", train={"steps": 2}, checkpoint={"every_steps": 2}))
    saved = tmp_path / "run" / "checkpoints" / "step-00000002"
    shutil.copytree(saved, tmp_path / "elsewhere")
    in_run = load_model(tmp_path / "run")
    moved = load_model(tmp_path / "elsewhere")
    assert moved.tokenizer_hash == in_run.tokenizer_hash == in_run.tokenizer.hash
    for a, b in zip(moved.model.state_dict().values(), in_run.model.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    # Checkpoints saved before they kept the tokenizer: the run's copy serves one in place; one moved
    # out of its run is an error that says where the tokenizer was looked for.
    for old in (saved, tmp_path / "elsewhere"):
        strip_checkpoint_tokenizer(old)
    assert load_model(saved).tokenizer_hash == in_run.tokenizer_hash
    with pytest.raises(FileNotFoundError, match=re.escape(f"no tokenizer (looked in {tmp_path / 'elsewhere'}/")):
        load_model(tmp_path / "elsewhere")


@pytest.mark.slow
def test_each_sources_validation_loss_is_logged_in_training_and_scored_by_eval(token_data, tmp_path):
    """With a mixture, validation covered the first source only; now each source and all of them."""
    import shutil

    from marinlm.jobs import run_training
    from marinlm.loading import load_model
    from marinlm.train.metrics import read_metrics

    shutil.copytree(token_data, tmp_path / "other")  # a second source: the same documents, other rows drawn
    sources = [{"path": str(token_data)}, {"path": str(tmp_path / "other"), "weight": 0.5}]
    config = train_config(
        token_data,
        tmp_path / "run",
        data={"sources": sources},
        train={"steps": 2},
        checkpoint={"every_steps": 2},
        validation={"every_steps": 2, "max_rows": 3},
    )
    run_training(config)
    [logged] = [m for m in read_metrics(tmp_path / "run") if "val/loss" in m and m["step"] == 2]
    names = [token_data.name, "other"]
    per = [(logged[f"val/{n}/loss"], logged[f"val/{n}/tokens"]) for n in names]
    assert logged["val/tokens"] == sum(t for _, t in per) and all(t > 0 for _, t in per)
    assert logged["val/loss"] == pytest.approx(sum(loss * t for loss, t in per) / logged["val/tokens"])
    assert per[0][0] != per[1][0]  # 3 rows of each, drawn with each source's seed

    results = run_eval(load_model(tmp_path / "run"), EvalOptions(tasks=["val"], limit=3))["results"]
    assert list(results) == ["val", *(f"val:{n}" for n in names)]
    assert results["val"]["loss"] == pytest.approx(logged["val/loss"], rel=1e-5)
    for n in names:
        assert results[f"val:{n}"]["loss"] == pytest.approx(logged[f"val/{n}/loss"], rel=1e-5)
        assert results[f"val:{n}"]["bits_per_byte"] == pytest.approx(logged[f"val/{n}/bpb"], rel=1e-5)


@pytest.mark.slow
def test_val_of_a_run_trained_with_relative_paths_scores_from_another_folder(token_data, tmp_path, monkeypatch):
    """`marinlm eval /a/runs/tiny --tasks val` from another folder was "runs/tokens/manifest.json: no
    manifest": the run's data path is relative to the folder training ran from, /a."""
    import shutil

    from marinlm.jobs import run_training
    from marinlm.loading import load_model

    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    shutil.copytree(token_data, project / "runs" / "tokens")
    elsewhere.mkdir()
    monkeypatch.chdir(project)
    config = train_config(Path("runs/tokens"), Path("runs/tiny"), train={"steps": 2}, checkpoint={"every_steps": 2})
    run_training(replace(config, validation=replace(config.validation, every_steps=0)))
    options = EvalOptions(tasks=["val"], limit=4)
    here = run_eval(load_model("runs/tiny"), options)["results"]["val"]

    monkeypatch.chdir(elsewhere)
    there = run_eval(load_model(project / "runs" / "tiny"), options)["results"]["val"]
    assert there["loss"] == here["loss"] and there["tokens"] == here["tokens"] and math.isfinite(there["loss"])
    shutil.move(project / "runs" / "tokens", tmp_path / "moved")
    with pytest.raises(
        TaskDataError,
        match=re.escape(f"current folder, {elsewhere}, else from the folder training ran from, {project})"),
    ):
        run_eval(load_model(project / "runs" / "tiny"), options)


@pytest.mark.slow
@pytest.mark.distributed
def test_eval_hook_under_torchrun_scores_what_marinlm_eval_scores(token_data, tmp_path):
    """In-training evaluation of an FSDP run (it used to be refused with world size > 1): every rank
    takes part in each forward; the logged scores equal `marinlm eval` of the same checkpoint."""
    import subprocess

    from marinlm.config import save_config
    from marinlm.loading import load_model
    from marinlm.train.metrics import read_metrics

    from conftest import ROOT

    write_tasks(tmp_path / "tasks")
    (tmp_path / "text.txt").write_text("\n".join(SAMPLE_TEXTS) * 12)  # more than 5 windows: cut by the limit
    tasks = ["arc_easy", "piqa", "val", f"bpb:{tmp_path / 'text.txt'}"]
    hook = {"every_n_steps": 2, "tasks": tasks, "limit": 5, "data_dir": str(tmp_path / "tasks")}
    save_config(train_config(token_data, tmp_path / "run", train={"steps": 2}, eval=hook), tmp_path / "run.yaml")
    out = subprocess.run(
        [*torchrun_command(2), "-m", "marinlm", "train", str(tmp_path / "run.yaml")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    logged = [r for r in read_metrics(tmp_path / "run") if "eval/arc_easy/acc" in r]
    assert [r["step"] for r in logged] == [2]
    options = EvalOptions(tasks=tasks, data_dir=str(tmp_path / "tasks"), limit=5)
    offline = run_eval(load_model(tmp_path / "run"), options)["results"]
    # `--limit` takes that many rows of the validation split too; without it, all of them.
    whole = run_eval(load_model(tmp_path / "run"), EvalOptions(tasks=["val"]))["results"]["val"]
    seq_len = load_model(tmp_path / "run").config.data.seq_len
    assert 4 * seq_len < offline["val"]["tokens"] <= 5 * seq_len < whole["tokens"]
    # `marinlm eval` under torchrun: the checkpoint loaded sharded (FSDP2), the items dealt over ranks.
    evaluate = ["eval", str(tmp_path / "run"), "--tasks", *tasks, "--limit", "5", "--data-dir", str(tmp_path / "tasks")]
    out = subprocess.run(
        [*torchrun_command(2), "-m", "marinlm", *evaluate, "--output", str(tmp_path / "sharded.json")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert out.stdout.count("results:") == 1  # rank 0 reports
    sharded = json.loads((tmp_path / "sharded.json").read_text())
    assert sharded["config"]["processes"] == 2
    for task, metrics in offline.items():
        for name, value in metrics.items():
            if name != "seconds":
                assert sharded["results"][task][name] == pytest.approx(value, rel=1e-5, nan_ok=True), (task, name)
    max_seq_len = load_model(tmp_path / "run").config.model.max_seq_len
    assert 4 * max_seq_len < offline[tasks[3]]["tokens"] <= 5 * max_seq_len + 1
    pairs = (
        ("arc_easy", "acc"),
        ("arc_easy", "acc_norm"),
        ("piqa", "acc"),
        ("val", "loss"),
        (tasks[3], "bits_per_byte"),
    )
    for task, metric in pairs:
        assert logged[0][f"eval/{task}/{metric}"] == pytest.approx(offline[task][metric], rel=1e-5), (task, metric)
    table = markdown_table(
        {
            "results": offline,
            "config": {"checkpoint": "c", "tokenizer_hash": "h", "limit": 5, "num_fewshot": 0, "seconds": 1.0},
        }
    )
    assert isinstance(offline["val"]["tokens"], int) and "| val | tokens |" not in table
    assert f"| {offline['val']['tokens']:,} tokens |" in table  # how much of the split was scored
    assert "limit 5, 0-shot, 1.0 s." in table
    shots = {"checkpoint": "c", "tokenizer_hash": "h", "limit": 5, "num_fewshot": 2, "seconds": 1.0}
    assert "limit 5, 2-shot, 1.0 s." in markdown_table({"results": {"mmlu": {"acc": 0.3}}, "config": shots})
    table = markdown_table({"results": {"mmlu": {"acc": 0.3}, "piqa": {"acc": 0.5}}, "config": shots})
    assert "limit 5, MMLU 2-shot, the other tasks 0-shot, 1.0 s." in table
    # A "|" in a file's name ended its cell; no limit read "limit None".
    unlimited = {**shots, "limit": None, "num_fewshot": 0}
    table = markdown_table({"results": {"bpb:a|b.txt": {"bits_per_byte": 1.5}}, "config": unlimited})
    assert "| bpb:a\\|b.txt | bits_per_byte | 1.5000 |" in table and "`h`, no limit, 0-shot, 1.0 s." in table


def test_eval_hook_checks_its_task_files_before_the_first_step(token_data, tmp_path):
    """A missing task file used to surface at step N, ending the run with the steps since the last
    checkpoint lost."""
    from marinlm.jobs import attach_eval_hook
    from marinlm.train.trainer import Trainer

    config = train_config(
        token_data,
        tmp_path / "run",
        train={"steps": 4},
        eval={"every_n_steps": 3, "tasks": ["hellaswag"], "data_dir": str(tmp_path / "missing")},
    )
    trainer = Trainer(config, resume="none")
    with pytest.raises(TaskDataError, match=r"missing/hellaswag_val.jsonl: task file not found"):
        attach_eval_hook(trainer)  # as run_training does, before the first step
    trainer.close()


@pytest.mark.slow
def test_real_task_files_parse_and_score(loaded):
    data_dir = shared_data("eval")
    options = EvalOptions(
        tasks=["hellaswag", "arc_easy", "arc_challenge", "piqa", "winogrande", "lambada_openai", "mmlu"],
        data_dir=str(data_dir),
        limit=2,
        batch_size=16,
    )
    report = run_eval(loaded, options)
    counts = {t: report["results"][t]["n"] for t in options.tasks}
    assert counts["mmlu"] == 2 * 57 and all(counts[t] == 2 for t in options.tasks if t != "mmlu")
    full = prepare(EvalOptions(tasks=["hellaswag", "piqa", "lambada_openai"], data_dir=str(data_dir)))
    assert [len(items) for _, _, items in full] == [10042, 1838, 5153]


def test_task_rows_from_hf_datasets_on_local_files(tmp_path, loaded):
    pytest.importorskip("datasets")
    write_tasks(tmp_path / "local")
    rows = tmp_path / "arc_rows.jsonl"
    rows.write_text(
        "".join(
            json.dumps({"query": f"Question: q{i}?", "choices": ["a", "b"], "gold": i % 2}) + "\n" for i in range(3)
        )
    )
    options = EvalOptions(
        tasks=["arc_easy", "piqa"],
        data_dir=str(tmp_path / "local"),
        hf_datasets={"arc_easy.jsonl": f"json:{rows}:train"},
    )
    prepared = prepare(options)
    arc_items = prepared[0][2]
    assert [i.requests[0].context for i in arc_items] == [f"Question: q{i}?\nAnswer:" for i in range(3)]
    assert [i.gold for i in arc_items] == [0, 1, 0]
    assert len(prepared[1][2]) == 1  # piqa still from the local file
    # The results name the HF source, and hash only the files read from disk (the local arc_easy.jsonl,
    # not read, was hashed as if it had been).
    config = run_eval(loaded, replace(options, limit=2))["config"]
    assert config["hf_datasets"] == {"arc_easy.jsonl": f"json:{rows}:train"}
    assert sorted(Path(f).name for f in config["task_file_sha256"]) == ["piqa_valid.jsonl", "piqa_valid_labels.lst"]
    from marinlm.cli import main

    with pytest.raises(SystemExit):  # a bare --hf meant none, and the tasks were read from disk
        main(["eval", "run", "--tasks", "arc_easy", "--hf"])
    # A file no asked task reads was ignored, and the task read from disk without a word.
    with pytest.raises(ConfigError, match=r"^hf_datasets: 'arc_easy.json' is no file of the tasks asked for; their"):
        prepare(replace(options, hf_datasets={"arc_easy.json": f"json:{rows}:train"}))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"query": "Q", "gold": 0}) + "\n")
    with pytest.raises(TaskDataError, match=r"missing field 'choices'"):
        prepare(
            EvalOptions(
                tasks=["arc_easy"],
                data_dir=str(tmp_path / "local"),
                hf_datasets={"arc_easy.jsonl": f"json:{bad}:train"},
            )
        )


def test_cli_output_may_be_a_folder(tmp_path, loaded, monkeypatch):
    """`--output DIR` writes DIR/eval.json (it was an IsADirectoryError), or eval-2.json beside an earlier one."""
    import marinlm.loading as inference
    from marinlm.cli import main

    monkeypatch.setattr(inference, "load_model", lambda run, device: loaded)
    (tmp_path / "text.txt").write_text(" ".join(SAMPLE_TEXTS))
    (tmp_path / "out").mkdir()
    assert main(["eval", "run", "--tasks", f"bpb:{tmp_path / 'text.txt'}", "--output", str(tmp_path / "out")]) == 0
    report = json.loads((tmp_path / "out" / "eval.json").read_text())
    assert report["results"][f"bpb:{tmp_path / 'text.txt'}"]["bits_per_byte"] > 0
    assert (tmp_path / "out" / "eval.md").is_file()
    # A second result in the folder goes beside the first, as the default output's do (it was written over it).
    assert main(["eval", "run", "--tasks", f"bpb:{tmp_path / 'text.txt'}", "--output", str(tmp_path / "out")]) == 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["eval-2.json", "eval-2.md", "eval.json", "eval.md"]
    # A folder to be made, written with a trailing slash (it became a file of that name, and NAME.md beside it).
    assert main(["eval", "run", "--tasks", f"bpb:{tmp_path / 'text.txt'}", "--output", f"{tmp_path / 'new'}/"]) == 0
    assert sorted(p.name for p in (tmp_path / "new").iterdir()) == ["eval.json", "eval.md"]
    # A file name is written as given.
    assert main(["eval", "run", "--tasks", f"bpb:{tmp_path / 'text.txt'}", "--output", str(tmp_path / "r.json")]) == 0
    assert (tmp_path / "r.json").is_file() and (tmp_path / "r.md").is_file()


def test_val_task_without_its_data_fails_before_any_scoring(tmp_path, loaded, monkeypatch):
    write_tasks(tmp_path / "tasks")
    config = train_config(tmp_path / "moved-tokens", tmp_path / "run")
    run = LoadedModel(loaded.model, loaded.tokenizer, config, Path("memory"), loaded.tokenizer_hash)
    monkeypatch.setattr(Scorer, "loglikelihood", lambda *a, **k: pytest.fail("scored before checking 'val'"))
    with pytest.raises(TaskDataError, match=r"task 'val' scores the validation split .*moved-tokens"):
        run_eval(run, EvalOptions(tasks=["arc_easy", "val"], data_dir=str(tmp_path / "tasks")), tmp_path / "out.json")
    assert not (tmp_path / "out.json").exists()
    # A run with no training data of its own (an imported checkpoint's): named, with what to use instead
    # (it was a bare "data.sources: give at least one tokenized dataset").
    with pytest.raises(TaskDataError, match=r"task 'val' .* memory names no tokenized dataset .* bpb:PATH"):
        run_eval(
            loaded, EvalOptions(tasks=["arc_easy", "val"], data_dir=str(tmp_path / "tasks")), tmp_path / "out.json"
        )
    assert not (tmp_path / "out.json").exists()


def test_scoring_and_generation_start_texts_as_training_started_documents(loaded, tmp_path, monkeypatch):
    """A run trained with data.add_bos false never saw BOS: its texts began after the previous
    document's EOS, so scoring and generation put EOS first, not a token untrained at position 0."""
    import marinlm.loading as inference
    from marinlm.model import SamplingConfig

    (tmp_path / "text.txt").write_text("the cat sat on the mat")
    options = EvalOptions(tasks=[f"bpb:{tmp_path / 'text.txt'}"])
    first_ids = []
    real_generate = inference.stream_generate

    def spy(model, ids, *args, **kwargs):
        first_ids.append(int(ids[0, 0]))
        return real_generate(model, ids, *args, **kwargs)

    monkeypatch.setattr(inference, "stream_generate", spy)
    scores = {}
    for add_bos in (True, False):
        config = train_config(tmp_path / "tokens", tmp_path / "run", data={"add_bos": add_bos})
        run = LoadedModel(loaded.model, loaded.tokenizer, config, Path("memory"), loaded.tokenizer_hash)
        scores[add_bos] = run_eval(run, options)["results"][options.tasks[0]]["bits_per_byte"]
        inference.generate_text(run, "a b", SamplingConfig(max_new_tokens=1, temperature=0))
    assert first_ids == [loaded.tokenizer.bos_id, loaded.tokenizer.eos_id]
    assert scores[True] != scores[False]
    bos_run = LoadedModel(loaded.model, loaded.tokenizer, TrainConfig(), Path("memory"), loaded.tokenizer_hash)
    assert scores[True] == run_eval(bos_run, options)["results"][options.tasks[0]]["bits_per_byte"]


def test_generating_past_max_seq_len_warns(loaded, capsys):
    from marinlm.loading import generate_text
    from marinlm.model import SamplingConfig

    limit = loaded.model.config.max_seq_len
    generate_text(loaded, "a b c", SamplingConfig(max_new_tokens=2, temperature=0))
    assert "max_seq_len" not in capsys.readouterr().err
    generate_text(loaded, "a b c", SamplingConfig(max_new_tokens=limit, temperature=0))
    assert f"plus {limit} new ones pass the model's max_seq_len {limit}" in capsys.readouterr().err


def test_generation_in_generate_and_eval_keeps_to_the_tokenizers_ids(loaded, monkeypatch):
    """The model's 4,096 rows pass the tokenizer's few hundred ids: both generators limit sampling to
    the ids the tokenizer can decode."""
    import marinlm.eval.lm as lm
    import marinlm.loading as inference
    from marinlm.model import SamplingConfig

    assert loaded.model.config.vocab_size > loaded.tokenizer.vocab_size
    produced = []
    for module in (inference, lm):
        real = module.stream_generate

        def spy(*args, real=real, **kwargs):
            for token in real(*args, **kwargs):
                produced.append(int(token[0]))
                yield token

        monkeypatch.setattr(module, "stream_generate", spy)
    inference.generate_text(loaded, "a b", SamplingConfig(max_new_tokens=60, temperature=1.0, seed=0))
    Scorer(loaded.model, loaded.tokenizer, max_length=64, batch_size=1).generate_until("a b", ["zzz"], max_tokens=60)
    assert len(produced) > 60 and max(produced) < loaded.tokenizer.vocab_size


def test_without_data_dir_tasks_come_from_the_env_or_an_error_says_how(tmp_path, monkeypatch):
    """An installed package has no ../shared/data/eval: the error named a path inside site-packages."""
    import marinlm.eval.runner as runner
    import marinlm.eval.tasks as tasks

    write_tasks(tmp_path / "tasks")
    monkeypatch.setattr(runner, "DEFAULT_DATA_DIR", tmp_path / "site-packages" / "shared" / "data" / "eval")
    monkeypatch.delenv(runner.DATA_ENV, raising=False)
    with pytest.raises(TaskDataError, match=r"no --data-dir was given, MARINLM_EVAL_DATA is not set.*--hf") as e:
        prepare(EvalOptions(tasks=["arc_easy"]))
    assert str(e.value).startswith("task 'arc_easy' needs arc_easy.jsonl: ") and "site-packages" not in str(e.value)
    # A task read from HF datasets with a bad row keeps its own error: it is not a missing folder.
    monkeypatch.setattr(tasks, "_hf_rows", lambda spec, name: [{"query": "Q", "gold": 0}])
    with pytest.raises(TaskDataError, match=r"missing field 'choices'"):
        prepare(EvalOptions(tasks=["arc_easy"], hf_datasets={"arc_easy.jsonl": "some/dataset:test"}))
    monkeypatch.setenv(runner.DATA_ENV, str(tmp_path / "tasks"))
    assert len(prepare(EvalOptions(tasks=["arc_easy"]))[0][2]) > 0
    with pytest.raises(TaskDataError, match=r"elsewhere/arc_easy.jsonl: task file not found \(point"):
        prepare(EvalOptions(tasks=["arc_easy"], data_dir=str(tmp_path / "elsewhere")))  # no hint: it was given


def test_an_unreachable_hub_for_hf_task_files_is_an_error_not_a_traceback(tmp_path, loaded, monkeypatch, capsys):
    """`--hf FILE=NAME:SPLIT` on a machine without the Hub: HF datasets retries, then raises
    ConnectionError, which `marinlm eval` printed as a traceback."""
    import datasets

    import marinlm.loading as inference
    from marinlm.cli import main

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'org/hellaswag' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    monkeypatch.setattr(inference, "load_model", lambda run_arg, device: loaded)
    argv = ["eval", "run", "--tasks", "hellaswag", "--hf", "hellaswag_val.jsonl=org/hellaswag:validation"]
    assert main([*argv, "--output", str(tmp_path / "r.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: hf source for hellaswag_val.jsonl (org/hellaswag:validation): Couldn't reach")
    assert "--data-dir" in err and "Traceback" not in err
    assert not (tmp_path / "r.json").exists()


def test_cli_results_outlive_checkpoint_retention_and_never_overwrite(tmp_path, loaded, monkeypatch):
    """`marinlm eval RUN` wrote CHECKPOINT/eval.json: while training went on, retention
    (checkpoint.keep_last) deleted that checkpoint folder and the results with it, and a second
    eval of the same checkpoint overwrote the first."""
    import marinlm.loading as inference
    from marinlm.cli import main

    checkpoint = tmp_path / "run" / "checkpoints" / "step-00000050"
    checkpoint.mkdir(parents=True)
    standalone = tmp_path / "exported"
    standalone.mkdir()
    (tmp_path / "text.txt").write_text(" ".join(SAMPLE_TEXTS))
    task = f"bpb:{tmp_path / 'text.txt'}"
    for folder in (checkpoint, standalone):
        run = LoadedModel(loaded.model, loaded.tokenizer, loaded.config, folder, loaded.tokenizer_hash)
        monkeypatch.setattr(inference, "load_model", lambda run_arg, device, run=run: run)
        for _ in range(2):
            assert main(["eval", "run", "--tasks", task, "--limit", "1"]) == 0
    assert sorted(p.name for p in (tmp_path / "run" / "eval").iterdir()) == [
        "step-00000050-2.json",
        "step-00000050-2.md",
        "step-00000050.json",
        "step-00000050.md",
    ]
    assert list(checkpoint.iterdir()) == []  # the checkpoint folder is left as training wrote it
    assert sorted(p.name for p in standalone.iterdir()) == ["eval-2.json", "eval-2.md", "eval.json", "eval.md"]
    report = json.loads((tmp_path / "run" / "eval" / "step-00000050.json").read_text())
    assert report["config"]["checkpoint"] == str(checkpoint)
