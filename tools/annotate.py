"""The human evaluation of CLUE section 5.2: paired excerpts of two evaluated models, a small local
annotation page, and the report (evidence alignment F1 per model, the grounding rate, the Wilcoxon
test). Reached through evaluate.py's command line; kept apart so that evaluate.py reads in one
sitting.

    python -m tools.annotate pairs RUN_A RUN_B --out PAIRS.jsonl [--n 50] [--seed 0]
    python -m tools.annotate annotate PAIRS.jsonl [--port 8765] [--host 127.0.0.1] [--out
    ANSWERS.jsonl]
    python -m tools.annotate annotate-report PAIRS.jsonl ANSWERS.jsonl [ANSWERS.jsonl ...] [--json
    FILE]

The page (annotate.html, plain HTML and JavaScript) asks for the annotator's name, then for each
item: first select the conversation lines needed for the judgment and confirm them (they lock), then
rate each model's excerpt grounded or not. Excerpts come only after the lines are confirmed, in an
order drawn per annotator and item, labelled 1 and 2: model names never reach the page; the server
maps a rating back to its model. Every click is appended to the answers JSONL at once (flushed and
synced), and the state is replayed from that file, so a closed tab or a crash loses nothing and
reopening the page continues at the first unfinished item.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import itertools
import json
import os
import random
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse, urlsplit

from config import (
    ConfigError,
    atomic_write_text,
    check_output_file,
    excerpt,
    load_config,
    port_number,
    read_log,
)
from data import DataError, parse_answer, split_blocks, split_completion, task_brief, visible_turns
from dataset import example_from_json, example_to_json
from evaluate import (
    COMPLETIONS,
    EVAL_JSON,
    EvalConfig,
    EvalError,
    alignment_f1,
    load_eval,
    load_set,
    matched_lines,
    mean_sd,
    read_completions,
    wilcoxon,
)
from verifier import EVIDENCE_CLOSE, EVIDENCE_OPEN

PAGE = Path(__file__).with_name("annotate.html")
EXCERPT_CHARS = 600
# an event is a few hundred bytes; a longer body is refused (413), never parsed in part
MAX_EVENT_BYTES = 1 << 16
DISCARD_BYTES = 1 << 26  # a refused body up to this size is read and dropped before the answer

# ----------------------------------------------------------------------------- pairs


def completion_excerpt(completion: str) -> str:
    """The fixed excerpt rule, the same for every model: the last block of the reasoning (where it
    usually concludes), cut to its last EXCERPT_CHARS characters (from a word start) when longer,
    with evidence tags shown as plain quotation marks, so that no model is known by its quoting
    style."""
    blocks = split_blocks(split_completion(completion)[0])
    text = (blocks[-1] if blocks else "").replace(EVIDENCE_OPEN, "“").replace(EVIDENCE_CLOSE, "”")
    if len(text) > EXCERPT_CHARS:
        text = text[-EXCERPT_CHARS:]
        space = text.find(" ")
        text = "… " + (text[space + 1 :] if 0 <= space < 60 else text)
    return text


def make_pairs(run_dirs: list, n: int, seed: int = 0) -> list[dict]:
    """`n` items that both evaluation runs answered, from the sets with a domain (the social tasks),
    taken from each set in turn (random within a set, seeded) and independently of correctness; each
    with both models' first sampled completion."""
    runs = []
    for d in map(Path, run_dirs):
        cfg = load_config(d / "config.yaml", [], EvalConfig)
        name = load_eval(d / EVAL_JSON)["name"] if (d / EVAL_JSON).exists() else d.name
        runs.append(
            (
                name,
                cfg,
                {
                    (r["set"], r["id"]): r
                    for r in read_completions(d / COMPLETIONS)
                    if r["sample"] == 0
                },
            )
        )
    if len({name for name, _, _ in runs}) != 2:
        names = [name for name, _, _ in runs]
        raise EvalError(
            f"pairs: two runs of differently named models expected, got {excerpt(names)}"
        )
    rng = random.Random(seed)
    by_set = []
    for s in (s for s in runs[0][1].sets if s.domain is not None):
        shared = [
            e for e in load_set(s) if all((s.name, e.id) in records for _, _, records in runs)
        ]
        by_set.append([(s, e) for e in rng.sample(shared, len(shared))])
    chosen = [
        item for item in itertools.chain(*itertools.zip_longest(*by_set)) if item is not None
    ][:n]
    pairs = []
    for s, example in chosen:
        models = {}
        for name, _, records in runs:
            record = records[(s.name, example.id)]
            text = record["completion"]
            answer = parse_answer(text, example)
            models[name] = {
                "completion": text,
                "answer": answer,
                "excerpt": completion_excerpt(text),
                "correct": answer is not None and set(answer) == set(example.labels),
            }
        pairs.append(
            {
                "id": f"{s.name}/{example.id}",
                "set": s.name,
                "domain": s.domain,
                "example": example_to_json(example),
                "models": models,
            }
        )
    return pairs


