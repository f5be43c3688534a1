"""Pre-routing tokenization with vLLM's own renderer, configured like the engine.

The router must hash the token ids the engine will hash, so it renders text and chat requests
exactly as vLLM's OpenAI server does (``OnlineRenderer``: the model's tokenizer, its chat
template or the one given to the engine, special tokens, ``cache_salt`` untouched). Ray Serve
LLM ships such a tokenizer for its KV-aware router, but Ray 2.60's imports a module vLLM 0.32
no longer has (``vllm.entrypoints.chat_utils``); this one uses vLLM 0.32's modules.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["EngineTokenizer"]


class EngineTokenizer:
    """Renders a completion or chat request to its prompt token ids (the first prompt of a
    batch). Built from the engine's arguments (``model``, ``served_model_name``, tokenizer and
    chat-template options); building takes seconds (vLLM's config), tokenizing microseconds
    to milliseconds."""

    def __init__(self, engine_kwargs: dict[str, Any]) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.entrypoints.launchers.cli_args import FrontendArgs
        from vllm.renderers.chat_utils import load_chat_template
        from vllm.renderers.online_renderer import OnlineRenderer
        from vllm.renderers.registry import renderer_from_config

        if not engine_kwargs.get("model"):
            raise ValueError("EngineTokenizer: engine_kwargs must name the model")
        frontend_fields = {f.name for f in dataclasses.fields(FrontendArgs)}
        engine_fields = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
        frontend = {k: v for k, v in engine_kwargs.items() if k in frontend_fields}
        engine = {
            k: v
            for k, v in engine_kwargs.items()
            if k in engine_fields and k not in frontend and k != "kv_transfer_config"
        }
        vllm_config = AsyncEngineArgs(**engine).create_engine_config()
        args = FrontendArgs(**frontend)
        self.model_config = vllm_config.model_config
        self._renderer = OnlineRenderer(
            self.model_config,
            renderer_from_config(vllm_config),
            request_logger=None,
            chat_template=load_chat_template(args.chat_template),
            chat_template_content_format=args.chat_template_content_format,
            trust_request_chat_template=args.trust_request_chat_template,
            enable_auto_tools=args.enable_auto_tool_choice,
            exclude_tools_when_tool_choice_none=args.exclude_tools_when_tool_choice_none,
            tool_parser=args.tool_call_parser,
            default_chat_template_kwargs=args.default_chat_template_kwargs,
        )

    async def token_ids(self, request: Any) -> list[int] | None:
        """The prompt token ids of a completion or chat request; None when the request cannot
        be rendered (the engine will answer it with its own error)."""
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse
        from vllm.renderers.inputs.preprocess import extract_prompt_components

        try:
            if getattr(request, "messages", None):
                result = await self._renderer.render_chat(
                    request.model_copy(deep=True), skip_mm_cache=True
                )
                inputs = None if isinstance(result, ErrorResponse) else result[1]
            else:
                prompt = request.prompt
                if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
                    request = request.model_copy(update={"prompt": prompt[0]})
                result = await self._renderer.render_completion(request, skip_mm_cache=True)
                inputs = None if isinstance(result, ErrorResponse) else result
        except Exception as e:  # a bad request: not the router's to answer
            logger.debug("EngineTokenizer: cannot render the request: %s", e)
            return None
        if not inputs:
            return None
        ids = extract_prompt_components(self.model_config, inputs[0]).token_ids
        return list(ids) if ids is not None else None
