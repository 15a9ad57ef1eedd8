"""The checkpoint's tokenizer plus its chat format: special ids, stop ids and prompt rendering."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.exceptions
import jinja2.ext
import jinja2.sandbox
from tokenizers import Tokenizer

from diffgemma.chat.template import check_roles, normalize_messages, render_gemma4

# The turn-closing and tool-response tokens stop a Gemma 4 reply; used when generation_config has no list.
_DEFAULT_STOP_TOKENS = ("<turn|>", "<|tool_response>")


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
        self._special_ids = frozenset(i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special)
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
        """Token ids of `text`, special tokens included as written; no BOS is added (the template writes it)."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        enable_thinking: bool = False,
    ) -> str:
        """The prompt text: the checkpoint's chat template when it ships one, else our Gemma 4 renderer."""
        check_roles(messages)
        messages = normalize_messages(messages)
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
