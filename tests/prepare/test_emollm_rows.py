"""EmoLLM Stage I (prepare/emollm_rows.py, its own command): the ESConv and ECoK layouts, the
retrieval behind g_t against hand-picked matches, CPT rows cut to max_length, the ARG teacher's
parser, ARG rows from a scripted teacher on the local judge server (both target forms of the gate,
rejections counted, a rerun resumed from the answer log), one-line errors for bad input with nothing
written, and the chain CPT -> ARG SFT -> grpo.py's dialogue demo from the merged Stage I model
against the rules judge, all on the CPU."""

import json
import re
from pathlib import Path

import pytest
import yaml
from helpers import grpo_checkpoint as write_checkpoint
from helpers import read_jsonl

import model as M
import sft
from config import load_config
from dialogue import rl as dialogue_rl
from dialogue.rl import DialogueConfig
from judge_server import JudgeServer, rules_backend
from prepare import emollm_rows as E
from tokenizer import load_tokenizer

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"
FIXTURES = Path(__file__).parents[1] / "fixtures" / "emollm"
ESCONV, ECOK = FIXTURES / "esconv.json", FIXTURES / "ecok.jsonl"
WORDS = (
    "user assistant User: Assistant: I my job lost the rent Thank you Facts: Needs: Emotion: yes"
).split()


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("emollm") / "base", words=WORDS, hidden=16)


@pytest.fixture(scope="module")
def llama_base(tmp_path_factory):
    """Appendix G.2's backbone (LLaMA-3.1-8B) in miniature."""
    path = tmp_path_factory.mktemp("emollm") / "llama"
    return write_checkpoint(path, words=WORDS, hidden=16, llama=True)


def write_config(tmp_path: Path, name: str, emollm: dict | None = None, **raw) -> Path:
    """sft.py's config `<name>.yaml`; with `emollm`, also prepare/emollm_rows.py's
    `<name>_prepare.yaml` (`prep`) for the same rows (out = data) measured as that training run
    encodes them."""
    path = tmp_path / f"{name}.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "output_dir": str(tmp_path / name),
                "lr": 1e-2,
                "epochs": 1,
                "batch_size": 2,
                "rows_per_update": 2,
                "lora": {"rank": 4, "alpha": 8, "dropout": 0.0},
                "device": "cpu",
                "save_merged": True,
                **raw,
            }
        )
    )
    if emollm is not None:
        shared = {k: raw[k] for k in ("objective", "model", "max_length") if k in raw}
        prep(path).write_text(yaml.safe_dump({"out": raw["data"], **shared, **emollm}))
    return path


def prep(path: Path) -> Path:
    return path.with_name(path.stem + "_prepare.yaml")


# -------------------------------------------------------------------------- dialogues, knowledge, G


def test_the_esconv_layout_is_read_with_same_speaker_turns_merged():
    first, second = E.load_dialogues([str(ESCONV)])
    assert first.id == "esconv-0" and (first.problem, first.emotion) == ("job crisis", "anxiety")
    assert [role for role, _, _ in first.turns] == [
        "assistant",
        "user",
        "assistant",
        "user",
        "assistant",
        "user",
    ]
    assert first.turns[1][1] == "Not great. I lost my job last month. Now I worry about the rent."
    assert first.turns[2][2] == ("Reflection of feelings",) and E.contexts(first) == [1, 3, 5]
    assert E.contexts(second) == [0, 2] and second.turns[0][0] == "user"
    assert E.context_meta(first, 1) == {
        "source": "esconv-0",
        "turn": 1,
        "next_strategy": ["Reflection of feelings"],
    }


def test_retrieval_keeps_the_best_matching_tails_of_each_slot():
    triples = [
        E.Triple("lose job", "xReact", "worried"),
        E.Triple("lose a good job", "xReact", "sad"),
        E.Triple("lose job", "XNEED", "to find work"),
        E.Triple("rent due", "xWant", "money"),
        E.Triple("lose job", "isAfter", "fired"),
        E.Triple("job", "xReact", "worried"),
    ]
    knowledge = E.Knowledge(triples, E.Relations(), min_overlap=0.5, per_slot=2)
    # lost, job, rent (a final s dropped, stop words out)
    query = E.words("I lost my job and the rent")
    assert query == {"lost", "job", "rent"}
    # "lose job": 1 of 2 head words (job) = 0.5; "lose a good job":
    # lose, good, job -> 1/3 < 0.5; "rent due": 0.5; "job": 1/1 ranks
    # first; isAfter fills no slot; the second "worried" is a repeat
    assert knowledge.retrieve(query) == {
        "needs": ["to find work", "money"],
        "appraisal": [],
        "emotion": ["worried"],
    }
    assert E.Knowledge(triples, E.Relations(), 0.6, 2).retrieve(query)["emotion"] == ["worried"]
    assert E.Knowledge(triples, E.Relations(), 0.5, 1).retrieve(query)["needs"] == ["to find work"]


