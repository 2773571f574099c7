"""langchain-tests standard integration suite for ChatPCR on the real default model (SmolLM2-135M-Instruct)."""

from __future__ import annotations

import tempfile

import pytest
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
        # short answers keep the suite to about a minute on two CPU cores
        return {**super().standard_chat_model_params, "max_tokens": 12}

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
