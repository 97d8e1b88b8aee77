"""The tokenizer of a Qwen checkpoint and the hand-written ChatML format: `load_tokenizer(folder)`
reads tokenizer.json, tokenizer_config.json (EOS and pad tokens, the chat template's default system
prompt), generation_config.json (Qwen declares several EOS ids) and config.json (the family, which
decides the thinking prefix). `QwenTokenizer.chat_ids` is the prompt every trainer and evaluation
feeds the model. Imports no torch and from the project only config's `excerpt` (model.py re-exports
`load_tokenizer`)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from tokenizers import Tokenizer

from config import excerpt


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


def chatml_template(family: str, default_system: str | None = None) -> str:
    """`QwenTokenizer.chat` as a Jinja chat template, the `chat_template` of the
    tokenizer_config.json files the project writes: a serving engine (vLLM's chat endpoint) or
    transformers' apply_chat_template then renders the prompt string `chat` does, `enable_thinking`
    read from the template's variables. Contents are inserted verbatim (no tools, no stripping of
    earlier reasoning, as Qwen's own templates do). qwen2 ignores `enable_thinking`, as Qwen2.5's
    own template does; `chat` refuses it there. `default_system` is written as the literal
    load_tokenizer reads back."""
    head = ""
    if default_system is not None:
        literal = default_system.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n")
        head = (
            "{%- if not messages or messages[0]['role'] != 'system' %}"
            f"{{{{- '<|im_start|>system\\n{literal}<|im_end|>\\n' }}}}{{%- endif %}}"
        )
    think = (
        "{%- if enable_thinking is defined and enable_thinking is false %}{{- "
        "'<think>\\n\\n</think>\\n\\n' }}"
    )
    think = {
        "qwen2": "",
        "qwen3": think + "{%- endif %}",
        "qwen3_5": think + "{%- else %}{{- '<think>\\n' }}{%- endif %}",
    }
    return (
        head
        + (
            "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + "
            "message['content'] + '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt "
            "%}{{- '<|im_start|>assistant\\n' }}"
        )
        + think[family]
        + "{%- endif %}"
    )


class QwenTokenizer:
    """A `tokenizers.Tokenizer` with the checkpoint's EOS ids and a hand-written ChatML format.
    `family` decides the thinking prefix of the generation prompt: qwen2 has none; qwen3 thinks by
    default and adds an empty think block when enable_thinking=False; qwen3_5 opens `<think>\\n` by
    default and also adds the empty block when disabled. `default_system` is the system prompt the
    checkpoint's own template inserts when the messages have none (Qwen2.5 has one)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        eos_token_ids: list[int],
        pad_token_id: int | None,
        family: str,
        default_system: str | None,
        source: Path | None = None,
    ):
        self.tokenizer, self.eos_token_ids, self.pad_token_id = (
            tokenizer,
            eos_token_ids,
            pad_token_id,
        )
        self.family, self.default_system, self.source = family, default_system, source

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
        prefix."""
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
        pieces = [""]
        if self.default_system is not None and (not messages or messages[0]["role"] != "system"):
            pieces[-1] += f"<|im_start|>system\n{self.default_system}<|im_end|>\n"
        for i, m in enumerate(messages):
            if m.get("role") not in ("system", "user", "assistant") or not isinstance(
                m.get("content"), str
            ):
                raise ValueError(
                    f"chat: message {i} needs role system/user/assistant and string content, "
                    f"got {excerpt(m)}"
                )
            pieces[-1] += f"<|im_start|>{m['role']}\n"
            pieces += [m["content"], "<|im_end|>\n"]
        if add_generation_prompt:
            pieces[-1] += "<|im_start|>assistant\n"
            if self.family == "qwen2" and enable_thinking is not None:
                raise ValueError("chat: enable_thinking is not available for qwen2 checkpoints")
            if enable_thinking is False:
                pieces[-1] += THINK_OFF
            elif self.family == "qwen3_5":
                pieces[-1] += "<think>\n"
        return pieces

    def save(self, out_dir) -> None:
        """tokenizer.json (with any added tokens), the source's generation_config.json, and its
        tokenizer_config.json with `chat_template` set to `chatml_template` of this tokenizer: what
        `chat` renders, so an engine serving the folder renders the prompts the trainers built (the
        source's chat_template.jinja is not copied; it would win). Each file is written whole, then
        renamed into place."""
        out = Path(out_dir)
        self.tokenizer.save(str(out / "tokenizer.json"))
        config = read_json(self.source / "tokenizer_config.json") if self.source is not None else {}
        files = {
            "tokenizer_config.json": json.dumps(
                config | {"chat_template": chatml_template(self.family, self.default_system)},
                indent=2,
                ensure_ascii=False,
            )
        }
        if self.source is not None and (self.source / "generation_config.json").is_file():
            files["generation_config.json"] = (self.source / "generation_config.json").read_text(
                encoding="utf-8"
            )
        for name, text in files.items():
            tmp = out / f"{name}.tmp"
            tmp.write_text(text, encoding="utf-8")
            os.replace(tmp, out / name)


def load_tokenizer(path) -> QwenTokenizer:
    """tokenizer.json + tokenizer_config.json (EOS/pad tokens, chat template) + the EOS ids of
    generation_config.json (Qwen declares several) + config.json's model_type for the family."""
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
    if family not in ("qwen2", "qwen3", "qwen3_5"):
        family = "qwen3" if tokenizer.token_to_id("<think>") is not None else "qwen2"
    template = tok_cfg.get("chat_template") if isinstance(tok_cfg.get("chat_template"), str) else ""
    if (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text(encoding="utf-8")
    found = re.search(r"'<\|im_start\|>system\\n([^'{}]+?)<\|im_end\|>\\n'", template)
    return QwenTokenizer(
        tokenizer, eos, token_of("pad_token"), family, found.group(1) if found else None, path
    )
