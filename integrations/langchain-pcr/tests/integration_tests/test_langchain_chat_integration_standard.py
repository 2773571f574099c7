"""langchain-tests standard integration suite for ChatPCR on the real default model (SmolLM2-135M-Instruct)."""

from __future__ import annotations

import tempfile

import pytest
from langchain_core.language_models import BaseChatModel
from langchain_pcr import ChatPCR
from langchain_tests.integration_tests import ChatModelIntegrationTests

from pcr_rag import EngineConfig

pytestmark = pytest.mark.slow

# One cache directory for the whole class: equal configs share one engine (one model load) in the process.
_CONFIG = EngineConfig(cache_dir=tempfile.mkdtemp(prefix="pcr-lc-std-"), dram_capacity="256MiB",
                       ssd_capacity="256MiB")


class TestChatPCRIntegration(ChatModelIntegrationTests):
    @property
    def chat_model_class(self) -> type[ChatPCR]:
        return ChatPCR

    @property
    def chat_model_params(self) -> dict:
        return {"config": _CONFIG}

    @property
    def standard_chat_model_params(self) -> dict:
        # short answers keep the suite to a few minutes on two CPU cores; a tool call or a joke as JSON needs
        # room for its closing braces
        return {**super().standard_chat_model_params, "max_tokens": 64}

    # Tool calling, structured output and JSON mode run on grammar-constrained decoding; no multimodal input.
    @property
    def has_tool_calling(self) -> bool:
        return True

    @property
    def has_tool_choice(self) -> bool:
        return True

    @property
    def has_structured_output(self) -> bool:
        return True

    @property
    def supports_json_mode(self) -> bool:
        return True

    @property
    def supports_image_inputs(self) -> bool:
        return False

    @property
    def returns_usage_metadata(self) -> bool:
        return True

    @property
    def supported_usage_metadata_details(self) -> dict:
        return {"invoke": ["cache_read_input"], "stream": ["cache_read_input"]}

    def invoke_with_cache_read_input(self, *, stream: bool = False):
        """Two calls over the same document: the second reads its KV from the cache."""
        llm = ChatPCR(**self.chat_model_params, max_tokens=4)
        doc = "The heapq module implements a min-heap on a list; heapq.heappush adds an item. " * 6
        question = [("human", f"Context: {doc}\nQuestion: what does heappush do?")]
        llm.invoke(question, documents=[doc])
        if stream:
            full = None
            for chunk in llm.stream(question, documents=[doc]):
                full = chunk if full is None else full + chunk
            msg = full
        else:
            msg = llm.invoke(question, documents=[doc])
        assert msg.usage_metadata["input_token_details"]["cache_read"] > 0
        return msg

    # The tests below fail on the 135M default model only because of what the model chooses to write, never
    # because of the format: the grammar keeps every call and every JSON object well-formed. Outputs recorded on
    # SmolLM2-135M-Instruct (greedy); gemma3-270m (`tests/integration_tests/test_langchain_tools.py`) was tried too.
    @pytest.mark.xfail(reason="tool_choice='auto': SmolLM2-135M answers in plain text ('The weather in San Francisco, "
                              "CA is: ...') instead of calling get_weather; gemma3-270m answers in text too",
                       strict=False)
    @pytest.mark.parametrize("model", [{}, {"output_version": "v1"}], indirect=True)
    def test_agent_loop(self, model: BaseChatModel) -> None:
        super().test_agent_loop(model)

    @pytest.mark.xfail(reason="valid call, wrong value: SmolLM2-135M translates the name ('Hello Group' for "
                              "'你好啊集团'); gemma3-270m keeps the Chinese name but writes 'Hello Corporation' for "
                              "'こんにちは株式会社'", strict=False)
    def test_unicode_tool_call_integration(self, model: BaseChatModel, *, tool_choice: str | None = None,
                                           force_tool_call: bool = True) -> None:
        super().test_unicode_tool_call_integration(model, tool_choice=tool_choice, force_tool_call=force_tool_call)

    @pytest.mark.xfail(reason="json_mode (any JSON object): SmolLM2-135M repeats itself inside 'setup' ('The cat was "
                              "having a cat-themed party, and the cat was having ...') until max_tokens, so no "
                              "'punchline'; gemma3-270m writes other keys ('user', 'title', 'description')",
                       strict=False)
    def test_json_mode(self, model: BaseChatModel) -> None:
        super().test_json_mode(model)
