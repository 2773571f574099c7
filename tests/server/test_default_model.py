"""End to end on the real default model (slow): the openai client against `pcr-rag serve` in-process, answers equal
to a local engine's, cached tokens on the repeat, a streamed answer equal to the non-streamed one."""

from __future__ import annotations

import openai
import pytest

from pcr_rag import EngineConfig, PCREngine
from pcr_rag.request import ChatPrompt, SamplingParams
from pcr_rag.server import ServerThread

pytestmark = pytest.mark.slow


def test_default_model_through_the_server(tmp_path, h) -> None:
    config = dict(chunk_size=32, max_new_tokens=12, dram_capacity="256MiB", ssd_capacity="256MiB", max_active=2,
                  max_model_len=1024)
    docs = list(h.DOCS)
    messages = h.rag_messages(docs)
    with PCREngine(config=EngineConfig(cache_dir=tmp_path / "served", **config)) as engine, \
            PCREngine(config=EngineConfig(cache_dir=tmp_path / "local", **config)) as local, \
            ServerThread(engine) as url:
        want = local.submit(ChatPrompt(messages, docs), SamplingParams(max_new_tokens=12)).result()
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
        replies = [client.chat.completions.create(model=engine.loaded.name, messages=messages, max_tokens=12,
                                                  extra_body={"documents": docs}) for _ in range(2)]
        stream = client.chat.completions.create(model=engine.loaded.name, messages=messages, max_tokens=12,
                                                stream=True, stream_options={"include_usage": True},
                                                extra_body={"documents": docs})
        chunks = list(stream)
    assert [r.choices[0].message.content for r in replies] == [want.text, want.text]
    assert replies[0].usage.prompt_tokens_details.cached_tokens == 0
    assert replies[1].usage.prompt_tokens_details.cached_tokens > 0
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0
