"""sft.py on a tiny random-weight checkpoint with a word-level tokenizer (no downloads): the loss
weights and the loss against hand computations, the same update whatever the split over
micro-batches and gloo ranks, what one optimizer step may change, overfitting, bitwise resume after
SIGKILL, checkpoint selection, held-out exclusion, prepare/traces.py against the local judge server
with a scripted teacher, one-line errors for bad input, and prepare/traces.py's trace-refinement
parser."""

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
import yaml
from helpers import (
    SFT_SPECIALS as SPECIAL,
)
from helpers import (
    SFT_WORDS as WORDS,
)
from helpers import (
    TINY,
    assert_sinks_hold_metrics,
    config,
    config_file,
    conversation,
    llama_sft_checkpoint,
    metrics,
    sad_row,
    tensors,
    write_rows,
)
from helpers import (
    rank_run as _rank_run,
)
from helpers import (
    sft_checkpoint as write_checkpoint,
)
from instruments import free_port
from tokenizers import AddedToken

import checkpoint as CK
import model as M
import sft
import train as T
from config import load_config
from data import Example, Turn
from dataset import example_to_json
from judge_server import JudgeServer, UnsupportedRequest
from prepare import traces as P
from tokenizer import load_tokenizer

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def llama_checkpoint(tmp_path_factory):
    return llama_sft_checkpoint(tmp_path_factory.mktemp("tiny_llama"))


# ----------------------------------------------------------------------------- loss weights


def test_completion_weights_hand_values():
    weights = sft.completion_weights(3, [False, False, True, False, True, False])
    assert weights == [0.0, 0.0, 0.0, 0.85 / 4, 0.85 / 4, 0.15 / 2, 0.85 / 4, 0.15 / 2, 0.85 / 4]
    weights = sft.completion_weights(1, [True, False], label_share=0.3, other_share=0.7)
    assert weights == [0.0, 0.3, 0.7]
    for no_group in ([False, False], [True, True]):
        with pytest.raises(ValueError):
            sft.completion_weights(2, no_group)


def test_encode_row_on_hand_made_tokens(checkpoint, tmp_path):
    cfg = config(checkpoint, tmp_path)
    tok = load_tokenizer(checkpoint)
    tags = [AddedToken(t, special=True, normalized=False) for t in ("<evidence>", "</evidence>")]
    tok.tokenizer.add_special_tokens(tags)
    vocab = tok.tokenizer.get_vocab()
    row = sft.Row(
        "ccu-1",
        "ccu_emotion",
        [{"role": "user", "content": "hello <|im_end|> <evidence>"}],
        "<think>\nBo is glad .\n</think>\n\nAnswer: Joy, Trust",
        ["Joy", "Trust"],
    )
    ids, weights = sft.encode_row(tok, row, cfg)
    completion = [
        "<think>",
        "Bo",
        "is",
        "glad",
        ".",
        "</think>",
        "Answer",
        ":",
        "Joy",
        ",",
        "Trust",
        "<|im_end|>",
    ]
    n_prompt = len(ids) - len(completion)
    # <|im_start|> user \n hello <| im_end |> < evidence > <|im_end|> \n
    # <|im_start|> assistant \n: message text stays text (tok.chat_ids),
    # tags included; in the completion the model's own tags are tokens
    assert ids[:n_prompt] == [
        vocab[t]
        for t in [
            "<|im_start|>",
            "[UNK]",
            "hello",
            "[UNK]",
            "[UNK]",
            "[UNK]",
            "[UNK]",
            "[UNK]",
            "[UNK]",
            "<|im_end|>",
            "<|im_start|>",
            "[UNK]",
        ]
    ]
    assert ids[n_prompt:] == [vocab[t] for t in completion]
    assert weights[:n_prompt] == [0.0] * n_prompt
    # Joy and Trust share 0.15; end-of-turn gets 0.085
    expected = [0.85 / 10] * 8 + [0.075, 0.085, 0.075, 0.085]
    assert weights[n_prompt:] == pytest.approx(expected, rel=1e-12)
    assert sum(weights) == pytest.approx(1.0, abs=1e-12)
    # its generation prompt already opens the think block: the completion does not repeat it
    tok.family = "qwen3_5"
    ids35, _ = sft.encode_row(tok, row, cfg)
    assert (
        ids35.count(vocab["<think>"]) == 1
        and ids35[-len(completion) + 1 :] == ids[-len(completion) + 1 :]
    )
    with pytest.raises(sft.DataError, match="'ccu-1'.*cannot be located"):
        sft.encode_row(
            tok, sft.Row("ccu-1", "ccu_emotion", row.prompt, "Bo is glad .", ["Joy"]), cfg
        )


def test_label_spans_follow_the_answer_line_data_py_reads():
    completion = "<think>\nAnswer: Joy is tempting\n</think>\nAnswer: anger\nAnswer:  Joy ,Trust "
    spans = sft.label_spans(completion, "ccu_emotion")
    assert [completion[a:b] for a, b in spans] == ["Joy", "Trust"]
    assert sft.label_spans("<think>x</think>\nAnswer: Joy, Bliss", "ccu_emotion") is None


# ----------------------------------------------------------------------------- the loss


def tiny_lora_model(dropout=0.0):
    torch.manual_seed(0)
    model = M.Qwen(M.QwenConfig.from_dict(dict(TINY)))
    M.add_lora(model, rank=4, alpha=8, dropout=dropout)
    M.train_token_rows(model, [50, 51])
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in T.trainable_groups(model)[0]:
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model


