"""The human evaluation (tools/annotate.py): the excerpt rule, pairs drawn from two runs, the
annotation server over HTTP (every click saved, reload continues, model identities and their order
hidden from the page), the report against hand computations, and one item clicked through in a
headless Chromium."""

import json
import shutil
import threading
from pathlib import Path

import pytest
import requests

import evaluate as ev
from config import save_resolved_config
from data import Example, Turn
from dataset import example_to_json, save_jsonl
from tools import annotate

CONVERSATION = [
    Turn("Mei", "Did you finish the report?"),
    Turn("Ken", "Not yet, the data came late."),
    Turn("Mei", "The client calls at noon."),
    Turn("Ken", "Fine, I will skip lunch then."),
]


def example(i: int) -> Example:
    return Example(f"x{i}", "meld_emotion", CONVERSATION, 3, ["anger" if i % 2 else "sadness"])


def pair(i: int, domain="in") -> dict:
    grounded = (
        "<think>\nKen was told <evidence>The client calls at noon.</evidence> and answers "
        "<evidence>I will skip lunch then</evidence>.\n</think>\n\nAnswer: anger"
    )
    plain = "<think>\nKen sounds tired.\n\nHe gives in.\n</think>\n\nAnswer: sadness"
    e = example(i)
    return {
        "id": f"set/{e.id}",
        "set": "set",
        "domain": domain,
        "example": example_to_json(e),
        "models": {
            "CLUE": {
                "completion": grounded,
                "answer": ["anger"],
                "excerpt": annotate.completion_excerpt(grounded),
                "correct": i % 2 == 1,
            },
            "Base": {
                "completion": plain,
                "answer": ["sadness"],
                "excerpt": annotate.completion_excerpt(plain),
                "correct": i % 2 == 0,
            },
        },
    }


@pytest.fixture
def pairs_file(tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(pair(i, "in" if i < 3 else "out")) + "\n" for i in range(6)))
    return path


@pytest.fixture
def serve(pairs_file, tmp_path):
    servers = []

    def start(seed=0):
        server = annotate.AnnotationServer(
            annotate.load_pairs(pairs_file), tmp_path / "answers.jsonl", seed=seed
        )
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def test_excerpt_rule():
    assert (
        annotate.completion_excerpt(
            "<think>\nFirst block.\n\nLast block here.\n</think>\nAnswer: joy"
        )
        == "Last block here."
    )
    long = "<think>\n" + " ".join(f"w{i}" for i in range(400)) + "\n</think>"
    cut = annotate.completion_excerpt(long)
    assert cut.startswith("… w") and cut.endswith("w399") and len(cut) <= annotate.EXCERPT_CHARS + 2
    assert annotate.completion_excerpt("no reasoning closes") == "no reasoning closes"
    tagged = "<think>\nHe says <evidence>I am fine</evidence> twice.\n</think>\nAnswer: joy"
    # no model is known by its tags
    assert annotate.completion_excerpt(tagged) == "He says “I am fine” twice."


