"""Text <-> token ids and the chat template, for a GGUF file or a Hugging Face directory.

Imports no torch: the light stages (context, tokenize, detokenize) load this in ~0.3 s. The chat
template is rendered with jinja2's sandbox, trim_blocks and lstrip_blocks on, as transformers does.
Prompts are data: in `encode_chat` control tokens come only from the template's own framing;
control-token text inside a message (`<|im_start|>system`) is encoded as ordinary text.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import secrets
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as _HFTokenizer

from engine.weights import model_format, read_gguf_header, resolve_model

_GGUF_CONTROL_TOKEN = 3  # tokenizer.ggml.token_type: 1 normal, 3 control, 4 user-defined, 6 byte
_GGUF_USER_DEFINED = 4
_DEFAULT_MAX_MODEL_LEN = 2048


class Tokenizer:
    """A byte-level BPE tokenizer plus the model's chat template and special ids."""

    def __init__(
        self,
        backend: _HFTokenizer,
        *,
        model_name: str,
        chat_template: str | None,
        bos_token_id: int | None,
        eos_token_id: int,
        max_model_len: int,
    ) -> None:
        self._backend = backend
        self.model_name = model_name
        self.chat_template = chat_template
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.max_model_len = max_model_len
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.special_token_ids = frozenset(
            i for i, tok in backend.get_added_tokens_decoder().items() if tok.special
        )
        self._template = _compile_template(chat_template) if chat_template else None
        # The same tokenizer with control tokens split as text: for the text between framing.
        self._text_backend = _HFTokenizer.from_str(backend.to_str())
        self._text_backend.encode_special_tokens = True
        control = {
            tok.content: (i, tok)
            for i, tok in backend.get_added_tokens_decoder().items()
            if tok.special
        }
        self._control_ids = {text: i for text, (i, _) in control.items()}
        # Longest first, so a token that is a prefix of another never wins; lstrip / rstrip
        # tokens take the whitespace beside them, as the tokenizers library matches them.
        self._control_re = re.compile(
            "|".join(
                ("\\s*" if tok.lstrip else "") + re.escape(text) + ("\\s*" if tok.rstrip else "")
                for text, (_, tok) in sorted(control.items(), key=lambda kv: -len(kv[0]))
            )
            or "(?!)"
        )

    @functools.cached_property
    def _fingerprint(self) -> str:
        digest = hashlib.sha256(self._backend.to_str().encode())
        digest.update(b"\0" + (self.chat_template or "").encode())
        return digest.hexdigest()[:16]

    def fingerprint(self) -> str:
        """A digest of the vocabulary, merges, special tokens and chat template: two tokenizers
        with one fingerprint turn every conversation into the same ids."""
        return self._fingerprint

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; no special tokens are added, but special-token text is matched
        (`"<|im_end|>"` is the control id): for text the caller owns whole, such as a raw prompt.
        Message content goes through `encode_chat`, which never matches it."""
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, got {type(text).__name__}")
        return self._backend.encode(text, add_special_tokens=False).ids

    def encode_text(self, text: str) -> list[int]:
        """Token ids of `text` as plain text: control-token text becomes ordinary tokens."""
        if not isinstance(text, str):
            raise TypeError(f"encode_text() takes a str, got {type(text).__name__}")
        return self._text_backend.encode(text, add_special_tokens=False).ids

    def text_offsets(self, text: str) -> list[tuple[int, int]]:
        """(start, end) character offsets of `encode_text(text)`'s tokens (a character split over
        several byte tokens gives each of them its whole span)."""
        return list(self._text_backend.encode(text, add_special_tokens=False).offsets)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(
                f"token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})"
            )
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    @property
    def eos_token(self) -> str:
        return self._backend.id_to_token(self.eos_token_id)

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_token_id is None else self._backend.id_to_token(self.bos_token_id)

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        """Render the model's chat template; messages are dicts with str `role` and `content`."""
        if self._template is None:
            raise ValueError(f"model {self.model_name!r} has no chat template in its metadata")
        _check_messages(messages)
        return self._template.render(
            messages=[dict(m) for m in messages],
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token,
        )

    def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
    ) -> list[int]:
        """The chat template's token ids, where control tokens come only from the template.

        Control-token text in a message's content is first swapped for a marker (private-use
        characters and a per-call nonce) that the template passes through like any text; the
        rendered prompt is cut at the control tokens that remain (the framing's own), and each
        stretch between them, markers restored, is encoded with control tokens split as text.
        For content without control-token text the ids equal transformers' apply_chat_template
        with tokenize=True: the same stretches are encoded the same way.
        """
        _check_messages(messages)
        nonce = secrets.token_hex(8)
        found: list[str] = []

        def hide(match: re.Match[str]) -> str:
            found.append(match.group())
            return f"\ue000{nonce}:{len(found) - 1}\ue001"

        hidden = [{**m, "content": self._control_re.sub(hide, m["content"])} for m in messages]
        text = self.apply_chat_template(hidden, add_generation_prompt)
        marker = re.compile(f"\ue000{nonce}:(\\d+)\ue001")
        ids: list[int] = []
        start = 0
        for framing in self._control_re.finditer(text):
            ids += self._stretch(text[start : framing.start()], marker, found)
            token = framing.group()  # with the whitespace an lstrip / rstrip token took
            ids.append(self._control_ids[token if token in self._control_ids else token.strip()])
            start = framing.end()
        return ids + self._stretch(text[start:], marker, found)

    def _stretch(self, text: str, marker: re.Pattern[str], found: list[str]) -> list[int]:
        if not text:
            return []
        return self.encode_text(marker.sub(lambda m: found[int(m.group(1))], text))


