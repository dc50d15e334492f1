"""Chat templates: a model folder's Jinja template, rendered as transformers renders it.

The template is read from ``chat_template.jinja`` or the ``chat_template`` field of
``tokenizer_config.json`` (a string, or a list of named templates whose ``default`` is used), as
transformers' ``AutoTokenizer`` reads it. Rendering uses the same sandboxed Jinja environment as
``PreTrainedTokenizer.apply_chat_template`` (``trim_blocks``, ``lstrip_blocks``, loop controls,
``raise_exception``, ``strftime_now`` and a ``tojson`` that keeps non-ASCII text), with the
folder's special tokens (``bos_token``, ``eos_token``, ...) as variables; the rendered text is
then encoded without adding special tokens, since the template writes them itself.
"""

from __future__ import annotations

import datetime
import functools
import json
from pathlib import Path
from typing import Any

import attrs
import jinja2
import jinja2.ext
import jinja2.sandbox

__all__ = ["ChatTemplate", "TemplateError", "load_chat_template", "render"]

#: The special-token names transformers passes to a template.
_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token")


class TemplateError(ValueError):
    """A template that cannot render these messages (its own ``raise_exception`` included)."""


@attrs.define(frozen=True, slots=True, kw_only=True)
class ChatTemplate:
    """A chat template's source, where it came from, and the special tokens it may refer to."""

    source: str
    origin: str
    special_tokens: tuple[tuple[str, str], ...] = ()


def _token_text(value: Any) -> str | None:
    """A special token as ``tokenizer_config.json`` writes it: a string or ``{"content": ...}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def load_chat_template(folder: str | Path) -> ChatTemplate | None:
    """The chat template of a model folder, or None when it has none. A template file that
    cannot be read or parsed raises ``ValueError`` naming the file."""
    folder = Path(folder)
    config_path = folder / "tokenizer_config.json"
    try:
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    except (OSError, ValueError) as err:
        raise ValueError(f"cannot read {config_path}: {err}") from err
    specials = tuple(
        (name, text) for name in _SPECIAL_TOKENS if (text := _token_text(config.get(name)))
    )
    jinja_path = folder / "chat_template.jinja"
    if jinja_path.is_file():
        source, origin = jinja_path.read_text(), str(jinja_path)
    else:
        source, origin = config.get("chat_template"), f"{config_path} chat_template"
        if isinstance(source, list):  # named templates: [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
    if not isinstance(source, str) or not source:
        return None
    template = ChatTemplate(source=source, origin=origin, special_tokens=specials)
    _compiled(source, origin)  # a template that does not parse is refused at once
    return template


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent=None, separators=None, sort_keys=False):
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.datetime.now().strftime(format)


@functools.lru_cache(maxsize=8)
def _compiled(source: str, origin: str) -> jinja2.Template:
    """A template's ``source`` compiled in transformers' environment (once per template)."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as err:
        raise ValueError(f"the chat template of {origin} does not parse: {err}") from err


def render(
    template: ChatTemplate, messages: list[dict[str, Any]], add_generation_prompt: bool = True
) -> str:
    """The prompt text of ``messages`` under ``template`` (``add_generation_prompt``: ending
    where the assistant's reply begins). Raises :class:`TemplateError` when the template
    refuses the messages."""
    try:
        return _compiled(template.source, template.origin).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            **dict(template.special_tokens),
        )
    except TemplateError:
        raise
    except jinja2.TemplateError as err:
        raise TemplateError(f"the chat template could not render these messages: {err}") from err
