"""Offline batch API, shaped like vLLM's: `LLM(model=...).generate(prompts, params)`,
`.chat(messages, params)` and `.embed(prompts)`."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from llmd.config import load_engine_config
from llmd.engine import LLMEngine
from llmd.outputs import EmbeddingRequestOutput, RequestOutput
from llmd_client.protocol import PoolingParams, SamplingParams

Prompt = str | list[int]
# One chat message as OpenAI's API writes it: {"role": ..., "content": text or text parts}.
Message = dict[str, Any]


class LLM:
    def __init__(self, model: str = "", **settings: Any) -> None:
        self.config = load_engine_config(model=model, **settings)
        self.engine = LLMEngine(self.config)
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 *, priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order. A prompt is text or a list of token ids."""
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None:
            params_list = [SamplingParams()] * len(prompt_list)
        elif isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(f"got {len(params_list)} sampling params for {len(prompt_list)} prompts")
        return self._run(prompt_list, params_list, priority)

    def embed(self, prompts: Prompt | Sequence[Prompt],
              pooling_params: PoolingParams | Sequence[PoolingParams] | None = None, *,
              truncate: bool = False) -> list[EmbeddingRequestOutput]:
        """vLLM's `LLM.embed`: one EmbeddingRequestOutput per prompt, in order, its
        `.outputs.embedding` the model's final hidden states pooled by the engine's
        `pooling_type` (normalized, and cut to `dimensions`, as `pooling_params` say).
        A prompt is text or token ids; one longer than max_model_len is refused, or with
        `truncate` embedded from its first tokens that fit. Prompts run batched, as many
        per step as the token budget takes."""
        prompt_list = _as_prompt_list(prompts)
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            params_list = [pooling_params or PoolingParams()] * len(prompt_list)
        else:
            params_list = list(pooling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(f"got {len(params_list)} pooling params for {len(prompt_list)} prompts")
        return self._run(prompt_list, params_list, None, truncate=truncate)

    def sleep(self, level: int = 1) -> None:
        """vLLM's `LLM.sleep`: free the KV cache and keep the weights (level 1: on a GPU
        in pinned host memory; on CPU where they are) or drop them (level 2), until
        `wake_up()`. Generating meanwhile is refused."""
        self.engine.sleep(level)

    def wake_up(self) -> None:
        """vLLM's `LLM.wake_up`: the weights and the KV cache back (level 2: read from the files)."""
        self.engine.wake_up()

    def is_sleeping(self) -> bool:
        return self.engine.sleep_level is not None

    def _run(self, prompts: list[Prompt], params: list[SamplingParams] | list[PoolingParams],
             priority: Sequence[int] | None, *, truncate: bool = False) -> list[Any]:
        """Queue every prompt (none if one is refused), step until all finish; their
        final outputs in order."""
        engine = self.engine
        ids = []
        try:
            for i, (prompt, request_params) in enumerate(zip(prompts, params)):
                prio = priority[i] if priority is not None else 0
                ids.append(engine.add_request(None, prompt, request_params, priority=prio, truncate=truncate))
        except Exception:
            engine.abort_request(ids)
            raise
        finished: dict[str, Any] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
        return [finished[i] for i in ids]

    def chat(self, messages: Sequence[Message] | Sequence[Sequence[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, chat_template_kwargs: dict[str, Any] | None = None,
             tools: list[dict[str, Any]] | None = None) -> list[RequestOutput]:
        """vLLM's `LLM.chat`: one conversation (a list of messages) or a list of them,
        each rendered with the model's chat template (or `chat_template`) and generated
        as `generate` does; one RequestOutput per conversation, its prompt the rendered
        text. A message's content is text or a list of text parts. `tools` (OpenAI's
        function tools) go to the template as transformers passes them, or, for a
        template that knows no tools, into llmd's tool prompt; as in vLLM, the reply is
        text (read calls out of it with llmd.tool_calls.ToolCallParser)."""
        from llmd.tool_calls import for_template, format_for, parse_tools

        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        processor = self.engine.input_processor
        template = chat_template or getattr(self.tokenizer, "chat_template", None)
        choice = parse_tools(tools, None, None)
        kwargs = dict(chat_template_kwargs or {})
        texts = []
        for conversation in conversations:
            rendered, template_tools = for_template([_text_message(m) for m in conversation], choice,
                                                    format_for(None, template), template)
            if template_tools is not None:
                kwargs["tools"] = template_tools
            texts.append(processor.chat_text(rendered, chat_template=chat_template,
                                             add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message, template_kwargs=kwargs))
        outputs = self.generate([processor.tokenize_chat(text) for text in texts], sampling_params)
        for output, text in zip(outputs, texts):
            output.prompt = text
        return outputs


def _text_message(message: Message) -> dict[str, str]:
    """A message with its content as one text (OpenAI's text parts joined)."""
    content = message.get("content")
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise ValueError("messages: only text content parts are supported")
        content = "".join(p["text"] for p in content)
    return {**message, "content": content or ""}


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one tokenized prompt
    return prompts