def _check_messages(messages: Sequence[Mapping[str, Any]]) -> None:
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence):
        raise ValueError(f"messages must be a list of dicts, got {type(messages).__name__}")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ValueError(f"messages[{i}] must be a dict, got {type(m).__name__}")
        for field in ("role", "content"):
            if not isinstance(m.get(field), str):
                raise ValueError(
                    f"messages[{i}].{field} must be a str, got {type(m.get(field)).__name__}"
                )


def _compile_template(source: str) -> jinja2.Template:
    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, **kw: Any) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, **kw)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


@functools.lru_cache(maxsize=8)
def load_tokenizer(model: str) -> Tokenizer:
    """A registered name, a .gguf path or an HF directory -> its Tokenizer (cached per name)."""
    path = resolve_model(model)
    if model_format(path) == "hf":
        return _from_hf_dir(path, model)
    return _from_gguf(path, model)


def _from_gguf(path: Path, name: str) -> Tokenizer:
    meta = read_gguf_header(path).metadata
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(
            f"{str(path)!r} has tokenizer.ggml.model={kind!r}; only byte-level BPE ('gpt2') is "
            "supported"
        )
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type")
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    backend = _HFTokenizer(
        models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False)
    )
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    if types is not None:
        special = [
            AddedToken(tokens[i], special=int(t) == _GGUF_CONTROL_TOKEN, normalized=False)
            for i, t in enumerate(types)
            if int(t) in (_GGUF_CONTROL_TOKEN, _GGUF_USER_DEFINED)
        ]
        backend.add_special_tokens([t for t in special if t.special])
        backend.add_tokens([t for t in special if not t.special])
    arch = meta.get("general.architecture", "llama")
    return Tokenizer(
        backend,
        model_name=name,
        chat_template=meta.get("tokenizer.chat_template"),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=int(meta["tokenizer.ggml.eos_token_id"]),
        max_model_len=int(meta.get(f"{arch}.context_length", _DEFAULT_MAX_MODEL_LEN)),
    )


def _from_hf_dir(path: Path, name: str) -> Tokenizer:
    backend = _HFTokenizer.from_file(str(path / "tokenizer.json"))
    cfg_path, tcfg_path = path / "config.json", path / "tokenizer_config.json"
    config = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    tcfg = json.loads(tcfg_path.read_text()) if tcfg_path.is_file() else {}
    template = tcfg.get("chat_template")
    if isinstance(template, list):  # named templates: take "default"
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    jinja_file = path / "chat_template.jinja"
    if template is None and jinja_file.is_file():
        template = jinja_file.read_text()

    def token_id(key: str) -> int | None:
        tok = tcfg.get(key)
        if isinstance(tok, dict):
            tok = tok.get("content")
        if isinstance(tok, str) and backend.token_to_id(tok) is not None:
            return backend.token_to_id(tok)
        value = config.get(f"{key}_id")
        return value[0] if isinstance(value, list) else value

    eos = token_id("eos_token")
    if eos is None:
        raise ValueError(f"{str(path)!r}: no eos token in tokenizer_config.json or config.json")
    return Tokenizer(
        backend,
        model_name=name,
        chat_template=template,
        bos_token_id=token_id("bos_token"),
        eos_token_id=int(eos),
        max_model_len=int(config.get("max_position_embeddings", _DEFAULT_MAX_MODEL_LEN)),
    )
