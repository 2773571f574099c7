"""How many pcr_rag modules a chat request's body passes through inside the server, from the route handler's entry
until `PCREngine.submit` is called.

A tiny random Llama (`pcr_rag.testing.tiny_model`, as tests/server/conftest.py builds it) is served by `create_app`
through FastAPI's `TestClient`; one RAG chat request (messages, documents, sampling fields) is sent to
``/v1/chat/completions`` under a `sys.setprofile` / `threading.setprofile` tracer. From the first entry into the
route's endpoint function (read from the app's routes, so the script works whatever module holds it) until the first
entry into `PCREngine.submit`, each Python ``call`` and ``return`` event on the request's path (the handler's thread
and the ``pcr-request`` worker threads, `ServerState.off_loop`) records the pcr_rag module that runs next: the
called function's on a call, the caller's on a return; frames outside pcr_rag (FastAPI, pydantic, the standard
library) record nothing. Consecutive repeats are collapsed, so the sequence is the walk a reader makes through the
modules: its length minus one is the number of module switches. The submit itself is not recorded (the engine's
properties read on the way, such as its tokenizer and limits, are).

Run: ``.venv/bin/python scripts/chat_body_path.py`` (CPU, a few seconds). Prints the distinct modules, the switches
and the sequence.
"""

from __future__ import annotations

import logging
import sys
import tempfile
import threading
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

from fastapi.routing import APIRoute
from fastapi.testclient import TestClient

from pcr_rag import EngineConfig, PCREngine
from pcr_rag.server import ServerSettings, create_app
from pcr_rag.testing import tiny_model

CHAT_PATH = "/v1/chat/completions"
DOCS = (
    "pathlib offers classes for filesystem paths. Path objects join with the slash operator.",
    "json encodes Python objects as JSON text. json.dumps returns a str and json.loads parses one.",
)
QUESTION = "What do pathlib and json do?"


class ModuleWalk:
    """The profiler hook: records the pcr_rag module entered on each call/return event of the request's path,
    between the first entry into ``start`` and the first entry into ``stop``."""

    def __init__(self, start: CodeType, stop: CodeType) -> None:
        self.start = start
        self.stop = stop
        self.recording = False
        self.done = False
        self.handler_thread: int | None = None
        self.modules: list[str] = []
        self.lock = threading.Lock()

    def _on_path(self) -> bool:
        thread = threading.current_thread()
        return thread.ident == self.handler_thread or thread.name.startswith("pcr-request")

    def _enter(self, frame: FrameType | None) -> None:
        module = frame.f_globals.get("__name__", "") if frame is not None else ""
        if module.startswith("pcr_rag") and (not self.modules or self.modules[-1] != module):
            self.modules.append(module)

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if self.done or event not in ("call", "return"):
            return
        with self.lock:
            if self.done:
                return
            if not self.recording:
                if event == "call" and frame.f_code is self.start:
                    self.recording = True
                    self.handler_thread = threading.get_ident()
                    self._enter(frame)
                return
            if not self._on_path():
                return
            if event == "call" and frame.f_code is self.stop:
                self.done = True
                return
            self._enter(frame if event == "call" else frame.f_back)


def chat_endpoint(app: Any) -> CodeType:
    for route in app.routes:
        if isinstance(route, APIRoute) and route.path == CHAT_PATH and "POST" in route.methods:
            return route.endpoint.__code__
    raise LookupError(f"no POST {CHAT_PATH} route")


def walk() -> list[str]:
    model, tokenizer = tiny_model("llama", seed=0)
    with tempfile.TemporaryDirectory() as tmp:
        config = EngineConfig(cache_dir=Path(tmp) / "kv", chunk_size=16, max_new_tokens=4, dram_capacity="64MiB",
                              ssd_capacity="64MiB", max_active=4, max_model_len=1024, dtype="float32")
        engine = PCREngine(model, tokenizer, config=config)
        try:
            app = create_app(engine, ServerSettings(served_model_name="tiny"))
            tracer = ModuleWalk(chat_endpoint(app), PCREngine.submit.__code__)
            body = {"model": "tiny", "documents": list(DOCS), "max_tokens": 4, "temperature": 0.7, "top_p": 0.9,
                    "seed": 1, "stop": ["\n\n"],
                    "messages": [{"role": "system", "content": "Answer from the context."},
                                 {"role": "user", "content": "Context:\n" + "\n\n".join(DOCS)
                                                             + f"\n\nQuestion: {QUESTION}"}]}
            threading.setprofile(tracer)
            sys.setprofile(tracer)
            try:
                with TestClient(app) as client:
                    response = client.post(CHAT_PATH, json=body)
            finally:
                sys.setprofile(None)
                threading.setprofile(None)  # type: ignore[arg-type]
            if response.status_code != 200:
                raise RuntimeError(f"the chat request failed: {response.status_code} {response.text}")
            if not tracer.done:
                raise RuntimeError("the engine's submit was never reached on the request's path")
            return tracer.modules
        finally:
            engine.close()


def main() -> None:
    logging.disable(logging.WARNING)
    modules = walk()
    print(f"distinct pcr_rag modules: {len(set(modules))}")
    print(f"module switches: {len(modules) - 1}")
    print(f"sequence ({len(modules)} entries, handler entry -> PCREngine.submit):")
    for module in modules:
        print(f"  {module}")


if __name__ == "__main__":
    main()
