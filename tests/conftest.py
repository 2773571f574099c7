"""Shared pytest set-up: torch on one thread so unit tests are deterministic and cheap on 2 cores; the fixtures of
the tests that run an engine on the tiny random model (one model per module, engines on a cache dir)."""

from __future__ import annotations

import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from pcr_rag import EngineConfig, PCREngine  # noqa: E402
from pcr_rag.testing import TEST_DEVICE, tiny_model  # noqa: E402

torch.set_num_threads(1)

#: A small, deterministic engine: chunks of 16 tokens, float32, no warm-up, every cached chunk loaded (on the tiny
#: model computing beats any read, so the measured planner would rightly skip the tiers these tests are about).
TINY_ENGINE: dict[str, Any] = dict(chunk_size=16, dram_capacity="64MiB", ssd_capacity="64MiB", max_new_tokens=6,
                                   device=TEST_DEVICE, dtype="float32", prefetch=False, warmup=False,
                                   load_planner="always-load")


@pytest.fixture(scope="module")
def tiny() -> tuple[Any, Any]:
    """A 2-layer random Llama and its tokenizer, float32."""
    return tiny_model("llama", num_layers=2, dtype=torch.float32)


@pytest.fixture
def tiny_engine(tiny) -> Callable[..., PCREngine]:
    """``tiny_engine(cache_dir, **config)``: a `PCREngine` on the tiny model with `TINY_ENGINE` and ``config``."""
    def make(path: Path, **kw: Any) -> PCREngine:
        model, tok = tiny
        return PCREngine(model=model, tokenizer=tok, config=EngineConfig(cache_dir=path, **{**TINY_ENGINE, **kw}))
    return make
