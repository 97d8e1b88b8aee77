"""EmoLLM's scenario seeds summarized by a teacher (prepare/emollm_seeds.py) on the local judge
server with a scripted teacher: each seed is what the server returned, every answer is journaled, a
rerun asks only for what failed or was never asked, a malformed answer is rejected and counted,
sampling per source by hand, and the configs hold C.3's values."""

import json
import re
from pathlib import Path

import pytest
import yaml
from helpers import read_jsonl
from instruments import free_port

from dialogue import play as dialogue
from judge_server import JudgeServer
from prepare import emollm_seeds as S
from prepare.convert import convert_meddialog

REPO = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).parents[1] / "fixtures" / "emollm"


class SeedTeacher:
    """Answers the seed prompt with a JSON seed made from the dialogue's first line, or, for the
    headache consultation, text around the JSON (malformed); `fail` makes the cough consultation's
    request fail (HTTP 500)."""

    def __init__(self):
        self.calls, self.answers, self.fail = 0, {}, False

    def __call__(self, messages, params):
        assert messages[0]["content"] == S.SEED_TEACHER_SYSTEM
        text = re.search(r"<dialogue>\n(.*?)\n</dialogue>", messages[-1]["content"], re.DOTALL)
        text = text.group(1)
        if self.fail and "cough" in text:
            raise RuntimeError("teacher down")
        self.calls += 1
        first = text.split("\n")[0]
        answer = json.dumps(
            {
                "scenario": f"You support someone; the talk began with: {first[:30].strip()}",
                "initial_prompt": f"Opening {self.calls}: {text.split(chr(10))[-1][-25:]}",
            }
        )
        if "headaches" in text:
            answer = "Here is the seed: " + answer
        self.answers[first] = answer
        return answer


def sources(tmp_path: Path) -> list[str]:
    meddialog = tmp_path / "meddialog.jsonl"
    meddialog.write_text(
        "".join(json.dumps(d) + "\n" for d in convert_meddialog(FIXTURES / "meddialog.json"))
    )
    return [str(FIXTURES / "esconv.json"), str(meddialog)]


def config(tmp_path: Path, url: str, **raw) -> Path:
    path = tmp_path / "seeds.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "dialogues": sources(tmp_path),
                "out": str(tmp_path / "seeds.jsonl"),
                "teacher": {"base_url": url, "model": "teacher", "retries": 0, "timeout": 20},
                **raw,
            }
        )
    )
    return path


def test_seeds_are_the_teachers_summaries_journaled_and_resumed(tmp_path, capsys):
    teacher = SeedTeacher()
    teacher.fail = True
    out, journal = tmp_path / "seeds.jsonl", tmp_path / "seeds.jsonl.teacher.jsonl"
    with JudgeServer(teacher).start() as server:
        path = config(tmp_path, server.url)
        with pytest.raises(SystemExit) as stop:  # the cough consultation's call fails
            S.main([str(path)])
        assert stop.value.code == 2 and teacher.calls == 3 and len(read_jsonl(journal)) == 3
        captured = capsys.readouterr()
        assert "dialogues 4, asked 4, reused 0, failures 1, rejected 1, seeds 2" in captured.out
        # the server's reason, in full, as it happens; then the ending: the kept rows written, the
        # failed call not journaled (the rerun asks it)
        assert "a call to 'teacher' failed: judge at " in captured.out
        reason = captured.out.split("a call to 'teacher' failed: ")[1].split("\n")[0]
        assert captured.err == (
            f"error: {out}: 2 rows written, but 1 teacher calls failed, the first: "
            f"{reason[:117]}...; rerun the same command to ask the rest (the answers so far: "
            f"{journal.name}, kept)\n"
        )
        assert len(read_jsonl(out)) == 2
        teacher.fail = False
        S.main([str(path)])  # asks only for the failed one
        assert teacher.calls == 4 and len(read_jsonl(journal)) == 4
        assert "dialogues 4, asked 1, reused 3, failures 0, rejected 1, seeds 3" in (
            capsys.readouterr().out
        )
        seeds = read_jsonl(out)
        S.main([str(path)])  # nothing left to ask
        assert teacher.calls == 4 and read_jsonl(out) == seeds
    first_lines = {
        "esconv-0": "Assistant: Hi, how are you today?",
        "esconv-1": "User: My partner left me and I cannot stop crying.",
        "meddialog-0": "User: Hi doctor, I had a cold three weeks ago and the cough has not gone "
        "away. It is dry and worse at night. Should I be worried?",
    }
    # each seed is exactly what the server returned for its dialogue; the headache answer had
    # text around its JSON and was rejected
    assert seeds == [
        {"id": i, **json.loads(teacher.answers[line])} for i, line in first_lines.items()
    ]
    assert len(teacher.answers) == 4
    loaded = dialogue.load_scenarios(out)  # what grpo.py and dialogue/evaluation.py read
    assert [s.id for s in loaded] == list(first_lines)
    # the journal holds the parsed answers, the rejected one as null
    values = [r["value"] for r in read_jsonl(journal)]
    assert values.count(None) == 1 and {json.dumps(v) for v in values if v is not None} == {
        json.dumps({k: s[k] for k in ("scenario", "initial_prompt")}) for s in seeds
    }