def load_pairs(path) -> list[dict]:
    if not Path(path).is_file():
        raise EvalError(f"{path}: file not found")
    pairs = read_log(Path(path), EvalError)
    if not pairs:
        raise EvalError(f"{path}: no pairs")
    for number, pair in enumerate(pairs, 1):
        if (
            not isinstance(pair, dict)
            or not {"id", "example", "models"} <= set(pair)
            or len(pair["models"]) != 2
        ):
            raise EvalError(f"{path}:{number}: expected {{id, example, models: two models}}")
        try:
            pair["example"] = example_from_json(pair["example"])
        except DataError as e:
            raise EvalError(f"{path}:{number}: field 'example': {e}") from None
    if len({p["id"] for p in pairs}) != len(pairs):
        raise EvalError(f"{path}: item ids repeat")
    return pairs


# ----------------------------------------------------------------------------- annotations


_EVENT_FIELDS = {
    "lines": {"lines": list},
    "confirm": {},
    "rating": {"model": str, "grounded": bool},
}


def read_answers(path) -> list[dict]:
    """The events of an answers file (read_log); EvalError naming the line of a record that is not
    one the annotation server writes."""
    events = read_log(Path(path), EvalError)
    for number, e in enumerate(events, 1):
        fields = _EVENT_FIELDS.get(e.get("kind")) if isinstance(e, dict) else None
        if not (
            fields is not None
            and isinstance(e.get("annotator"), str)
            and isinstance(e.get("item"), str)
            and all(type(e.get(key)) is kind for key, kind in fields.items())
        ):
            raise EvalError(f"{path}:{number}: not an event of the annotation page")
    return events


def replay(events: list[dict], annotator: str | None = None) -> dict:
    """{(annotator, item): {"lines": [...], "confirmed": bool, "ratings": {model: bool}}} from the
    answers file's events, the last click winning."""
    state: dict = {}
    for event in events:
        if annotator is not None and event["annotator"] != annotator:
            continue
        item = state.setdefault(
            (event["annotator"], event["item"]), {"lines": [], "confirmed": False, "ratings": {}}
        )
        if event["kind"] == "lines":
            item["lines"] = event["lines"]
        elif event["kind"] == "confirm":
            item["confirmed"] = True
        elif event["kind"] == "rating":
            item["ratings"][event["model"]] = event["grounded"]
    return state


