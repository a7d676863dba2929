"""Tool calling in chat: how the tools reach the prompt and how the model's calls come back.

The model's chat template renders `tools` (passed as Hugging Face passes them). A template that
never mentions tools (SmolLM2's GGUF template) gets them from `tool_prompt` instead: Hermes'
instructions (Qwen2.5's wording) added to the system message, with earlier assistant tool calls
and tool results written the Hermes way (`fallback_messages`). The reply is parsed by the
template's style (`tool_style`): Hermes' `<tool_call>{"name", "arguments"}</tool_call>` blocks
(Qwen, Hermes, SmolLM2), or Llama 3's bare JSON `{"name", "parameters"}` (several joined by
";"). `parse_tool_calls` parses a whole reply; `ToolStream` the same text as it streams, giving
content deltas at once and each call when it is complete. A block that does not parse stays
content.

Pure functions over text and JSON: no client, no tokenizer, no event loop. Which tool_choice
values are served is the schema's decision (schemas.refuse_tool_choice).
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, Literal

ToolStyle = Literal["hermes", "llama3"]

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"


def tool_style(template: str | None) -> ToolStyle:
    """Which format the model writes its calls in, by its chat template."""
    if (
        template
        and HERMES_OPEN not in template
        and (_PYTHON_TAG in template or "ipython" in template)
    ):
        return "llama3"
    return "hermes"


def template_renders_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template


def tool_grammar(tools: list[dict], only: str | None, style: ToolStyle, parallel: bool) -> str:
    """The grammar (llguidance's Lark, with `%json` for the call) a reply keeps to when
    tool_choice forces a call: of any of `tools` ("required") or of the one named `only`, in
    the template's `style`, one call or (with `parallel`) several; `parse_tool_calls` then
    always finds them."""
    from taipan.ops.grammar import bounded_schema

    key = "arguments" if style == "hermes" else "parameters"
    calls = []
    for tool in tools:
        function = tool["function"]
        if only is not None and function["name"] != only:
            continue
        params = function.get("parameters") or {"type": "object"}
        calls.append({
            "type": "object",
            "properties": {"name": {"const": function["name"]}, key: params},
            "required": ["name", key],
            "additionalProperties": False,
        })  # fmt: skip
    body = json.dumps(bounded_schema({"anyOf": calls}))
    if style == "hermes":
        call, sep = '"<tool_call>\\n" body "\\n</tool_call>"', '"\\n"'
    else:
        call, sep = "body", '"; "'
    start = f"call ({sep} call)*" if parallel else "call"
    return f"start: {start}\ncall: {call}\nbody: %json {body}\n"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# --- the prompt ------------------------------------------------------------------------------


def tool_prompt(tools: list[dict]) -> str:
    """Hermes' tool instructions (Qwen2.5's template's wording) for a template without its own."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{lines}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def fallback_messages(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """Messages for a template that knows no tools: the instructions in the system message,
    assistant tool calls as Hermes blocks in its content, tool results as a user's
    `<tool_response>` (as Qwen2.5's template writes them)."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            blocks = [
                HERMES_OPEN + "\n" + json.dumps(_call_json(c), ensure_ascii=False) + "\n"
                + HERMES_CLOSE
                for c in m["tool_calls"]
            ]  # fmt: skip
            content = "\n".join([m["content"], *blocks] if m.get("content") else blocks)
            m = {k: v for k, v in m.items() if k != "tool_calls"} | {"content": content}
        elif m.get("role") == "tool":
            content = f"<tool_response>\n{m.get('content', '')}\n</tool_response>"
            m = {"role": "user", "content": content}
        out.append(m)
    if tools:
        prompt = tool_prompt(tools)
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0].get('content', '')}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _call_json(call: dict) -> dict:
    f = call.get("function", {})
    return {"name": f.get("name"), "arguments": f.get("arguments", {})}


# --- the reply -------------------------------------------------------------------------------


def _as_call(obj: Any) -> dict | None:
    """An OpenAI tool call of a parsed JSON object {"name", "arguments" | "parameters"}."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return {
        "id": new_call_id(),
        "type": "function",
        "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)},
    }


def _json_calls(text: str) -> list[dict] | None:
    """The calls of one JSON object, or of a JSON list of them; None unless all parse."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    objs = obj if isinstance(obj, list) else [obj]
    calls = [_as_call(o) for o in objs]
    return calls if calls and all(calls) else None