def test_seeds_with_the_teacher_down_stop_at_the_first_call_and_write_nothing(tmp_path, capsys):
    url = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    path = config(tmp_path, url)
    path.write_text(path.read_text().replace("retries: 0", "retries: 0\n  backoff: 0.01"))
    with pytest.raises(SystemExit) as stop:
        S.main([str(path)])
    assert stop.value.code == 2 and capsys.readouterr().err == (
        f"error: 'teacher': asked once before the run: judge at {url}/chat/completions: "
        "ConnectionError (ConnectionRefusedError: [Errno 111] Connection refused), still failing "
        "after 3 attempts\n"
    )
    assert not (tmp_path / "seeds.jsonl").exists()
    assert not (tmp_path / "seeds.jsonl.teacher.jsonl").exists()


def test_the_teacher_sees_the_whole_dialogue_and_its_situation():
    [d, _] = S.load_dialogues([str(FIXTURES / "esconv.json")])
    message = S.seed_request(d, 512).messages[-1]["content"]
    assert message.startswith("<dialogue>\nAssistant: Hi, how are you today?\nUser: ")
    last = d.turns[-1][1]
    assert f"{last}\n</dialogue>" in message  # the last turn too: the teacher summarizes it all
    assert "Situation: I lost my job last month and I worry about paying the rent." in message
    assert "Topic: job crisis" in message and "Emotion: anxiety" in message


def test_parse_seed_takes_exactly_one_object_of_two_texts():
    good = {"scenario": "You support a tired nurse.", "initial_prompt": "I am exhausted."}
    assert S.parse_seed(json.dumps(good)) == good
    assert S.parse_seed(" " + json.dumps({k: f" {v} " for k, v in good.items()}) + "\n") == good
    for bad in [
        "Sure: " + json.dumps(good),
        json.dumps([good]),
        json.dumps({**good, "id": "x"}),
        json.dumps({"scenario": good["scenario"]}),
        json.dumps({**good, "initial_prompt": "  "}),
        json.dumps({**good, "initial_prompt": 3}),
    ]:
        assert S.parse_seed(bad) is None, bad


def test_per_source_sampling_by_hand(tmp_path):
    """Sources of 2 (ESConv) and 2 (MedDialog) dialogues, one per source: 2 seeds, one of each;
    a dialogue without a user turn is never drawn."""
    paths = sources(tmp_path)
    lonely = tmp_path / "lonely.jsonl"
    lonely.write_text(
        json.dumps({"id": "z0", "dialog": [{"speaker": "supporter", "content": "Hello?"}]}) + "\n"
    )
    dialogues = S.load_dialogues([*paths, str(lonely)])
    assert [d.id for d in S.sample_dialogues(dialogues, None, 0)] == [
        "esconv-0",
        "esconv-1",
        "meddialog-0",
        "meddialog-1",
    ]
    for seed in range(4):
        picked = [d.id for d in S.sample_dialogues(dialogues, 1, seed)]
        assert len(picked) == 2 and picked[0].startswith("esconv-")
        assert picked[1].startswith("meddialog-")
    assert len({tuple(d.id for d in S.sample_dialogues(dialogues, 1, s)) for s in range(8)}) > 1
    assert [d.id for d in S.sample_dialogues(dialogues, 5, 0)] == [
        "esconv-0",
        "esconv-1",
        "meddialog-0",
        "meddialog-1",
    ]


@pytest.mark.parametrize(
    "name, per_source",
    [("emollm_seeds_prepare.yaml", 100), ("emollm_eval_seeds_prepare.yaml", 100)],
)
def test_the_seed_configs_hold_c3s_values(name, per_source):
    cfg = S.parse_cli(S.SeedSettings, [str(REPO / "configs" / name)])
    # C.3: 100 test dialogues per dataset, summarized by gpt-5-mini; the four SFT/RL sources
    assert (cfg.per_source, cfg.teacher.model) == (per_source, "gpt-5-mini")
    assert [Path(p).name.split(".")[0] for p in cfg.dialogues] == [
        "empathetic_dialogues",
        "msdialog",
        "meddialog",
        "iclr",
    ]
    if "eval" not in name:  # the training seeds are what Stage II trains on, as many as it draws
        rl = yaml.safe_load((REPO / "configs" / "emollm_qwen3_8b.yaml").read_text())
        assert rl["train_data"] == [cfg.out]
        drawn = rl["updates"] * rl["rollout"]["prompts_per_update"]
        assert cfg.per_source * len(cfg.dialogues) == drawn == 400
