"""Configs and run outputs, shared by every script: YAML configs with `key=value` overrides checked
against a dataclass schema (`python X.py config.yaml [key=value ...]`), rank-0 printing, the
metrics.jsonl writer and reader, the logs a rerun resumes from (`read_log`, `open_log`), and the
resolved config written beside a run's outputs with secrets removed."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import reprlib
import sys
import types
import typing
import urllib.parse
from pathlib import Path

import yaml

import sinks

# ----------------------------------------------------------------------------- configs


class ConfigError(ValueError):
    """A bad config: the message is one line naming the file (and line) or override, and the key."""


# of an input value quoted in an error message: a path fits, a 50 MB label does not
EXCERPT_CHARS = 120
# for values other than a string: items, nesting and the strings inside them cut short
_REPR = reprlib.Repr()
_REPR.maxother = _REPR.maxlong = EXCERPT_CHARS
_REPR.maxstring, _REPR.maxlevel = 40, 3
_REPR.maxlist = _REPR.maxtuple = _REPR.maxset = _REPR.maxfrozenset = _REPR.maxdict = 6


def excerpt(value) -> str:
    """An input value as an error message quotes it: its repr, cut to a bounded excerpt with the
    length named, `'aaaa...' (52,428,800 characters)`; a long list or mapping shows its first items
    and names its size. Every error that echoes a value from a file, a config, a request or the
    command line goes through here."""
    if isinstance(value, str):
        if len(value) <= EXCERPT_CHARS:
            return repr(value)
        cut = repr(value[:EXCERPT_CHARS])
        return f"{cut[:-1]}...{cut[-1]} ({len(value):,} characters)"
    shown = _REPR.repr(value)
    cut = isinstance(value, (list, tuple, dict, set, frozenset)) and len(value) > _REPR.maxlist
    return f"{shown} ({len(value):,} items)" if cut else shown


# a config's size with aliases expanded: refuses "billion laughs" documents
MAX_YAML_VALUES = 10_000


class _YamlLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` that also reads `1e-5` as a float (YAML 1.2), where PyYAML alone reads a
    string, and refuses a key repeated in one mapping, which PyYAML alone lets the last one win."""

    def construct_mapping(self, node, deep=False):
        first_line = {}
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode):
                line = key_node.start_mark.line + 1
                if key_node.value in first_line:
                    raise yaml.constructor.ConstructorError(
                        None,
                        None,
                        f"duplicate key '{key_node.value}' (first on line "
                        f"{first_line[key_node.value]})",
                        key_node.start_mark,
                    )
                first_line[key_node.value] = line
        return super().construct_mapping(node, deep)


_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:\d+\.?\d*|\.\d+)[eE][-+]?\d+$"),
    list("-+0123456789."),
)


def _expanded_size(node, memo: dict) -> int:
    """Values in a composed document once its aliases are expanded (capped at MAX_YAML_VALUES + 1;
    a node that contains itself counts as too many)."""
    if id(node) not in memo:
        memo[id(node)] = MAX_YAML_VALUES + 1
        children = (
            node.value
            if isinstance(node, yaml.SequenceNode)
            else [n for pair in node.value for n in pair]
            if isinstance(node, yaml.MappingNode)
            else []
        )
        memo[id(node)] = min(
            MAX_YAML_VALUES + 1, 1 + sum(_expanded_size(child, memo) for child in children)
        )
    return memo[id(node)]


def _load_yaml(text: str):
    """(value, composed node) of one YAML document. Raises yaml.YAMLError for bad YAML, a repeated
    key, or aliases that expand the document past MAX_YAML_VALUES values."""
    loader = _YamlLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None, None
        if _expanded_size(node, {}) > MAX_YAML_VALUES:
            raise yaml.YAMLError(f"aliases expand the document past {MAX_YAML_VALUES} values")
        return loader.construct_document(node), node
    finally:
        loader.dispose()


def _key_lines(node, prefix: str = "", lines: dict | None = None) -> dict[str, int]:
    """Map each dotted key of a composed YAML mapping to its 1-based line in the file."""
    lines = {} if lines is None else lines
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            key = f"{prefix}{key_node.value}"
            lines[key] = key_node.start_mark.line + 1
            _key_lines(value_node, key + ".", lines)
    return lines


