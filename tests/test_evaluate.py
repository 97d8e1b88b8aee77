"""evaluate.py: F1 against scikit-learn, the Wilcoxon test against scipy, mean and sample SD,
catch-all exclusion, cause identification and evidence alignment on hand-made cases; then whole
evaluations: an endpoint (the local judge server, scripted answers and a tiny random checkpoint)
against the same checkpoint in-process, resume after an interruption, the Markdown tables and both
figures."""

import dataclasses
import json
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import TINY, fake_eval, write_tiny_checkpoint

import evaluate as ev
from config import load_config, open_log, read_log
from data import DataError, Example, Turn
from dataset import save_jsonl
from dialogue import eqbench3
from http_client import JudgeConfig
from judge_server import Faults, JudgeServer, rules_backend

REPO = Path(__file__).resolve().parents[1]

# -------------------------------------------------------------------------- F1 against scikit-learn


def sk_scores(gold, pred, labels, multi):
    """The oracle: scikit-learn's weighted and macro F1 over the labels present in gold or
    predictions."""
    metrics = pytest.importorskip("sklearn.metrics")
    from sklearn.preprocessing import MultiLabelBinarizer

    present = [
        lab for lab in labels if any(lab in g for g in gold) or any(lab in (p or ()) for p in pred)
    ]
    if multi:
        binarize = MultiLabelBinarizer(classes=present)
        y_true = binarize.fit_transform([set(g) & set(present) for g in gold])
        y_pred = binarize.transform([set(p or ()) & set(present) for p in pred])
        kw = {}
    else:
        y_true, y_pred = [g[0] for g in gold], [p[0] if p else "<invalid>" for p in pred]
        kw = {"labels": present}
    return tuple(
        metrics.f1_score(y_true, y_pred, average=avg, zero_division=0, **kw)
        for avg in ("weighted", "macro")
    )


@pytest.mark.parametrize("seed", range(6))
def test_single_label_f1_matches_sklearn(seed):
    rng = random.Random(seed)
    labels = ["anger", "joy", "neutral", "sadness", "fear"]
    gold = [[rng.choice(labels[:4])] for _ in range(60)]  # fear never gold: predicted-only label
    pred = [None if rng.random() < 0.15 else [rng.choice(labels)] for _ in gold]
    ours = ev.f1_scores(gold, pred, labels)
    assert (ours["weighted"], ours["macro"]) == pytest.approx(
        sk_scores(gold, pred, labels, multi=False), abs=1e-12
    )
    assert ours["n"] == 60
    assert ours["accuracy"] == pytest.approx(sum(p == g for g, p in zip(gold, pred)) / 60)


@pytest.mark.parametrize("seed", range(6))
def test_multi_label_f1_matches_sklearn(seed):
    rng = random.Random(100 + seed)
    labels = ["Anger", "Joy", "Trust", "Fear", "Sadness", "Surprise"]
    gold = [rng.sample(labels, rng.randint(1, 3)) for _ in range(50)]
    pred = [None if rng.random() < 0.1 else rng.sample(labels, rng.randint(1, 3)) for _ in gold]
    ours = ev.f1_scores(gold, pred, labels)
    assert (ours["weighted"], ours["macro"]) == pytest.approx(
        sk_scores(gold, pred, labels, multi=True), abs=1e-12
    )


def test_catch_all_targets_are_context_not_scored():
    labels = ["Joy", "Anger", "None"]
    gold = [["Joy"], ["Anger"], ["None"], ["Joy"]]
    pred = [["Joy"], ["None"], ["Joy"], None]
    scores = ev.f1_scores(gold, pred, labels, catch_all="None")
    # Scored: rows 0, 1, 3. Joy: TP 1, FN 1 -> F1 2/3 (support 2). Anger: FN 1 -> 0 (support 1).
    # Predicting the catch-all is only a miss (no "None" class); row 2's false Joy is not counted.
    assert scores["n"] == 3 and set(scores["per_label"]) == {"Joy", "Anger"}
    assert scores["weighted"] == pytest.approx((2 / 3 * 2 + 0 * 1) / 3)
    assert scores["macro"] == pytest.approx(1 / 3)
    assert scores["accuracy"] == pytest.approx(1 / 3)
    everything = ev.f1_scores(gold, pred, labels)  # without the exclusion the catch-all is a class
    assert everything["n"] == 4 and "None" in everything["per_label"]
    assert ev.f1_scores([["None"]], [["None"]], labels, "None")["weighted"] is None


def test_mean_and_sample_sd():
    stat = ev.mean_sd([0.5, 0.7, 0.9])
    # sqrt((0.04+0+0.04)/2)
    assert stat["mean"] == pytest.approx(0.7) and stat["sd"] == pytest.approx(0.2)
    assert ev.mean_sd([0.4])["sd"] is None and ev.mean_sd([0.4, None])["mean"] is None


def test_task_scores_average_runs_per_task():
    def ex(i, task, labels, **kw):
        return Example(f"e{i}", task, [Turn("A", "hi")], 0, labels, **kw)

    examples = [
        ex(0, "meld_emotion", ["joy"]),
        ex(1, "meld_emotion", ["anger"]),
        ex(2, "ccu_emotion", ["Joy"]),
    ]
    completions = [
        ["</think>\nAnswer: joy", "</think>\nAnswer: anger"],
        ["</think>\nAnswer: anger", "no answer"],
        ["</think>\nAnswer: Joy", "</think>\nAnswer: Joy, Trust"],
    ]
    scores = ev.task_scores(examples, completions)
    # meld run 0: both right (1, 1); run 1: joy missed, anger predicted where joy was gold,
    # anger invalid: joy F1 0, anger F1 0 -> (0, 0). Means 0.5 / 0.5, invalid (0 + 0.5) / 2.
    assert scores["meld_emotion"] == {"weighted": 0.5, "macro": 0.5, "invalid": 0.25, "n": 2}
    # ccu run 1: Joy TP, Trust FP: weighted = Joy's F1 1 (Trust has no support), macro (1 + 0) / 2.
    assert scores["ccu_emotion"]["weighted"] == pytest.approx(1.0)
    assert scores["ccu_emotion"]["macro"] == pytest.approx(0.75)


# --------------------------------------------------------------------------- Wilcoxon against scipy


def test_wilcoxon_exact_matches_scipy_without_ties():
    stats = pytest.importorskip("scipy.stats")
    for seed in range(20):
        rng = random.Random(seed)
        n = rng.randint(1, 50)
        x = [rng.random() for _ in range(n)]
        y = [v + rng.gauss(0.1, 0.3) for v in x]
        ours, ref = ev.wilcoxon(x, y), stats.wilcoxon(x, y, method="exact")
        assert ours["method"] == "exact" and ours["n"] == n
        assert ours["statistic"] == pytest.approx(ref.statistic) and ours["p"] == pytest.approx(
            ref.pvalue, rel=1e-9
        )


def test_wilcoxon_with_ties_and_zeros_matches_scipy_permutation():
    stats = pytest.importorskip("scipy.stats")
    for seed in range(20):
        rng = random.Random(seed)
        n = rng.randint(4, 16)
        x = [rng.choice([0.0, 0.25, 0.5, 0.75, 1.0]) for _ in range(n)]
        y = [rng.choice([0.0, 0.25, 0.5, 0.75, 1.0]) for _ in range(n)]
        nonzero = [(a, b) for a, b in zip(x, y) if a != b]
        ours = ev.wilcoxon(x, y)
        assert ours["n"] == len(nonzero)
        if len(nonzero) < 2:
            continue
        # All 2^n sign patterns enumerated (n <= 13 <
        # log2(9999)): scipy's permutation p is exact too.
        ref = stats.wilcoxon(*zip(*nonzero), method=stats.PermutationMethod(n_resamples=9999))
        assert ours["statistic"] == pytest.approx(ref.statistic)
        assert ours["p"] == pytest.approx(ref.pvalue, rel=1e-9)


def test_wilcoxon_normal_approximation_above_50_matches_scipy():
    stats = pytest.importorskip("scipy.stats")
    for seed in range(5):
        rng = random.Random(seed)
        # exact in binary: exact ties
        x = [rng.choice([0.0, 0.25, 0.5, 0.75, 1.0]) for _ in range(120)]
        y = [rng.choice([0.0, 0.25, 0.5, 0.75, 1.0]) for _ in range(120)]
        ours, ref = ev.wilcoxon(x, y), stats.wilcoxon(x, y, method="asymptotic")
        assert ours["method"] == "normal" and ours["n"] > 50
        assert ours["p"] == pytest.approx(ref.pvalue, rel=1e-9)