def test_cpt_rows_carry_g_t_and_drop_the_oldest_turns_to_fit(base, tmp_path, capsys):
    path = write_config(
        tmp_path,
        "cpt",
        model=str(base),
        data=str(tmp_path / "cpt.jsonl"),
        objective="lm",
        max_length=67,
        emollm={"dialogues": [str(ESCONV)], "knowledge": str(ECOK), "fact_words": 4},
    )
    E.main([str(prep(path))])
    rows = read_jsonl(tmp_path / "cpt.jsonl")
    assert [r["id"] for r in rows] == [
        "esconv-0/t1",
        "esconv-0/t3",
        "esconv-0/t5",
        "esconv-1/t0",
        "esconv-1/t2",
    ]
    assert rows[0]["text"] == (
        "<think>\nFacts: job crisis; I lost my job last month and I worry about paying the rent; "
        "the user says: Not great. I lost ...\nNeeds: to have financial security; to find a new "
        "job\nAppraisal: unlucky and out of control\nEmotion: anxiety; "
        "worried\n</think>\nAssistant: Hi, how are you today?\nUser: Not great. I lost my job "
        "last month. Now I worry about the rent."
    )
    assert rows[3]["text"].endswith("</think>\nUser: My partner left me and I cannot stop crying.")
    assert "Appraisal: (none retrieved)" in rows[3]["text"] and rows[3]["meta"]["knowledge"] == 2
    tok, cfg = load_tokenizer(base), sft.parse_cli(sft.SFTConfig, [str(path)])
    lengths = [len(sft.encode_text_row(tok, sft.TextRow("", r["text"]), cfg)[0]) for r in rows]
    assert max(lengths) == 67 and lengths[0] == 67  # t1 fits whole, with 67 tokens
    # t5 (101 tokens whole) lost its three oldest turns
    last = rows[2]["text"].split("</think>\n")[1]
    assert last.startswith("User: Yes. I feel like a failure.") and last.endswith(
        "User: Thank you, that helps."
    )
    assert "esconv-0: " not in capsys.readouterr().out
    settings = E.parse_cli(E.EmoLLMData, [str(prep(path))])
    short = tmp_path / "short.jsonl"
    with pytest.raises(E.JudgeError, match=f"^{short}: not written: no row was kept"):
        E.prepare(settings, "lm", short, lambda prompt, text: len(text) < 150)
    # no g_t fits in 150 characters: nothing kept, nothing written
    assert "rows 0, too long 5" in capsys.readouterr().out and not short.exists()


# ----------------------------------------------------------------------------- the ARG teacher


ARG = (
    "Facts: The user lost a job.\nNeeds: Security.\nAppraisal: Out of their control.\nEmotion: "
    "Anxious.\nStrategy: Validate, then one small step."
)
LOOK = "\nLookahead 1: The user calms a little.\nChoice: Keep the strategy."


def answer(arg=ARG, gate="yes", reply="That sounds hard. What worries you most?") -> str:
    return f"{arg}\nReasoning needed: {gate}\nReply: {reply}"


def test_parse_arg_accepts_the_format_and_names_each_rejection():
    parsed = E.parse_arg(answer(ARG + LOOK), lookahead=3)
    assert parsed.gate == 1 and parsed.reply == "That sounds hard. What worries you most?"
    assert [n for n, _ in parsed.sections] == [
        "Facts",
        "Needs",
        "Appraisal",
        "Emotion",
        "Strategy",
        "Lookahead 1",
        "Choice",
    ]
    assert parsed.target() == (
        "<think>\n" + ARG + LOOK + "\n</think>\n\nThat sounds hard. What worries you most?"
    )
    short = E.parse_arg(answer(gate="No."), 3)
    assert short.gate == 0 and short.target() == "That sounds hard. What worries you most?"
    assert E.parse_arg(answer(reply="Line one.\nLine two."), 3).reply == "Line one.\nLine two."
    rejected = {
        "missing section": [
            answer(ARG.replace("Strategy: Validate, then one small step.", "")),
            answer(ARG.replace("Needs: Security.\n", "")),
            f"{ARG}\nReply: Hi.",
        ],
        "missing reply": [answer(reply=""), f"{ARG}\nReasoning needed: yes"],
        "malformed": [
            answer(ARG + LOOK.replace("Lookahead 1", "Lookahead 2")),
            answer(ARG + "\nChoice: Keep."),
            answer(ARG + "\nLookahead 1: Calmer."),
            answer(gate="maybe"),
            "Sure!\n" + answer(),
            answer(
                ARG
                + LOOK.replace(
                    "\nChoice", "\nLookahead 2: a.\nLookahead 3: b.\nLookahead 4: c.\nChoice"
                )
            ),
            answer(reply="</think> Hi"),
            answer("\n".join(reversed(ARG.split("\n")))),
        ],
    }
    for reason, texts in rejected.items():
        for text in texts:
            assert E.parse_arg(text, 3) == reason, text


