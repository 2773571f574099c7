"""langchain-tests standard unit suite for ChatPCR (construction only: the model is not loaded)."""

from __future__ import annotations

from langchain_pcr import ChatPCR
from langchain_tests.unit_tests import ChatModelUnitTests


class TestChatPCRUnit(ChatModelUnitTests):
    @property
    def chat_model_class(self) -> type[ChatPCR]:
        return ChatPCR

    @property
    def chat_model_params(self) -> dict:
        return {"model": "smollm2-135m-instruct"}

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


def test_construction_does_not_load_a_model() -> None:
    llm = ChatPCR(model="smollm2-135m-instruct", max_tokens=8)
    assert llm._holder.loaded is None
    assert llm._get_ls_params()["ls_model_name"] == "smollm2-135m-instruct"
    assert llm._get_ls_params()["ls_max_tokens"] == 8
    assert ChatPCR(max_new_tokens=5).max_tokens == 5  # alias


def test_engine_and_model_are_exclusive() -> None:
    import pytest

    with pytest.raises(ValueError, match="either engine="):
        ChatPCR(engine=object(), model="smollm2-135m-instruct")
