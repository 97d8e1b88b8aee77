"""The tokenizer of a Qwen or Llama 3 checkpoint and the hand-written chat formats (ChatML for Qwen,
Llama 3's header format): `load_tokenizer(folder)` reads tokenizer.json, tokenizer_config.json (EOS
and pad tokens, the chat template's default system prompt), generation_config.json (Qwen and Llama
declare several EOS ids) and config.json (the family, which decides the format and the thinking
prefix). `QwenTokenizer.chat_ids` is the prompt every trainer and evaluation feeds the model.
Imports no torch and from the project only config's `excerpt` (model.py re-exports
`load_tokenizer`)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from config import atomic_write_text, excerpt


class CheckpointError(ValueError):
    """A config, checkpoint or adapter we cannot use; the message names the file and the field."""


def read_json(path: Path) -> dict:
    """The JSON object in `path`; a missing file, bad JSON or any other value is an error naming
    it."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: file not found")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as e:  # JSON syntax, not UTF-8, nested too deep
        raise CheckpointError(f"{path}: invalid JSON ({str(e) or type(e).__name__})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


THINK_OFF = "<think>\n\n</think>\n\n"


@dataclass(frozen=True)
class ChatFormat:
    """How a family's chat template frames turns: `begin` opens the conversation, `header` (with
    `{role}`) opens a turn, `end_token` (a special token) closes it and `separator` follows it."""

    begin: str
    header: str
    end_token: str
    separator: str


CHATML = ChatFormat("", "<|im_start|>{role}\n", "<|im_end|>", "\n")
LLAMA3 = ChatFormat(
    "<|begin_of_text|>", "<|start_header_id|>{role}<|end_header_id|>\n\n", "<|eot_id|>", ""
)
FORMATS = {"qwen2": CHATML, "qwen3": CHATML, "qwen3_5": CHATML, "llama": LLAMA3}
# Llama 3.1's template opens every system turn with these lines (the date fixed, as its default)
LLAMA31_PREAMBLE = "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n"


def _literal(text: str) -> str:
    """`text` as a single-quoted Jinja string literal."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n") + "'"


def chat_template(family: str, default_system: str | None = None, preamble: str = "") -> str:
    """`QwenTokenizer.chat` as a Jinja chat template, the `chat_template` of the
    tokenizer_config.json files the project writes: a serving engine (vLLM's chat endpoint) or
    transformers' apply_chat_template then renders the prompt string `chat` does, `enable_thinking`
    read from the template's variables. Contents are inserted verbatim (no tools, no stripping of
    earlier reasoning or of whitespace, as Qwen's and Llama's own templates do). qwen2 and llama
    ignore `enable_thinking`, as their own templates do; `chat` refuses it there. `default_system`
    and `preamble` are written as the literals load_tokenizer reads back."""
    fmt = FORMATS[family]
    before, after = fmt.header.split("{role}")
    end = _literal(fmt.end_token + fmt.separator)
    head = f"{{{{- {_literal(fmt.begin)} }}}}" if fmt.begin else ""
    if default_system is not None:
        turn = fmt.header.format(role="system") + preamble + default_system
        head += (
            "{%- if not messages or messages[0]['role'] != 'system' %}"
            f"{{{{- {_literal(turn + fmt.end_token + fmt.separator)} }}}}{{%- endif %}}"
        )
    first = (
        f" + ({_literal(preamble)} if loop.first and message['role'] == 'system' else '')"
        if preamble
        else ""
    )
    think = (
        "{%- if enable_thinking is defined and enable_thinking is false %}{{- "
        "'<think>\\n\\n</think>\\n\\n' }}"
    )
    think = {
        "qwen3": think + "{%- endif %}",
        "qwen3_5": think + "{%- else %}{{- '<think>\\n' }}{%- endif %}",
    }
    return (
        head
        + "{%- for message in messages %}"
        + f"{{{{- {_literal(before)} + message['role'] + {_literal(after)}{first} + "
        + f"message['content'] + {end} }}}}{{%- endfor %}}"
        + "{%- if add_generation_prompt %}"
        + f"{{{{- {_literal(fmt.header.format(role='assistant'))} }}}}"
        + think.get(family, "")
        + "{%- endif %}"
    )


class QwenTokenizer:
    """A `tokenizers.Tokenizer` with the checkpoint's EOS ids and a hand-written chat format
    (FORMATS[family]: ChatML, or Llama 3's headers). `family` decides the thinking prefix of the
    generation prompt: qwen2 and llama have none; qwen3 thinks by default and adds an empty think
    block when enable_thinking=False; qwen3_5 opens `<think>\\n` by default and also adds the empty
    block when disabled. `default_system` is the system prompt the checkpoint's own template inserts
    when the messages have none (Qwen2.5 has one; Llama 3.1 an empty one), `system_preamble` the
    text its template writes before the first system message (Llama 3.1: LLAMA31_PREAMBLE)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        eos_token_ids: list[int],
        pad_token_id: int | None,
        family: str,
        default_system: str | None,
        source: Path | None = None,
        system_preamble: str = "",
    ):
        self.tokenizer, self.eos_token_ids, self.pad_token_id = (
            tokenizer,
            eos_token_ids,
            pad_token_id,
        )
        self.family, self.default_system, self.source = family, default_system, source
        self.system_preamble = system_preamble

    @property
    def thinking_switch(self) -> bool:
        """Whether the chat format takes enable_thinking (Qwen3, Qwen3.5)."""
        return self.family in ("qwen3", "qwen3_5")

    @property
    def end_of_turn(self) -> int:
        """The id of the token that closes a turn (`<|im_end|>`, Llama 3's `<|eot_id|>`): the last
        token of a trained assistant turn."""
        return self.token_id(FORMATS[self.family].end_token)

    def __len__(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, special_tokens: bool = True) -> list[int]:
        """Token ids of `text` (no BOS is ever added). special_tokens=False encodes strings such as
        '<|im_end|>' as plain text: use it for untrusted text that must not inject control
        tokens."""
        self.tokenizer.encode_special_tokens = not special_tokens
        try:
            return self.tokenizer.encode(text, add_special_tokens=False).ids
        finally:
            self.tokenizer.encode_special_tokens = False

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_id(self, token: str) -> int:
        i = self.tokenizer.token_to_id(token)
        if i is None:
            raise KeyError(f"token {excerpt(token)} is not in the vocabulary")
        return i

    def chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        enable_thinking: bool | None = None,
    ) -> str:
        """ChatML: `<|im_start|>{role}\\n{content}<|im_end|>\\n` per message (contents verbatim),
        then, with add_generation_prompt, `<|im_start|>assistant\\n` and the family's think
        prefix. Llama 3: `<|begin_of_text|>`, then per message
        `<|start_header_id|>{role}<|end_header_id|>\\n\\n{content}<|eot_id|>`, and the assistant's
        header; Llama 3.1 always opens with a system turn starting with `system_preamble`."""
        return "".join(self._chat_pieces(messages, add_generation_prompt, enable_thinking))

    def chat_ids(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        enable_thinking: bool | None = None,
    ) -> list[int]:
        """The token ids of `chat(...)`, each message content encoded as plain text: text that
        spells `<|im_end|>` or a tag such as `<evidence>` cannot forge a turn or a control token.
        The prompt every trainer and evaluation feeds the model; a serving engine that tokenizes the
        whole string may read such spellings as special tokens."""
        pieces = self._chat_pieces(messages, add_generation_prompt, enable_thinking)
        return [
            i
            for n, piece in enumerate(pieces)
            for i in self.encode(piece, special_tokens=n % 2 == 0)
        ]

    def _chat_pieces(self, messages, add_generation_prompt, enable_thinking) -> list[str]:
        """Template text and message contents, alternating (contents at the odd indices)."""
        fmt = FORMATS[self.family]
        pieces = [fmt.begin]
        if self.default_system is not None and (not messages or messages[0]["role"] != "system"):
            messages = [{"role": "system", "content": self.default_system}, *messages]
        for i, m in enumerate(messages):
            if m.get("role") not in ("system", "user", "assistant") or not isinstance(
                m.get("content"), str
            ):
                raise ValueError(
                    f"chat: message {i} needs role system/user/assistant and string content, "
                    f"got {excerpt(m)}"
                )
            pieces[-1] += fmt.header.format(role=m["role"])
            if i == 0 and m["role"] == "system":
                pieces[-1] += self.system_preamble
            pieces += [m["content"], fmt.end_token + fmt.separator]
        if add_generation_prompt:
            pieces[-1] += fmt.header.format(role="assistant")
            if not self.thinking_switch and enable_thinking is not None:
                raise ValueError(
                    f"chat: enable_thinking is not available for {self.family} checkpoints"
                )
            if enable_thinking is False:
                pieces[-1] += THINK_OFF
            elif self.family == "qwen3_5":
                pieces[-1] += "<think>\n"
        return pieces

    def save(self, out_dir) -> None:
        """tokenizer.json (with any added tokens), the source's generation_config.json, and its
        tokenizer_config.json with `chat_template` set to `chat_template` of this tokenizer: what
        `chat` renders, so an engine serving the folder renders the prompts the trainers built (the
        source's chat_template.jinja is not copied; it would win). Each file is written whole, then
        renamed into place (atomic_write_text: a failed write names the file)."""
        out = Path(out_dir)
        config = read_json(self.source / "tokenizer_config.json") if self.source is not None else {}
        files = {
            "tokenizer.json": self.tokenizer.to_str(pretty=True),
            "tokenizer_config.json": json.dumps(
                config
                | {
                    "chat_template": chat_template(
                        self.family, self.default_system, self.system_preamble
                    )
                },
                indent=2,
                ensure_ascii=False,
            ),
        }
        if self.source is not None and (self.source / "generation_config.json").is_file():
            files["generation_config.json"] = (self.source / "generation_config.json").read_text(
                encoding="utf-8"
            )
        for name, text in files.items():
            atomic_write_text(out / name, text)