class Teacher:
    """The scripted ARG teacher (told apart by its system prompt); every other call goes to the
    rules judge."""

    def __init__(self):
        self.calls = 0

    def __call__(self, messages, params):
        if not messages[0]["content"].startswith(E.ARG_TEACHER_SYSTEM[:60]):
            return rules_backend(messages, params)
        self.calls += 1
        current = re.search(
            r"<user_text>\n(.*?)\n</user_text>", messages[-1]["content"], re.DOTALL
        ).group(1)
        if "Thank you" in current:
            return answer(gate="no", reply="You are welcome.")
        if "Hello?" in current:
            return answer(reply="")  # no reply: rejected
        if "failure" in current:
            return answer(ARG.replace("Emotion: Anxious.\n", ""))  # a missing section: rejected
        return answer(ARG + LOOK, reply="I lost my job too once. You are not alone.")


def sft_config(base, tmp_path, url, **raw) -> Path:
    emollm = {
        "dialogues": [str(ESCONV)],
        "lookahead": 2,
        "teacher": {"base_url": url, "model": "teacher", "retries": 0, "timeout": 20},
        **raw.pop("emollm", {}),
    }
    return write_config(
        tmp_path,
        "sft",
        model=str(base),
        data=str(tmp_path / "arg.jsonl"),
        objective="target",
        epochs=2,
        emollm=emollm,
        **raw,
    )


def test_arg_rows_from_a_scripted_teacher_gate_both_forms_and_resume(base, tmp_path, capsys):
    teacher = Teacher()
    with JudgeServer(teacher).start() as server:
        path = sft_config(base, tmp_path, server.url)
        E.main([str(prep(path))])
        assert teacher.calls == 5
        out = capsys.readouterr().out
        assert (
            "contexts 5, reused 0, teacher_failures 0, missing section 1, missing reply 1, "
            "malformed 0, too long 0, rows 3, reasoned 2"
        ) in out
        rows = read_jsonl(tmp_path / "arg.jsonl")
        assert [(r["id"], r["meta"]["gate"]) for r in rows] == [
            ("esconv-0/t1", 1),
            ("esconv-0/t5", 0),
            ("esconv-1/t0", 1),
        ]
        assert (
            rows[0]["target"]
            == f"<think>\n{ARG}{LOOK}\n</think>\n\nI lost my job too once. You are not alone."
        )
        assert rows[1]["target"] == "You are welcome." and rows[1]["meta"]["arg"].startswith(
            "<think>\nFacts:"
        )
        assert rows[0]["prompt"] == [
            {"role": "assistant", "content": "Hi, how are you today?"},
            {
                "role": "user",
                "content": "Not great. I lost my job last month. Now I worry about the rent.",
            },
        ]
        assert rows[2]["prompt"][-1]["role"] == "user" and len(rows[2]["prompt"]) == 1
        E.main([str(prep(path))])  # a rerun asks only for what is missing: nothing
        assert teacher.calls == 5 and read_jsonl(tmp_path / "arg.jsonl") == rows
        assert "contexts 5, reused 5," in capsys.readouterr().out
        # the two contexts drawn are the two rejected answers: nothing kept, nothing written
        with pytest.raises(SystemExit) as stop:
            E.main([str(prep(path)), "share=0.4", "seed=3", "max_length=40"])
        captured = capsys.readouterr()
        assert stop.value.code == 2 and teacher.calls == 5
        assert "contexts 2, reused 2, teacher_failures 0, missing section 1, missing reply 1" in (
            captured.out
        )
        assert "arg.jsonl: not written: no row was kept" in captured.err
        assert read_jsonl(tmp_path / "arg.jsonl") == rows