def test_pairs_from_two_runs_alternate_sets(tmp_path):
    sets = {
        "a": [example(i) for i in range(4)],
        "b": [Example(f"y{i}", "wiki_power", CONVERSATION[:2], None, ["A"]) for i in range(4)],
    }
    mmlu = [Example("m0", "mmlu", [], None, ["A"], meta={"question": "?", "options": ["x", "y"]})]
    save_jsonl(mmlu, tmp_path / "mmlu.jsonl")
    # no domain: not a social task, never paired
    cfg_sets = [ev.EvalSet("mmlu", str(tmp_path / "mmlu.jsonl"))]
    for name, examples in sets.items():
        save_jsonl(examples, tmp_path / f"{name}.jsonl")
        cfg_sets.append(
            ev.EvalSet(name, str(tmp_path / f"{name}.jsonl"), "in" if name == "a" else "out")
        )
    for model, answer in (("CLUE", "anger"), ("Base", "A")):
        out = tmp_path / model
        save_resolved_config(
            ev.EvalConfig(str(out), cfg_sets, name=model, endpoint=ev.JudgeConfig()), out
        )
        (out / "eval.json").write_text(json.dumps({"name": model}))
        with open(out / "completions.jsonl", "w") as f:
            for name, examples in (sets | {"mmlu": mmlu}).items():
                # the fourth is not answered by both
                for e in examples[: 4 if model == "CLUE" else 3]:
                    for r in range(2):
                        text = f"<think>\nrun {r}\n</think>\nAnswer: {answer}"
                        f.write(
                            json.dumps(
                                {
                                    "set": name,
                                    "id": e.id,
                                    "sample": r,
                                    "completion": text,
                                    "answer": [answer],
                                }
                            )
                            + "\n"
                        )
    pairs = annotate.make_pairs([tmp_path / "CLUE", tmp_path / "Base"], n=5, seed=1)
    assert [p["set"] for p in pairs] == ["a", "b", "a", "b", "a"]
    assert len({p["id"] for p in pairs}) == 5 and all(
        not p["id"].endswith(("x3", "y3")) for p in pairs
    )
    first = pairs[0]
    assert (
        set(first["models"]) == {"CLUE", "Base"} and first["models"]["CLUE"]["excerpt"] == "run 0"
    )
    assert first["models"]["CLUE"]["correct"] == (first["example"]["labels"] == ["anger"])
    assert annotate.make_pairs([tmp_path / "CLUE", tmp_path / "Base"], n=5, seed=1) == pairs


def get_item(server, annotator="ann", index=None):
    params = {"annotator": annotator} | ({} if index is None else {"index": index})
    response = requests.get(server.url + "api/item", params=params, timeout=5)
    return response.status_code, response.text, response.json()


def post(server, **event):
    response = requests.post(server.url + "api/event", json={"annotator": "ann"} | event, timeout=5)
    return response.status_code, response.text, response.json()


def test_annotation_server_saves_every_click_and_continues(serve, tmp_path):
    server = serve()
    answers = tmp_path / "answers.jsonl"
    page = requests.get(server.url, timeout=5)
    assert page.status_code == 200 and "<script>" in page.text and "CLUE" not in page.text
    status, text, view = get_item(server)
    assert status == 200 and view["index"] == 0 and view["excerpts"] is None
    assert view["lines"][3] == "Ken: Fine, I will skip lunch then." and view["target"] == 3
    assert "CLUE" not in text and "Base" not in text and "grounded" not in text
    status, _, err = post(server, item="set/x0", kind="rating", slot=0, grounded=True)
    assert status == 400 and "confirmed" in err["error"]  # excerpts are rated only after the lines
    assert post(server, item="set/x0", kind="lines", lines=[2, 5])[0] == 400
    status, text, view = post(server, item="set/x0", kind="lines", lines=[3, 2])
    assert status == 200 and view["selected"] == [2, 3] and view["excerpts"] is None
    assert len(answers.read_text().splitlines()) == 1  # saved at once
    status, text, view = post(server, item="set/x0", kind="confirm")
    assert view["confirmed"] and [x["slot"] for x in view["excerpts"]] == [0, 1]
    assert "CLUE" not in text and "Base" not in text  # identities stay on the server
    # confirmed lines are locked
    assert post(server, item="set/x0", kind="lines", lines=[1])[0] == 400
    order = server.order("ann", "set/x0")
    post(server, item="set/x0", kind="rating", slot=0, grounded=True)
    status, text, view = post(server, item="set/x0", kind="rating", slot=1, grounded=False)
    assert [x["grounded"] for x in view["excerpts"]] == [True, False] and view["finished"] == 1
    saved = [json.loads(line) for line in answers.read_text().splitlines()]
    assert [e["kind"] for e in saved] == ["lines", "confirm", "rating", "rating"]
    assert [(e["model"], e["grounded"]) for e in saved[2:]] == [(order[0], True), (order[1], False)]
    # A new server on the same file (a reopened page,
    # a restarted process) continues where it stopped.
    again = serve()
    status, _, view = get_item(again)
    assert view["index"] == 1 and view["finished"] == 1
    _, _, first = get_item(again, index=0)
    assert first["selected"] == [2, 3] and [x["grounded"] for x in first["excerpts"]] == [
        True,
        False,
    ]
    assert get_item(again, annotator="other")[2]["index"] == 0  # annotators are kept apart


