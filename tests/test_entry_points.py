"""The entry points keep the project's rule (docs/configs.md#errors) under broken and hostile input
and faults: every input and the output's name checked before anything is written, outputs staged and
moved into place (a failure leaves nothing, the rerun works), nothing the user had replaced, one
located line with exit 2 where a traceback was, and no exit 0 for input that should be refused.
The tools (export_checkpoint, small_checkpoint), evaluate.py's run, `compare` and `plot`, the
bounded settings (thread counts, server URLs, lineage records) and the dialogue judges' ratings."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import config, sft_checkpoint, tensors

REPO = Path(__file__).resolve().parents[1]


def one_line_error(capsys, stop) -> str:
    """The stderr of an entry point stopped by `stop` (pytest.raises(SystemExit)): exit 2, one
    line."""
    error = capsys.readouterr().err
    assert stop.value.code == 2 and error.count("\n") == 1 and "Traceback" not in error, error
    return error.strip()


def weights(folder: Path) -> dict[str, torch.Tensor]:
    found = {}
    for shard in folder.glob("*.safetensors"):
        found |= tensors(shard)
    return found


# ----------------------------------------------------------------------------- export_checkpoint


@pytest.fixture(scope="module")
def sft_full_run(tmp_path_factory):
    """A full-parameter `sft.py` run (objective clue: the evidence rows trained) on the tiny SFT
    checkpoint, a checkpoint after every update; its folder."""
    import sft

    root = tmp_path_factory.mktemp("sft_full")
    cfg = config(sft_checkpoint(root / "base"), root, finetune="full", lora=None, save_every=1)
    try:
        sft.train(cfg)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return root / "run"


def test_an_sft_full_checkpoint_exports_to_the_model_the_run_wrote(sft_full_run, tmp_path):
    """The docstring names sft.py runs: the last checkpoint's export equals, tensor for tensor, the
    best/ the run exported itself (fsdp.export_full, another path), the `<evidence>` rows
    included (was: refused as "a run of another base", its embed_rows unknown to the base)."""
    from tools.export_checkpoint import main

    last = max(sft_full_run.glob("ckpt-*"))
    main([str(last), str(tmp_path / "out")])
    exported, written = weights(tmp_path / "out"), weights(sft_full_run / "best")
    assert exported.keys() == written.keys()
    assert all(torch.equal(exported[k], written[k]) for k in written)


@pytest.mark.parametrize("cut", ["shard", "state.json", "config.yaml"])
def test_a_cut_checkpoint_exports_nothing_and_says_which_file(sft_full_run, tmp_path, capsys, cut):
    """A checkpoint whose DCP shard, state.json or the run's config.yaml is cut short (a full
    disk, a copy stopped short): one line naming the file, exit 2, nothing written (was: a
    SafetensorError or JSONDecodeError traceback)."""
    from tools.export_checkpoint import main

    run = tmp_path / "run"
    shutil.copytree(sft_full_run, run)
    last = max(run.glob("ckpt-*"))
    damaged = {
        "shard": next((last / "dcp").glob("*.safetensors")),
        "state.json": last / "state.json",
        "config.yaml": run / "config.yaml",
    }[cut]
    text = damaged.read_bytes()
    damaged.write_bytes(text[: text.index(b"output_dir")] if cut == "config.yaml" else text[:40])
    if cut == "config.yaml":
        damaged.write_bytes(damaged.read_bytes() + b"objective: [clue\n")
    with pytest.raises(SystemExit) as stop:
        main([str(last), str(tmp_path / "out")])
    error = one_line_error(capsys, stop)
    assert error.startswith("error: ") and str(damaged) in error, error
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


@pytest.mark.parametrize("out", ["notes.txt", "kept", "CKPT/export"])
def test_an_export_refuses_an_out_it_would_replace_or_write_into_the_checkpoint(
    sft_full_run, tmp_path, capsys, out
):
    """`OUT` a file of the user's, a folder holding files, or a new folder inside the checkpoint:
    one line naming it, nothing written (was: the model written into the checkpoint's own folder;
    the file was "Not a directory", a line that did not say what to do)."""
    from tools.export_checkpoint import main

    last = max(sft_full_run.glob("ckpt-*"))
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / "a.txt").write_text("mine")
    target = str(last / "export") if out == "CKPT/export" else str(tmp_path / out)
    before = sorted(str(p) for p in [*tmp_path.rglob("*"), *last.rglob("*")])
    with pytest.raises(SystemExit) as stop:
        main([str(last), target])
    assert one_line_error(capsys, stop).startswith(f"error: {target}: ")
    assert sorted(str(p) for p in [*tmp_path.rglob("*"), *last.rglob("*")]) == before


FULL_DISK_EXPORT = """
import resource, sys
sys.path.insert(0, sys.argv[3])
resource.setrlimit(resource.RLIMIT_FSIZE, (8192, 8192))
from tools.export_checkpoint import main
main(sys.argv[1:3])
"""


def test_an_export_onto_a_full_disk_names_the_file_leaves_nothing_and_reruns(
    sft_full_run, tmp_path
):
    """The disk fills while the model is written (the file-size limit stands in for it: Python
    ignores SIGXFSZ, so the write fails with EFBIG): one line naming the file being written, no
    temporary left beside or inside `out`, and the rerun with room writes the model (was: a line
    naming no file, a `.tmp` in `out`, the rerun refused as "not empty")."""
    last = max(sft_full_run.glob("ckpt-*"))
    out = tmp_path / "out"
    full = subprocess.run(
        [sys.executable, "-c", FULL_DISK_EXPORT, str(last), str(out), str(REPO)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert full.returncode == 2 and full.stderr == (
        f"error: [Errno 27] File too large: '{out}/model-00001-of-00001.safetensors'\n"
    ), full.stderr
    assert list(tmp_path.iterdir()) == [], list(tmp_path.iterdir())
    from tools.export_checkpoint import main

    main([str(last), str(out)])
    assert weights(out).keys() == weights(sft_full_run / "best").keys()


# ----------------------------------------------------------------------------- small_checkpoint

EXAMPLE = {
    "id": "a",
    "task": "meld_emotion",
    "turns": [{"speaker": "A", "text": "I won the prize today"}],
    "target": 0,
    "labels": ["joy"],
}


@pytest.mark.parametrize(
    "argv, expected",
    [
        (
            ["ex.jsonl", "out", "--vocab", "0"],
            "--vocab: a vocabulary size from 259 to 262,144, not 0",
        ),
        (["ex.jsonl", "out", "--vocab", "-5"], "a vocabulary size from 259 to 262,144, not -5"),
        (["ex.jsonl", "out", "--vocab", str(10**12)], f"262,144, not {10**12}"),
        (["absent.jsonl", "out"], "error: absent.jsonl: no such data file"),
        (["bad.jsonl", "out"], "error: bad.jsonl:2: field 'turns': missing"),
        (["ex.jsonl", "empty.jsonl", "out"], "error: empty.jsonl: no examples"),
        (["ex.jsonl", "notes.txt"], "error: notes.txt: exists and is not an empty folder"),
    ],
)
def test_small_checkpoint_refuses_bad_input_in_one_line_writing_nothing(
    tmp_path, monkeypatch, capsys, argv, expected
):
    """A missing or bad examples file, an empty one, `out` a file of the user's, a vocabulary size
    below the byte alphabet or past any real one: the last stderr line says what, exit 2, nothing
    written (was: tracebacks, a Rust allocation abort for 10**12, and exit 0 with a checkpoint for
    an empty file or --vocab 0)."""
    from tools.small_checkpoint import main

    monkeypatch.chdir(tmp_path)
    line = json.dumps(EXAMPLE) + "\n"
    Path("ex.jsonl").write_text(line)
    Path("bad.jsonl").write_text(line + json.dumps({"id": "b", "task": "meld_emotion"}) + "\n")
    Path("empty.jsonl").write_text("\n")
    Path("notes.txt").write_text("mine")
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(SystemExit) as stop:
        main(argv)
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert stop.value.code == 2 and expected in error and "Traceback" not in error, error
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert Path("notes.txt").read_text() == "mine"
    main(["ex.jsonl", "out", "--vocab", "259"])  # the smallest size: a checkpoint that loads
    import model as M

    assert M.Qwen.from_pretrained("out").config.vocab_size >= 259


# ----------------------------------------------------------------------------- compare


def test_compare_into_a_folder_holding_a_table_is_refused_without_overwrite(tmp_path, capsys):
    """`compare A B --out A` (A's own table.md), or a folder holding the user's table.md: refused
    with one line, the files kept (was: replaced, exit 0); --overwrite replaces them."""
    import evaluate as ev

    evals = []
    for name in ("a", "b"):
        folder = tmp_path / name
        folder.mkdir()
        entry = {"task": "tom_mc", "n_items": 1, "decoding": {"n_samples": 1}, "invalid": None}
        entry["group_accuracy"] = {"mean": 0.5, "sd": None}
        summary = {"name": name, "sets": {"S": entry}, "averages": {}}
        summary["config"] = {"report": "accuracy"}
        (folder / "eval.json").write_text(json.dumps(summary))
        (folder / "table.md").write_text(f"{name}'s own table\n")
        evals.append(str(folder))
    for out in (tmp_path / "a", tmp_path / "b"):
        with pytest.raises(SystemExit) as stop:
            ev.main(["compare", *evals, "--out", str(out)])
        error = capsys.readouterr().err.strip().splitlines()[-1]
        assert stop.value.code == 2 and error.endswith(
            f"{out / 'table.md'} exists (an evaluation's own, or yours); pass --overwrite to "
            "replace it, or choose another --out"
        ), error
        assert (out / "table.md").read_text() == f"{out.name}'s own table\n"
    (tmp_path / "file").write_text("mine")
    with pytest.raises(SystemExit):
        ev.main(["compare", *evals, "--out", str(tmp_path / "file")])
    assert "is a file; name the folder" in capsys.readouterr().err
    ev.main(["compare", *evals, "--out", str(tmp_path / "a"), "--overwrite"])
    assert (tmp_path / "a" / "table.md").read_text().startswith("### Accuracy")


# ----------------------------------------------------------------------------- evaluate.py's run


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """test_grpo's tiny checkpoint and four examples to evaluate: (base, examples)."""
    from helpers import grpo_checkpoint, write_examples

    root = tmp_path_factory.mktemp("eval")
    return grpo_checkpoint(root / "base"), write_examples(root / "eval.jsonl")


def eval_config(tmp_path, tiny, **overrides) -> Path:
    import yaml

    base, examples = tiny
    raw = {
        "output_dir": str(tmp_path / "eval"),
        "sets": [{"name": "toy", "path": str(examples)}],
        "checkpoint": str(base),
        "n_samples": 1,
        "device": "cpu",
        "sampling": {"max_new_tokens": 4},
    } | overrides
    path = tmp_path / "eval.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def lineage_adapter(tmp_path, tiny, lineage) -> Path:
    from helpers import sft_adapter

    adapter = sft_adapter(tiny[0], tmp_path / "adapter")
    (adapter / "lineage.json").write_text(json.dumps(lineage))
    return adapter


@pytest.mark.parametrize(
    "case, expected",
    [
        ("missing checkpoint", "{tmp}/export-30"),
        ("missing SFT adapter", "{tmp}/sft-gone"),
        ("null base", "lineage.json: field 'base': expects a path, got None"),
        ("number SFT adapter", "lineage.json: field 'sft_adapter': expects a path or null, got 7"),
    ],
)
def test_evaluate_writes_nothing_until_its_model_has_loaded(tmp_path, tiny, capsys, case, expected):
    """A missing checkpoint (the content-RM chain's export not made yet, the real-data page's
    evaluation before SFT finished), a lineage.json naming a missing SFT adapter, one whose values
    are null or a number: one line, exit 2, and no output_dir, so the corrected command runs (was:
    config.yaml and an empty completions.jsonl written first, the corrected command refused as
    "holds completions made with other checkpoint", content_rm pairs reading the empty file; and a
    TypeError traceback for the null and the number)."""
    import evaluate as ev

    base = str(tiny[0].resolve())
    overrides = {
        "missing checkpoint": {"checkpoint": str(tmp_path / "export-30")},
        "missing SFT adapter": {"base": base, "sft_adapter": str(tmp_path / "sft-gone")},
        "null base": {"base": None, "sft_adapter": None},
        "number SFT adapter": {"base": base, "sft_adapter": 7},
    }[case]
    if "checkpoint" in overrides:
        config = eval_config(
            tmp_path, tiny, **overrides, report="accuracy", n_samples=6, name="social_r1_rm_source"
        )
    else:
        adapter = lineage_adapter(tmp_path, tiny, overrides)
        config = eval_config(tmp_path, tiny, adapter=str(adapter))
    with pytest.raises(SystemExit) as stop:
        ev.main([str(config)])
    error = one_line_error(capsys, stop)
    assert expected.format(tmp=tmp_path) in error, error
    assert not (tmp_path / "eval").exists()


def test_a_bad_eqbench3_scenario_file_stops_before_any_set_is_sampled(tmp_path, tiny, capsys):
    """An eqbench3 set whose scenario file has a bad line, beside a set of examples: the line is
    reported before anything is sampled or written (was: after the other sets were sampled into
    completions.jsonl)."""
    from dialogue import eqbench3

    scenarios = tmp_path / "scenarios.txt"
    scenarios.write_text("intro\n######## 1 | A | B\n####### Prompt1\nhi\n")
    config = eval_config(
        tmp_path,
        tiny,
        report="accuracy",
        sets=[
            {"name": "toy", "path": str(tiny[1])},
            {"name": "EQBench3", "path": str(scenarios), "kind": "eqbench3"},
        ],
    )
    with pytest.raises(SystemExit) as stop:
        eqbench3.main([str(config)])
    error = one_line_error(capsys, stop)
    assert f"{scenarios}:1: text before the first" in error, error
    assert not (tmp_path / "eval").exists()


def test_an_adapter_that_names_no_base_is_evaluated_with_a_line_saying_so(tmp_path, tiny, capsys):
    """An adapter without lineage.json whose adapter_config.json names no base (a GRPO adapter
    trained over an SFT adapter, copied without its lineage.json) is evaluated on the checkpoint
    given, with one line saying its lineage is unknown (was: without a word); an sft.py adapter
    names its base (base_model_name_or_path) and gets no such line."""
    from helpers import sft_adapter

    import evaluate as ev
    import sft

    adapter = sft_adapter(tiny[0], tmp_path / "grpo-adapter")  # base_model_name_or_path: null
    ev.main([str(eval_config(tmp_path, tiny, adapter=str(adapter)))])
    assert (
        capsys.readouterr().out.count(
            f"adapter {adapter}: no lineage.json and no base_model_name_or_path in its "
            f"adapter_config.json, so what it was trained on is unknown: evaluated on checkpoint "
            f"{tiny[0]} as given"
        )
        == 1
    )
    checkpoint = sft_checkpoint(tmp_path / "sft-base")
    sft.train(config(checkpoint, tmp_path / "sft"))
    best = tmp_path / "sft" / "run" / "best"
    named = json.loads((best / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert named == str(checkpoint)
    capsys.readouterr()
    overrides = {"checkpoint": str(checkpoint), "adapter": str(best)}
    overrides["output_dir"] = str(tmp_path / "eval-sft")
    ev.main([str(eval_config(tmp_path, tiny, **overrides))])
    assert "lineage" not in capsys.readouterr().out


# ----------------------------------------------------------------------------- bounded settings


def no_model(monkeypatch):
    import grpo

    def no_load(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(grpo.Qwen, "from_pretrained", no_load)


@pytest.fixture(scope="module")
def grpo_assets(tmp_path_factory):
    from helpers import grpo_checkpoint, write_examples

    root = tmp_path_factory.mktemp("grpo")
    return grpo_checkpoint(root / "base"), write_examples(root / "train.jsonl")


@pytest.mark.parametrize(
    "override, expected",
    [
        ("distributed.cpu_threads=1099511627776", "must be >= 0 and <= 1024, got 1099511627776"),
        ("rollout.decode=compiled", "torch.compile on the CPU needs a C++ compiler"),
    ],
)
def test_a_setting_no_library_can_take_stops_before_any_model_loads(
    tmp_path, grpo_assets, judge, monkeypatch, capsys, override, expected
):
    """distributed.cpu_threads=2**40 (was: torch's "Overflow when unpacking long" traceback) and
    rollout.decode: compiled on a machine without a working C++ compiler (Inductor's search made
    to find none; was: 109 lines from Inductor, after the model loaded): one line naming the key,
    before any model loads."""
    from helpers import run_config
    from torch._inductor import config as inductor

    import grpo

    no_model(monkeypatch)
    monkeypatch.setattr(inductor.cpp, "cxx", (None, str(tmp_path / "no-such-c++")))
    config = run_config(tmp_path, grpo_assets, judge.url)
    with pytest.raises(SystemExit) as stop:
        grpo.main([str(config), override])
    error = one_line_error(capsys, stop)
    key = override.split("=")[0]
    assert f"'{key}'" in error and expected in error, error
    assert not (tmp_path / "run").exists()


def test_omp_num_threads_past_any_machine_is_one_line(monkeypatch):
    from config import ConfigError
    from distributed import DistributedSettings, cpu_threads

    monkeypatch.setenv("OMP_NUM_THREADS", str(2**40))
    with pytest.raises(ConfigError, match=r"OMP_NUM_THREADS: at most 1024 threads, got '109"):
        cpu_threads(DistributedSettings())


@pytest.mark.parametrize(
    "url, expected",
    [
        ("127.0.0.1:8000/v1", "expects an http:// or https:// URL"),
        ("''", "expects an http:// or https:// URL such as http://127.0.0.1:8000/v1, got ''"),
        ("http://a:99999/v1", "expects an http:// or https:// URL"),
        ("[http://a:8000/v1, 'http://a:8000/v1/']", "a list of distinct URLs"),
    ],
)
def test_a_rollout_server_url_is_checked_and_compared_in_one_spelling(tmp_path, url, expected):
    """`rollout.vllm.base_url` with no scheme, empty, with a bad port, or one server spelled with
    and without a trailing `/` (was: accepted, the last dealt to as two servers): a ConfigError
    naming the override; a URL's trailing `/` and spaces are dropped (the judge's too)."""
    import grpo
    from config import ConfigError, load_config

    path = tmp_path / "c.yaml"
    path.write_text(f"output_dir: {tmp_path}\ntrain_data: [x]\nmodel: {{path: m}}\n")
    with pytest.raises(ConfigError) as refused:
        load_config(path, [f"rollout.vllm.base_url={url}"], grpo.GRPOConfig)
    assert str(refused.value).startswith(
        f"override 'rollout.vllm.base_url={url}': 'rollout.vllm.base_url': "
    ) and expected in str(refused.value), refused.value
    cfg = load_config(
        path,
        ["rollout.vllm.base_url=' http://a:8000/v1/ '", "judge.base_url=http://j/v1/"],
        grpo.GRPOConfig,
    )
    assert cfg.rollout.vllm.urls == ["http://a:8000/v1"] and cfg.judge.base_url == "http://j/v1"


# ----------------------------------------------------------------------------- the converters


@pytest.mark.parametrize(
    "dataset, source, target",
    [
        ("socialiqa", "dev.jsonl", "dev.jsonl"),
        ("emobench", "data", "data/EA.jsonl"),  # a file the converter reads from its folder
        ("emobench", "data", "data/new/out.jsonl"),
    ],
)
def test_a_converter_never_writes_over_its_dataset(
    tmp_path, monkeypatch, capsys, dataset, source, target
):
    """prepare.convert with the output named as its input file, or inside its input folder (a
    file it reads there, or a new one): one line, the dataset unchanged (was: the user's
    dev.jsonl or EA.jsonl replaced by its conversion, exit 0)."""
    from prepare import convert

    monkeypatch.chdir(tmp_path)
    shutil.copytree(REPO / "tests" / "fixtures" / "benchmarks" / dataset, dataset)
    before = {p: p.read_bytes() for p in Path(dataset).rglob("*") if p.is_file()}
    with pytest.raises(SystemExit) as stop:
        convert.main([dataset, f"{dataset}/{source}", f"{dataset}/{target}"])
    error = one_line_error(capsys, stop)
    assert error.startswith(f"error: 'output': {dataset}/{target} is "), error
    assert {p: p.read_bytes() for p in Path(dataset).rglob("*") if p.is_file()} == before