class AnnotationServer(ThreadingHTTPServer):
    """The annotation page and its small JSON API, on the standard library's HTTP server (loopback
    by default): GET / (the page), GET /api/item?annotator=A[&index=k], POST /api/event."""

    daemon_threads = True

    def __init__(
        self,
        pairs: list[dict],
        answers: Path,
        host: str = "127.0.0.1",
        port: int = 0,
        seed: int = 0,
    ):
        self.pairs, self.answers, self.seed = pairs, Path(answers), seed
        self.index = {p["id"]: i for i, p in enumerate(pairs)}
        read_answers(self.answers)  # a file the page did not write stops here, before serving
        self.lock = threading.Lock()
        self.host_name = host
        super().__init__((host, port), _Handler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}/"

    def names_me(self, host: str | None) -> bool:
        """Whether a request's Host header names this server: its port, and an IP address, localhost
        or the name it was started with. Any other name is DNS rebinding (a site's own name pointed
        at this machine, which would make that site's requests look same-origin)."""
        try:
            url = urlsplit(f"//{host}")
            if host is None or url.hostname is None or (url.port or 80) != self.server_address[1]:
                return False
        except ValueError:  # a port that is not a number
            return False
        if url.hostname in ("localhost", self.host_name.lower()):
            return True
        try:
            return ipaddress.ip_address(url.hostname) is not None
        except ValueError:
            return False

    def order(self, annotator: str, item: str) -> list[str]:
        """The models in display order for this annotator and item: random, and the same on every
        reload."""
        models = sorted(self.pairs[self.index[item]]["models"])
        return random.Random(f"{self.seed}|{annotator}|{item}").sample(models, 2)

    def item_view(self, annotator: str, index: int | None) -> dict:
        """What the page may see of an item: the lines and the annotator's clicks so far, the
        excerpts (by slot, never by model) only once the lines are confirmed."""
        with self.lock:
            state = replay(read_answers(self.answers), annotator)
        blank = {"lines": [], "confirmed": False, "ratings": {}}
        done = [len(state.get((annotator, p["id"]), blank)["ratings"]) == 2 for p in self.pairs]
        if index is None:
            index = done.index(False) if False in done else len(self.pairs) - 1
        pair = self.pairs[index]
        example, mine = pair["example"], state.get((annotator, pair["id"]), blank)
        view = {
            "index": index,
            "count": len(self.pairs),
            "finished": sum(done),
            "id": pair["id"],
            "task": task_brief(example),
            "target": example.target,
            "lines": [
                f"{t.speaker}: {t.text}" if t.speaker else t.text for t in visible_turns(example)
            ],
            "selected": mine["lines"],
            "confirmed": mine["confirmed"],
            "excerpts": None,
        }
        if mine["confirmed"]:
            models = pair["models"]
            view["excerpts"] = [
                {
                    "slot": slot,
                    "text": models[m]["excerpt"],
                    "answer": models[m]["answer"],
                    "grounded": mine["ratings"].get(m),
                }
                for slot, m in enumerate(self.order(annotator, pair["id"]))
            ]
        return view

    def record(self, event: dict) -> dict:
        """Check one click, append it to the answers file (flushed and synced), return the item's
        new view."""
        annotator, item, kind = event.get("annotator"), event.get("item"), event.get("kind")
        if (
            not isinstance(annotator, str)
            or not 0 < len(annotator.strip()) <= 64
            or not annotator.isprintable()
            or not isinstance(item, str)
            or item not in self.index
        ):
            raise ValueError(
                "an event needs an annotator name (1-64 printable characters) and a known item"
            )
        pair = self.pairs[self.index[item]]
        with self.lock:
            mine = replay(read_answers(self.answers), annotator).get(
                (annotator, item), {"confirmed": False}
            )
            record = {
                "time": datetime.datetime.now().isoformat(timespec="seconds"),
                "annotator": annotator,
                "item": item,
                "kind": kind,
            }
            n_lines = len(visible_turns(pair["example"]))
            if kind in ("lines", "confirm") and mine["confirmed"]:
                raise ValueError("the lines of this item are confirmed and locked")
            if kind == "lines":
                lines = event.get("lines")
                if (
                    not isinstance(lines, list)
                    or not all(type(i) is int and 0 <= i < n_lines for i in lines)
                    or len(set(lines)) != len(lines)
                ):
                    raise ValueError(f"'lines' must be distinct line numbers in 0..{n_lines - 1}")
                record["lines"] = sorted(lines)
            elif kind == "rating":
                slot, grounded = event.get("slot"), event.get("grounded")
                if (
                    not mine["confirmed"]
                    or type(slot) is not int
                    or slot not in (0, 1)
                    or type(grounded) is not bool
                ):
                    raise ValueError(
                        "a rating needs confirmed lines, a slot 0 or 1 and grounded true or false"
                    )
                record |= {"model": self.order(annotator, item)[slot], "grounded": grounded}
            elif not isinstance(kind, str) or kind != "confirm":
                raise ValueError("'kind' must be lines, confirm or rating")
            with open(self.answers, "a", encoding="utf-8") as f:
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
                f.flush()
                os.fsync(f.fileno())
        return self.item_view(annotator, self.index[item])