def test_wilcoxon_by_hand():
    # d = (1, 2, -3): T+ = 1 + 2 = 3 of 6; of the 8 sign
    # patterns, T+ <= 3 in 5 -> p = min(1, 2 * 5/8) = 1.
    assert ev.wilcoxon([1, 2, 0], [0, 0, 3]) == {
        "statistic": 3.0,
        "p": 1.0,
        "n": 3,
        "method": "exact",
    }
    # Five positive differences: only one pattern has T+ = 15 -> p = 2 / 32.
    assert ev.wilcoxon([1, 2, 3, 4, 5], [0, 0, 0, 0, 0])["p"] == pytest.approx(2 / 32)
    assert ev.wilcoxon([0.5, 0.5], [0.5, 0.5]) == {
        "statistic": 0.0,
        "p": 1.0,
        "n": 0,
        "method": "exact",
    }


# ----------------------------------------------------------------------------- causes and alignment


def ecf_example(labels=("anger",), causes=((1, "you broke my phone"),), target=2) -> Example:
    turns = [
        Turn("Ross", "Hey, how was the trip?"),
        Turn("Joey", "I think you broke my phone, man."),
        Turn("Ross", "What? I never touched it!"),
    ]
    return Example(
        "ecf-1",
        "meld_emotion",
        turns,
        target,
        list(labels),
        meta={"causes": [{"turn": t, "span": s} for t, s in causes]},
    )


def test_cause_turns_keep_earlier_causes_of_non_neutral_targets():
    # the target itself is no
    assert ev.cause_turns(ecf_example(causes=((1, "x"), (2, "y"), (1, "z")))) == [1]
    assert ev.cause_turns(ecf_example(labels=("neutral",))) == []  # earlier cause
    assert ev.cause_turns(ecf_example(causes=((2, "self"),))) == []
    assert ev.cause_identified([False, True], ["anger"]) is True
    assert ev.cause_identified([False, None], ["anger"]) is None
    assert ev.cause_identified([False, False], ["anger"]) is False
    assert ev.cause_identified([], None) is False


def test_alignment_lines_from_any_quotation_style():
    example = ecf_example()
    completion = (
        "<think>Joey says <evidence>you broke my phone</evidence>. Ross answers “I never touched "
        "it”, and \"how was the trip\" is small talk. 'phone' alone is no "
        "quotation.</think>\nAnswer: anger"
    )
    assert ev.matched_lines(completion, example) == {0, 1, 2}
    assert ev.matched_lines(
        "<think>He says 「never touched it」 and “a made-up line”.</think>", example
    ) == {2}
    assert ev.alignment_f1({1, 2}, {2}) == pytest.approx(2 * 1 / 3)
    assert ev.alignment_f1(set(), {0}) == 0.0 and ev.alignment_f1({0}, set()) is None


# ----------------------------------------------------------------------------- whole evaluations


def tiny_sets() -> dict[str, list[Example]]:
    """Tiny sets: ccu_emotion (multi-label, one catch-all target), meld_emotion with ECF causes,
    mmlu."""
    ccu = [
        Example(f"ccu-{i}", "ccu_emotion", [Turn("A", "Hello there"), Turn("B", text)], 1, labels)
        for i, (text, labels) in enumerate(
            [
                ("say Joy", ["Joy"]),
                ("say Anger", ["Anger"]),
                ("say None", ["None"]),
                ("say Joy", ["Joy", "Trust"]),
            ]
        )
    ]
    meld = [
        ecf_example(),
        Example(
            "ecf-2",
            "meld_emotion",
            [Turn("A", "It is sunny."), Turn("B", "say neutral")],
            1,
            ["neutral"],
        ),
    ]
    mmlu = [
        Example(
            "mmlu-0", "mmlu", [], None, ["B"], meta={"question": "2 + 2 = ?", "options": ["3", "4"]}
        )
    ]
    return {"ccu": ccu, "meld": meld, "mmlu": mmlu}


def write_sets(folder: Path) -> dict[str, Path]:
    paths = {}
    for name, examples in tiny_sets().items():
        paths[name] = folder / f"{name}.jsonl"
        save_jsonl(examples, paths[name])
    return paths


def scripted_model(messages, params):
    """A fake model behind the endpoint: answers what the turn to analyze says ("say X"), and for
    the ECF target quotes the cause turn; for MMLU answers B. Deterministic, so runs agree."""
    prompt = messages[-1]["content"]
    if "Question: 2 + 2" in prompt:
        return "<think>\nFour is option B.\n</think>\n\nAnswer: B"
    target = prompt.rsplit("Turn to analyze:\n", 1)[1].splitlines()[0]
    if "never touched" in target:
        return (
            "<think>\nJoey says <evidence>you broke my phone</evidence>, so Ross feels anger at "
            "the blame.\n</think>\n\nAnswer: anger"
        )
    label = target.split("say ", 1)[1]
    return f"<think>\nThe turn says <evidence>say {label}</evidence>.\n</think>\n\nAnswer: {label}"


def eval_config(tmp_path, paths, out, causes=True, **overrides) -> ev.EvalConfig:
    sets = [
        ev.EvalSet("ccu", str(paths["ccu"]), "in"),
        ev.EvalSet("meld", str(paths["meld"]), "out", causes=causes),
        ev.EvalSet("mmlu", str(paths["mmlu"])),
    ]
    return ev.EvalConfig(output_dir=str(tmp_path / out), sets=sets, **overrides)


def test_endpoint_evaluation_numbers_by_hand(tmp_path):
    paths = write_sets(tmp_path)
    seen = []

    def model(messages, params):
        seen.append(params)
        return scripted_model(messages, params)

    with (
        JudgeServer(model, port=0).start() as server,
        JudgeServer(rules_backend, port=0).start() as judge_server,
    ):
        endpoint = JudgeConfig(
            base_url=server.url, model="scripted", timeout=10, retries=0, concurrency=2
        )
        judge = JudgeConfig(base_url=judge_server.url, model="rules", timeout=10, retries=0)
        result = ev.evaluate(
            eval_config(tmp_path, paths, "run", endpoint=endpoint, judge=judge, name="scripted")
        )
        requests_made = list(seen)
        # the same evaluation from the command line, with an override
        config = tmp_path / "eval.yaml"
        sets = [("ccu", "in", "false"), ("meld", "out", "true"), ("mmlu", "null", "false")]
        config.write_text(
            (
                f"output_dir: {tmp_path / 'cli'}\nendpoint: {{base_url: '{server.url}', model: "
                f"scripted}}\njudge: {{base_url: '{judge_server.url}'}}\nsets:\n"
            )
            + "".join(
                f"  - {{name: {n}, path: '{paths[n]}', domain: {d}, causes: {c}}}\n"
                for n, d, c in sets
            )
        )
        cli = subprocess.run(
            [sys.executable, str(REPO / "evaluate.py"), str(config), "name=scripted"],
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=300,
        )
        assert cli.returncode == 0, cli.stderr
        assert "ETA" in cli.stdout and "| scripted |" in cli.stdout
        assert json.loads((tmp_path / "cli" / "eval.json").read_text())["sets"] == result["sets"]
    # 4 ccu + 2 meld examples x 3 samples, 1 greedy MMLU completion.
    assert len(requests_made) == 19 and sum(p["temperature"] == 0.0 for p in requests_made) == 1
    sampled = [p for p in requests_made if p["temperature"] != 0.0]
    assert all((p["temperature"], p["top_p"], p["top_k"]) == (0.6, 0.95, 20) for p in sampled)
    assert all("seed" not in p and "chat_template_kwargs" not in p for p in requests_made)
    ccu = result["sets"]["ccu"]
    # ccu scored targets 0, 1, 3 (2 is the catch-all): Joy TP 2, Anger TP 1, Trust FN 1 ->
    # weighted (1*2 + 1*1 + 0*1) / 4 = 0.75, macro (1 + 1 + 0) / 3.
    assert ccu["n_scored"] == 3 and ccu["weighted_f1"] == {
        "mean": 0.75,
        "sd": 0.0,
        "runs": [0.75] * 3,
    }
    assert ccu["macro_f1"]["mean"] == pytest.approx(2 / 3) and ccu["invalid"]["mean"] == 0.0
    meld = result["sets"]["meld"]
    assert meld["weighted_f1"]["mean"] == 1.0
    assert meld["causes"] == {"n_targets": 1, "n_pairs": 1, "unknown": [0, 0, 0]}
    assert meld["cause_rate"] == {"mean": 1.0, "sd": 0.0, "runs": [1.0, 1.0, 1.0]}
    assert (
        result["sets"]["mmlu"]["decoding"]["n_samples"] == 1
        and result["sets"]["mmlu"]["weighted_f1"]["sd"] is None
    )
    assert result["averages"]["in"]["weighted_f1"]["mean"] == 0.75 and result["averages"]["out"][
        "sets"
    ] == ["meld"]
    assert result["sets"]["ccu"]["reasoning_tokens"]["mean"] is None  # no tokenizer for an endpoint
    out = tmp_path / "run"
    saved = json.loads((out / "eval.json").read_text())
    assert (
        saved["sets"]["ccu"]["weighted_f1"]["mean"] == 0.75
        and saved["model"]["endpoint"] == endpoint.base_url
    )
    assert saved["config"]["endpoint"]["base_url"] == endpoint.base_url
    assert len((out / "completions.jsonl").read_text().splitlines()) == 19
    assert load_config(out / "config.yaml", [], ev.EvalConfig).endpoint.model == "scripted"
    table = (out / "table.md").read_text()
    assert (
        "| scripted | 75.00 ± 0.00 | 75.00 ± 0.00 | 100.00 ± 0.00 | 100.00 ± 0.00 | 100.00 |"
        in table
    )