def load_tokenizer(path) -> QwenTokenizer:
    """tokenizer.json + tokenizer_config.json (EOS/pad tokens, chat template) + the EOS ids of
    generation_config.json (Qwen and Llama declare several) + config.json's model_type for the
    family. A llama checkpoint needs Llama 3's header tokens; its template's "Cutting Knowledge
    Date" lines (Llama 3.1 and later) make the system turn always present, opened by
    LLAMA31_PREAMBLE."""
    path = Path(path)
    if not (path / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{path / 'tokenizer.json'}: file not found")
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok_cfg = read_json(path / "tokenizer_config.json")
    gen_cfg = (
        read_json(path / "generation_config.json")
        if (path / "generation_config.json").is_file()
        else {}
    )
    model_cfg = read_json(path / "config.json") if (path / "config.json").is_file() else {}

    def token_of(key):
        value = tok_cfg.get(key)
        value = value.get("content") if isinstance(value, dict) else value
        if value is None:
            return None
        i = tokenizer.token_to_id(value)
        if i is None:
            raise CheckpointError(
                f"{path / 'tokenizer_config.json'}: field '{key}' = {excerpt(value)} "
                f"is not in tokenizer.json"
            )
        return i

    eos = gen_cfg.get("eos_token_id", [])
    eos = [eos] if isinstance(eos, int) else list(eos)
    eos += [i for i in [token_of("eos_token")] if i is not None and i not in eos]
    if not eos:
        raise CheckpointError(
            f"{path}: no EOS token (fields 'eos_token' of tokenizer_config.json, "
            f"'eos_token_id' of generation_config.json)"
        )
    family = {"qwen3_5_text": "qwen3_5"}.get(
        model_cfg.get("model_type"), model_cfg.get("model_type")
    )
    if family == "llama" and tokenizer.token_to_id("<|start_header_id|>") is None:
        raise CheckpointError(
            f"{path / 'tokenizer.json'}: no '<|start_header_id|>' token: only Llama 3's chat "
            f"format is supported"
        )
    if family not in FORMATS:
        family = "qwen3" if tokenizer.token_to_id("<think>") is not None else "qwen2"
    template = tok_cfg.get("chat_template") if isinstance(tok_cfg.get("chat_template"), str) else ""
    if (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text(encoding="utf-8")
    found = re.search(r"'<\|im_start\|>system\\n([^'{}]+?)<\|im_end\|>\\n'", template)
    preamble = (
        LLAMA31_PREAMBLE if family == "llama" and "Cutting Knowledge Date" in template else ""
    )
    default_system = found.group(1) if found else ("" if preamble else None)
    return QwenTokenizer(
        tokenizer, eos, token_of("pad_token"), family, default_system, path, preamble
    )