def test_reply_rows_are_the_recorded_replies_with_no_teacher(base, tmp_path, capsys):
    """Table 1's SFT baseline (reply_only): every context answered in the fixture, its supporter's
    next turn the target (read off esconv.json by hand); the teacher's URL answers nothing."""
    path = sft_config(base, tmp_path, "http://127.0.0.1:9/v1", emollm={"reply_only": True})
    E.main([str(prep(path))])
    assert "reply SFT: contexts 5, no reply 2, too long 0, rows 3" in capsys.readouterr().out
    rows = read_jsonl(tmp_path / "arg.jsonl")
    assert [(r["id"], r["target"]) for r in rows] == [
        ("esconv-0/t1", "That sounds really stressful, losing a job and then worrying about rent."),
        ("esconv-0/t3", "Losing a job does not make you a failure."),
        ("esconv-1/t0", "After a long relationship ends, crying is a natural way to grieve."),
    ]
    assert rows[1]["prompt"][-1] == {"role": "user", "content": "Yes. I feel like a failure."}
    assert len(rows[1]["prompt"]) == 4 and rows[2]["prompt"] == [
        {"role": "user", "content": "My partner left me and I cannot stop crying."}
    ]


def test_the_sft_baseline_configs_differ_from_stage1_sft_in_base_data_and_rows_only():
    """EmoLLM's SFT baseline trains Stage I (ii)'s settings on the base model and the recorded
    replies of the same contexts."""
    base, row = (
        yaml.safe_load((CONFIGS / f"emollm_{name}.yaml").read_text())
        for name in ("stage1_sft", "sft_baseline")
    )
    changed = {k for k in base.keys() | row.keys() if base.get(k) != row.get(k)}
    assert changed == {"model", "data", "output_dir"} and row["model"] == "checkpoints/Qwen3-8B"
    base, row = (
        yaml.safe_load((CONFIGS / f"emollm_{name}_prepare.yaml").read_text())
        for name in ("stage1_sft", "sft_baseline")
    )
    assert row["reply_only"] and (row["out"], row["model"]) == (
        yaml.safe_load((CONFIGS / "emollm_sft_baseline.yaml").read_text())["data"],
        "checkpoints/Qwen3-8B",
    )
    assert all(row[k] == base[k] for k in ("dialogues", "share", "seed", "max_length", "objective"))