def _type_name(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value, tp, key: str, where):
    """Check `value` against the annotation `tp`; return it (ints widen to float, lists to
    tuples)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is typing.Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        for option in options:
            try:
                return _coerce(value, option, key, where)
            except ConfigError:
                if dataclasses.is_dataclass(option) and isinstance(value, dict):
                    raise  # the section's own problem, not a mismatch of types
                continue
        raise ConfigError(f"{where(key)}: '{key}' expects {_type_name(tp)}, got {excerpt(value)}")
    if origin is typing.Literal:
        if value in args:
            return value
        raise ConfigError(
            f"{where(key)}: '{key}' must be one of {list(args)}, got {excerpt(value)}"
        )
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(
                f"{where(key)}: '{key}' expects a mapping of {tp.__name__} fields, got "
                f"{excerpt(value)}"
            )
        return _build(tp, value, key + ".", where)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where(key)}: '{key}' expects a list, got {excerpt(value)}")
        item_tp = args[0] if args else typing.Any
        items = [_coerce(v, item_tp, f"{key}[{i}]", where) for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where(key)}: '{key}' expects a mapping, got {excerpt(value)}")
        value_tp = args[1] if args else typing.Any
        return {k: _coerce(v, value_tp, f"{key}.{k}", where) for k, v in value.items()}
    if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            number = float(value)
        except OverflowError:  # an integer past the float range
            number = math.inf
        if not math.isfinite(number):
            raise ConfigError(
                f"{where(key)}: '{key}' expects a finite number, got {excerpt(value)}"
            )
        return number
    if tp in (bool, int, float, str):
        if isinstance(value, tp) and not (tp is int and isinstance(value, bool)):
            return value
        raise ConfigError(
            f"{where(key)}: '{key}' expects {tp.__name__}, got {type(value).__name__} "
            f"{excerpt(value)}"
        )
    raise TypeError(f"config schema: unsupported annotation {tp!r} for '{key}'")


@dataclasses.dataclass(frozen=True)
class Bounds:
    """The range a numeric setting must lie in: at least `ge` (or above `gt`), at most `le`."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None

    def __str__(self) -> str:
        parts = [f">= {self.ge}" if self.ge is not None else None]
        parts += [f"> {self.gt}" if self.gt is not None else None]
        parts += [f"<= {self.le}" if self.le is not None else None]
        return " and ".join(p for p in parts if p)

    def holds(self, value) -> bool:
        return not (
            (self.ge is not None and value < self.ge)
            or (self.gt is not None and value <= self.gt)
            or (self.le is not None and value > self.le)
        )


def bounded(default, *, ge=None, gt=None, le=None):
    """A dataclass field with a default and a range `load_config` checks (None always passes)."""
    return dataclasses.field(default=default, metadata={"bounds": Bounds(ge, gt, le)})


def _build(schema, raw: dict, prefix: str, where):
    hints = typing.get_type_hints(schema)
    fields = {f.name: f for f in dataclasses.fields(schema) if f.init}
    for name in raw:
        if name not in fields:
            known = ", ".join(sorted(fields))
            raise ConfigError(
                f"{where(prefix + str(name))}: unknown key '{prefix}{name}' (known keys: {known})"
            )
    kwargs = {}
    for name, field in fields.items():
        if name in raw:
            kwargs[name] = _coerce(raw[name], hints[name], prefix + name, where)
            bounds = field.metadata.get("bounds")
            if bounds and kwargs[name] is not None and not bounds.holds(kwargs[name]):
                raise ConfigError(
                    f"{where(prefix + name)}: '{prefix}{name}' must be {bounds}, got "
                    f"{excerpt(kwargs[name])}"
                )
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{where(prefix + name)}: missing required key '{prefix}{name}'")
    try:
        return schema(**kwargs)
    # a check across keys in the schema's __post_init__, worded "<key>: <problem>"
    except ConfigError as e:
        key, _, problem = str(e).partition(": ")
        raise ConfigError(f"{where(prefix + key)}: '{prefix}{key}': {problem}") from None


def override_key(key: str) -> str:
    """An override's dotted key as the config's errors name it: a number is a list index
    (`sets.0.path` -> `sets[0].path`)."""
    return re.sub(r"\.(\d+)(?=\.|$)", r"[\1]", key)


