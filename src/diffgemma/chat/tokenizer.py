"""The checkpoint's tokenizer plus its chat format: special ids, stop ids and prompt rendering."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.exceptions
import jinja2.ext
import jinja2.sandbox
from tokenizers import Tokenizer

from diffgemma.chat.template import check_roles, normalize_messages, render_gemma4, strip_thinking

# The turn-closing and tool-response tokens stop a Gemma 4 reply; used when generation_config has no list.
_DEFAULT_STOP_TOKENS = ("<turn|>", "<|tool_response>")
# Every client string gets this private-use mark after each character a control token starts with (`<`), so
# no control token can start in client text, whatever the template joins; the marks go before encoding.
_MARK_BASE = 0xF0000
_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def _byte_alphabet() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2's): which character stands for which byte."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_OF_CHAR = _byte_alphabet()


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from exc


def _compile_template(source: str) -> jinja2.Template:
    """Compile a chat template in the environment transformers uses for chat templates."""

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: Any = None,
        separators: Any = None,
        sort_keys: bool = False,
    ):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"chat template does not compile: {exc}") from exc


class ChatTokenizer:
    """A `tokenizers.Tokenizer` with the ids and chat rendering the engine and server need."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        stop_ids: Iterable[int] | None = None,
        chat_template: str | None = None,
        bos_token: str = "<bos>",
        eos_token: str = "<eos>",
        pad_token: str = "<pad>",
    ) -> None:
        self.tokenizer = tokenizer
        self.bos_token, self.eos_token, self.pad_token = bos_token, eos_token, pad_token
        self._bos_id = self._required_id(bos_token)
        self._eos_id = self._required_id(eos_token)
        self._pad_id = tokenizer.token_to_id(pad_token)
        if stop_ids is None:
            found = (tokenizer.token_to_id(t) for t in _DEFAULT_STOP_TOKENS)
            stop_ids = [self._eos_id, *(i for i in found if i is not None)]
        self._stop_ids = frozenset(int(i) for i in stop_ids)
        added = tokenizer.get_added_tokens_decoder()
        self._special_ids = frozenset(i for i, t in added.items() if t.special)
        # Longest first, so a regex finds what the tokenizer's own added-token matcher (leftmost-longest) finds.
        specials = sorted({t.content for t in added.values() if t.special}, key=len, reverse=True)
        self._special_re = re.compile("|".join(map(re.escape, specials))) if specials else None
        # The characters a control token can be assembled from the start of: what client text must not carry.
        self._control_starts = frozenset(t[0] for t in specials)
        # A twin that reads control-token spellings as text: how client text is tokenized.
        self._text_tokenizer = Tokenizer.from_str(tokenizer.to_str())
        self._text_tokenizer.encode_special_tokens = True
        self._byte_level = '"ByteLevel"' in json.dumps(json.loads(tokenizer.to_str()).get("decoder"))
        self.chat_template = chat_template
        self._template = _compile_template(chat_template) if chat_template is not None else None

    def _required_id(self, token: str) -> int:
        token_id = self.tokenizer.token_to_id(token)
        if token_id is None:
            raise ValueError(f"tokenizer has no {token!r} token")
        return token_id

    @classmethod
    def from_dir(cls, path: str | Path) -> ChatTokenizer:
        """Load tokenizer.json, tokenizer_config.json, generation_config.json and chat_template.jinja."""
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise ValueError(f"no tokenizer.json in {path}")
        try:
            tokenizer = Tokenizer.from_file(str(tok_file))
        except Exception as exc:  # tokenizers raises a bare Exception on bad JSON
            raise ValueError(f"cannot load {tok_file}: {exc}") from exc

        names: dict[str, str] = {}
        if (path / "tokenizer_config.json").is_file():
            config = _read_json(path / "tokenizer_config.json")
            for key in ("bos_token", "eos_token", "pad_token"):
                value = config.get(key)
                if isinstance(value, Mapping):  # the AddedToken dict spelling
                    value = value.get("content")
                if isinstance(value, str):
                    names[key] = value

        stop_ids = None
        if (path / "generation_config.json").is_file():
            eos = _read_json(path / "generation_config.json").get("eos_token_id")
            if eos is not None:
                stop_ids = [eos] if isinstance(eos, int) else list(eos)

        template_file = path / "chat_template.jinja"
        template = template_file.read_text(encoding="utf-8") if template_file.is_file() else None
        return cls(tokenizer, stop_ids=stop_ids, chat_template=template, **names)

    # ids
    @property
    def bos_id(self) -> int:
        return self._bos_id

    @property
    def eos_id(self) -> int:
        return self._eos_id

    @property
    def pad_id(self) -> int | None:
        return self._pad_id

    @property
    def stop_ids(self) -> set[int]:
        """Ids that end a reply (generation_config `eos_token_id`)."""
        return set(self._stop_ids)

    @property
    def special_ids(self) -> set[int]:
        """Ids of every special (control) token; `decode(skip_special=True)` drops these."""
        return set(self._special_ids)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.tokenizer.token_to_id(token)

    # text
    def encode(self, text: str) -> list[int]:
        """Token ids of `text` with control tokens parsed where spelled (the engine's own structure, or an
        operator's raw prompt); no BOS is added (the template writes it). Client text goes through
        `encode_text` or `encode_chat`."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_text(self, text: str) -> list[int]:
        """Token ids of `text` as plain text: a spelled control token (`<turn|>`) is tokenized as its characters."""
        return self._text_tokenizer.encode(text, add_special_tokens=False).ids

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        enable_thinking: bool = False,
    ) -> list[int]:
        """The prompt's token ids, in which only the template's own structure is control tokens: text from the
        messages and tools (content, tool results, names, arguments, schemas) is tokenized as plain text even
        where it spells a control token, whole or in pieces the template joins. The ids equal
        `encode(render(...))` whenever the text spells and forms none."""
        check_roles(messages)
        # The template drops thought channels from earlier model turns; spelled in their text, they go first.
        messages = [_without_thoughts(m) for m in normalize_messages(messages)]
        chars: set[str] = set()
        _scan([messages, tools], chars)
        starts = sorted(chars & self._control_starts)
        if not starts:  # no client text holds a character a control token starts with: none can form
            return self.encode(self._render(messages, tools, add_generation_prompt, enable_thinking))
        mark = _mark(chars)
        table = {ord(c): c + mark for c in starts}
        escaped = _escape([messages, tools], table)
        text = self._render(escaped[0], escaped[1], add_generation_prompt, enable_thinking)
        unmark = {ord(mark): None}
        ids: list[int] = []
        pos = 0
        assert self._special_re is not None
        for m in self._special_re.finditer(text):  # the template's control tokens; text between them is data
            ids += self.encode_text(text[pos : m.start()].translate(unmark))
            ids.append(self.tokenizer.token_to_id(m.group()))
            pos = m.end()
        return ids + self.encode_text(text[pos:].translate(unmark))

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special)

    def token_bytes(self, token_id: int) -> bytes:
        """The UTF-8 bytes one token stands for (a token may hold part of a character): through the byte-level
        alphabet, a `<0xNN>` byte-fallback piece or SentencePiece's `▁` space, else its decoded text."""
        piece = self.tokenizer.id_to_token(token_id)
        if piece is None or token_id in self._special_ids:
            return self.decode([token_id]).encode()
        if _BYTE_PIECE.fullmatch(piece):
            return bytes([int(piece[3:5], 16)])
        if self._byte_level and all(c in _BYTE_OF_CHAR for c in piece):
            return bytes(_BYTE_OF_CHAR[c] for c in piece)
        return piece.replace("\u2581", " ").encode()

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        enable_thinking: bool = False,
    ) -> str:
        """The prompt text: the checkpoint's chat template when it ships one, else our Gemma 4 renderer. For
        display: the model reads `encode_chat`'s ids, which keep control-token spellings in messages as text."""
        check_roles(messages)
        return self._render(normalize_messages(messages), tools, add_generation_prompt, enable_thinking)

    def _render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        add_generation_prompt: bool,
        enable_thinking: bool,
    ) -> str:
        if self._template is None:
            return render_gemma4(
                messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                enable_thinking=enable_thinking,
                bos_token=self.bos_token,
            )
        return self._template.render(
            messages=messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            enable_thinking=enable_thinking,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
        )


