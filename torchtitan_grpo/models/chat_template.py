"""Chat messages -> prompt text and token ids, with the model's chat template:
what vLLM's ``/v1/chat/completions`` does before it generates, for text-only
chats (``vllm_chat``).

The template is, first found: the request's ``chat_template`` (only when the
server runs with ``--trust-request-chat-template``, as vLLM), the server's
``--chat-template``, the tokenizer's own. A model whose tokenizer has none
and a server started without one cannot render ``messages``: a 400 naming
``messages`` says so. The text is rendered by the tokenizer's
``apply_chat_template`` (its sandboxed Jinja) and then tokenised with
``add_special_tokens`` (false by default: the template places them).

Message content is a string, null, or a list of text parts (joined with
``"\\n"``, vLLM's "string" content format); other part types (images, audio)
are refused naming the part. Other message keys (``name``, ``tool_calls``,
``tool_call_id``, ``reasoning``) reach the template as sent.
"""

from __future__ import annotations

import inspect
import os
from typing import Any, Callable

_JINJA_CHARS = "{}\n"
"""A ``--chat-template`` value holding any of these is a template, not a path (vLLM's rule)."""


class ChatTemplateError(ValueError):
    """A chat that cannot be rendered; ``param`` names the field at fault."""

    def __init__(self, message: str, param: str = "messages"):
        super().__init__(message)
        self.param = param


def load_chat_template(value: str | None) -> str | None:
    """``--chat-template``: a file's path, or the Jinja template itself.
    ValueError when it is neither (a path that does not exist)."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if any(c in value for c in _JINJA_CHARS):
        return value
    raise ValueError(f"--chat-template {value!r} is not a file, and not a Jinja template either")


def _render_kwargs(tokenizer: Any) -> frozenset[str]:
    """Names ``apply_chat_template`` takes itself: a ``chat_template_kwargs``
    key among them would change how the server renders, not what the
    template sees, and is refused."""
    try:
        names = set(inspect.signature(tokenizer.apply_chat_template).parameters)
    except (TypeError, ValueError):
        names = set()
    return frozenset(names | {"conversation", "tokenize", "chat_template", "return_dict", "tools", "documents"})


def _content(content: Any, where: str) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ChatTemplateError(f"'{where}.content' must be a string, null or a list of text parts",
                                f"{where}.content")
    texts = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        if not isinstance(part, dict):
            raise ChatTemplateError(f"'{at}' must be an object {{\"type\": \"text\", \"text\": ...}}", at)
        kind = part.get("type", "text")
        if kind != "text":
            raise ChatTemplateError(f"'{at}.type' is {kind!r}: the built-in server takes text parts only",
                                    f"{at}.type")
        if not isinstance(part.get("text"), str):
            raise ChatTemplateError(f"'{at}.text' must be a string", f"{at}.text")
        texts.append(part["text"])
    return "\n".join(texts)


def conversation(messages: Any) -> list[dict]:
    """The messages as the template sees them (content parts joined); a
    400-worthy :class:`ChatTemplateError` naming the first bad field."""
    if not isinstance(messages, list):
        raise ChatTemplateError("'messages' must be a list of message objects")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ChatTemplateError(f"'{where}' must be an object with 'role' and 'content'", where)
        if not isinstance(m.get("role"), str):
            raise ChatTemplateError(f"'{where}.role' must be a string", f"{where}.role")
        msg = dict(m)
        if "content" in msg:
            msg["content"] = _content(m["content"], where)
        out.append(msg)
    return out


class ChatRenderer:
    """Renders chats for one tokenizer (``None``: the model has none)."""

    def __init__(self, tokenizer: Any, server_template: str | None = None, trust_request_template: bool = False):
        self.tokenizer = tokenizer
        self.server_template = server_template
        self.trust_request_template = trust_request_template
        self._reserved = _render_kwargs(tokenizer) if tokenizer is not None else frozenset()

    def template(self, request_template: str | None) -> str:
        if request_template is not None:
            if not self.trust_request_template:
                raise ChatTemplateError("Chat template is passed with request, but --trust-request-chat-template "
                                        "is not set. Refused request with untrusted chat template.",
                                        "chat_template")
            return request_template
        if self.tokenizer is None:
            raise ChatTemplateError("'messages' needs a tokenizer to render and this model directory has none; "
                                    "use /v1/completions with token ids")
        template = self.server_template or getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise ChatTemplateError(
                "'messages' cannot be rendered: this model's tokenizer has no chat template. Start the server "
                "with --chat-template FILE (or put one in the model's tokenizer_config.json), or send a "
                "rendered prompt to /v1/completions")
        return template

    def render(self, messages: Any, *, add_generation_prompt: bool = True, continue_final_message: bool = False,
               add_special_tokens: bool = False, chat_template: str | None = None,
               template_kwargs: dict | None = None, tools: list | None = None, documents: list | None = None,
               check_text: Callable[[str], None] | None = None) -> tuple[str, list[int]]:
        """(prompt text, prompt token ids) of a chat; ``check_text`` sees the
        text before it is tokenised (and may refuse it)."""
        chat = conversation(messages)
        template = self.template(chat_template)
        kwargs = dict(template_kwargs or {})
        for key in kwargs:
            if key in self._reserved:
                raise ChatTemplateError(f"'chat_template_kwargs.{key}' is set by the server, not by the template's "
                                        "variables", f"chat_template_kwargs.{key}")
        if continue_final_message and not (chat and chat[-1].get("role") == "assistant"):
            raise ChatTemplateError("'continue_final_message' needs a final message with role 'assistant'",
                                    "continue_final_message")
        try:
            text = self.tokenizer.apply_chat_template(
                chat, chat_template=template, tools=tools, documents=documents,
                add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                tokenize=False, **kwargs)
        except Exception as e:  # the template's own raise_exception, a Jinja error, a bad variable
            raise ChatTemplateError(f"'messages' could not be rendered with the chat template: "
                                    f"{type(e).__name__}: {e}") from None
        if not isinstance(text, str):
            raise ChatTemplateError(f"the chat template rendered a {type(text).__name__}, not text")
        if check_text is not None:
            check_text(text)
        return text, list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