def _apply_override(raw: dict, override: str) -> None:
    """Set `key=value` in `raw`: a dotted key reaches into sections, a number into a list's item
    (`sets.0.path=...`), which must exist."""
    key, sep, text = override.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override '{override}': expected key=value, e.g. optim.lr=1e-5")
    parts = key.split(".")
    node, at = raw, ""
    for depth, part in enumerate(parts):
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise ConfigError(
                    f"override '{override}': '{at}' is a list of {len(node)} item(s): give an "
                    f"index from 0 to {len(node) - 1}, or the whole list ({at}=[...])"
                )
            index = int(part)
        elif isinstance(node, dict):
            index = part
        else:
            raise ConfigError(f"override '{override}': '{at}' is not a section")
        at = override_key(f"{at}.{part}" if at else part)
        if depth == len(parts) - 1:
            break
        if isinstance(node, dict) and part not in node:
            node[part] = {}
        node = node[index]
    try:
        node[index] = _load_yaml(text)[0]
    except (yaml.YAMLError, RecursionError) as e:
        raise ConfigError(f"override '{override}': not valid YAML: {_yaml_problem(e)}") from None


def _yaml_problem(error: Exception) -> str:
    if isinstance(error, RecursionError):
        return "nested too deeply"
    return " ".join(str(getattr(error, "problem", None) or error).split())


def load_config(path, overrides, schema):
    """Read the YAML file at `path`, apply `a.b.c=value` overrides (values typed by YAML rules),
    and build the dataclass `schema` from it. Unknown, missing or mistyped keys raise a
    `ConfigError` whose one-line message names the file and line, or the override."""
    path = Path(path)
    try:
        raw, node = _load_yaml(read_text(path, ConfigError))
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the config: {e.strerror or e}") from None
    except (yaml.YAMLError, RecursionError) as e:
        mark = getattr(e, "problem_mark", None)
        at = f":{mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}{at}: not valid YAML: {_yaml_problem(e)}") from None
    lines = _key_lines(node)
    raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        raise ConfigError(
            f"{path}: the top level must be a mapping of keys, got {type(raw).__name__}"
        )
    for override in overrides:
        _apply_override(raw, override)
    return _build(schema, raw, "", ConfigSource(str(path), tuple(overrides), lines).where)


@dataclasses.dataclass(frozen=True)
class ConfigSource:
    """A config file and the command line's overrides on it: where a key was set, for an error
    about it found after loading (a reward's settings, a folder a key names). Reads as the file's
    path."""

    path: str
    overrides: tuple[str, ...] = ()
    lines: dict[str, int] | None = None  # the file's key lines (_key_lines); read when needed

    def __str__(self) -> str:
        return self.path

    def where(self, key: str) -> str:
        """The last override that set `key` or a section above it, else the file and the key's
        line (a list item's: its list's)."""
        for override in reversed(self.overrides):
            prefix = override_key(override.partition("=")[0])
            if key == prefix or key.startswith((prefix + ".", prefix + "[")):
                return f"override '{override}'"
        lines = self.lines
        if lines is None:
            try:
                lines = _key_lines(_load_yaml(read_text(self.path, ConfigError))[1])
            except (OSError, ConfigError, yaml.YAMLError, RecursionError):
                lines = {}
        line = lines.get(key.split("[")[0])
        return f"{self.path}:{line}" if line else self.path


def config_error(config_path, key: str, problem: str) -> ConfigError:
    """A problem with `key`, located where it was set: its override, or the config file's line
    (`config_path` a ConfigSource; a plain path names the file)."""
    where = config_path.where(key) if isinstance(config_path, ConfigSource) else config_path
    return ConfigError(f"{where}: '{key}': {problem}")


def parse_cli(schema, argv=None):
    """`script.py config.yaml [key=value ...]` -> the config; a bad config exits with one error
    line. `--help` lists the schema's top-level keys and points to docs/config-reference.md, to
    the section of the script that defines the schema (integrations/trl.py reads grpo.py's)."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        # `python -m folder.script` runs a script of a folder: its section is folder/script.py
        spec = getattr(sys.modules["__main__"], "__spec__", None)
        command = f"python -m {spec.name}" if spec else Path(sys.argv[0]).name
        module = spec.name if spec else Path(sys.argv[0]).stem
        if schema.__module__ != "__main__":
            module = schema.__module__
        section = module.replace(".", "/") + ".py"
        keys = ", ".join(f.name for f in dataclasses.fields(schema) if f.init)
        print(
            f"usage: {command} config.yaml [key=value ...]\ntop-level keys: {keys}\nevery key "
            f"with its type, default and source: docs/config-reference.md#"
            f"{section.replace('.', '').replace('/', '')}",
            file=sys.stdout if argv else sys.stderr,
        )
        raise SystemExit(0 if argv else 2)
    try:
        return load_config(argv[0], argv[1:], schema)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def http_url(url: str) -> str:
    """A server's base URL in one spelling, surrounding spaces and trailing slashes removed (so
    `http://a/v1/` and `http://a/v1` are one server); a ConfigError, worded for a schema's
    __post_init__, unless it is an http:// or https:// URL with a host."""
    text = url.strip().rstrip("/")
    try:
        parts = urllib.parse.urlsplit(text)
        parts.port  # noqa: B018 (raises ValueError for a port that is not a number or out of range)
    except ValueError:
        parts = None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(
            f"base_url: expects an http:// or https:// URL such as http://127.0.0.1:8000/v1, got "
            f"{excerpt(url)}"
        )
    return text