def parse_tool_calls(text: str, style: ToolStyle) -> tuple[str | None, list[dict]]:
    """(content, tool calls) of a whole reply; content None when only calls were written."""
    if style == "llama3":
        return _parse_llama3(text)
    calls, kept, pos = [], [], 0
    for m in _HERMES_BLOCK.finditer(text):
        parsed = _json_calls(m.group(1).strip())
        if parsed is None:
            continue
        kept.append(text[pos : m.start()])
        calls += parsed
        pos = m.end()
    kept.append(text[pos:])
    content = "".join(kept).strip() if calls else text
    return (content or None), calls


def _parse_llama3(text: str) -> tuple[str | None, list[dict]]:
    body = text.strip()
    if body.startswith(_PYTHON_TAG):
        body = body[len(_PYTHON_TAG) :].strip()
    if not body.startswith(("{", "[")):
        return text, []
    calls: list[dict] = []
    for part in _split_top_level(body, ";"):
        parsed = _json_calls(part)
        if parsed is None:
            return text, []
        calls += parsed
    return None, calls


def _split_top_level(text: str, sep: str) -> list[str]:
    """`text` split at `sep` outside JSON strings and brackets."""
    parts, depth, start, quoted, escaped = [], 0, 0, False, False
    for i, ch in enumerate(text):
        if quoted:
            escaped, quoted = (not escaped and ch == "\\"), quoted and (escaped or ch != '"')
            continue
        if ch == '"':
            quoted = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        elif ch == sep and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    parts.append(text[start:].strip())
    return [p for p in parts if p]


class ToolStream:
    """The tool-call parser over streamed text. `feed(text)` returns (content delta, complete
    calls); `end()` what is left at the end of the reply. Content before a possible call goes
    out at once; text that may be a call is held until it is known (a Hermes block closed, or
    the end of a Llama 3 reply, which is JSON from its first character)."""

    def __init__(self, style: ToolStyle) -> None:
        self.style = style
        self.held = ""
        self.started = False  # any text seen (Llama 3: a reply that starts as JSON is held)
        self.json_reply = False
        self.num_calls = 0
        self.blank = ""  # whitespace-only content held back (it may only separate calls)

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self.held += text
        if self.style == "llama3":
            return self._feed_llama3()
        content, calls = "", []
        while True:
            start = self.held.find(HERMES_OPEN)
            if start < 0:
                keep = _partial_suffix(self.held, HERMES_OPEN)
                content += self.held[: len(self.held) - keep]
                self.held = self.held[len(self.held) - keep :]
                break
            content += self.held[:start]
            self.held = self.held[start:]
            end = self.held.find(HERMES_CLOSE)
            if end < 0:
                break
            block = self.held[: end + len(HERMES_CLOSE)]
            self.held = self.held[end + len(HERMES_CLOSE) :]
            parsed = _json_calls(block[len(HERMES_OPEN) : -len(HERMES_CLOSE)].strip())
            if parsed is None:
                content += block
            else:
                calls += parsed
        return self._counted(content, calls)

    def _feed_llama3(self) -> tuple[str, list[dict]]:
        if not self.started:
            head = self.held.lstrip()
            if not head:
                return "", []
            self.started = True
            self.json_reply = head.startswith(("{", "[", "<"))
        if self.json_reply:
            return "", []
        out, self.held = self.held, ""
        return out, []

    def delta(self, text: str, finished: bool, parallel: bool, sent: int) -> tuple[str, list[dict]]:
        """One streamed delta's (content, calls): `feed(text)`, then `end()` on the last one;
        without `parallel` tool calls only the first call of the reply (`sent` already sent)."""
        text, calls = self.feed(text)
        if finished:
            more, end_calls = self.end()
            text, calls = text + more, calls + end_calls
        if not parallel:
            calls = calls[: max(0, 1 - sent)]
        return text, calls

    def end(self) -> tuple[str, list[dict]]:
        held, self.held = self.held, ""
        content, calls = held, []
        if held:
            parsed, found = parse_tool_calls(held, self.style)
            if found or self.style == "llama3":
                content, calls = parsed or "", found
        content, calls = self._counted(content, calls)
        blank, self.blank = self.blank, ""
        if not self.num_calls:  # blank text that separated no calls is content after all
            content += blank
        return content, calls

    def _counted(self, content: str, calls: list[dict]) -> tuple[str, list[dict]]:
        """Count the calls; hold trailing whitespace back until text follows it (blank lines
        around calls are not content)."""
        self.num_calls += len(calls)
        content = self.blank + content
        text = content.rstrip()
        self.blank = content[len(text) :]
        return text, calls


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (may become it)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0
