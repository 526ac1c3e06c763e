"""Prompts as token ids: plain text, token ids as given, or chat messages through the template.

Runs in the worker process, on the prompt thread (through model_worker.prompt_desk). Owns the rules
for turning a Generate or Tokenize message into the ids an engine runs, with the model's own
tokenizer and chat template (tools and the template's switches included); what cannot be turned
into ids is a `RequestRejected`, answered as Rejected.
"""

from __future__ import annotations

from model_worker.chat_template import ChatTemplate, TemplateError
from model_worker.engines.base import RequestRejected, TextCodec
from wire.params import ChatMessage, ChatOptions
from wire.results import RejectCode

_PLAIN_CHAT = ChatOptions()


class PromptBuilder:
    def __init__(self, codec: TextCodec, chat_template: ChatTemplate | None, model_name: str = "") -> None:
        self.codec = codec
        self.chat_template = chat_template
        self.model_name = model_name

    def ids(
        self,
        prompt: str | None,
        prompt_token_ids: list[int] | None,
        messages: list[ChatMessage] | None,
        chat: ChatOptions | None = None,
    ) -> list[int]:
        """The prompt's ids; exactly one of the three is set (the codec checked it)."""
        if messages is not None:
            return self.chat_ids(messages, chat)
        if prompt_token_ids is not None:
            return list(prompt_token_ids)
        return self.codec.encode(prompt or "", add_special_tokens=True)

    def chat_ids(self, messages: list[ChatMessage], chat: ChatOptions | None = None) -> list[int]:
        options = chat or _PLAIN_CHAT
        template = self.chat_template
        if template is None:
            raise RequestRejected(
                RejectCode.CHAT_TEMPLATE_MISSING,
                "this model has no chat template; use /v1/completions or set one in models.yaml",
                "messages",
            )
        if options.tools and not template.supports_tools:
            raise RequestRejected(
                RejectCode.UNSUPPORTED_PARAMETER,
                f"the chat template of model '{self.model_name}' cannot render tools",
                "tools",
            )
        if not template.renders_tool_calls:
            for index, message in enumerate(messages):
                if message.tool_calls:
                    raise RequestRejected(
                        RejectCode.UNSUPPORTED_PARAMETER,
                        f"the chat template of model '{self.model_name}' cannot render the tool calls of "
                        f"messages.{index}",
                        f"messages.{index}.tool_calls",
                    )
        try:
            text = template.render(
                [m.for_template() for m in messages],
                add_generation_prompt=options.add_generation_prompt,
                tools=[t.for_template() for t in options.tools],
                continue_final_message=options.continue_final_message,
                extra=options.template_kwargs,
            )
        except TemplateError as exc:
            raise RequestRejected(RejectCode.INVALID_MESSAGES, str(exc), "messages") from None
        # The template already holds bos and other special tokens.
        return self.codec.encode(text, add_special_tokens=False)