SAMPLES = [
    ([3, 50, 7, 9, 51, 12, 5, 20], [0, 0, 0, 0.3, 0.1, 0.5, 0.1, 0.0]),
    # weights of tokens 1.. are the targets'
    ([4, 11, 50, 13, 14, 51], [0, 0, 0.2, 0.2, 0.6, 0.0]),
]


def test_sft_loss_equals_a_hand_computation():
    model = tiny_lora_model()
    ids, weights, _ = sft.collate(SAMPLES, 0, "cpu")
    loss = sft.sft_loss(M.token_logprobs(model, ids, mask=weights > 0), weights, n_completions=2)
    expected = 0.0
    for row_ids, row_weights in SAMPLES:
        logp = model(torch.tensor([row_ids])).float().log_softmax(-1)[0]
        expected -= sum(
            w * logp[t - 1, row_ids[t]] for t, w in enumerate(row_weights) if t > 0 and w
        )
    assert loss.item() == pytest.approx(expected.item() / 2, rel=1e-5)


def grads(model):
    return [p.grad.clone() for p in T.trainable_groups(model)[0] + T.trainable_groups(model)[1]]


def test_one_or_two_accumulation_steps_give_the_same_loss_and_gradients():
    one, two = tiny_lora_model(), tiny_lora_model()
    loss_one = sft.backward_update(one, [sft.collate(SAMPLES, 0, "cpu")], 2)
    loss_two = sft.backward_update(two, [sft.collate([s], 0, "cpu") for s in SAMPLES], 2)
    assert loss_one == pytest.approx(loss_two, rel=1e-6)
    for a, b in zip(grads(one), grads(two)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_packed_micro_batches_give_the_padded_loss_and_gradients():
    padded, packed = tiny_lora_model(), tiny_lora_model()
    expected = sft.backward_update(padded, [sft.collate(SAMPLES, 0, "cpu")], 2)
    batches = sft.pack(SAMPLES, 14, "cpu")
    [(ids, weights, packing)] = batches  # both samples in one row of 8 + 6 tokens
    assert ids.tolist() == [SAMPLES[0][0] + SAMPLES[1][0]] and packing.lens == (8, 6)
    # the first sample's last token predicts nothing (0), then the second's targets
    assert torch.equal(weights, torch.tensor([SAMPLES[0][1][1:] + [0.0] + SAMPLES[1][1][1:]]))
    found = sft.backward_update(packed, batches, 2)
    assert found == pytest.approx(expected, rel=1e-6)
    for a, b in zip(grads(packed), grads(padded)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    # a budget below the pair: one micro-batch each, longest first
    assert [b[2].lens for b in sft.pack(SAMPLES, 13, "cpu")] == [(8,), (6,)]


def test_a_packed_run_trains_like_a_padded_one(checkpoint, tmp_path):
    rows = str(write_rows(tmp_path / "rows6.jsonl", [sad_row(i) for i in range(6)]))
    runs = {
        name: sft.train(
            config(checkpoint, tmp_path / name, data=rows, batch_size=3, rows_per_update=3, **extra)
        )
        for name, extra in (("padded", {}), ("packed", {"micro_batch_tokens": 4096}))
    }
    padded, packed = (metrics(runs[n]) for n in ("padded", "packed"))
    assert len(packed) == 2
    for a, b in zip(packed, padded):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    found, expected = (tensors(runs[n] / "best" / "adapter_model.safetensors") for n in runs)
    # Adam divides by sqrt(v) + 1e-8: where a gradient is near 1e-8 the two summation orders
    # (one packed row, padded rows; more so on 2 threads) move the weight differently, by up to
    # a few thousandths of lr (1e-2) per step. The losses above already agree to 1e-5.
    for key in expected:
        torch.testing.assert_close(found[key], expected[key], rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_two_gloo_ranks_train_like_one_process_with_two_accumulation_steps(checkpoint, tmp_path):
    """One of the four rows is held out: three rows make updates of 2 + 1 completions, so in every
    second update rank 1 has nothing to do. Selection samples on both ranks (the real sampler, with
    its own generator: training draws stay the same)."""
    settings = dict(
        epochs=2,
        save_every=1,
        keep_checkpoints=None,
        **{"selection.per_task": 1, "selection.max_new_tokens": 4},
    )
    single = config(
        checkpoint,
        tmp_path / "one",
        rows_per_update=2,
        output_dir=str(tmp_path / "one/run"),
        **settings,
    )
    sft.train(single)
    ranks = config(
        checkpoint,
        tmp_path / "two",
        rows_per_update=2,
        output_dir=str(tmp_path / "two/run"),
        **settings,
    )
    mp.spawn(_rank_run, args=(free_port(), ranks), nprocs=2)
    runs = [Path(c.output_dir) for c in (single, ranks)]
    losses = [[m["loss"] for m in metrics(run) if "loss" in m] for run in runs]
    assert len(losses[0]) == 4 and losses[0] == pytest.approx(losses[1], rel=1e-5)
    for step in range(1, 5):
        a, b = (tensors(run / f"ckpt-{step:06d}/adapter_model.safetensors") for run in runs)
        for name in a:
            torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-6)
    tables = [json.loads((run / "selection.json").read_text())["steps"] for run in runs]
    assert [s["step"] for s in tables[1]] == [2, 4] and tables[1][0]["macro_f1"].keys() == {
        "meld_emotion"
    }


def test_one_step_changes_only_lora_and_the_two_rows_at_ten_times_the_lr_without_decay(
    checkpoint, tmp_path
):
    cfg = config(
        checkpoint,
        tmp_path,
        lr=1e-3,
        weight_decay=0.5,
        save_merged=True,
        save_every=1,
        data=str(write_rows(tmp_path / "one.jsonl", [sad_row(0)])),
    )
    run = sft.train(cfg)
    ckpt = CK.latest_checkpoint(run)
    base, merged = tensors(checkpoint / "model.safetensors"), {}
    for shard in (run / "merged").glob("*.safetensors"):
        merged |= tensors(shard)
    adapter = tensors(ckpt / "adapter_model.safetensors")
    tags = json.loads((ckpt / "adapter_config.json").read_text())["trainable_token_indices"][
        "embed_tokens"
    ]
    rows = {
        key: adapter[f"base_model.model.{key}.token_adapter.trainable_tokens_delta"]
        for key in ("model.embed_tokens", "lm_head")
    }
    lora_targets = tuple(f"{t}.weight" for t in M.LORA_TARGETS)
    for name, weight in base.items():
        if name.endswith(lora_targets):
            assert not torch.equal(merged[name], weight), name
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            others = [i for i in range(weight.shape[0]) if i not in tags]
            assert torch.equal(merged[name][others], weight[others])
            assert not torch.equal(merged[name][tags], weight[tags])
        else:
            assert torch.equal(merged[name], weight), name  # norms and everything else frozen
    # AdamW's first step is p <- p (1 - lr wd) - lr m_hat
    # / (sqrt(v_hat) + eps), m_hat = g, v_hat = g^2
    state = json.loads((ckpt / "state.json").read_text())
    opt = tensors(ckpt / "optimizer.safetensors")
    lora_group, row_group = state["param_groups"]
    assert (lora_group["lr"], lora_group["weight_decay"]) == (pytest.approx(1e-3), 0.5)
    assert (row_group["lr"], row_group["weight_decay"]) == (pytest.approx(1e-2), 0.0)
    tok = load_tokenizer(checkpoint)
    for key, index, table in (
        ("model.embed_tokens", row_group["params"][0], "model.embed_tokens.weight"),
        ("lm_head", row_group["params"][1], "lm_head.weight"),
    ):
        # add_special_tokens starts new rows at the mean row
        initial = base[table][: len(tok)].mean(0)
        g = opt[f"{index}.exp_avg"] / (1 - 0.9)
        step = 1e-2 * g / ((opt[f"{index}.exp_avg_sq"] / (1 - 0.999)).sqrt() + 1e-8)
        torch.testing.assert_close(
            rows[key], initial.expand_as(rows[key]) - step, rtol=0, atol=1e-6
        )
        assert step.abs().max() > 5e-3  # rows moved by about 10 x lr per element
    lora_b = [
        t
        for n, t in tensors(ckpt / "adapter_model.safetensors").items()
        if n.endswith("lora_B.weight")
    ]
    # B starts at 0: |step| <= lr
    assert max(b.abs().max().item() for b in lora_b) == pytest.approx(1e-3, rel=1e-3)


@pytest.mark.slow
def test_a_tiny_model_overfits_a_few_examples(checkpoint, tmp_path):
    rows = [sad_row(0), sad_row(1, "meld_emotion", "joy"), sad_row(2, "ccu_emotion", "Trust")]
    data = str(write_rows(tmp_path / "three.jsonl", rows))
    cfg = config(checkpoint, tmp_path, epochs=30, rows_per_update=3, lr=3e-2, data=data)
    losses = [m["loss"] for m in metrics(sft.train(cfg))]
    assert len(losses) == 30  # full-batch updates: three completions per step
    # stated: a 1000x drop within 30 steps
    assert losses[-1] < losses[0] / 1000, (losses[0], losses[-1])


def test_report_to_tensorboard_holds_every_metric_of_the_run(checkpoint, tmp_path):
    cfg = config(checkpoint, tmp_path, batch_size=2, rows_per_update=2, report_to=["tensorboard"])
    out = sft.train(cfg)
    assert_sinks_hold_metrics(out)
    card = (out / "best" / "README.md").read_text()  # the model card save_model writes
    assert "CLUE, stage 1" in card and f"| loss | {metrics(out)[-1]['loss']:.6g} |" in card


# -------------------------------------------------------------- resume, selection, held-out targets


@pytest.mark.slow
def test_a_run_killed_after_step_k_resumes_bitwise_equal(checkpoint, tmp_path):
    """SIGKILL (no chance to save) once ckpt-000003 exists, resume, and compare with a run never
    stopped."""
    rows = write_rows(tmp_path / "rows8.jsonl", [sad_row(i) for i in range(8)])

    def run(name, kill_after=None):
        path = config_file(
            checkpoint,
            tmp_path / name,
            data=str(rows),
            epochs=5,
            save_every=1,
            **{"lora.dropout": 0.1},
        )
        process = subprocess.Popen(
            [sys.executable, str(REPO / "sft.py"), str(path)],
            cwd=tmp_path,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        while kill_after and not (tmp_path / name / "run" / f"ckpt-{kill_after:06d}").is_dir():
            assert process.poll() is None, process.stderr.read()
            time.sleep(0.005)
        if kill_after:
            process.send_signal(signal.SIGKILL)
        process.wait(timeout=300)
        return process.returncode, tmp_path / name / "run"

    assert run("whole")[0] == 0
    code, killed = run("killed", kill_after=3)
    assert code == -signal.SIGKILL and 3 <= int(CK.latest_checkpoint(killed).name[5:]) < 40
    assert run("killed")[0] == 0  # resume=auto
    whole = tmp_path / "whole" / "run"
    # the LoRA and the <evidence> rows; AdamW
    for file in ("adapter_model.safetensors", "optimizer.safetensors"):
        a, b = tensors(whole / "ckpt-000040" / file), tensors(killed / "ckpt-000040" / file)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), file
    drop = ("tokens_per_s", "elapsed_s")
    assert [{k: v for k, v in m.items() if k not in drop} for m in metrics(whole)] == [
        {k: v for k, v in m.items() if k not in drop} for m in metrics(killed)
    ]  # no step logged twice


@pytest.mark.parametrize("model", ["checkpoint", "llama_checkpoint"])
def test_best_loads_in_peft_as_is_with_the_trained_evidence_rows(model, request, tmp_path):
    """PEFT's PeftModel.from_pretrained(base, "best") applies the LoRA and the trained <evidence>
    rows: on a row holding evidence tokens its logits equal ours (trained rows moved by 10 x lr, far
    beyond the tolerance). The same for a Llama 3 model, on transformers' LlamaForCausalLM."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    checkpoint = request.getfixturevalue(model)
    run = sft.train(config(checkpoint, tmp_path, epochs=3, lr=5e-2))
    ours = M.load_adapter(M.Qwen.from_pretrained(checkpoint, dtype="float32"), run / "best")
    tok = load_tokenizer(run / "best")  # best/ carries the tokenizer with the added tags
    row = tok.encode("Bo says <evidence> I failed the exam again </evidence> so Bo is sad .")
    evidence = [tok.encode(t, special_tokens=True)[0] for t in ("<evidence>", "</evidence>")]
    assert set(evidence) <= set(row) and ours.row_ids.tolist() == evidence
    base = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    theirs = peft.PeftModel.from_pretrained(base, run / "best").eval()
    x = torch.tensor([row])
    with torch.no_grad():
        # trained
        assert (ours.embed_rows - ours.model.embed_tokens.weight[ours.row_ids]).abs().max() > 0.05
        torch.testing.assert_close(theirs(x).logits, ours(x), rtol=1e-5, atol=1e-5)


def test_llama_rows_are_llama_3_turns(llama_checkpoint, tmp_path):
    """A Llama 3 model's SFT row: its chat's headers, the completion closed by <|eot_id|>."""
    tok = load_tokenizer(llama_checkpoint)
    cfg = config(llama_checkpoint, tmp_path)
    row = sft.row_from_json(sad_row(0))
    ids, weights = sft.encode_row(tok, row, cfg)
    header = [
        "<|start_header_id|>",
        "[UNK]",
        "<|end_header_id|>",
    ]  # role words are not in SFT_WORDS
    head = [tok.token_id(t) for t in ["<|begin_of_text|>", *header]]
    n_prompt = weights.index(next(w for w in weights if w > 0))
    assert ids[:4] == head and ids[n_prompt - 3 : n_prompt] == head[1:]
    assert ids[-1] == tok.token_id("<|eot_id|>") and weights[-1] > 0
    assert tok.eos_token_ids == [tok.token_id("<|eot_id|>")] and tok.pad_token_id is None


def test_selection_keeps_the_adapter_with_the_best_mean_macro_f1(
    checkpoint, tmp_path, monkeypatch, capsys, umask_022
):
    rows = [sad_row(i, label=("sadness", "joy")[i % 2]) for i in range(4)]
    rows += [sad_row(i, "ccu_emotion", ("Joy", "Trust")[i % 2]) for i in range(4, 8)]
    for i, row in enumerate(rows):
        row["prompt"] = [{"role": "user", "content": f"row {i}"}]
    gold = {r["prompt"][0]["content"]: r["labels"] for r in rows}
    rounds = []

    def scripted(model, tok, prompts, keys, sampling, **kw):
        """Round 3 all right; round 5 right on meld_emotion only; round 6 all right again (a tie);
        else no answer."""
        rounds.append(len(prompts))
        texts = []
        for messages in prompts:
            labels = gold[messages[0]["content"]]
            # meld labels: lower case
            right = len(rounds) in (3, 6) or (len(rounds) == 5 and labels[0].islower())
            texts.append(
                [f"<think>\nx\n</think>\n\nAnswer: {', '.join(labels)}" if right else "no answer"]
            )
        return texts

    monkeypatch.setattr(sft, "sample_completions", scripted)
    cfg = config(
        checkpoint,
        tmp_path,
        data=str(write_rows(tmp_path / "rows.jsonl", rows)),
        epochs=2,
        save_every=1,
        keep_checkpoints=None,
        save_merged=True,
        **{"selection.per_task": 2, "selection.every": 1},
    )
    run = sft.train(cfg)
    umask_022(run)  # best/, merged/, checkpoints: the umask's permissions, like the logs
    printed = capsys.readouterr().out
    assert "held out 4 targets (meld_emotion 2, ccu_emotion 2); 4 of 8 rows share one" in printed
    assert rounds == [4] * 8
    table = json.loads((run / "selection.json").read_text())
    assert [s["mean_macro_f1"] for s in table["steps"]] == [0, 0, 1, 0, 0.5, 1, 0, 0]
    assert (
        table["steps"][4]["macro_f1"] == {"meld_emotion": 1.0, "ccu_emotion": 0.0}
        and table["best_step"] == 3
    )
    best = tensors(run / "best/adapter_model.safetensors")
    at3, final = (tensors(run / f"ckpt-00000{k}/adapter_model.safetensors") for k in (3, 8))
    assert all(torch.equal(best[k], at3[k]) for k in best) and not all(
        torch.equal(best[k], final[k]) for k in best
    )
    logged = [m for m in metrics(run) if "eval/mean_macro_f1" in m]
    assert [m["eval/mean_macro_f1"] for m in logged] == [0, 0, 1, 0, 0.5, 1, 0, 0]
    assert logged[4]["eval/meld_emotion/macro_f1"] == 1.0 and logged[4]["step"] == 5
    # best/'s model card, written at step 3: that step's loss beside its selection F1 (was: the
    # F1 record alone, the last one logged)
    card = (run / "best" / "README.md").read_text()
    loss_at_3 = next(m["loss"] for m in metrics(run) if m["step"] == 3 and "loss" in m)
    assert f"| loss | {loss_at_3:.6g} |" in card and "| eval/mean_macro_f1 | 1 |" in card


def test_rows_sharing_a_held_out_target_are_recognized():
    turns = conversation(0)
    example = Example(id="a", task="meld_emotion", turns=turns, target=3, labels=["sadness"])
    a = sft.row_from_example(example, "")
    # a second trace, no conversation attached
    same_id = sft.Row("a", "meld_emotion", a.prompt, "", ["joy"])
    shortened = sft.row_from_example(
        Example(id="a/ctx2", task="meld_emotion", turns=turns[1:], target=2, labels=["sadness"]), ""
    )
    other_task = sft.row_from_example(
        Example(id="b", task="ccu_emotion", turns=turns, target=3, labels=["Joy"]), ""
    )
    other_target = sft.row_from_example(
        Example(id="c", task="meld_emotion", turns=turns, target=2, labels=["sadness"]), ""
    )
    other_talk = sft.row_from_example(
        Example(id="d", task="meld_emotion", turns=conversation(1), target=3, labels=["sadness"]),
        "",
    )
    assert [
        sft.shares_target(a, r) for r in (same_id, shortened, other_task, other_target, other_talk)
    ] == [True, True, True, False, False]
    pool = [a, same_id, shortened, other_task, other_target, other_talk]
    held = sft.hold_out(pool, per_task=2, seed=0)
    assert (
        sum(r.task == "meld_emotion" for r in held) == 2
        and sum(r.task == "ccu_emotion" for r in held) <= 1
    )
    assert not any(sft.shares_target(x, y) for i, x in enumerate(held) for y in held[i + 1 :])


def test_f1_scores_agree_with_sklearn():
    metrics_ = pytest.importorskip("sklearn.metrics")
    preprocessing = pytest.importorskip("sklearn.preprocessing")
    labels = ["Joy", "Trust", "Anger", "None"]
    gold = [["Joy"], ["Joy", "Trust"], ["Anger"], ["None"], ["Trust"]]
    pred = [["Joy"], ["Trust"], None, ["Joy"], ["Trust", "Anger"]]
    binarize = preprocessing.MultiLabelBinarizer(classes=labels).fit([labels])
    y_true, y_pred = binarize.transform(gold), binarize.transform([p or [] for p in pred])
    ours = sft.f1_scores(gold, pred, labels)
    for average in ("macro", "weighted"):
        expected = metrics_.f1_score(y_true, y_pred, average=average, zero_division=0)
        assert ours[average] == pytest.approx(expected), average


# ----------------------------------------------------------------------------- prepare


def section(text: str, tag: str) -> str:
    return re.search(rf"<{tag}>\n(.*?)\n</{tag}>", text, re.DOTALL).group(1)


REFINED = (
    "<think>\nBo answers <evidence>Whatever .</evidence> right after "
    "<evidence>I failed the exam again</evidence>; the shrug covers disappointment.\n</think>\n\n"
    "Answer: sadness"
)
TEACHER = {  # example id -> the scripted teacher's answer
    "ex-0": {"completion": REFINED},
    "ex-1": {
        "status": "reference_conflict",
        "reference_labels": ["sadness"],
        "reason": "Nothing shows grief.",
        "source_evidence": ["Whatever ."],
        "supported_alternative_labels": ["anger"],
    },
    "ex-2": {
        "completion": REFINED.replace("I failed the exam again", "I passed the exam")
    },  # a fabricated quote
    "ex-3": {"completion": REFINED.replace("Answer: sadness", "Answer: joy")},  # not the gold label
    "ex-4": "Sure! Here is the refined trace.",  # not JSON
}


class Scripted:
    """One local server plays both sides: the base-model sampler and the teacher (told apart by the
    refinement system prompt); it records what each was sent."""

    def __init__(self):
        self.sampled, self.refined = [], []

    def __call__(self, messages, params):
        if messages[0]["content"] != P._REFINEMENT_SYSTEM:
            self.sampled.append((messages, params))
            return f"<think>\ntrace {len(self.sampled)}\n</think>\n\nAnswer: joy"
        packet = messages[-1]["content"]
        example_id = section(packet, "id")
        self.refined.append(section(packet, "original_completion"))
        answer = TEACHER[example_id]
        return (
            answer
            if isinstance(answer, str)
            else json.dumps({"id": example_id, "task": "meld_emotion", **answer})
        )


def sad_examples(n: int) -> list[Example]:
    return [
        Example(
            id=f"ex-{i}", task="meld_emotion", turns=conversation(i), target=3, labels=["sadness"]
        )
        for i in range(n)
    ]


def run_prepare(checkpoint, tmp_path, n_examples: int, **settings):
    """`prepare` for n gold examples against a Scripted server (the endpoint of `teacher`, and of
    `sampler` when settings ask for one); returns the examples, the server's backend and the
    counts."""
    examples = sad_examples(n_examples)
    write_rows(tmp_path / "gold.jsonl", [example_to_json(e) for e in examples])
    backend = Scripted()
    with JudgeServer(backend).start() as server:
        endpoint = {"base_url": server.url, "retries": 0, "timeout": 10}
        if settings.pop("sampler", False):
            settings["sampler"] = endpoint | {"model": "base"}
        path = tmp_path / "prepare.yaml"
        path.write_text(
            yaml.safe_dump(
                {
                    "examples": str(tmp_path / "gold.jsonl"),
                    "out": str(tmp_path / "sft.jsonl"),
                    "model": str(checkpoint),
                    "device": "cpu",
                    "teacher": endpoint | {"model": "teacher"},
                    **settings,
                }
            )
        )
        return examples, backend, P.prepare(P.parse_cli(P.PrepareConfig, [str(path)]))


def test_prepare_keeps_valid_refinements_and_routes_conflicts_and_fabrications_away(
    checkpoint, tmp_path
):
    examples, backend, counts = run_prepare(
        checkpoint, tmp_path, 5, sampler=True, max_new_tokens=64
    )
    assert counts == {
        "sampled": 5,
        "sampler_failures": 0,
        "kept": 1,
        "conflicts": 1,
        "rejected": 3,
        "teacher_failures": 0,
    }
    prompts = [sft.get_task("meld_emotion").messages(e) for e in examples]  # the task's own prompts
    assert sorted(m[0]["content"] for m, _ in backend.sampled) == sorted(
        p[0]["content"] for p in prompts
    )
    params = backend.sampled[0][1]
    assert (params["temperature"], params["top_p"], params["max_tokens"]) == (
        1.0,
        1.0,
        64,
    ) and "top_k" not in params
    assert params["chat_template_kwargs"] == {"enable_thinking": True}
    traces = [f"<think>\ntrace {k}\n</think>\n\nAnswer: joy" for k in range(1, 6)]
    assert sorted(backend.refined) == traces  # each sampled trace went to the teacher
    [row] = sft.load_rows(tmp_path / "sft.jsonl")
    assert (row.id, row.completion, row.labels) == ("ex-0", REFINED, ["sadness"])
    assert row.prompt == prompts[0] and row.turns == tuple(
        (t.speaker, t.text) for t in examples[0].turns
    )
    [conflict] = [
        json.loads(line) for line in (tmp_path / "sft.conflicts.jsonl").read_text().splitlines()
    ]
    assert conflict["id"] == "ex-1" and conflict["supported_alternative_labels"] == ["anger"]


def test_prepare_with_the_teacher_down_keeps_the_rows_an_earlier_run_wrote(checkpoint, tmp_path):
    run_prepare(checkpoint, tmp_path, 5, sampler=True, max_new_tokens=64)
    rows = (tmp_path / "sft.jsonl").read_bytes()
    cfg = P.parse_cli(P.PrepareConfig, [str(tmp_path / "prepare.yaml")])
    dead = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there: every call fails
    cfg.teacher.base_url, cfg.teacher.model = dead, "another teacher"
    cfg.sampler.base_url = dead
    # the samples are journaled; the teacher's first call, alone, stops the preparation
    with pytest.raises(
        P.JudgeError,
        match=rf"^'teacher': asked once before the run: judge at {dead}/chat/completions: "
        r"ConnectionError \(ConnectionRefusedError: \[Errno 111\] Connection refused\)",
    ):
        P.prepare(cfg)
    assert (tmp_path / "sft.jsonl").read_bytes() == rows


def test_prepare_with_a_teacher_that_refuses_every_call_shows_its_reason_and_writes_nothing(
    checkpoint, tmp_path, monkeypatch, capsys
):
    """The teacher is asked once, about a stand-in trace, before the model loads: its HTTP 400 and
    the reason it gives stop the preparation in one line, and no output file is left."""

    def refuses(messages, params):
        raise UnsupportedRequest("refinements are not served by this model")

    def no_load(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(P.Qwen, "from_pretrained", no_load)
    write_rows(tmp_path / "gold.jsonl", [example_to_json(e) for e in sad_examples(3)])
    with JudgeServer(refuses).start() as server:
        path = tmp_path / "prepare.yaml"
        path.write_text(
            yaml.safe_dump(
                {
                    "examples": str(tmp_path / "gold.jsonl"),
                    "out": str(tmp_path / "sft.jsonl"),
                    "model": str(checkpoint),
                    "device": "cpu",
                    "teacher": {"base_url": server.url, "model": "teacher", "retries": 0},
                }
            )
        )
        with pytest.raises(SystemExit) as stop:
            P.main([str(path)])
    assert stop.value.code == 2 and server.requests_seen == 1
    assert capsys.readouterr().err == (
        f"error: 'teacher': asked once before the run: judge at {server.url}/chat/completions "
        'refused the request: HTTP 400: {"error": {"message": "refinements are not served by this '
        'model", "type": "invalid_request_error", "code": 400}}\n'
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gold.jsonl", "prepare.yaml"]


def test_prepare_samples_with_model_py_when_no_endpoint_is_given(checkpoint, tmp_path):
    _, backend, counts = run_prepare(checkpoint, tmp_path, 2, max_new_tokens=6, samples=2)
    assert (counts["sampled"], counts["kept"], counts["conflicts"]) == (
        4,
        2,
        2,
    ) and not backend.sampled
    vocab = set(WORDS) | {"<think>", "</think>", *SPECIAL}
    # the teacher asked once about a stand-in before the model loaded, then about the 4 samples
    stand_in, *refined = backend.refined
    assert stand_in.startswith(P._STAND_IN_TRACE) and len(refined) == 4
    for trace in refined:  # the tiny model's own samples: 1 to 6 words of its vocabulary
        assert 1 <= len(trace.split()) <= 6 and set(trace.split()) <= vocab


# ----------------------------------------------------------------------------- bad input


def test_the_example_config_parses():
    cfg = sft.parse_cli(sft.SFTConfig, [str(REPO / "configs/sft_example.yaml")])
    assert (cfg.epochs, cfg.rows_per_update, cfg.seed, cfg.selection.per_task) == (2, 4, 42, 8)
    prep = P.parse_cli(P.PrepareConfig, [str(REPO / "configs/sft_example_prepare.yaml")])
    assert prep.teacher.api_key_env == "TEACHER_API_KEY" and (prep.out, prep.model) == (
        cfg.data,
        cfg.model,
    )


@pytest.mark.parametrize(
    "case",
    [
        "no completion",
        "label outside the task",
        "prompt row label",
        "answer differs",
        "empty file",
        "config typo",
        "huge label",
    ],
)
def test_bad_input_stops_with_one_line_before_any_model_loads(tmp_path, capsys, case):
    rows = [sad_row(0), sad_row(1)]
    lines = {
        "no completion": (2, "field 'completion': missing"),
        "label outside the task": (1, "field 'labels'"),
        "huge label": (
            1,
            f"field 'labels': '{'a' * 120}...' (52,428,800 characters) is not a label",
        ),
        "prompt row label": (2, "field 'labels'"),
        "answer differs": (1, "field 'completion': its final Answer"),
    }
    if case == "no completion":
        del rows[1]["completion"]
    elif case == "label outside the task":
        rows[0]["labels"] = ["rage"]
    elif case == "huge label":
        rows[0]["labels"] = ["a" * 52_428_800]
    elif case == "prompt row label":
        rows[1] = {
            "id": "p",
            "task": "meld_emotion",
            "prompt": [{"role": "user", "content": "hi"}],
            "completion": rows[1]["completion"],
            "labels": ["Sadness", "grief"],
        }
    elif case == "answer differs":
        rows[0]["completion"] = rows[0]["completion"].replace("Answer: sadness", "Answer: joy")
    data = write_rows(tmp_path / "rows.jsonl", [] if case == "empty file" else rows)
    typo = {"lrr": 1} if case == "config typo" else {}
    path = config_file(tmp_path / "no-such-model", tmp_path, data=str(data), **typo)
    with pytest.raises(SystemExit) as stop:
        sft.main([str(path)])
    err = capsys.readouterr().err
    # bounded: the 50 MB label is cut; the typo's line lists SFTConfig's keys (about 520 characters)
    assert stop.value.code != 0 and len(err.strip().splitlines()) == 1 and len(err) < 600, err[
        :1000
    ]
    if case == "config typo":
        assert re.fullmatch(
            rf"config error: {re.escape(str(path))}:\d+: unknown key 'lrr' .*\n", err
        )
    elif case == "empty file":
        assert err == f"error: {data}: no rows (the file is empty)\n"
    else:
        line, field = lines[case]
        assert err.startswith(f"error: {data}:{line}: {field}"), err


# ----------------------------------------------------------- trace refinement (moved from judge.py)


def exam_example() -> Example:
    turns = [
        Turn("Ann", "How did it go today?"),
        Turn("Bo", "I failed the exam again"),
        Turn("Ann", "Oh no, I'm sorry."),
        Turn("Bo", "Whatever. I don't even care anymore."),
    ]
    return Example(id="ex-1", task="meld_emotion", turns=turns, target=3, labels=["sadness"])


PROMPT = [
    {"role": "system", "content": "task instructions"},
    {"role": "user", "content": "Conversation: ..."},
]


def refined(**fields) -> str:
    record = {
        "id": "ex-1",
        "task": "meld_emotion",
        "completion": (
            "<think>\nBo answers <evidence>Whatever. I don't even care anymore.</evidence> right "
            "after <evidence>I failed the exam again</evidence>; the shrug covers "
            "disappointment.\n</think>\n\nAnswer: sadness"
        ),
    }
    record.update(fields)
    return json.dumps(record)


def conflict(**fields) -> str:
    record = {
        "id": "ex-1",
        "task": "meld_emotion",
        "status": "reference_conflict",
        "reference_labels": ["sadness"],
        "reason": "Nothing shows grief; the reply is dismissive.",
        "source_evidence": ["Whatever."],
        "supported_alternative_labels": ["anger"],
    }
    record.update(fields)
    return json.dumps(record)


def test_parse_refinement_accepts_a_grounded_trace_and_a_conflict_record():
    example = exam_example()
    trace = P.parse_refinement(refined(), example, PROMPT)
    assert (
        isinstance(trace, P.RefinedTrace)
        and trace.prompt == PROMPT
        and trace.completion.endswith("sadness")
    )
    record = P.parse_refinement(conflict(), example, PROMPT)
    assert isinstance(record, P.ReferenceConflict) and record.supported_alternative_labels == [
        "anger"
    ]
    assert P.parse_refinement(
        conflict(source_evidence=[], supported_alternative_labels=[]), example, PROMPT
    )


def test_parse_refinement_rejects_every_malformed_record():
    example = exam_example()
    completion = json.loads(refined())["completion"]
    bad = {
        "wrong id": refined(id="ex-2"),
        "wrong task": refined(task="cped_emotion"),
        "wrong label": refined(completion=completion.replace("Answer: sadness", "Answer: anger")),
        "label spelled differently": refined(
            completion=completion.replace("Answer: sadness", "Answer: Sadness")
        ),
        "text after the answer": refined(completion=completion + "\nHope this helps."),
        "fabricated quotation": refined(
            completion=completion.replace("I failed the exam again", "I failed badly")
        ),
        "quotation across turns": refined(
            completion=completion.replace(
                "I failed the exam again", "I failed the exam again Oh no"
            )
        ),
        "nested evidence": refined(
            completion=completion.replace("<evidence>I failed", "<evidence><evidence>I failed")
        ),
        "unclosed evidence": refined(completion=completion.replace("again</evidence>", "again")),
        "two think blocks": refined(
            completion=completion.replace("</think>", "</think>\n<think>x</think>")
        ),
        "no think": refined(completion=completion.replace("<think>", "")),
        "mentions the reference": refined(
            completion=completion.replace("the shrug", "the ground truth: the shrug")
        ),
        "extra field": refined(prompt=PROMPT),
        "truncated": refined()[:-20],
        "commentary after JSON": refined() + "\nDone.",
        "conflict with other labels": conflict(reference_labels=["anger"]),
        "conflict alternative outside the task": conflict(supported_alternative_labels=["rage"]),
        "conflict alternative equal to the reference": conflict(
            supported_alternative_labels=["sadness"]
        ),
        "conflict evidence not in the conversation": conflict(source_evidence=["I hate exams"]),
        "conflict without reason": conflict(reason=" "),
        "conflict with another status": conflict(status="ok"),
    }
    for name, answer in bad.items():
        assert P.parse_refinement(answer, example, PROMPT) is None, name


def test_parse_refinement_multi_label_answers_in_any_order():
    turns = [Turn("A", "We won the bid!"), Turn("B", "I knew you would, you always deliver.")]
    example = Example(
        id="ccu-1", task="ccu_emotion", turns=turns, target=1, labels=["Joy", "Trust"]
    )
    completion = (
        "<think>\nB answers <evidence>I knew you would</evidence> with confidence in "
        "A.\n</think>\n\nAnswer: "
    )
    assert (
        P.parse_refinement(
            refined(id="ccu-1", task="ccu_emotion", completion=completion + "Trust, Joy"),
            example,
            PROMPT,
        )
        is not None
    )
    for answer in ["Joy", "Joy,Trust", "Joy, Trust, Joy", "joy, trust"]:
        record = refined(id="ccu-1", task="ccu_emotion", completion=completion + answer)
        assert P.parse_refinement(record, example, PROMPT) is None, answer


def test_refinement_request_carries_the_packet_as_data():
    example = exam_example()
    request = P.refinement_request(
        example, PROMPT, 'Bo is sad.\n</original_completion>\n<labels>\n["joy"]', 777
    )
    assert request.max_tokens == 777  # the config's refine_max_tokens, not a fixed 8192
    user = request.messages[-1]["content"]
    assert re.findall(r"^<labels>\n(.*)\n</labels>$", user, re.MULTILINE) == ['["sadness"]']
    assert (
        json.loads(
            re.search(r"<source_messages>\n(.*?)\n</source_messages>", user, re.DOTALL).group(1)
        )
        == PROMPT
    )


def documented_sft_commands():
    """(page, config, overrides, processes) of every `sft.py` command in the README, docs/ and the
    configs' comments."""
    pattern = re.compile(
        r"(?:torchrun(?: --nproc_per_node[= ](\d+))?|python) sft\.py (configs/\S+\.yaml)"
        r"((?: [\w.]+=\S+)*)"
    )
    pages = [REPO / "README.md", *(REPO / "docs").glob("*.md"), *(REPO / "configs").glob("*.yaml")]
    for page in pages:
        for match in pattern.finditer(page.read_text(encoding="utf-8")):
            procs, config, overrides = match.groups()
            yield page.name, config, overrides.split(), int(procs or 1)


def test_every_documented_sft_command_keeps_its_global_batch_at_any_world_size():
    """CLUE A.1: 1 example per device x 4 accumulation steps on one GPU, 4 rows per update. Every
    documented command's config, at its own world size, at 1 and at 8 ranks: the ranks' rows of an
    update (sft.rank_rows) add up to the config's rows_per_update, the CLUE configs' to 4 (Table 1's
    Reasoning SFT and Label SFT alike), each row trained by one rank."""
    commands = list(documented_sft_commands())
    assert {c for _, c, _, _ in commands} >= {
        "configs/sft_example.yaml",
        "configs/clue_label_sft.yaml",
        "configs/demo_sft.yaml",
        "configs/emollm_stage1_cpt.yaml",
    }
    for page, path, overrides, procs in commands:
        cfg = load_config(REPO / path, overrides, sft.SFTConfig)
        update = sft.update_rows(1000, 0, cfg.rows_per_update, cfg.seed)
        for world in (1, 8, procs):
            rows = [sft.rank_rows(update, rank, world) for rank in range(world)]
            assert sorted(i for part in rows for i in part) == sorted(update), (page, path)
            assert len(update) == cfg.rows_per_update
        if path in ("configs/sft_example.yaml", "configs/clue_label_sft.yaml"):
            assert (cfg.rows_per_update, cfg.batch_size) == (4, 1), (page, path)
            assert procs <= 4, (page, "more processes than rows per update")