class _Handler(BaseHTTPRequestHandler):
    server: AnnotationServer
    timeout = 30  # seconds a client may stall mid-request before its connection is closed

    def log_message(self, format, *args) -> None:
        pass

    def _send(self, status: int, body: bytes, kind: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", f"{kind}; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def _json(self, status: int, payload: dict) -> None:
        self._send(status, json.dumps(payload, ensure_ascii=False).encode("utf-8"))

    def do_GET(self) -> None:
        url = urlparse(self.path)
        if not self.server.names_me(self.headers.get("Host")):
            return self._json(403, {"error": "the Host header does not name this server"})
        if url.path == "/":
            return self._send(200, PAGE.read_bytes(), "text/html")
        if url.path != "/api/item":
            return self._json(404, {"error": f"no route for GET {url.path}"})
        query = parse_qs(url.query)
        annotator, index = query.get("annotator", [""])[0], query.get("index", [None])[0]
        bad_index = index is not None and not (
            index.isdigit() and int(index) < len(self.server.pairs)
        )
        if not annotator.strip() or bad_index:
            return self._json(
                400, {"error": "annotator (a name) and an optional item index are expected"}
            )
        self._json(200, self.server.item_view(annotator, None if index is None else int(index)))

    def _refusal(self) -> tuple[int, str] | None:
        """Why a POST is refused before its body is read, or None. Only the page's own requests
        pass: the Host is this server, an Origin (every browser sends one on a POST) is that same
        host, the body is JSON (a cross-site page can send text/plain without asking, never
        application/json) of a declared length up to MAX_EVENT_BYTES."""
        host, origin, lengths = (
            self.headers.get("Host"),
            self.headers.get("Origin"),
            self.headers.get_all("Content-Length", []),
        )
        if urlparse(self.path).path != "/api/event":
            return 404, f"no route for POST {urlparse(self.path).path}"
        if not self.server.names_me(host) or (
            origin is not None and origin.lower() != f"http://{host}".lower()
        ):
            return 403, "only the annotation page itself may post events (same origin)"
        if "Transfer-Encoding" in self.headers or len(lengths) > 1:
            return 400, "the body needs one Content-Length and no Transfer-Encoding"
        if not lengths:
            return 411, "the body needs a Content-Length"
        if not (lengths[0].isascii() and lengths[0].isdigit()):
            return 400, f"Content-Length must be a number of bytes, got {excerpt(lengths[0])}"
        if int(lengths[0]) > MAX_EVENT_BYTES:
            return (
                413,
                f"an event is at most {MAX_EVENT_BYTES} bytes, this body has {int(lengths[0])}",
            )
        if self.headers.get_content_type() != "application/json":
            return 415, "events are sent as application/json"
        return None

    def do_POST(self) -> None:
        refusal = self._refusal()
        length = self.headers.get("Content-Length", "")
        length = int(length) if length.isascii() and length.isdigit() else None
        if refusal is None:
            body = self.rfile.read(length)
            try:
                if len(body) < length:
                    raise ValueError("the body ended before its Content-Length")
                event = json.loads(body.decode("utf-8"))
                return self._json(200, self.server.record(event if isinstance(event, dict) else {}))
            except ValueError as e:  # JSON, UTF-8 and the event's own checks
                refusal = 400, str(e)
            except RecursionError:
                refusal = 400, "the body nests too deeply to be an event"
        else:
            self.close_connection = True
            if (
                length is not None
                and length <= DISCARD_BYTES
                and "Transfer-Encoding" not in self.headers
            ):
                # so that the client,
                while length > 0 and (chunk := self.rfile.read(min(length, 1 << 16))):
                    # still sending, reads the answer instead of a reset connection
                    length -= len(chunk)
        self._json(refusal[0], {"error": refusal[1]})


# ----------------------------------------------------------------------------- report


def annotation_report(pairs: list[dict], events: list[dict]) -> dict:
    """Per model and domain (all, in, out): the share of rated excerpts judged grounded (also among
    items both models answered correctly), evidence alignment F1 per item (the lines the full
    reasoning's quotations match against each annotator's confirmed lines, averaged over the
    annotators who selected at least one line), its mean, and the Wilcoxon test on the paired
    per-item scores; plus the annotators' agreement on grounded ratings of the same excerpt."""
    state = replay(events)
    models = sorted(pairs[0]["models"])
    report = {"models": models, "domains": {}}
    for domain in ("all", "in", "out"):
        chosen = [p for p in pairs if domain == "all" or p.get("domain") == domain]
        if not chosen:
            continue
        scores = {m: [] for m in models}
        grounded = {m: [] for m in models}
        grounded_both_correct = {m: [] for m in models}
        for pair in chosen:
            mine = [s for (a, item), s in state.items() if item == pair["id"]]
            both = all(pair["models"][m]["correct"] for m in models)
            for m in models:
                matched = matched_lines(pair["models"][m]["completion"], pair["example"])
                f1s = [
                    alignment_f1(matched, set(s["lines"]))
                    for s in mine
                    if s["confirmed"] and s["lines"]
                ]
                scores[m].append(sum(f1s) / len(f1s) if f1s else None)
                ratings = [s["ratings"][m] for s in mine if m in s["ratings"]]
                grounded[m] += ratings
                grounded_both_correct[m] += ratings if both else []
        paired = [
            (a, b)
            for a, b in zip(scores[models[0]], scores[models[1]])
            if a is not None and b is not None
        ]
        report["domains"][domain] = {
            "items": len(chosen),
            "items_with_lines": len(paired),
            "alignment_f1": {
                m: mean_sd([s for s in scores[m] if s is not None] or [None])["mean"]
                for m in models
            },
            "grounded": {
                m: sum(grounded[m]) / len(grounded[m]) if grounded[m] else None for m in models
            },
            "grounded_both_correct": {
                m: sum(g) / len(g) if (g := grounded_both_correct[m]) else None for m in models
            },
            "wilcoxon": wilcoxon([a for a, _ in paired], [b for _, b in paired])
            if paired
            else None,
        }
    agree = []
    for pair in pairs:
        for m in models:
            ratings = [
                s["ratings"][m]
                for (_, item), s in state.items()
                if item == pair["id"] and m in s["ratings"]
            ]
            agree += [a == b for a, b in itertools.combinations(ratings, 2)]
    report["agreement"] = sum(agree) / len(agree) if agree else None
    return report


def _pct(value) -> str:
    return "–" if value is None else f"{100 * value:.1f}"


def report_markdown(report: dict) -> str:
    a, b = report["models"]
    lines = [
        f"| Domain | Items (with lines) | Alignment F1 {a} | Alignment F1 {b} | Wilcoxon p | "
        f"Grounded % {a} | Grounded % {b} | Grounded % both correct ({a} / {b}) |",
        "|---" * 8 + "|",
    ]
    for domain, r in report["domains"].items():
        p = (
            "–"
            if r["wilcoxon"] is None
            else f"{r['wilcoxon']['p']:.3g} ({r['wilcoxon']['method']})"
        )
        lines.append(
            f"| {domain} | {r['items']} ({r['items_with_lines']}) | {_pct(r['alignment_f1'][a])} "
            f"| {_pct(r['alignment_f1'][b])} | {p} | {_pct(r['grounded'][a])} | "
            f"{_pct(r['grounded'][b])} | {_pct(r['grounded_both_correct'][a])} / "
            f"{_pct(r['grounded_both_correct'][b])} |"
        )
    return (
        "\n".join(lines)
        + f"\n\nAgreement on grounded ratings of shared excerpts: {_pct(report['agreement'])}%\n"
    )


# ----------------------------------------------------------------------------- command line


def main(argv: list[str]) -> None:
    """`python -m tools.annotate pairs | annotate | annotate-report ...`: the human evaluation's
    three steps."""
    parser = argparse.ArgumentParser(
        prog="python -m tools.annotate", description="The human evaluation (paper 5.2)."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    pairs = commands.add_parser("pairs", help="draw paired items from two evaluation runs")
    pairs.add_argument("runs", nargs=2, help="two evaluation output folders")
    pairs.add_argument("--out", required=True, help="PAIRS.jsonl to write")
    pairs.add_argument("--n", type=int, default=50, help="items (default 50, as in the paper)")
    pairs.add_argument("--seed", type=int, default=0)
    serve = commands.add_parser("annotate", help="serve the annotation page")
    serve.add_argument("pairs", help="PAIRS.jsonl from `tools/annotate.py pairs`")
    serve.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default: loopback only)"
    )
    serve.add_argument("--port", type=port_number, default=8765)
    serve.add_argument(
        "--out", help="answers JSONL (default: PAIRS.answers.jsonl beside the pairs)"
    )
    serve.add_argument("--seed", type=int, default=0, help="seed of the excerpt order")
    report = commands.add_parser(
        "annotate-report", help="alignment F1, grounding and the Wilcoxon test"
    )
    report.add_argument("pairs")
    report.add_argument(
        "answers", nargs="+", help="answers JSONL files (one per annotator, or shared)"
    )
    report.add_argument("--json", help="also write the report as JSON")
    args = parser.parse_args(argv)
    try:
        if args.command == "pairs":
            if args.n < 1:
                parser.error(f"--n: at least 1 item, not {args.n}")
            check_output_file(args.out, "--out")
            items = make_pairs(args.runs, args.n, args.seed)
            atomic_write_text(
                args.out, "".join(json.dumps(p, ensure_ascii=False) + "\n" for p in items)
            )
            print(f"wrote {len(items)} pairs to {args.out}")
        elif args.command == "annotate":
            answers = Path(args.out or Path(args.pairs).with_suffix(".answers.jsonl"))
            check_output_file(answers, "--out")
            with AnnotationServer(
                load_pairs(args.pairs), answers, args.host, args.port, args.seed
            ) as server:
                print(
                    f"annotation page at {server.url} (answers: {answers}); Ctrl-C to stop",
                    flush=True,
                )
                try:
                    server.serve_forever()
                except KeyboardInterrupt:
                    pass
        else:
            if args.json:
                check_output_file(args.json, "--json")
            if missing := [path for path in args.answers if not Path(path).is_file()]:
                raise EvalError(f"{missing[0]}: no such answers file")
            events = [e for path in args.answers for e in read_answers(path)]
            result = annotation_report(load_pairs(args.pairs), events)
            print(report_markdown(result))
            if args.json:
                atomic_write_text(args.json, json.dumps(result, indent=1) + "\n")
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except (DataError, EvalError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main(sys.argv[1:])