def port_number(text: str) -> int:
    """argparse's type for a --port option: a TCP port, 0 for any free one."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port from 0 to 65535, not {text}")
    return port


# ----------------------------------------------------------------------------- run outputs

# a config's `report_to`: the sinks (sinks.py) a run's metrics go to beside metrics.jsonl
ReportTo = list[typing.Literal[tuple(sinks.PACKAGES)]]


def check_report_to(names, out_dir) -> None:
    """Raise a ConfigError, worded for a schema's __post_init__, when a sink's package is missing
    or its folder in `out_dir` is taken by a file."""
    problem = sinks.missing_package(names) or sinks.taken_folder(names, out_dir)
    if problem:
        raise ConfigError(f"report_to: {problem}")


def is_main_process() -> bool:
    """Rank 0 under torchrun, or a plain single-process run."""
    return int(os.environ.get("RANK", "0")) == 0


def print0(*args, **kwargs) -> None:
    if is_main_process():
        print(*args, **kwargs, flush=True)


def _jsonable(value):
    """Plain JSON values: tensors and numpy scalars become numbers; NaN and infinities become the
    strings "nan", "inf", "-inf" so a diverging run stays visible and the file stays strict JSON."""
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        value = value.tolist()
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _jsonable(dataclasses.asdict(value))
    return value


class MetricsWriter:
    """Appends one JSON object per line to a `.jsonl` file (rank 0 only) and flushes after every
    record, so a crash never loses a step already logged; appending continues a resumed run. With
    `report_to` (sinks.py: tensorboard, wandb), each record's numbers also go to those sinks at its
    `step`, which are given `run_config` with its secrets removed; the steps after the file's last
    one (those a resumed run logs again) are first purged from the sinks that can."""

    def __init__(self, path, report_to=(), run_config=None):
        self.path = Path(path)
        self._file = None
        self._sinks = []
        if is_main_process():
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")
            if report_to:
                resolved = redact_secrets(_jsonable(run_config))
                # a resumed run's log was trimmed to its checkpoint: later steps leave the sinks too
                steps = [
                    r["step"] for r in read_metrics(self.path) if isinstance(r.get("step"), int)
                ]
                self._sinks = sinks.open_sinks(
                    report_to, self.path.parent, resolved, max(steps, default=0) + 1
                )

    def write(self, record: dict) -> None:
        if self._file is not None:
            record = _jsonable(record)
            self._file.write(json.dumps(record, ensure_ascii=False, allow_nan=False) + "\n")
            self._file.flush()
            if self._sinks and isinstance(record.get("step"), int):
                values = _numbers(record)
                del values["step"]
                for sink in self._sinks:
                    sink.log(values, record["step"])

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        for sink in self._sinks:
            sink.close()
        self._sinks = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _numbers(record: dict) -> dict:
    """The numeric values of a metrics record ("nan"/"inf" strings read as floats)."""
    record = {k: float(v) if v in ("nan", "inf", "-inf") else v for k, v in record.items()}
    return {
        k: v for k, v in record.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
    }


def read_metrics(path) -> list[dict]:
    """metrics.jsonl records, numbers only ("nan"/"inf" strings read as floats); torn lines
    skipped."""
    records = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            raw = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(raw.get("step"), (int, float)):
            records.append(_numbers(raw))
    return records


def read_log(path, error: type[Exception] = ValueError) -> list:
    """The records of a JSONL file we append to (a journal, completions.jsonl), or [] when it does
    not exist. A torn last line (a run killed mid-write: not JSON, or cut inside a character) is
    ignored, and the file is left as it is; any other line that is not JSON, or not UTF-8, raises
    `error` naming the file and line. Lines end at "\\n" only: a text may hold U+2028."""
    path = Path(path)
    if not path.exists():
        return []
    lines = re.findall(rb"[^\n]*\n|[^\n]+$", path.read_bytes())
    records = []
    for number, line in enumerate(lines, 1):
        torn = number == len(lines) and not line.endswith(b"\n")
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError:
            if torn:
                break
            raise error(f"{path}:{number}: not UTF-8 text") from None
        try:
            records.append(json.loads(text))
        except json.JSONDecodeError:
            if not torn:
                raise error(f"{path}:{number}: not valid JSON") from None
    return records


class LogFile:
    """A JSONL file opened for appending (open_log): a write that fails (a full disk) names it."""

    def __init__(self, path: Path):
        self.path, self._file = path, open(path, "a", encoding="utf-8")

    def _named(self, call, *args):
        try:
            return call(*args)
        except OSError as e:
            raise OSError(e.errno, e.strerror, str(self.path)) from None

    def write(self, text: str) -> int:
        return self._named(self._file.write, text)

    def flush(self) -> None:
        self._named(self._file.flush)

    def __enter__(self) -> LogFile:
        return self

    def __exit__(self, *exc) -> None:
        self._named(self._file.close)


def open_log(path) -> LogFile:
    """`path` opened for appending records (its folder made). A torn last line, which `read_log`
    ignores, is moved first to `<path>.torn` (appended there) and said so on stderr, so that the
    next record starts a line of its own; a last record missing only its newline gets one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = path.read_bytes() if path.exists() else b""
    if data and not data.endswith(b"\n"):
        cut = data.rfind(b"\n") + 1
        try:
            json.loads(data[cut:])
            with open(path, "ab") as f:
                f.write(b"\n")
        except (json.JSONDecodeError, UnicodeDecodeError):
            torn = path.with_name(path.name + ".torn")
            with open(torn, "ab") as f:
                f.write(data[cut:] + b"\n")
                f.flush()
                os.fsync(f.fileno())
            os.truncate(path, cut)
            print(
                f"{path}: moved a torn last line ({len(data) - cut} bytes) to {torn} before "
                "appending",
                file=sys.stderr,
            )
    return LogFile(path)