# ----------------------------------------------------------------------------- tiny checkpoint


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """A random-weight Qwen3 checkpoint written by transformers, with a word-level tokenizer over
    the words of the tiny sets' prompts and the answer words, so completions vary from prompt to
    prompt."""
    from data import build_prompt

    path = tmp_path_factory.mktemp("tiny")
    prompts = " ".join(build_prompt(e) for examples in tiny_sets().values() for e in examples)
    words = list(
        dict.fromkeys(
            ["[UNK]", "</think>", "Answer:", "Joy", "Anger", "anger", "B", *prompts.split()]
        )
    )
    return write_tiny_checkpoint(
        path,
        words,
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>"],
        dict(
            vocab_size=len(words) + 5,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            max_position_embeddings=4096,
            tie_word_embeddings=False,
        ),
        wordpiece_decoder=True,
        pad_token=None,
        weights="transformers",
    )


def small_sampling(**kw):
    return ev.SamplingConfig(max_new_tokens=12, **kw)


def test_endpoint_and_in_process_greedy_agree(tmp_path, tiny_checkpoint):
    """The same checkpoint evaluated greedily in-process and behind judge_server's model backend
    gives the same completions and the same numbers."""
    import judge_server

    paths = write_sets(tmp_path)
    common = dict(sampling=small_sampling(temperature=0.0), n_samples=2, name="tiny")
    with (
        JudgeServer(judge_server.ModelBackend(str(tiny_checkpoint)), port=0).start() as server,
        JudgeServer(rules_backend, port=0).start() as judge,
    ):
        common["judge"] = JudgeConfig(base_url=judge.url, timeout=30, retries=0)
        local = ev.evaluate(
            eval_config(
                tmp_path,
                paths,
                "local",
                checkpoint=str(tiny_checkpoint),
                device="cpu",
                # the model backend runs on the CPU too
                batch_size=3,
                **common,
            )
        )
        served = ev.evaluate(
            eval_config(
                tmp_path,
                paths,
                "served",
                endpoint=JudgeConfig(base_url=server.url, model="tiny", timeout=60, retries=0),
                tokenizer=str(tiny_checkpoint),
                **common,
            )
        )

    def records(run):
        return {
            (r["set"], r["id"], r["sample"]): r
            for r in map(
                json.loads, (tmp_path / run / "completions.jsonl").read_text().splitlines()
            )
        }

    a, b = records("local"), records("served")
    assert a == b and len(a) == (4 + 2) * 2 + 1
    # the prompts lead to different completions
    assert len({r["completion"] for r in a.values()}) > 3
    from tokenizers import Tokenizer

    words = Tokenizer.from_file(str(tiny_checkpoint / "tokenizer.json"))
    assert all("</think>" not in r["completion"] for r in a.values())  # all of it is reasoning
    assert [r["reasoning_tokens"] for r in a.values()] == [
        len(words.encode(r["completion"]).ids) for r in a.values()
    ]
    assert local["sets"] == served["sets"] and local["averages"] == served["averages"]


def test_interrupted_evaluation_resumes_to_the_same_completions(
    tmp_path, tiny_checkpoint, monkeypatch
):
    import model as qwen

    paths = write_sets(tmp_path)
    settings = dict(
        checkpoint=str(tiny_checkpoint),
        device="cpu",
        sampling=small_sampling(),
        batch_size=3,
        n_samples=3,
    )
    ev.evaluate(eval_config(tmp_path, paths, "whole", causes=False, **settings))
    real, calls = qwen.generate, []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:  # one example per call (3 samples each): the third ccu example is lost
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(qwen, "generate", interrupted)
    with pytest.raises(KeyboardInterrupt):
        ev.evaluate(eval_config(tmp_path, paths, "cut", causes=False, **settings))
    cut = tmp_path / "cut" / "completions.jsonl"
    assert len(cut.read_text().splitlines()) == 6
    with open(cut, "a") as f:
        f.write('{"set": "ccu", "id": "torn')  # a crash in the middle of a line
    monkeypatch.setattr(qwen, "generate", real)
    ev.evaluate(eval_config(tmp_path, paths, "cut", causes=False, **settings))

    def records(run):
        text = (tmp_path / run / "completions.jsonl").read_text()
        return sorted(json.dumps(json.loads(line), sort_keys=True) for line in text.splitlines())

    assert records("cut") == records("whole") and len(records("cut")) == 19
    assert len({json.loads(r)["completion"] for r in records("cut")}) > 3  # sampled, not all alike
    # another decoding in the same output_dir is refused
    with pytest.raises(ev.ConfigError, match="seed"):
        ev.evaluate(eval_config(tmp_path, paths, "cut", causes=False, **(settings | {"seed": 1})))


def test_read_log_splits_records_at_newline_only(tmp_path):
    """A completion may hold U+2028, U+2029 or U+0085 (line breaks to str.splitlines): its record
    stays whole; a torn last line is ignored and the file left as it is, until open_log moves it to
    completions.jsonl.torn before appending."""
    records = [{"completion": "a\u2028b\x85c"}, {"completion": "d\u2029"}, {"completion": ""}]
    whole = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    path = tmp_path / "completions.jsonl"
    path.write_text(whole + '{"completion": "e\u2028', encoding="utf-8")
    assert read_log(path, ev.EvalError) == records
    assert path.read_text(encoding="utf-8") == whole + '{"completion": "e\u2028'
    with open_log(path) as f:
        f.write('{"completion": "f"}\n')
    assert read_log(path) == [*records, {"completion": "f"}]
    assert (tmp_path / "completions.jsonl.torn").read_text() == '{"completion": "e\u2028\n'
    # a bad line inside stops the read
    path.write_text(whole + '{"completion": "e\n' + whole, encoding="utf-8")
    with pytest.raises(ev.EvalError, match=r"completions.jsonl:4: not valid JSON"):
        read_log(path, ev.EvalError)


# -------------------------------------------------------------------- tables, figures, command line


