"""Chat templates: finding a model's Jinja2 template and compiling it the way transformers does.

Owns the sandboxed Jinja2 environment (helpers `raise_exception`, `strftime_now`, an unescaped
`tojson`, loop controls, trim/lstrip blocks) so rendered prompts equal Hugging Face's
`apply_chat_template`. Must not import torch; jinja2 is imported only when a template compiles.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path


class ChatTemplateError(ValueError):
    """A chat template that cannot be read or parsed."""


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ChatTemplateError(f"cannot parse {path}: {exc}") from exc


def read_chat_template(path: Path, config: dict) -> str | None:
    """The template of a Hugging Face directory: tokenizer_config.json's `chat_template` (its
    "default" entry when it lists several), else chat_template.jinja, else chat_template.json."""
    template = config.get("chat_template")
    if isinstance(template, list):  # several named templates; use the default one
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default")
    if template is None and (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text(encoding="utf-8")
    if template is None and (path / "chat_template.json").is_file():
        template = _read_json(path / "chat_template.json").get("chat_template")
    return template


def compile_chat_template(source: str):
    """A sandboxed Jinja2 template with the helpers Hugging Face chat templates expect."""
    from datetime import datetime

    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson escapes HTML characters, which templates do not expect.
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"the chat template does not parse: {exc}") from exc


@functools.lru_cache(maxsize=16)
def cached_chat_template(source: str):
    """`compile_chat_template(source)`, kept for the next use of the same source (a server's
    --chat-template, the templates requests bring)."""
    return compile_chat_template(source)


def template_source(value: str) -> str:
    """A chat template given as vLLM's --chat-template takes one: a file's path (read), or the
    template itself (anything with a Jinja mark or a newline); it must compile."""
    path = Path(value).expanduser()
    if path.is_file():
        try:
            value = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ChatTemplateError(f"cannot read the chat template {path}: {exc}") from exc
    elif not any(mark in value for mark in ("{{", "{%", "\n")):
        raise ChatTemplateError(
            f"chat template {value!r} is neither a file nor a template (no {{{{ }}}} or {{% %}})"
        )
    cached_chat_template(value)
    return value