def test_excerpt_order_is_random_per_item_and_stable(serve):
    server = serve()
    orders = [tuple(server.order(a, f"set/x{i}")) for a in ("ann", "bob") for i in range(6)]
    assert len(set(orders)) == 2  # both orders occur
    assert orders == [
        tuple(serve().order(a, f"set/x{i}")) for a in ("ann", "bob") for i in range(6)
    ]
    status, _, view = post(server, item="set/x1", kind="confirm")
    shown = [x["text"] for x in view["excerpts"]]
    models = pair(1)["models"]
    assert shown == [models[m]["excerpt"] for m in server.order("ann", "set/x1")]


def test_report_by_hand(pairs_file):
    pairs = annotate.load_pairs(pairs_file)
    events = []
    for annotator, lines in (("ann", [2, 3]), ("bob", [3])):
        for p in pairs[:4]:
            events += [
                {"annotator": annotator, "item": p["id"], "kind": "lines", "lines": lines},
                {"annotator": annotator, "item": p["id"], "kind": "confirm"},
                {
                    "annotator": annotator,
                    "item": p["id"],
                    "kind": "rating",
                    "model": "CLUE",
                    "grounded": True,
                },
                {
                    "annotator": annotator,
                    "item": p["id"],
                    "kind": "rating",
                    "model": "Base",
                    "grounded": annotator == "ann",
                },
            ]
    report = annotate.annotation_report(pairs, events)
    # CLUE's quotations match lines 2 and 3: F1 1 against ann's {2, 3}, 2/3 against bob's {3};
    # mean 5/6. Base quotes nothing: F1 0. Items 4-5 have no annotations, so 4 items are paired.
    everything = report["domains"]["all"]
    assert everything["items"] == 6 and everything["items_with_lines"] == 4
    assert everything["alignment_f1"] == {"Base": 0.0, "CLUE": pytest.approx(5 / 6)}
    assert everything["grounded"] == {"Base": 0.5, "CLUE": 1.0}
    # four positive differences, all tied
    assert everything["wilcoxon"]["p"] == pytest.approx(2 / 16)
    # Items x1 and x3 (odd) have CLUE correct, Base wrong: no item has both correct.
    assert everything["grounded_both_correct"] == {"Base": None, "CLUE": None}
    assert report["domains"]["out"]["items_with_lines"] == 1
    assert report["agreement"] == 0.5  # CLUE: 4 agreeing pairs; Base: 4 disagreeing
    assert "| all | 6 (4) | 0.0 | 83.3 |" in annotate.report_markdown(report)


def chromium_paths():
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    return chromium, driver


def test_page_in_headless_chromium(serve, tmp_path):
    webdriver = pytest.importorskip(
        "selenium.webdriver", reason="selenium is not installed (requirements-dev.txt)"
    )
    chromium, driver_path = chromium_paths()
    if not chromium or not driver_path:
        pytest.skip(
            "no chromium / chromedriver (Debian: apt-get install -y chromium chromium-driver)"
        )
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    server = serve()
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        f"--user-data-dir={tmp_path / 'profile'}",
    ):
        options.add_argument(flag)
    browser = webdriver.Chrome(
        options=options, service=webdriver.ChromeService(executable_path=driver_path)
    )
    answers = tmp_path / "answers.jsonl"

    def saved():
        return (
            [json.loads(line) for line in answers.read_text().splitlines()]
            if answers.exists()
            else []
        )

    def wait_for(condition):  # the page re-renders after every saved click
        WebDriverWait(browser, 10, ignored_exceptions=(StaleElementReferenceException,)).until(
            lambda _: condition()
        )

    def click(element_id, then_class):
        browser.find_element(By.ID, element_id).click()
        wait_for(
            lambda: then_class in browser.find_element(By.ID, element_id).get_attribute("class")
        )

    try:
        browser.get(server.url)
        browser.find_element(By.ID, "annotator").send_keys("carol")
        browser.find_element(By.ID, "start").click()
        wait_for(lambda: browser.find_element(By.ID, "title").text.startswith("Item 1 of 6"))
        assert not browser.find_elements(By.CSS_SELECTOR, ".excerpt")
        click("line-2", "selected")
        click("line-3", "selected")
        assert len(saved()) == 2
        browser.find_element(By.ID, "confirm").click()
        wait_for(lambda: len(browser.find_elements(By.CSS_SELECTOR, ".excerpt")) == 2)
        assert "CLUE" not in browser.page_source and "Base" not in browser.page_source
        click("rate-0-yes", "chosen")
        click("rate-1-no", "chosen")
        # the page as the evaluator sees it (pytest --basetemp=DIR keeps DIR/.../page.png)
        screenshot = tmp_path / "page.png"
        assert browser.save_screenshot(str(screenshot))
        assert screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        events = saved()
        assert [e["kind"] for e in events] == ["lines", "lines", "confirm", "rating", "rating"]
        assert events[1]["lines"] == [2, 3] and {e["annotator"] for e in events} == {"carol"}
        order = server.order("carol", "set/x0")
        assert [(e["model"], e["grounded"]) for e in events[3:]] == [
            (order[0], True),
            (order[1], False),
        ]
        # the name is remembered and the page continues at the first unfinished item
        browser.refresh()
        wait_for(
            lambda: browser.find_element(By.ID, "title").text.startswith("Item 2 of 6 (1 finished)")
        )
    finally:
        browser.quit()