def test_the_arg_contexts_are_a_share_of_each_source_by_hand(tmp_path):
    """EmoLLM C.2: 10% of each dataset's contexts. Sources of 25, 6 and 16 contexts give 2.5 -> 3,
    0.6 -> 1 (at least one) and 1.6 -> 2, whatever the pooled total (47 -> 4.7 would be 5)."""

    def source(name: str, dialogues: int, user_turns: int) -> str:
        turn = [{"speaker": "seeker", "content": "hi"}, {"speaker": "supporter", "content": "yes"}]
        path = tmp_path / f"{name}.jsonl"
        path.write_text(
            "".join(
                json.dumps({"id": f"{name}{i}", "dialog": turn * user_turns}) + "\n"
                for i in range(dialogues)
            )
        )
        return str(path)

    paths = [source("a", 25, 1), source("b", 3, 2), source("c", 8, 2)]
    dialogues = E.load_dialogues(paths)
    assert len(E.sample_contexts(dialogues, None, 0)) == 25 + 6 + 16
    for seed in (0, 1):
        picked = E.sample_contexts(dialogues, 0.1, seed)
        names = [d.id[0] for d, _ in picked]
        assert (names.count("a"), names.count("b"), names.count("c")) == (3, 1, 2)
        order = [(int(d.id[1:]), t) for d, t in picked]
        assert len({(d.id, t) for d, t in picked}) == 6 and all(
            order[i] < order[i + 1] for i in range(5) if names[i] == names[i + 1]
        )  # distinct, each source's in file order
    draws = {tuple((d.id, t) for d, t in E.sample_contexts(dialogues, 0.1, s)) for s in range(5)}
    assert len(draws) > 1  # a random draw, not the first contexts


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "case",
    [
        "no speaker",
        "empty content",
        "bad speaker",
        "triple without tail",
        "triple not an object",
        "no knowledge file",
    ],
)
def test_bad_input_stops_with_one_line_and_writes_nothing(tmp_path, capsys, case):
    dialogues = json.loads(ESCONV.read_text())
    triples = ECOK.read_text().splitlines()
    if case == "no speaker":
        del dialogues[1]["dialog"][2]["speaker"]
    elif case == "empty content":
        dialogues[0]["dialog"][4]["content"] = "  "
    elif case == "bad speaker":
        dialogues[0]["dialog"][0]["speaker"] = "helper"
    elif case == "triple without tail":
        triples[3] = json.dumps({"head": "lose job", "relation": "xReact"})
    elif case == "triple not an object":
        triples[3] = json.dumps(["lose job", "xReact", "worried"])
    (tmp_path / "d.json").write_text(json.dumps(dialogues, indent=2))
    (tmp_path / "k.jsonl").write_text("\n".join(triples) + "\n")
    knowledge = str(tmp_path / ("missing.jsonl" if case == "no knowledge file" else "k.jsonl"))
    path = write_config(
        tmp_path,
        "cpt",
        model=str(tmp_path / "no-model"),
        data=str(tmp_path / "out.jsonl"),
        objective="lm",
        emollm={"dialogues": [str(tmp_path / "d.json")], "knowledge": knowledge},
    )
    with pytest.raises(SystemExit) as stop:
        E.main([str(prep(path))])
    err = capsys.readouterr().err
    assert stop.value.code != 0 and len(err.strip().splitlines()) == 1, err
    second = [
        n
        for n, line in enumerate((tmp_path / "d.json").read_text().split("\n"), 1)
        if line == "  {"
    ][1]
    expected = {
        # its start
        "no speaker": rf"{tmp_path}/d.json:{second}: field 'dialog\[2\].speaker': missing",
        "empty content": rf"{tmp_path}/d.json:2: field 'dialog\[4\].content': empty",
        "bad speaker": rf"{tmp_path}/d.json:2: field 'dialog\[0\].speaker': 'helper' is neither",
        "triple without tail": rf"{tmp_path}/k.jsonl:4: field 'tail': missing",
        "triple not an object": (
            rf"{tmp_path}/k.jsonl:4: expected a \{{head, relation, tail\}} object"
        ),
        "no knowledge file": rf"{tmp_path}/missing.jsonl: no such data file",
    }[case]
    assert re.match("error: " + expected, err), err
    assert not (tmp_path / "out.jsonl").exists()


def test_the_stage1_configs_hold_d1s_values():
    cpt = sft.parse_cli(sft.SFTConfig, [str(REPO / "configs/emollm_stage1_cpt.yaml")])
    assert (
        cpt.objective,
        cpt.lr,
        cpt.batch_size,
        cpt.rows_per_update,
        cpt.epochs,
        cpt.max_length,
    ) == (
        "lm",
        1e-4,
        16,
        16 * 2,  # D.1: per-device batch 16, accumulation 2, one GPU's
        1,
        320,
    )
    arg = sft.parse_cli(sft.SFTConfig, [str(REPO / "configs/emollm_stage1_sft.yaml")])
    assert (
        arg.objective,
        arg.lr,
        arg.batch_size,
        arg.rows_per_update,
        arg.epochs,
        arg.max_length,
    ) == (
        "target",
        2e-4,
        2,
        2 * 4 * 8,  # D.1: per-device batch 2, accumulation 4; 8 GPUs, as its command runs
        3,
        2048,
    )
    for name, cfg in (("cpt", cpt), ("sft", arg)):
        assert (
            cfg.lora.rank,
            cfg.lora.alpha,
            cfg.lora.dropout,
            cfg.warmup_steps,
            cfg.max_grad_norm,
        ) == (16, 32, 0.1, 100, 1.0) and cfg.save_merged
        # its data
        rows = E.parse_cli(E.EmoLLMData, [str(REPO / f"configs/emollm_stage1_{name}_prepare.yaml")])
        assert (rows.objective, rows.out, rows.model, rows.max_length, rows.enable_thinking) == (
            cfg.objective,
            cfg.data,
            cfg.model,
            cfg.max_length,
            cfg.enable_thinking,
        )
    assert arg.model == cpt.output_dir + "/merged"
    # C.2: ESConv is the CPT corpus only; the ARG SFT samples 10% of each of the four other sources
    arg_rows = E.parse_cli(E.EmoLLMData, [str(REPO / "configs/emollm_stage1_sft_prepare.yaml")])
    assert arg_rows.share == 0.1 and [Path(p).stem for p in arg_rows.dialogues] == [
        "empathetic_dialogues",
        "msdialog",
        "meddialog",
        "iclr",
    ]
    cpt_rows = E.parse_cli(E.EmoLLMData, [str(REPO / "configs/emollm_stage1_cpt_prepare.yaml")])
    assert [Path(p).name for p in cpt_rows.dialogues] == ["ESConv.json"]
    rl = load_config(REPO / "configs/emollm_qwen3_8b.yaml", [], DialogueConfig)
    assert rl.model.path == arg.output_dir + "/merged"


