"""ChatPCR tool calling and structured output on the real default model (SmolLM2-135M-Instruct)."""

from __future__ import annotations

import tempfile
from typing import Literal

import jsonschema
import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_pcr import ChatPCR
from pydantic import BaseModel, Field

from pcr_rag import EngineConfig

pytestmark = pytest.mark.slow

_CONFIG = EngineConfig(cache_dir=tempfile.mkdtemp(prefix="pcr-lc-tools-"), dram_capacity="256MiB",
                       ssd_capacity="256MiB")


@tool
def get_weather(location: str) -> str:
    """Get the current weather at a location."""
    return f"It is sunny and 21 C in {location}."


class Address(BaseModel):
    city: str
    country: str


class Person(BaseModel):
    """A person, where they live and what they like."""

    name: str
    age: int = Field(ge=0, le=130)
    address: Address
    hobbies: list[str] = Field(max_length=3)
    mood: Literal["happy", "sad", "calm"]


def test_two_step_tool_calling_agent_loop() -> None:
    llm = ChatPCR(config=_CONFIG, max_tokens=48)
    question = HumanMessage("What is the weather in Paris?")
    history: list = [question]
    call = llm.bind_tools([get_weather], tool_choice="any").invoke(history)
    assert isinstance(call, AIMessage) and len(call.tool_calls) == 1
    assert call.tool_calls[0]["name"] == "get_weather" and isinstance(call.tool_calls[0]["args"]["location"], str)
    history += [call, get_weather.invoke(call.tool_calls[0])]
    assert isinstance(history[-1], ToolMessage)
    answer = llm.bind_tools([get_weather], tool_choice="none").invoke(history)
    assert isinstance(answer, AIMessage) and answer.tool_calls == [] and answer.content.strip()


def test_nested_structured_requests_validate_on_the_default_model() -> None:
    llm = ChatPCR(config=_CONFIG, max_tokens=96).with_structured_output(Person, include_raw=True)
    schema = Person.model_json_schema()
    names = ["Ada, a 36 year old mathematician from London", "Linus, a 28 year old programmer from Helsinki",
             "Marie, a 44 year old chemist from Paris"]
    for who in names:
        out = llm.invoke(f"Describe {who} as a person record.")
        assert out["parsing_error"] is None, out["raw"].content
        assert isinstance(out["parsed"], Person)
        jsonschema.validate(out["parsed"].model_dump(), schema)