def test_command_line_report(pairs_file, tmp_path, capsys):
    answers = tmp_path / "a.jsonl"
    answers.write_text(
        json.dumps(
            {
                "annotator": "ann",
                "item": "set/x0",
                "kind": "rating",
                "model": "CLUE",
                "grounded": True,
            }
        )
        + "\n"
    )
    annotate.main(
        ["annotate-report", str(pairs_file), str(answers), "--json", str(tmp_path / "r.json")]
    )
    assert "| all | 6 (0) |" in capsys.readouterr().out
    assert (
        json.loads((tmp_path / "r.json").read_text())["domains"]["all"]["grounded"]["CLUE"] == 1.0
    )
    with pytest.raises(SystemExit):
        annotate.main(["annotate-report", str(tmp_path / "missing.jsonl"), str(answers)])
    assert Path(annotate.PAGE).is_file()


@pytest.mark.parametrize(
    "argv, expected",
    [
        (
            ["annotate", "{pairs}", "--port", "70000"],
            "--port: a port from 0 to 65535, not 70000",
        ),
        (["pairs", "{tmp}", "{tmp}", "--out", "{tmp}/p.jsonl", "--n", "0"], "--n: at least 1"),
        (["pairs", "{tmp}", "{tmp}", "--out", "{tmp}"], "'--out': {tmp} is a folder"),
        (["annotate", "{pairs}", "--out", "{tmp}"], "'--out': {tmp} is a folder"),
        (["annotate", "{pairs}", "--out", "{pairs}"], "{pairs}:1: not an event of the"),
        (["annotate-report", "{pairs}", "{pairs}"], "{pairs}:1: not an event of the"),
        (["annotate-report", "{pairs}", "{tmp}/absent.jsonl"], "absent.jsonl: no such answers"),
        (["annotate-report", "{pairs}", "{pairs}", "--json", "{tmp}"], "'--json': {tmp} is a"),
        (["pairs", "{run}", "{run}", "--out", "{tmp}/p.jsonl"], "eval.json: not an eval.json"),
    ],
)
def test_bad_input_is_one_line_and_writes_nothing(pairs_file, tmp_path, capsys, argv, expected):
    """Each ends in one line (argparse's usage line aside) and exit status 2; foreign answers files
    are refused before the page is served."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "eval.json").write_text('{"sets": {}}')
    save_resolved_config(ev.EvalConfig(str(run), [], endpoint=ev.JudgeConfig()), run)
    before = sorted(p.name for p in tmp_path.iterdir())
    fill = dict(pairs=pairs_file, tmp=tmp_path, run=run)
    with pytest.raises(SystemExit) as stop:
        annotate.main([a.format(**fill) for a in argv])
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert stop.value.code == 2 and expected.format(**fill) in error, error
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def raw_post(server, body: bytes, headers: dict, timeout=5.0) -> int | None:
    """One POST /api/event over a raw socket with exactly these headers; the response status (None
    when the server answers nothing within the timeout or drops the connection)."""
    import socket

    host, port = server.server_address[:2]
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    with socket.create_connection((host, port), timeout=timeout) as s:
        try:
            s.sendall(
                f"POST /api/event HTTP/1.1\r\nHost: {host}:{port}\r\n{head}\r\n".encode() + body
            )
            reply = s.recv(65536)
        except OSError:  # a timeout, a reset
            return None
    return int(reply.split()[1]) if reply.startswith(b"HTTP/") else None


def test_event_endpoint_refuses_forged_and_broken_requests(serve, tmp_path):
    server = serve()
    answers = tmp_path / "answers.jsonl"
    good = json.dumps(
        {"annotator": "ann", "item": "set/x0", "kind": "lines", "lines": [2]}
    ).encode()
    as_json = {"Content-Type": "application/json"}

    def sized(body, **extra):
        return {"Content-Length": str(len(body))} | as_json | extra

    big = good + b" " * (3 << 20)  # starts with a valid event
    cases = [
        (b"[" * 100_000, sized(b"[" * 100_000)),
        (json.dumps({"annotator": "ann", "item": ["set/x0"], "kind": "confirm"}).encode(), None),
        (json.dumps({"annotator": "ann", "item": {"a": 1}, "kind": "confirm"}).encode(), None),
        (
            json.dumps(
                {"annotator": "ann", "item": "set/x0", "kind": ["lines"], "lines": [1]}
            ).encode(),
            None,
        ),
        (
            json.dumps(
                {"annotator": "ann", "item": "set/x0", "kind": "lines", "lines": [[1], {"a": 1}]}
            ).encode(),
            None,
        ),
        (
            json.dumps(
                {"annotator": "\ud800", "item": "set/x0", "kind": "lines", "lines": [1]}
            ).encode(),
            None,
        ),
        (b"\xff\xfe{}", None),
        (good, {"Content-Length": "abc"} | as_json),
        (good, {"Content-Length": "-1"} | as_json),
        (good, {"Content-Length": "+5"} | as_json),
        (good, as_json),  # no length
        (good, {"Content-Length": str(len(good)), "Transfer-Encoding": "chunked"} | as_json),
        (big, sized(big)),
        (good, sized(good) | {"Content-Type": "text/plain"}),
        (good, {"Content-Length": str(len(good))}),  # no content type
        (good, sized(good, Origin="http://evil.example")),
        (good, sized(good, Origin="null")),
        (good, sized(good, Origin=f"http://127.0.0.1:{server.server_address[1] + 1}")),
    ]
    for body, headers in cases:
        status = raw_post(server, body, headers or sized(body))
        assert status is not None and 400 <= status < 500, (body[:40], headers, status)
        assert not answers.exists() or answers.read_text() == "", (body[:40], headers)
    # A forged Host (DNS rebinding: evil.example resolving to the loopback) is refused too.
    import socket

    with socket.create_connection(server.server_address[:2], timeout=5) as s:
        s.sendall(
            b"POST /api/event HTTP/1.1\r\nHost: evil.example:%d\r\nOrigin: http://evil.example:%d\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
            % (server.server_address[1], server.server_address[1], len(good), good)
        )
        assert s.recv(65536).split()[1].startswith(b"4")
    threading.Event().wait(0.3)  # anything a handler still does after answering would show now
    assert not answers.exists() or answers.read_text() == ""
    # The page's own requests still work: same origin, JSON.
    origin = server.url.rstrip("/")
    assert raw_post(server, good, sized(good, Origin=origin)) == 200
    assert (
        raw_post(server, good, sized(good, **{"Content-Type": "application/json; charset=utf-8"}))
        == 200
    )
    assert len(answers.read_text().splitlines()) == 2
    post(server, item="set/x0", kind="confirm")
    for slot in (1.0, True, [0], None):
        rating = json.dumps(
            {"annotator": "ann", "item": "set/x0", "kind": "rating", "slot": slot, "grounded": True}
        )
        assert raw_post(server, rating.encode(), sized(rating.encode())) == 400
    assert len(answers.read_text().splitlines()) == 3