def test_compare_prints_table_one_layout_with_differences(tmp_path):
    base, clue = fake_eval("Base", 0.40, 0.50, 900, 800), fake_eval("CLUE", 0.47, 0.55, 400, 350)
    for name, e in (("base", base), ("clue", clue)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "eval.json").write_text(json.dumps(e))
    result = subprocess.run(
        [
            sys.executable,
            str(REPO / "evaluate.py"),
            "compare",
            str(tmp_path / "base"),
            str(tmp_path / "clue" / "eval.json"),
            "--out",
            str(tmp_path / "cmp"),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "| Model | ccu_zh_emotion | In-domain avg | meld | Out-of-domain avg |" in lines
    assert "| Base | 40.00 ± 1.00 | 40.00 ± 1.00 | 50.00 ± 1.00 | 50.00 ± 1.00 |" in lines
    assert "| Δ vs Base | +7.00 | +7.00 | +5.00 | +5.00 |" in lines
    assert "| CLUE | 400 ± 0 | 400 ± 0 | 350 ± 0 | 350 ± 0 |" in lines
    assert (tmp_path / "cmp" / "table.md").read_text() == ev.markdown_tables([base, clue])
    assert (
        "Gain of CLUE over Base in average weighted F1: In-domain +7.00 points (+17.5%), "
        "Out-of-domain +5.00 points (+10.0%)"
    ) in lines


@pytest.mark.slow
def evaluate_command(config: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "evaluate.py"), str(config)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )


def test_bad_configs_are_one_line_errors(tmp_path):
    paths = write_sets(tmp_path)
    config = tmp_path / "c.yaml"
    config.write_text(
        f"output_dir: {tmp_path / 'o'}\nsets:\n  - name: ccu\n    path: {paths['ccu']}\n"
    )
    for extra, message in (
        ("", "exactly one of 'checkpoint'"),
        ("checkpoint: x\nn_samples: 0", "at least 1"),
        ("checkpoint: x\nsamples: 3", "unknown key 'samples'"),
    ):
        config.write_text(
            f"output_dir: {tmp_path / 'o'}\nsets:\n  - name: ccu\n    path: "
            f"{paths['ccu']}\n{extra}\n"
        )
        result = evaluate_command(config)
        assert (
            result.returncode != 0 and message in result.stderr and "Traceback" not in result.stderr
        )
        assert len(result.stderr.strip().splitlines()) == 1


def evaluate_on_a_dead_endpoint(tmp_path, completions: str):
    """evaluate.py over the ccu set through an endpoint where nothing listens, its output_dir
    holding `completions` as completions.jsonl; (output_dir, the finished command)."""
    paths = write_sets(tmp_path)
    out = tmp_path / "o"
    out.mkdir()
    (out / "completions.jsonl").write_text(completions)
    config = tmp_path / "c.yaml"
    config.write_text(
        f"output_dir: {out}\nsets:\n  - name: ccu\n    path: {paths['ccu']}\n"
        "endpoint: {base_url: 'http://127.0.0.1:9/v1', retries: 0}\n"
    )
    return out, evaluate_command(config)


def test_a_foreign_completions_file_in_output_dir_is_one_line_and_kept(tmp_path):
    out, result = evaluate_on_a_dead_endpoint(tmp_path, '{"prompt": "mine"}\n')
    assert result.returncode == 2 and result.stderr == (
        f"error: {out / 'completions.jsonl'}:1: not a completion record {{set, id, sample, "
        "completion, reasoning_tokens} of evaluate.py\n"
    )
    assert (out / "completions.jsonl").read_text() == '{"prompt": "mine"}\n'


def test_an_endpoint_that_keeps_failing_is_one_line_and_keeps_a_torn_line(tmp_path):
    """One line saying a rerun resumes (exit 2); the torn last line of an earlier run's
    completions.jsonl is moved to completions.jsonl.torn, not dropped."""
    out, result = evaluate_on_a_dead_endpoint(tmp_path, '{"set": "ccu", "id"')
    error = result.stderr.strip().splitlines()[-1]
    assert result.returncode == 2 and error.startswith("error: ") and "failed (first: " in error
    assert error.endswith("rerun the same command to resume") and "Traceback" not in result.stderr
    assert (out / "completions.jsonl.torn").read_text() == '{"set": "ccu", "id"\n'


def test_example_config_loads():
    cfg = load_config(REPO / "configs" / "eval_example.yaml", [], ev.EvalConfig)
    assert (cfg.sampling.temperature, cfg.sampling.top_p, cfg.sampling.top_k) == (0.6, 0.95, 20)
    assert cfg.n_samples == 3 and cfg.greedy_tasks == ["mmlu"]
    assert {s.domain for s in cfg.sets} == {"in", "out", None}


def test_cause_targets_on_ecf_match_a_count_from_the_raw_file(shared_data):
    """ECF 2.0 through prepare/convert.py: the eligible targets and earlier cause pairs equal a
    count made directly from the raw JSON (non-neutral emotion, cause utterance before the
    target)."""
    from prepare import convert

    path = shared_data / "ecf" / "Subtask_1_train.json"
    if not path.is_file():
        pytest.skip(f"{path} not found")
    targets = {}
    for conversation in json.loads(path.read_text(encoding="utf-8")):
        emotions = {u["utterance_ID"]: u["emotion"] for u in conversation["conversation"]}
        for emotion, cause in conversation["emotion-cause_pairs"]:
            t, c = int(emotion.split("_")[0]), int(cause.split("_")[0])
            if c < t and emotions[t] != "neutral":
                targets.setdefault((conversation["conversation_ID"], t), set()).add(c)
    examples = convert.convert_ecf(path)
    ours = {(e.id, tuple(turns)) for e in examples if (turns := ev.cause_turns(e))}
    expected = {
        (f"ecf-{conv}-{t}", tuple(sorted(c - 1 for c in causes)))
        for (conv, t), causes in targets.items()
    }
    assert ours == expected and len(ours) > 1000


# ----------------------------------------------------------------------------- benchmark table


def test_group_accuracy_counts_a_group_once_and_only_when_all_its_questions_are_right():
    def q(id, gold, group=None):
        meta = {"question": "?", "options": ["x", "y"]} | ({"group": group} if group else {})
        return Example(id, "tom_mc", [], None, [gold], meta=meta)

    examples = [q("eu-1-emotion", "A", "eu-1"), q("eu-1-cause", "B", "eu-1"), q("ea-1", "A")]
    examples += [q("eu-2-emotion", "A", "eu-2"), q("eu-2-cause", "A", "eu-2")]
    # eu-1: one of two right -> wrong; ea-1 right; eu-2: both right -> right (an invalid answer is
    # wrong); 2 of 3 items
    pred = [["A"], ["A"], ["A"], ["A"], ["A"]]
    assert ev.group_accuracy(examples, pred) == pytest.approx(2 / 3)
    assert ev.group_accuracy(examples, [["A"], ["B"], None, ["A"], ["A"]]) == pytest.approx(2 / 3)
    # without groups it is the plain share of right answers (f1_scores' accuracy)
    plain = [q(f"q{i}", g) for i, g in enumerate("AABB")]
    assert ev.group_accuracy(plain, [["A"], ["B"], ["B"], None]) == 0.5
    # grouped=False: each question alone (Social-R1 counts EmoBench's two questions apart): 4 of 5
    assert ev.group_accuracy(examples, pred, grouped=False) == pytest.approx(4 / 5)


def ability_set(right: dict[str, tuple[int, int]]) -> tuple[list[Example], dict]:
    """tom_mc examples with meta["ability"], `right[a]` = (answered right, items) per ability, and
    the journaled completions of one run (right ones answer A, the gold; the others B)."""
    examples, done = [], {}
    for ability, (hits, n) in right.items():
        for i in range(n):
            meta = {"question": "?", "options": ["x", "y"], "ability": ability}
            e = Example(f"{ability}-{i}", "tom_mc", [Turn("", "s")], None, ["A"], meta=meta)
            examples.append(e)
            letter = "A" if i < hits else "B"
            done[("Hard", e.id, 0)] = {"completion": f"r</think>\nAnswer: {letter}"}
            done[("Hard", e.id, 0)] |= {"reasoning_tokens": 1, "answer": [letter]}
    return examples, done


def test_tombench_hard_cell_is_the_mean_of_its_six_abilities_as_table_11_prints_it():
    """SocialR1-8B Full in Table 11: 0.5000, 0.3333, 0.8000, 0.7949, 0.7143, 0.6250 over the
    100-item test split, whose ability sizes those fractions give (14/12/20/39/7/8, 68 items right).
    The paper's cell is the abilities' mean, 0.6279, not the share of items, 0.68."""
    right = {"Belief": (7, 14), "Desire": (4, 12), "Emotion": (16, 20), "Intention": (31, 39)}
    right |= {"Knowledge": (5, 7), "Non-literal communication": (5, 8)}
    examples, done = ability_set(right)
    s = ev.EvalSet("Hard", "hard.jsonl", categories=list(right))
    cfg = ev.EvalConfig("out", [s], endpoint=JudgeConfig(), report="accuracy", n_samples=1)
    summary = ev.summarize(cfg, {"Hard": examples}, done, {}, "SocialR1-8B")
    entry = summary["sets"]["Hard"]
    assert f"{entry['category_accuracy']['mean']:.4f}" == "0.6279"
    assert entry["group_accuracy"]["mean"] == pytest.approx(0.68)
    rows = ev.accuracy_table([summary]).splitlines()
    assert "| Hard | 100 | 62.79 (items 68.00; 0.0% invalid) |" in rows
    assert "| Average | | 62.79 |" in rows
    # the same set without categories: the share of items right, as before
    plain = dataclasses.replace(cfg, sets=[ev.EvalSet("Hard", "hard.jsonl")])
    summary = ev.summarize(plain, {"Hard": examples}, done, {}, "SocialR1-8B")
    assert "| Hard | 100 | 68.00 (0.0% invalid) |" in ev.accuracy_table([summary]).splitlines()


def test_social_r1_table_2_row_from_its_appendix_rows():
    """DeepSeek-R1's rows of Tables 6-11 (each category's accuracy as printed) in, Table 2's cells
    and Overall out: ToMBench 0.6834, ToMBench-Hard 0.4436, SimpleToM 0.7187, EmoBench 0.7387,
    MotiveBench 0.8655, TactfulToM 0.6969; SocialIQA 0.8060 and Hi-ToM 0.7059 have no appendix table
    (item accuracy); Overall 0.7073."""
    appendix = {
        "ToMBench": [0.7846, 0.5611, 0.6905, 0.7824, 0.6332, 0.6484],
        "ToMBench-Hard": [0.5000, 0.4167, 0.8500, 0.3590, 0.2857, 0.2500],
        "SocialIQA": None,
        "SimpleToM": [0.6818, 0.6452, 0.8291],
        "EmoBench": [0.7959, 0.7857, 0.7143, 0.7164, 0.7000, 0.7200],
        "MotiveBench": [0.9000, 0.8333, 0.8633],
        "Hi-ToM": None,
        "TactfulToM": [0.4036, 0.7629, 0.7300, 0.9300, 0.8529, 0.6413, 0.8333, 0.4214],
    }
    items = {"SocialIQA": 0.8060, "Hi-ToM": 0.7059}
    printed = {"ToMBench": "68.34", "ToMBench-Hard": "44.36", "SocialIQA": "80.60"}
    printed |= {"SimpleToM": "71.87", "EmoBench": "73.87", "MotiveBench": "86.55"}
    printed |= {"Hi-ToM": "70.59", "TactfulToM": "69.69"}
    sets = {}
    for name, values in appendix.items():
        entry = {"n_items": 1, "decoding": {"n_samples": 1}, "invalid": None}
        if values is None:
            entry["group_accuracy"] = {"mean": items[name], "sd": None}
        else:
            categories = [f"c{i}" for i in range(len(values))]
            parts = {"values": {c: {"runs": [v]} for c, v in zip(categories, values)}}
            entry["category_accuracy"] = ev.category_accuracy(parts, categories)
            entry["group_accuracy"] = {"mean": 0.0, "sd": None}  # shown beside, not averaged
        sets[name] = entry
    rows = ev.accuracy_table([{"name": "DeepSeek-R1", "sets": sets}]).splitlines()
    cells = {
        name: cell for name, _, cell in (re.split(r" *\| *", row.strip("| ")) for row in rows[4:])
    }
    for name, cell in printed.items():
        assert cells[name].split(" ")[0] == cell, name
    assert cells["Average"] == "70.73"


def test_categories_that_the_file_does_not_hold_stop_before_any_sampling(tmp_path):
    examples, _ = ability_set({"Belief": (1, 2), "Desire": (0, 1)})
    path = tmp_path / "hard.jsonl"
    save_jsonl(examples, path)
    s = ev.EvalSet("Hard", str(path), categories=["Belief", "Non-Literal Communication"])
    cfg = ev.EvalConfig(str(tmp_path / "out"), [s], endpoint=JudgeConfig(), report="accuracy")
    with pytest.raises(ev.ConfigError, match=r"set 'Hard': categories: \['Non-Literal Comm"):
        ev.evaluate(cfg)
    assert not (tmp_path / "out").exists()  # nothing written, no server asked


def benchmark_files(folder: Path) -> dict[str, Path]:
    """The seven benchmarks through prepare/convert.py: the six fixtures in their public layouts and
    a two-item ToMBench file (English and Chinese: four questions)."""
    from prepare.convert import CONVERTERS

    bench = REPO / "tests" / "fixtures" / "benchmarks"
    tombench = folder / "tombench-src" / "False Belief Task.jsonl"
    tombench.parent.mkdir()
    lines = []
    for n, (answer, place) in enumerate([("A", "box"), ("B", "bag")]):
        line = {"STORY": f"Ann puts the ball in the {place}.", "QUESTION": "Where is the ball?"}
        line["ABILITY"] = ["Belief: first order", "Desire: discrepant desires"][n]
        line |= {"故事": "安把球放进去。", "问题": "球在哪里？", "答案\nANSWER": answer}
        line |= {"OPTION-A": "box", "OPTION-B": "bag", "选项A": "盒子", "选项B": "包"}
        lines.append(json.dumps(line, ensure_ascii=False))
    tombench.write_text("\n".join(lines) + "\n", encoding="utf-8")
    sources = {
        "ToMBench": ("tombench", tombench.parent),
        "SocialIQA": ("socialiqa", bench / "socialiqa" / "dev.jsonl"),
        "EmoBench": ("emobench", bench / "emobench" / "data"),
        "MotiveBench": ("motivebench", bench / "motivebench"),
        "SimpleToM": ("simpletom", bench / "simpletom"),
        "Hi-ToM": ("hitom", bench / "hitom"),
        "TactfulToM": ("tactfultom", bench / "tactfultom" / "final_set"),
    }
    paths = {}
    for name, (fmt, source) in sources.items():
        paths[name] = folder / f"{fmt}.jsonl"
        save_jsonl(CONVERTERS[fmt](source), paths[name])
    return paths


def hand_accuracy(records: list[dict], examples: dict[str, Example], runs: int) -> list[float]:
    """Per run: the share of items right, read from the journaled completions with a rule of our
    own: the text after the last </think> must end in a line `Answer: X` whose X is the gold
    letter; EmoBench's two questions of an item count as one, right only when both are."""
    right = {}
    for r in records:
        e = examples[r["id"]]
        after = r["completion"].rsplit("</think>", 1)[1] if "</think>" in r["completion"] else ""
        lines = [line.strip() for line in after.splitlines() if line.strip()]
        ok = bool(lines) and lines[-1] == f"Answer: {e.labels[0]}"
        key = (e.meta.get("group", e.id), r["sample"])
        right[key] = right.get(key, True) and ok
    items = {item for item, _ in right}
    return [sum(right[(i, s)] for i in items) / len(items) for s in range(runs)]


@pytest.fixture(scope="module")
def answer_checkpoint(tmp_path_factory):
    """A tiny random checkpoint whose vocabulary holds whole answer lines (one token each), so that
    some completions end in a valid answer and some do not."""
    return write_tiny_checkpoint(
        tmp_path_factory.mktemp("answers"),
        ["[UNK]", "so", *(f"</think>\nAnswer: {letter}" for letter in "ABC")],
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>"],
        dict(TINY, vocab_size=None),
        wordpiece_decoder=True,
    )


def test_benchmark_table_from_a_tiny_checkpoint_matches_a_hand_count(
    tmp_path, capsys, answer_checkpoint
):
    """`python evaluate.py CONFIG` with report: accuracy on the seven converted benchmarks and a
    tiny random checkpoint: one table row per benchmark, each accuracy equal to a count made from
    completions.jsonl."""
    from dataset import load_jsonl

    checkpoint = answer_checkpoint
    paths = benchmark_files(tmp_path)
    config = {
        "output_dir": str(tmp_path / "out"),
        "name": "tiny",
        "report": "accuracy",
        "checkpoint": str(checkpoint),
        "device": "cpu",
        "batch_size": 8,
        "n_samples": 2,
        "sampling": {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_new_tokens": 3},
        "sets": [{"name": name, "path": str(path)} for name, path in paths.items()],
    }
    (tmp_path / "bench.yaml").write_text(json.dumps(config))
    ev.main([str(tmp_path / "bench.yaml")])
    printed = capsys.readouterr().out
    table = (tmp_path / "out" / "table.md").read_text()
    assert table in printed
    main, *parts = table.split("\n#### ")
    rows = [line for line in main.splitlines() if line.startswith("| ")][1:]
    assert [row.split(" | ")[0][2:] for row in rows] == [*paths, "Average"]

    examples = {e.id: e for path in paths.values() for e in load_jsonl(path)}
    records = [json.loads(line) for line in (tmp_path / "out" / "completions.jsonl").open()]
    # a table per set whose items carry its paper's breakdown field (SocialIQA has none), each row
    # the hand count over that value's items
    fields = {"ToMBench": "ability", "EmoBench": "category", "MotiveBench": "source"}
    fields |= {"SimpleToM": "subset", "Hi-ToM": "order", "TactfulToM": "category"}
    assert [part.splitlines()[0] for part in parts] == [f"{n} by {f}" for n, f in fields.items()]
    for (name, field), part in zip(fields.items(), parts):
        values = {}
        for e in load_jsonl(paths[name]):
            values.setdefault(str(e.meta[field]), set()).add(e.id)
        lines = [line for line in part.splitlines() if line.startswith("| ")][1:]
        assert len(lines) == len(values) and (name != "ToMBench" or len(values) == 2), name
        for line in lines:
            value, items, cell = line[2:-2].split(" | ")
            runs = hand_accuracy([r for r in records if r["id"] in values[value]], examples, 2)
            sd = abs(runs[0] - runs[1]) / 2**0.5
            assert cell == f"{50 * sum(runs):.2f} ± {100 * sd:.2f}", (name, line)
    assert len(records) == 2 * len(examples) == 2 * 23
    valid = [r for r in records if r["answer"] is not None]
    assert 0 < len(valid) < len(records)  # some completions end in an answer line, some do not
    # items: ToMBench 4, SocialIQA 3, EmoBench 1 EA + 2 EU pairs, MotiveBench 3, SimpleToM 2,
    # Hi-ToM 2, TactfulToM 4
    counts = dict(zip(paths, [4, 3, 3, 3, 2, 2, 4]))
    means = []
    for name, row in zip(paths, rows):
        ids = {e.id for e in load_jsonl(paths[name])}
        runs = hand_accuracy([r for r in records if r["id"] in ids], examples, 2)
        mean = sum(runs) / 2
        sd = abs(runs[0] - runs[1]) / 2**0.5  # the sample SD of two runs
        means.append(mean)
        mine = [r for r in records if r["id"] in ids]
        invalid = sum(r["answer"] is None for r in mine) / len(mine)  # both runs the same size
        assert row == (
            f"| {name} | {counts[name]} | {100 * mean:.2f} ± {100 * sd:.2f} "
            f"({100 * invalid:.1f}% invalid) |"
        ), row
    assert rows[-1] == f"| Average | | {100 * sum(means) / len(means):.2f} |"
    assert any(m > 0 for m in means)  # some answers are right


def test_benchmark_config_lists_social_r1s_eight_benchmarks_and_eqbench3():
    cfg = load_config(REPO / "configs" / "eval_benchmarks.yaml", [], ev.EvalConfig)
    assert cfg.report == "accuracy" and cfg.n_samples == 3
    assert [(s.name, s.kind) for s in cfg.sets] == [  # Social-R1's Table 2, in its order
        ("ToMBench", "examples"),
        ("ToMBench-Hard", "examples"),
        ("SocialIQA", "examples"),
        ("SimpleToM", "examples"),
        ("EmoBench", "examples"),
        ("MotiveBench", "examples"),
        ("Hi-ToM", "examples"),
        ("TactfulToM", "examples"),
        ("EQBench3", "eqbench3"),
    ]
    # each cell as the paper makes it: the categories of its appendix table, named as the
    # converters write them
    from prepare.convert import _TACTFUL_BINARY, _TACTFUL_CHOICE, TOMBENCH_ABILITIES

    categories = {s.name: s.categories for s in cfg.sets if s.categories}
    assert categories["ToMBench"] == categories["ToMBench-Hard"] == list(TOMBENCH_ABILITIES)
    assert set(categories["TactfulToM"]) == {*_TACTFUL_CHOICE, *_TACTFUL_BINARY} - {
        "justificationQA"
    }
    assert len(categories["EmoBench"]) == 6 and len(categories["TactfulToM"]) == 8
    assert [s.name for s in cfg.sets if not s.grouped] == ["EmoBench"]
    # Social-R1's Tables 6-11; SocialIQA and Hi-ToM have none
    assert set(categories) == {
        "ToMBench",
        "ToMBench-Hard",
        "SimpleToM",
        "EmoBench",
        "MotiveBench",
        "TactfulToM",
    }


def test_benchmark_table_from_an_endpoint_equals_the_in_process_one(
    tmp_path, capsys, answer_checkpoint
):
    """The same checkpoint served (judge_server's model backend, an OpenAI-compatible server) and
    run in-process, greedily: the same completions, the same table."""
    import judge_server

    paths = benchmark_files(tmp_path)
    sets = [ev.EvalSet(name, str(path)) for name, path in paths.items()]
    common = dict(
        sets=sets,
        report="accuracy",
        name="tiny",
        n_samples=1,
        sampling=small_sampling(temperature=0.0),
    )
    local = ev.evaluate(
        ev.EvalConfig(
            str(tmp_path / "local"), checkpoint=str(answer_checkpoint), device="cpu", **common
        )
    )
    with JudgeServer(judge_server.ModelBackend(str(answer_checkpoint)), port=0).start() as server:
        endpoint = JudgeConfig(base_url=server.url, model="tiny", timeout=60, retries=0)
        served = ev.evaluate(
            ev.EvalConfig(
                str(tmp_path / "served"),
                endpoint=endpoint,
                tokenizer=str(answer_checkpoint),
                **common,
            )
        )

    def journal(run):
        lines = (tmp_path / run / "completions.jsonl").read_text().splitlines()
        return sorted(lines, key=lambda line: (json.loads(line)["set"], json.loads(line)["id"]))

    assert journal("local") == journal("served") and len(journal("local")) == 23
    assert local["sets"] == served["sets"]
    table = (tmp_path / "local" / "table.md").read_text()
    assert table == (tmp_path / "served" / "table.md").read_text() and "| TactfulToM | 4 |" in table
    # compare puts benchmark evaluations side by side in the same table, a column per model
    ev.main(["compare", str(tmp_path / "local"), str(tmp_path / "served")])
    side_by_side = capsys.readouterr().out
    assert "| Benchmark | Items | tiny | tiny |" in side_by_side
    row = next(line for line in table.splitlines() if line.startswith("| Hi-ToM |"))
    cell = row.split(" | ")[2].rstrip(" |")
    assert f"| Hi-ToM | 2 | {cell} | {cell} |" in side_by_side


# ------------------------------------------------------------- judge-scored benchmarks (EQBench3)

EQBENCH3 = REPO / "tests" / "fixtures" / "benchmarks" / "eqbench3" / "data" / "scenario_prompts.txt"


def test_eqbench3_scenarios_load_from_the_public_layout(tmp_path):
    """The fixture in EQ-Bench 3's scenario_prompts.txt layout: the three role-play scenarios with
    their turns; the analysis scenario and the one without a Prompt section are left out; text
    before a scenario's first Prompt line is not a turn."""
    from dialogue import eqbench3 as benchmarks

    scenarios = benchmarks.load_roleplay(EQBENCH3)
    assert [(s.id, s.category, s.title, len(s.prompts)) for s in scenarios] == [
        ("1", "Work Dilemma", "Credit For The Launch", 2),
        ("2", "Friend Issue", "The Borrowed Car", 2),
        ("3", "Family Issue", "Curfew", 1),
    ]
    assert scenarios[0].prompts[1].startswith("After the meeting Priya finds you")
    assert scenarios[2].prompts == (
        "Your sixteen-year-old came home two hours after curfew, smelling of smoke, and walked "
        "straight past you to their room. It is 1 a.m.",
    )
    bad = {
        "intro\n######## 1 | A | B\n####### Prompt1\nhi\n": ":1: text before the first",
        "######## 1 | A | B\n####### Prompt1\nhi\n######## 1 | A | C\n####### Prompt1\nyo\n": (
            ":4: field 'id': '1' appears twice"
        ),
        "######## 1 | A | B\n####### Prompt1\n\n####### Prompt2\nhi\n": ":1: scenario '1': Prompt1",
        "######## 4 | Analytical Interpretation | X\n####### Prompt1\nhi\n": "no role-play",
    }
    for n, (text, message) in enumerate(bad.items()):
        path = tmp_path / f"bad{n}.txt"
        path.write_text(text)
        with pytest.raises(DataError, match=re.escape(message)):
            benchmarks.load_roleplay(path)


def rubric_answer(scores: dict[str, int]) -> str:
    return "\n".join(f"{name}: fine | {value}" for name, value in scores.items())


def test_rubric_answers_are_parsed_strictly():
    from dialogue import eqbench3 as benchmarks

    scores = dict(zip(benchmarks.RUBRIC_CRITERIA, [20, 0, 7, 13, 19, 10, 4, 9]))
    assert benchmarks.parse_rubric_scores(rubric_answer(scores)) == scores
    for broken in (
        scores | {"pragmatic_ei": 21},  # above 20
        dict(list(scores.items())[:-1]),  # a criterion missing
        dict(reversed(scores.items())),  # another order
    ):
        assert benchmarks.parse_rubric_scores(rubric_answer(broken)) is None
    assert benchmarks.parse_rubric_scores('{"demonstrated_empathy": 12}') is None


def test_a_judged_set_aggregates_scored_transcripts_by_hand():
    """Per run: the mean over scored transcripts of (mean of the six ability criteria) x 5, as a
    fraction; an unscored transcript is counted and left out."""
    from dialogue import eqbench3 as benchmarks

    scenarios = benchmarks.load_roleplay(EQBENCH3)
    names = list(benchmarks.RUBRIC_CRITERIA)
    a = dict(zip(names, [10, 12, 14, 16, 18, 20, 0, 0]))  # ability mean 15 -> 75
    b = dict(zip(names, [4, 4, 4, 4, 4, 4, 20, 20]))  # 20
    c = dict(zip(names, [0, 0, 0, 0, 0, 6, 5, 5]))  # 1 -> 5
    scores = {("E", "1", 0): a, ("E", "2", 0): b, ("E", "3", 0): None}
    scores |= {("E", "1", 1): c, ("E", "2", 1): a, ("E", "3", 1): b}
    runs, numbers = benchmarks.summarize_set("E", scenarios, 2, scores)
    assert runs == pytest.approx([(75 + 20) / 2 / 100, (5 + 75 + 20) / 3 / 100])
    assert numbers["unscored"] == [1, 0] and numbers["n_items"] == 3
    assert numbers["criteria"]["warmth"] == pytest.approx([5 * 10, 5 * 25 / 3])


def scripted_rubric_judge(calls: list):
    """A judge backend with fixed scores per scenario (told apart by its scripted text): scenario 1
    and 2 get rubric answers, scenario 3 a malformed one. Records every request's dialogue."""
    from dialogue import eqbench3 as benchmarks

    names = list(benchmarks.RUBRIC_CRITERIA)
    fixed = {
        "Priya": dict(zip(names, [12, 14, 9, 11, 16, 10, 15, 8])),
        "Sam": dict(zip(names, [5, 7, 6, 4, 8, 6, 20, 3])),
    }

    def backend(messages, params):
        dialogue = messages[-1]["content"]
        calls.append(dialogue)
        for marker, scores in fixed.items():
            if marker in dialogue:
                return rubric_answer(scores)
        return "I would give this conversation a solid 15 out of 20."

    return backend, fixed


def test_benchmark_table_has_the_judged_row_beside_the_accuracy_rows(
    tmp_path, capsys, answer_checkpoint
):
    """`python evaluate.py CONFIG` with SocialIQA (accuracy) and the EQBench3 fixture (kind
    eqbench3) on the tiny checkpoint, the judge scripted: one row per benchmark; the judged row
    equals the hand computation from the scripted scores (scenario 3's malformed answer unscored);
    a rerun plays and asks nothing again."""
    from prepare.convert import CONVERTERS

    socialiqa = tmp_path / "socialiqa.jsonl"
    save_jsonl(
        CONVERTERS["socialiqa"](REPO / "tests/fixtures/benchmarks/socialiqa/dev.jsonl"), socialiqa
    )
    calls = []
    backend, fixed = scripted_rubric_judge(calls)
    with JudgeServer(backend).start() as server:
        config = {
            "output_dir": str(tmp_path / "out"),
            "name": "tiny",
            "report": "accuracy",
            "checkpoint": str(answer_checkpoint),
            "device": "cpu",
            "batch_size": 8,
            "n_samples": 2,
            "sampling": {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_new_tokens": 3},
            "judge": {"base_url": server.url, "retries": 0, "timeout": 30},
            "sets": [
                {"name": "SocialIQA", "path": str(socialiqa)},
                {"name": "EQBench3", "path": str(EQBENCH3), "kind": "eqbench3"},
            ],
        }
        (tmp_path / "bench.yaml").write_text(json.dumps(config))
        eqbench3.main([str(tmp_path / "bench.yaml")])
        printed = capsys.readouterr().out
        journal = (tmp_path / "out" / "roleplay.jsonl").read_text()
        eqbench3.main([str(tmp_path / "bench.yaml")])  # resumes: nothing left to play or ask
        assert capsys.readouterr().out.count("role-play:") == 0
    assert (tmp_path / "out" / "roleplay.jsonl").read_text() == journal
    table = (tmp_path / "out" / "table.md").read_text()
    assert table in printed
    rows = [line for line in table.splitlines() if line.startswith("| ")][1:]
    assert [row.split(" | ")[0][2:] for row in rows] == ["SocialIQA", "EQBench3", "Average"]

    # 3 scenarios x 2 runs, 2 + 2 + 1 turns each: 10 replies, then one judge call per transcript
    records = [json.loads(line) for line in journal.splitlines()]
    assert sorted((r["id"], r["sample"], r["turn"]) for r in records) == sorted(
        (sid, r, t)
        for sid, turns in (("1", 2), ("2", 2), ("3", 1))
        for r in range(2)
        for t in range(turns)
    )
    assert len(calls) == 6
    # the judge reads the scripted turns as written (no frame) and the replies
    last = next(r for r in records if (r["id"], r["sample"], r["turn"]) == ("2", 1, 1))
    (dialogue,) = [c for c in calls if "Sam" in c and f"Assistant: {last['reply']}" in c][:1]
    assert "Things have been really bad at home" in dialogue and "# My response" not in dialogue

    def hand(scores):  # the six ability criteria, 0-20, mean times 5
        ability = list(scores.values())[:6]
        return 5 * sum(ability) / 6

    expected = (hand(fixed["Priya"]) + hand(fixed["Sam"])) / 2  # both runs alike: SD 0
    assert rows[1] == f"| EQBench3 | 3 | {expected:.2f} ± 0.00 (2 of 6 unscored) |"
    summary = json.loads((tmp_path / "out" / "eval.json").read_text())
    accuracy = summary["sets"]["SocialIQA"]["group_accuracy"]["mean"]
    assert rows[2] == f"| Average | | {100 * accuracy:.2f} |"  # accuracy rows only
    judged = summary["sets"]["EQBench3"]
    assert judged["unscored"] == [1, 1]
    assert judged["criteria"]["warmth"]["mean"] == pytest.approx(5 * (15 + 20) / 2)
    # compare: the judged row side by side too
    ev.main(["compare", str(tmp_path / "out"), str(tmp_path / "out")])
    cell = f"{expected:.2f} ± 0.00 (2 of 6 unscored)"
    assert f"| EQBench3 | 3 | {cell} | {cell} |" in capsys.readouterr().out


def test_a_benchmark_whose_judge_fails_stops_after_journaling_and_writes_no_table(
    tmp_path, capsys, answer_checkpoint
):
    """The EQBench3 judge fails its second call: the run stops (exit 2) with the answers journaled
    and no eval.json or table.md scored on some of the transcripts; the rerun asks only that call
    and writes them."""
    calls = []
    backend, _ = scripted_rubric_judge(calls)
    with JudgeServer(backend, faults=Faults(script=("ok", "500"))).start() as server:
        config = {
            "output_dir": str(tmp_path / "out"),
            "report": "accuracy",
            "checkpoint": str(answer_checkpoint),
            "device": "cpu",
            "n_samples": 2,
            "sampling": {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_new_tokens": 3},
            "judge": {"base_url": server.url, "retries": 0, "timeout": 30},
            "sets": [{"name": "EQBench3", "path": str(EQBENCH3), "kind": "eqbench3"}],
        }
        (tmp_path / "bench.yaml").write_text(json.dumps(config))
        with pytest.raises(SystemExit) as stop:
            eqbench3.main([str(tmp_path / "bench.yaml")])
        out = tmp_path / "out"
        err = capsys.readouterr().err
        assert stop.value.code == 2 and err.startswith(
            f"error: 1 judge calls failed, the first: judge at {server.url}/chat/completions: "
            "HTTP 500"
        )
        assert len(read_log(out / "rubric.jsonl", ValueError)) == 5  # 3 scenarios x 2 runs - 1
        assert not (out / "eval.json").exists() and not (out / "table.md").exists()
        eqbench3.main([str(tmp_path / "bench.yaml")])
    assert len(calls) == 6 and len(read_log(out / "rubric.jsonl", ValueError)) == 6
    assert "| EQBench3 | 3 |" in (out / "table.md").read_text()


def test_a_judged_set_takes_no_task_and_needs_the_benchmark_table():
    from config import ConfigError

    judged = ev.EvalSet("EQBench3", str(EQBENCH3), kind="eqbench3")
    ok = ev.EvalConfig("out", [judged], checkpoint="ckpt", report="accuracy")
    kinds = {"eqbench3": eqbench3.EQBENCH3}
    ev.check_config(ok, kinds)
    for cfg in (
        dataclasses.replace(ok, report="f1"),
        dataclasses.replace(ok, sets=[dataclasses.replace(judged, task="tom_mc")]),
    ):
        with pytest.raises(ConfigError, match="a kind eqbench3 set takes no 'task'"):
            ev.check_config(cfg, kinds)
    # evaluate.py alone scores its own kind: the judged one goes through its extension
    with pytest.raises(ConfigError, match="evaluate.py scores kind examples, not 'eqbench3'"):
        ev.check_config(ok, {})


def test_a_served_policy_plays_the_scripted_turns_and_resumes_after_a_failed_request(tmp_path):
    """Through an endpoint: each turn's chat holds the framed scripted turns and the earlier replies
    without their reasoning; a request that fails stops the run (exit 2) with the answered turns
    kept, and the rerun asks only for the missing turn."""
    from dialogue import eqbench3 as benchmarks
    from judge_server import Faults

    chats = []

    def policy(messages, params):
        chats.append(messages)
        return f"<think>hidden</think>\nreply {len(messages) // 2}"

    scenarios = benchmarks.load_roleplay(EQBENCH3)
    rubric, _ = scripted_rubric_judge([])
    with (
        JudgeServer(policy, faults=Faults(script=("ok", "ok", "ok", "500"))).start() as served,
        JudgeServer(rubric).start() as judge,
    ):
        config = {
            "output_dir": str(tmp_path / "out"),
            "report": "accuracy",
            "endpoint": {"base_url": served.url, "model": "policy", "retries": 0},
            "n_samples": 1,
            "judge": {"base_url": judge.url, "retries": 0},
            "sets": [{"name": "EQBench3", "path": str(EQBENCH3), "kind": "eqbench3"}],
        }
        (tmp_path / "bench.yaml").write_text(json.dumps(config))
        with pytest.raises(SystemExit) as stop:
            eqbench3.main([str(tmp_path / "bench.yaml")])
        assert stop.value.code == 2
        kept = (tmp_path / "out" / "roleplay.jsonl").read_text().splitlines()
        assert len(kept) == 4  # three first turns and one of the two second turns
        first = len(chats)
        eqbench3.main([str(tmp_path / "bench.yaml")])
    assert len(chats) == first + 1  # only the missing turn is asked again
    records = [json.loads(line) for line in (tmp_path / "out" / "roleplay.jsonl").open()]
    assert sorted((r["id"], r["turn"]) for r in records) == [
        ("1", 0),
        ("1", 1),
        ("2", 0),
        ("2", 1),
        ("3", 0),
    ]
    assert {r["reply"] for r in records} == {"reply 0", "reply 1"}
    frame = benchmarks.ROLEPLAY_FRAME.format
    second_turn = chats[-1]
    scenario = next(s for s in scenarios if s.prompts[1] in second_turn[-1]["content"])
    assert second_turn == [
        {"role": "user", "content": frame(prompt=scenario.prompts[0])},
        {"role": "assistant", "content": "reply 0"},
        {"role": "user", "content": frame(prompt=scenario.prompts[1])},
    ]


def test_a_rubric_judged_by_the_rules_stand_in_says_so_in_the_tables_title():
    judged = {"kind": "eqbench3", "n_items": 2, "decoding": {"n_samples": 1}, "unscored": [0]}
    judged |= {"rubric_score": {"mean": 0.5, "sd": None}}
    for judge, said in (("rules", True), ("deepseek-v4-pro", False)):
        table = ev.accuracy_table([{"name": "m", "sets": {"EQBench3": judged | {"judge": judge}}}])
        title = table.splitlines()[0]
        assert ("(rubric scores of m: the rules stand-in, not a judge)" in title) == said, title


def test_baselines_by_hand():
    """Gold joy, joy, joy, sadness among MELD's seven labels. Majority (joy for all): joy F1 6/7,
    sadness 0: weighted 3/4 x 6/7, macro over the two labels seen 3/7. Uniform random (expected
    counts, L = 7, n = 4): F1_c = (2 g_c / 7) / (4 / 7 + g_c): joy 6/25, sadness 2/11, the five
    unseen 0; weighted (3 x 6/25 + 2/11) / 4, macro (6/25 + 2/11) / 7."""
    gold = ["joy", "joy", "joy", "sadness"]
    examples = [
        Example(f"m{i}", "meld_emotion", [Turn("A", "x")], 0, [label])
        for i, label in enumerate(gold)
    ]
    found = ev.baselines(examples)
    assert found["majority"]["label"] == "joy"
    assert found["majority"]["weighted"] == pytest.approx(3 / 4 * 6 / 7)
    assert found["majority"]["macro"] == pytest.approx(3 / 7)
    assert found["uniform"]["weighted"] == pytest.approx((3 * 6 / 25 + 2 / 11) / 4)
    assert found["uniform"]["macro"] == pytest.approx((6 / 25 + 2 / 11) / 7)


def test_grounding_counts_quoting_completions_and_verified_quotations():
    """Three completions on one conversation: two quote (one verified and one invented quotation;
    one verified), one does not: 2/3 quote, 2 of 3 quotations verify."""
    e = Example(
        "g", "meld_emotion", [Turn("A", "My grandfather passed away on Sunday.")], 0, ["sadness"]
    )
    texts = [
        "<evidence>My grandfather passed away</evidence> and <evidence>I won</evidence></think>\n"
        "Answer: sadness",
        "<evidence>passed away on Sunday</evidence></think>\nAnswer: sadness",
        "no quote</think>\nAnswer: sadness",
    ]
    assert ev.grounding(texts, [e] * 3) == {"quoting": 2 / 3, "verified": 2 / 3}
    assert ev.grounding(["nothing</think>\nAnswer: joy"], [e]) == {"quoting": 0.0, "verified": None}


def test_compare_refuses_evaluations_of_other_tasks_unless_asked_side_by_side(tmp_path, capsys):
    base, other = fake_eval("A", 0.40, 0.50, 900, 800), fake_eval("B", 0.02, 0.03, 400, 350)
    for e, task in ((base, "ccu_emotion"), (other, "cped_emotion")):
        for s in e["sets"].values():
            s |= {"task": task, "n_examples": 10, "examples": task}
        (tmp_path / e["name"]).mkdir()
        (tmp_path / e["name"] / "eval.json").write_text(json.dumps(e))
    with pytest.raises(SystemExit) as stop:
        ev.main(["compare", str(tmp_path / "A"), str(tmp_path / "B")])
    err = capsys.readouterr().err.strip()
    assert stop.value.code == 2 and len(err.splitlines()) == 1, err
    assert "set 'ccu_zh_emotion' is task ccu_emotion in" in err and "--side-by-side" in err
    ev.main(["compare", str(tmp_path / "A"), str(tmp_path / "B"), "--side-by-side"])
    out = capsys.readouterr().out
    assert "| B | 2.00 ± 1.00 |" in out and "Δ vs" not in out and "Gain of" not in out
    # the same task, other examples: refused too
    for s in other["sets"].values():
        s |= {"task": "ccu_emotion", "n_examples": 12, "examples": "another"}
    (tmp_path / "B" / "eval.json").write_text(json.dumps(other))
    with pytest.raises(SystemExit):
        ev.main(["compare", str(tmp_path / "A"), str(tmp_path / "B")])
    assert "holds other examples in" in capsys.readouterr().err


def test_a_relative_gain_on_a_base_under_the_floor_is_not_shown():
    low, high = fake_eval("Low", 0.05, 0.30, 1, 1), fake_eval("High", 0.20, 0.36, 1, 1)
    line = next(x for x in ev.markdown_tables([low, high]).splitlines() if x.startswith("Gain of"))
    assert line == (
        "Gain of High over Low in average weighted F1: In-domain +15.00 points (no relative gain "
        "on a base under 10 points), Out-of-domain +6.00 points (+20.0%)"
    )
