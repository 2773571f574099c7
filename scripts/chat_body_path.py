"""How many pcr_rag modules a chat request's body passes through inside the server, from the route handler's entry
until `PCREngine.submit` is called.

A tiny random Llama (`pcr_rag.testing.tiny_model`, as tests/server/conftest.py builds it) is served by `create_app`
through FastAPI's `TestClient`; one RAG chat request (messages, documents, sampling fields) is sent to
``/v1/chat/completions`` under a `sys.setprofile` / `threading.setprofile` tracer. From the first entry into the
route's endpoint function (read from the app's routes, so the script works whatever module holds it) until the first
entry into `PCREngine.submit`, on the request's path (the handler's thread and the ``pcr-request`` worker threads,
`ServerState.off_loop`), each Python function entered records its pcr_rag module; frames outside pcr_rag (FastAPI,
pydantic, the standard library) record nothing. Consecutive repeats are collapsed, so the sequence is the walk a
reader makes through the modules: its length minus one is the number of module switches. The submit itself is not
recorded (the engine's properties read on the way, such as its tokenizer and limits, are).

The stricter count also records a return into a pcr_rag caller (the caller's module is where the reader goes back
to): printed as a second figure, and its sequence with ``--returns``.

Run: ``.venv/bin/python scripts/chat_body_path.py [--returns]`` (CPU, a few seconds). Prints the distinct modules,
the switches and the sequence.
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
    """The profiler hook: between the first entry into ``start`` and the first entry into ``stop``, on the request's
    path, records the pcr_rag module of each function entered (`entered`), and of each function entered or returned
    to (`walked`)."""

    def __init__(self, start: CodeType, stop: CodeType) -> None:
        self.start = start
        self.stop = stop
        self.recording = False
        self.done = False
        self.handler_thread: int | None = None
        self.entered: list[str] = []
        self.walked: list[str] = []
        self.lock = threading.Lock()

    def _on_path(self) -> bool:
        thread = threading.current_thread()
        return thread.ident == self.handler_thread or thread.name.startswith("pcr-request")

    @staticmethod
    def _add(modules: list[str], frame: FrameType | None) -> None:
        module = frame.f_globals.get("__name__", "") if frame is not None else ""
        if module.startswith("pcr_rag") and (not modules or modules[-1] != module):
            modules.append(module)

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
                    self._add(self.entered, frame)
                    self._add(self.walked, frame)
                return
            if not self._on_path():
                return
            if event == "call" and frame.f_code is self.stop:
                self.done = True
            elif event == "call":
                self._add(self.entered, frame)
                self._add(self.walked, frame)
            else:
                self._add(self.walked, frame.f_back)


def chat_endpoint(app: Any) -> CodeType:
    """The code of the app's ``POST /v1/chat/completions`` endpoint, declared on the app or on a router it
    includes (FastAPI keeps an included router's routes behind ``original_router``)."""
    pending = list(app.routes)
    while pending:
        route = pending.pop(0)
        if isinstance(route, APIRoute) and route.path == CHAT_PATH and "POST" in route.methods:
            return route.endpoint.__code__
        pending.extend(getattr(getattr(route, "original_router", None), "routes", ()))
    raise LookupError(f"no POST {CHAT_PATH} route")


def walk() -> ModuleWalk:
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
            return tracer
        finally:
            engine.close()


def main() -> None:
    returns = "--returns" in sys.argv[1:]
    logging.disable(logging.WARNING)
    tracer = walk()
    entered, walked = tracer.entered, tracer.walked
    print(f"distinct pcr_rag modules: {len(set(entered))}")
    print(f"module switches: {len(entered) - 1}")
    print(f"module switches, returns to a caller counted too: {len(walked) - 1}")
    shown = walked if returns else entered
    what = "entered or returned to" if returns else "entered"
    print(f"sequence of modules {what} ({len(shown)} entries, handler entry -> PCREngine.submit):")
    for module in shown:
        print(f"  {module}")


if __name__ == "__main__":
    main()
