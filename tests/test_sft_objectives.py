"""sft.py's `target` and `lm` objectives on the tiny checkpoint of test_sft: the tokens each loss
covers, the loss of a 2-row batch against a hand computation from the model's own log-softmax, a CPU
run whose first logged loss is that hand value, no `<evidence>` tokens or selection, and one-line
errors for bad rows."""

import json

import pytest
import torch
from helpers import (
    SFT_WORDS as WORDS,
)
from helpers import (
    config,
    config_file,
    metrics,
    write_rows,
)
from helpers import (
    sft_checkpoint as write_checkpoint,
)

import model as M
import sft
from tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("tiny"))


V = {w: i for i, w in enumerate(WORDS)}
TARGETS = [
    {
        "id": "t0",
        "prompt": [{"role": "user", "content": "How did it go today ?"}],
        "target": "I failed .",
    },
    {
        "id": "t1",
        "prompt": [{"role": "system", "content": "hello"}, {"role": "user", "content": "Oh no"}],
        "target": "<think>\nBo is sad .\n</think>\n\nWe knew you would",
        "meta": {"gate": 1},
    },
]
TEXTS = [
    {"text": "<think> Ann is sad </think> Ann : I failed the exam again ."},
    {"id": "d1", "text": "Bo : We won the bid !", "meta": {"source": "x"}},
]


def hand_logp(checkpoint, ids: list[int]) -> torch.Tensor:
    """log p(ids[t] | ids[:t]) for t >= 1 from the base model's full-vocabulary log-softmax."""
    model = M.Qwen.from_pretrained(checkpoint, dtype="float32", device="cpu")
    logp = model(torch.tensor([ids])).float().log_softmax(-1)[0]
    return torch.stack([logp[t - 1, ids[t]] for t in range(1, len(ids))])


def test_target_rows_weigh_the_target_tokens_and_end_of_turn_only(checkpoint, tmp_path):
    cfg, tok = config(checkpoint, tmp_path, objective="target"), load_tokenizer(checkpoint)
    rows = [sft.text_row_from_json(r, "target") for r in TARGETS]
    ids, weights = sft.encode_text_row(tok, rows[1], cfg)
    target = [
        "<think>",
        "Bo",
        "is",
        "sad",
        ".",
        "</think>",
        "We",
        "knew",
        "you",
        "would",
        "<|im_end|>",
    ]
    assert ids[-len(target) :] == [V[w] if w in V else tok.token_id(w) for w in target]
    assert ids[: -len(target)] == tok.chat_ids(rows[1].prompt)
    assert weights == [0.0] * (len(ids) - len(target)) + [1.0] * len(target)
    _, by_row = sft.encode_text_row(
        tok, rows[1], config(checkpoint, tmp_path, objective="target", target_weighting="row")
    )
    assert by_row[-len(target) :] == [1 / len(target)] * len(target) and sum(
        by_row
    ) == pytest.approx(1.0)


def test_lm_rows_weigh_every_token_after_the_first(checkpoint, tmp_path):
    cfg, tok = config(checkpoint, tmp_path, objective="lm"), load_tokenizer(checkpoint)
    ids, weights = sft.encode_text_row(tok, sft.text_row_from_json(TEXTS[1], "lm"), cfg)
    assert ids == [V[w] for w in "Bo : We won the bid !".split()] + [tok.token_id("<|endoftext|>")]
    assert weights == [0.0] + [1.0] * 7


@pytest.mark.parametrize(
    "objective, weighting", [("target", "token"), ("target", "row"), ("lm", "token")]
)
def test_a_two_row_cpu_run_logs_the_hand_computed_loss_first(
    checkpoint, tmp_path, objective, weighting
):
    """Both rows in one update; LoRA's B starts at 0, so the first step's loss is the base model's.
    By hand: the rows' summed -log p over the covered tokens, divided by their count (token) or each
    row's mean, averaged (row)."""
    rows = TARGETS if objective == "target" else TEXTS
    data = str(write_rows(tmp_path / "rows.jsonl", rows))
    cfg = config(
        checkpoint,
        tmp_path,
        objective=objective,
        target_weighting=weighting,
        data=data,
        batch_size=2,
        rows_per_update=2,
        epochs=2,
        save_merged=True,
    )
    tok, per_row = load_tokenizer(checkpoint), []
    for raw in rows:
        if objective == "lm":
            ids = [tok.token_id(w) if w.startswith("<") else V[w] for w in raw["text"].split()]
            ids, covered = ids + [tok.token_id("<|endoftext|>")], len(ids)
        else:
            target = sft.encode_text(tok, raw["target"])[0] + [tok.token_id("<|im_end|>")]
            ids, covered = tok.chat_ids(raw["prompt"]) + target, len(target)
        per_row.append(-hand_logp(checkpoint, ids)[-covered:])
    if weighting == "token":
        expected = sum(n.sum() for n in per_row) / sum(len(n) for n in per_row)
    else:
        expected = sum(n.mean() for n in per_row) / 2
    run = sft.train(cfg)
    logged = metrics(run)
    assert [m["step"] for m in logged] == [1, 2]
    assert logged[0]["loss"] == pytest.approx(expected.item(), rel=1e-5)
    best = json.loads((run / "best" / "adapter_config.json").read_text())
    # no <evidence> rows
    assert best["r"] == 4 and not (run / "best" / "token_rows.safetensors").exists()
    assert not (run / "selection.json").exists() and (run / "merged" / "config.json").is_file()
    assert load_tokenizer(run / "merged").tokenizer.token_to_id("<evidence>") is None


@pytest.mark.parametrize(
    "objective, row, line",
    [
        (
            "target",
            {"id": "x", "prompt": [{"role": "user", "content": "hi"}]},
            "field 'target': missing",
        ),
        (
            "target",
            {"id": "x", "prompt": [{"role": "user", "content": "hi"}], "target": " \n"},
            "field 'target': empty",
        ),
        ("target", {"id": "x", "target": "hi"}, "field 'prompt': missing"),
        (
            "target",
            {"id": "x", "prompt": [], "target": "hi"},
            "field 'prompt': expected a non-empty list",
        ),
        ("lm", {"txt": "hi"}, "field 'txt': unknown field"),
        ("lm", {"text": "hi", "meta": 3}, "field 'meta': expected"),
        ("lm", {"text": 7}, "field 'text': expected a string"),
    ],
)
def test_a_bad_row_stops_with_one_line_naming_file_line_and_field(
    tmp_path, capsys, objective, row, line
):
    good = TARGETS[0] if objective == "target" else TEXTS[0]
    data = write_rows(tmp_path / "rows.jsonl", [good, row])
    path = config_file(
        tmp_path / "no-such-model",
        tmp_path,
        data=str(data),
        objective=objective,
        output_dir=str(tmp_path / "out"),
    )
    with pytest.raises(SystemExit) as stop:
        sft.main([str(path)])
    out, err = capsys.readouterr()
    assert stop.value.code != 0 and len(err.strip().splitlines()) == 1, err
    assert out == ""  # no info line before the error
    assert err.startswith(f"error: {data}:2: {line}"), err
    assert not (tmp_path / "out").exists()  # nothing written