def _without_thoughts(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant message with every `<|channel>...<channel|>` span cut from its text, as the template cuts it."""
    content = message.get("content")
    if message.get("role") != "assistant" or content is None:
        return message
    if isinstance(content, str):
        return {**message, "content": strip_thinking(content)}
    if isinstance(content, list):
        parts = [
            {**p, "text": strip_thinking(p["text"])}
            if isinstance(p, Mapping) and p.get("type") == "text" and isinstance(p.get("text"), str)
            else p
            for p in content
        ]
        return {**message, "content": parts}
    return message


def _scan(value: Any, chars: set[str]) -> None:
    """Collect the characters of every string (and mapping key) in `value`."""
    if isinstance(value, str):
        chars.update(value)
    elif isinstance(value, Mapping):
        for key, item in value.items():
            _scan(key, chars)
            _scan(item, chars)
    elif isinstance(value, list | tuple):
        for item in value:
            _scan(item, chars)


def _mark(used: set[str]) -> str:
    """A private-use character that occurs in none of the client's text."""
    code = _MARK_BASE
    while chr(code) in used:
        code += 1
    return chr(code)


def _escape(value: Any, table: dict[int, str]) -> Any:
    """A copy of `value` with `table` applied to every string and mapping key in it."""
    if isinstance(value, str):
        return value.translate(table)
    if isinstance(value, Mapping):
        return {_escape(k, table): _escape(v, table) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_escape(item, table) for item in value]
    return value
