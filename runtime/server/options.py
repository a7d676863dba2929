"""ServerOptions: the server-wide choices of how the OpenAI server renders prompts and reports
usage (`taipan serve` flags, vLLM's names), as the endpoints read them."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ServerOptions:
    """`prompt_tokens_details`: usage objects carry the prompt's cached tokens
    (--enable-prompt-tokens-details; off, as vLLM's, whose tests compare usage objects without
    it). `chat_template`: the template source chat prompts render with instead of the model's
    (--chat-template; already read from its file). `trust_request_chat_template`: a request may
    bring its own `chat_template` (--trust-request-chat-template; refused otherwise, as vLLM
    does: a template is code the server runs, if in a sandbox)."""

    prompt_tokens_details: bool = False
    chat_template: str | None = None
    trust_request_chat_template: bool = False

    @classmethod
    def of(cls, spec: dict) -> ServerOptions:
        """The options in an `http` spec (launcher.http_options' dict)."""
        return cls(
            prompt_tokens_details=bool(spec.get("prompt_tokens_details")),
            chat_template=spec.get("chat_template"),
            trust_request_chat_template=bool(spec.get("trust_request_chat_template")),
        )
