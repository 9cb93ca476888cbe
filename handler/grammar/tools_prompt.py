"""Chat messages (with tools) -> what `tokenizer.apply_chat_template` takes.

A chat template that handles tools (its source mentions `tools`, as Qwen2/2.5, Llama 3.1+,
Mistral and Hermes templates do) gets the OpenAI `tools` list and the history's `tool_calls` and
`tool` turns as they are, and renders them its own way.

For a template that does not (the dev model's, many older models'), the fallback is the Hermes
layout in plain text: a system message lists the tools as JSON and states the call syntax (the
`<tool_call>` block of `handler.grammar.constrained`, which the grammar enforces), earlier assistant calls
are written as such blocks, and a tool result becomes a user turn inside `<tool_response>` tags.

With tool_choice "none" the tools are not shown to the model at all.
"""

from __future__ import annotations

import json

from handler.grammar.constrained import TOOL_CALL_CLOSE, TOOL_CALL_OPEN

FALLBACK_SYSTEM = (
    "You may call functions to answer. The functions, as JSON schemas:\n{tools}\n"
    "To call a function, answer with one block per call, exactly:\n"
    + TOOL_CALL_OPEN + '{{"name": <function name>, "arguments": <arguments object>}}' + TOOL_CALL_CLOSE
)


def template_supports_tools(tokenizer) -> bool:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = " ".join(template.values())
    return bool(template) and "tools" in template


def _arguments(raw: str):
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def render_messages(tokenizer, req) -> tuple[list[dict], dict]:
    """(messages, extra keyword arguments for apply_chat_template)."""
    show_tools = req.tool_mode is not None
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if show_tools else None
    native = template_supports_tools(tokenizer)
    out: list[dict] = []
    for m in req.messages:
        role = "system" if m.role == "developer" else m.role
        content = m.text()
        if native:
            d: dict = {"role": role, "content": content}
            if m.tool_calls:
                d["tool_calls"] = [{"id": c.id, "type": "function",
                                    "function": {"name": c.function.name,
                                                 "arguments": _arguments(c.function.arguments)}}
                                   for c in m.tool_calls]
            if m.tool_call_id:
                d["tool_call_id"] = m.tool_call_id
            if m.name:
                d["name"] = m.name
            out.append(d)
            continue
        if m.tool_calls:
            blocks = [TOOL_CALL_OPEN + json.dumps({"name": c.function.name,
                                                   "arguments": _arguments(c.function.arguments)})
                      + TOOL_CALL_CLOSE for c in m.tool_calls]
            content = "\n".join(([content] if content else []) + blocks)
        if role == "tool":
            role, content = "user", f"<tool_response>\n{content}\n</tool_response>"
        out.append({"role": role, "content": content})
    if not show_tools:
        return out, {}
    if native:
        return out, {"tools": tools}
    system = FALLBACK_SYSTEM.format(tools="\n".join(json.dumps(t["function"]) for t in tools))
    if out and out[0]["role"] == "system":
        out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + system}
    else:
        out.insert(0, {"role": "system", "content": system})
    return out, {}