_SECRET_KEY = re.compile(r"api[_-]?key|secret|password|auth[_-]?token", re.IGNORECASE)


def redact_secrets(value):
    """Drop every mapping key that names a secret (api_key, secret, password, auth_token); keys
    ending in `_env` only name an environment variable and are kept."""
    if isinstance(value, dict):
        return {
            k: redact_secrets(v)
            for k, v in value.items()
            if not (_SECRET_KEY.search(str(k)) and not str(k).endswith("_env"))
        }
    if isinstance(value, (list, tuple)):
        return [redact_secrets(v) for v in value]
    return value


def read_text(path, error: type[Exception] = ValueError) -> str:
    """The text of a UTF-8 file, a leading BOM dropped. A file that is not UTF-8 raises `error`
    naming the file and the line of the first bad byte; OSError passes through."""
    data = Path(path).read_bytes()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise error(f"{path}:{line}: not UTF-8 text (byte {e.start})") from None


def check_output_file(path, key: str, inputs: dict | None = None) -> None:
    """ConfigError, before any work, when the file setting `key` is a folder, sits in a file, or is
    one of the run's `inputs` ({key: a path or a list of paths}), which it would replace."""
    path = Path(path)
    for input_key, paths in (inputs or {}).items():
        for given in paths if isinstance(paths, (list, tuple)) else [paths]:
            if given is not None and Path(given).resolve() == path.resolve():
                raise ConfigError(
                    f"'{key}': {path} is also '{input_key}': name another file to write"
                )
    if path.is_dir():
        raise ConfigError(f"'{key}': {path} is a folder; name the file to write")
    if any(parent.exists() and not parent.is_dir() for parent in path.parents):
        raise ConfigError(f"'{key}': {path} cannot be written (a file is in its path)")


def atomic_write_text(path, text: str | bytes) -> None:
    """Write `text` (UTF-8; bytes as they are) to a temporary name beside `path`, then rename:
    readers never see a partial file, and a failed write (a full disk, a folder in the way) leaves
    nothing behind."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        tmp.write_bytes(text.encode("utf-8") if isinstance(text, str) else text)
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):  # name the file asked for, not the temporary one
            raise OSError(e.errno, e.strerror, str(path)) from None
        raise


def save_resolved_config(cfg, output_dir) -> Path:
    """Write the config a run actually used to `output_dir/config.yaml`, secrets removed (rank
    0)."""
    path = Path(output_dir) / "config.yaml"
    if is_main_process():
        atomic_write_text(path, resolved_config_text(cfg))
    return path


def resolved_config_text(cfg) -> str:
    """A config as YAML, secrets removed: config.yaml's text, and a model card's."""
    return yaml.safe_dump(redact_secrets(_jsonable(cfg)), sort_keys=False, allow_unicode=True)