# ----------------------------------------------------------------------------- the chain


@pytest.mark.parametrize("backbone", ["base", "llama_base"])
def test_stage1_cpt_then_arg_sft_then_grpo_dialogue_demo_from_the_merged_model(
    backbone, request, tmp_path
):
    """Each stage starts from the previous one's merged checkpoint; the last is grpo.py's dialogue
    demo. The same chain on a Llama 3 model (G.2), whose merged checkpoints stay Llama 3."""
    base = request.getfixturevalue(backbone)
    cpt = write_config(
        tmp_path,
        "cpt",
        model=str(base),
        data=str(tmp_path / "cpt.jsonl"),
        objective="lm",
        max_length=80,
        emollm={"dialogues": [str(ESCONV)], "knowledge": str(ECOK)},
    )
    E.main([str(prep(cpt))])
    sft.main([str(cpt)])
    with JudgeServer(Teacher()).start() as server:
        arg = sft_config(tmp_path / "cpt" / "merged", tmp_path, server.url)
        E.main([str(prep(arg))])
        sft.main([str(arg)])
        stage1 = tmp_path / "sft" / "merged"
        # 3 rows by 2, twice
        assert [m["step"] for m in read_jsonl(tmp_path / "sft" / "metrics.jsonl")] == [1, 2, 3, 4]
        dialogue_rl.main(
            [
                str(REPO / "configs/dialogue_demo.yaml"),
                f"model.path={stage1}",
                f"output_dir={tmp_path / 'rl'}",
                f"judge.base_url={server.url}",
                "judge.retries=0",
                "updates=1",
                "rollout.max_new_tokens=6",
            ]
        )
    [record] = read_jsonl(tmp_path / "rl" / "metrics.jsonl")
    assert record["step"] == 1 and record["judge/calls"] > 0
    family = "llama" if backbone == "llama_base" else "qwen3"
    merged = M.QwenConfig.from_json(stage1 / "config.json").family
    assert merged == load_tokenizer(stage1).family == family


@pytest.mark.parametrize("case", ["objective clue", "lm without knowledge"])
def test_the_config_must_name_a_part_it_can_build(tmp_path, capsys, case):
    emollm = {"dialogues": [str(ESCONV)]} | (
        {} if case == "lm without knowledge" else {"knowledge": str(ECOK)}
    )
    path = write_config(
        tmp_path,
        "cpt",
        model="none",
        data=str(tmp_path / "out.jsonl"),
        objective="clue" if case == "objective clue" else "lm",
        emollm=emollm,
    )
    with pytest.raises(SystemExit) as stop:
        E.main([str(prep(path))])
    err = capsys.readouterr().err
    assert (
        stop.value.code == 2
        and len(err.strip().splitlines()) == 1
        and not (tmp_path / "out.jsonl").exists()
    ), err
    expected = {
        "objective clue": (
            rf"config error: {prep(path)}:\d+: 'objective' must be one of \['lm', 'target'\]"
        ),
        "lm without knowledge": (
            rf"config error: {prep(path)}: 'knowledge': the CPT rows \(objective lm\)"
        ),
    }[case]
    assert re.match(expected, err), err


def test_arg_rows_with_the_teacher_down_keep_the_existing_rows(base, tmp_path, capsys):
    with JudgeServer(Teacher()).start() as server:
        path = sft_config(base, tmp_path, server.url)
        E.main([str(prep(path))])
    rows = (tmp_path / "arg.jsonl").read_bytes()
    assert rows.count(b"\n") == 3
    # another teacher (new requests) that does not answer
    with pytest.raises(SystemExit) as stop:
        E.main([str(prep(path)), "teacher.model=other", "teacher.base_url=http://127.0.0.1:9/v1"])
    assert stop.value.code == 2 and (tmp_path / "arg.jsonl").read_bytes() == rows
    error = capsys.readouterr().err.strip()
    # the first call went alone and stopped the preparation: nothing else was sent
    assert error == (
        "error: 'teacher': asked once before the run: judge at http://127.0.0.1:9/v1/chat/"
        "completions: ConnectionError (ConnectionRefusedError: [Errno 111] Connection refused), "
        "still failing after 3 attempts"
    )
