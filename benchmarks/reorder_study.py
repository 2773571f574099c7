"""Cache-aware document order (`PCREngine.order_for_reuse`) on the stdlib retrieval workload: what it costs and
what it does to the answers.

    python benchmarks/reorder_study.py cost      # order_for_reuse time for k = 4..10 documents
    python benchmarks/reorder_study.py answers   # relevance vs cache-aware order on the default model

``cost`` times the walk on a tiny random model with the default model's tokenizer (the walk never runs the
model): nothing cached (the walk stops at the first position) and a whole k-document chain cached in reverse order
(the walk visits every position, ``k (k + 1) / 2`` runs), tokens warm in the prompt builder's cache, and the first
call on new documents (their tokenization included).

``answers`` runs every gold-labelled question once, in a seeded order, through two engines on the default model:
one prompts the retrieved passages in relevance order, the other in cache-aware order. It prints how often the
orders and the answers (token ids, greedy) differ, the share of prompt tokens reused, and two quality checks:
whether the answer names the gold module, and where the first gold passage stands in the prompt (hit@1, MRR);
retrieval hit@k (the gold module among the top k) is the same for both orders.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

from pcr_rag.bench.config import SYSTEM_PROMPT
from pcr_rag.bench.retrieval import retrieve_topics
from pcr_rag.config import EngineConfig
from pcr_rag.engine import PCREngine
from pcr_rag.model.model import load_model
from pcr_rag.rag.corpus import STDLIB_MODULES, CorpusDocument, split_passages, stdlib_corpus
from pcr_rag.rag.demo import CORPUS_CACHE_DIR, DEFAULT_QUESTIONS
from pcr_rag.testing import default_tokenizer, tiny_model

__all__ = ["GOLD_QUESTIONS", "AnswerStudy", "CostRow", "measure_answers", "measure_cost", "main"]

#: Questions about the stdlib corpus with the module whose documentation answers them (the bench's built-in
#: questions and the demo's). A passage is gold when its id is ``stdlib/<module>#<n>``.
GOLD_QUESTIONS: tuple[tuple[str, str], ...] = (
    ("How do I parse a JSON string into Python objects?", "json"),
    ("How do I write an object to a file as JSON with indentation?", "json"),
    ("How can I count how often each item occurs in a list?", "collections"),
    ("What is the difference between a deque and a list?", "collections"),
    ("How do I make a dataclass immutable?", "dataclasses"),
    ("How do I parse command-line options with subcommands?", "argparse"),
    ("How do I compute the difference between two dates?", "datetime"),
    ("How do I format a datetime as an ISO 8601 string?", "datetime"),
    ("How do I use decimal arithmetic with a fixed precision?", "decimal"),
    ("How do I find the differences between two sequences of lines?", "difflib"),
    ("How do I define an enumeration with automatic values?", "enum"),
    ("How do I cache the results of an expensive function?", "functools"),
    ("How do I get the n smallest items from a collection efficiently?", "heapq"),
    ("How do I read a gzip-compressed file line by line?", "gzip"),
    ("How do I compute a SHA-256 hash of some bytes?", "hashlib"),
    ("How do I check whether an IP address is in a network?", "ipaddress"),
    ("How do I iterate over all combinations of a list?", "itertools"),
    ("How do I configure logging to write to a file with timestamps?", "logging"),
    ("How do I join path components and get a file's suffix?", "pathlib"),
    ("How do I serialize an object with pickle and what are the risks?", "pickle"),
    ("How do I share a queue between producer and consumer threads?", "queue"),
    ("How do I generate a random sample without replacement?", "random"),
    ("How do I replace text with a regular expression and a callback?", "re"),
    ("How do I generate a secure random token for a password reset link?", "secrets"),
    ("How do I split a shell command line into arguments safely?", "shlex"),
    ("How do I copy a directory tree?", "shutil"),
    ("How do I compute the median and standard deviation of numbers?", "statistics"),
    ("How do I wrap long text to a fixed width?", "textwrap"),
    ("How do I start a background thread and wait for it to finish?", "threading"),
    ("How do I time a small code snippet accurately?", "timeit"),
    ("How do I write a unit test that checks an exception is raised?", "unittest"),
    ("How do I create a random UUID?", "uuid"),
    ("How do I turn warnings into errors?", "warnings"),
    ("How do I keep a reference to an object without preventing garbage collection?", "weakref"),
    ("How do I read the files inside a zip archive?", "zipfile"),
    ("How do I pack integers into bytes in big-endian order?", "struct"),
    *DEFAULT_QUESTIONS,
)


# ---------------------------------------------------------------------------------------------------- cost
@dataclass(frozen=True)
class CostRow:
    """Milliseconds per `order_for_reuse` call for ``k`` documents (medians over the repeats)."""

    k: int
    cold_ms: float      # the first call on new documents (tokenization included), nothing cached
    empty_ms: float     # nothing cached: the walk stops at the first position
    chain_ms: float     # a k-document chain cached in reverse order: every position visited
    placed: bool        # the cached chain's order came back


def measure_cost(passages: Sequence[str], tokenizer, *, ks: Sequence[int] = range(4, 11), repeats: int = 50,
                 chunk_size: int = 256) -> list[CostRow]:
    """`order_for_reuse` time for each k in ``ks`` on a tiny random model with ``tokenizer`` (see the module
    docstring); ``passages`` must hold at least ``2 * max(ks)`` texts."""
    model, _ = tiny_model("llama", seed=0, vocab_size=len(tokenizer))
    rows = []
    cursor = 0
    with PCREngine(model, tokenizer, config=EngineConfig(chunk_size=chunk_size, max_new_tokens=1,
                                                         dram_capacity="1GiB", max_model_len=16384)) as engine:
        for k in ks:
            docs = list(passages[cursor:cursor + k])
            cursor += k
            t0 = time.perf_counter()
            engine.order_for_reuse(docs)
            cold = time.perf_counter() - t0
            empty = _median_s(engine.order_for_reuse, docs, repeats)
            engine.generate("q?", docs[::-1])
            chain = _median_s(engine.order_for_reuse, docs, repeats)
            rows.append(CostRow(k, 1e3 * cold, 1e3 * empty, 1e3 * chain, engine.order_for_reuse(docs) == docs[::-1]))
    return rows


def _median_s(fn, arg, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(arg)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ---------------------------------------------------------------------------------------------------- answers
@dataclass(frozen=True)
class AnswerStudy:
    """Relevance vs cache-aware order over ``questions`` requests (one per question)."""

    questions: int
    top_k: int
    reordered: int                 # requests whose cache-aware order differs from relevance order
    answers_equal: int             # requests with identical answer token ids in both runs
    answers_equal_reordered: int   # ... among the reordered ones
    retrieval_hit_at_k: float      # gold module among the top k (same for both orders)
    answer_names_gold: tuple[float, float]   # (relevance, cache-aware): answer mentions the gold module
    gold_first: tuple[float, float]          # first prompt document is gold
    gold_mrr: tuple[float, float]            # mean reciprocal rank of the first gold passage in the prompt
    reuse_ratio: tuple[float, float]         # reused / prompt tokens over all requests
    prefix_hit_ratio: tuple[float, float]    # reused / document-prefix tokens (head + documents)


def measure_answers(*, top_k: int = 4, max_new_tokens: int = 32, tokens_per_passage: int = 300,
                    num_questions: int | None = None, seed: int = 0, model: str | None = None) -> AnswerStudy:
    """Run the gold questions through the relevance-order and the cache-aware-order engine (see the module
    docstring). Deterministic for a seed (greedy decoding)."""
    loaded = load_model(model)
    passages = split_passages(stdlib_corpus(STDLIB_MODULES, cache_dir=CORPUS_CACHE_DIR), tokens_per_passage=tokens_per_passage,
                              tokenizer=loaded.tokenizer)
    by_id: dict[str, CorpusDocument] = {p.doc_id: p for p in passages}
    pairs = list(GOLD_QUESTIONS)
    random.Random(seed).shuffle(pairs)
    pairs = pairs[:num_questions] if num_questions else pairs
    topics = retrieve_topics(passages, [q for q, _ in pairs], top_k)
    runs = {}
    cfg = EngineConfig(chunk_size=256, max_new_tokens=max_new_tokens, dram_capacity="6GiB", ssd_capacity=0)
    for mode in ("relevance", "cache-aware"):
        with PCREngine(loaded.model, loaded.tokenizer, config=cfg) as engine:
            rows = []
            for (question, _), (_, ids) in zip(pairs, topics):
                docs = [by_id[i].text for i in ids]
                if mode == "cache-aware":
                    order = engine.order_for_reuse(docs, system=SYSTEM_PROMPT, layout="rag")
                    ids = tuple(ids[docs.index(t)] for t in order)  # passages are distinct texts
                    docs = order
                result = engine.generate(question, docs, system=SYSTEM_PROMPT)
                doc_prefix = sum(s.num_tokens for s in engine.plan_for(question, docs, system=SYSTEM_PROMPT)
                                 if s.segment <= len(docs))
                rows.append((ids, result, doc_prefix))
            runs[mode] = rows
    rel, aware = runs["relevance"], runs["cache-aware"]
    golds = [g for _, g in pairs]
    n = len(pairs)

    def is_gold(doc_id: str, gold: str) -> bool:
        return doc_id.startswith(f"stdlib/{gold}#")

    def per_mode(rows, fn) -> float:
        return sum(fn(row, gold) for row, gold in zip(rows, golds)) / n

    def rank(ids, gold) -> float:
        return next((1.0 / (i + 1) for i, d in enumerate(ids) if is_gold(d, gold)), 0.0)

    reordered = [r[0] != a[0] for r, a in zip(rel, aware)]
    equal = [r[1].token_ids == a[1].token_ids for r, a in zip(rel, aware)]
    return AnswerStudy(
        questions=n, top_k=top_k, reordered=sum(reordered), answers_equal=sum(equal),
        answers_equal_reordered=sum(e for e, moved in zip(equal, reordered) if moved),
        retrieval_hit_at_k=sum(any(is_gold(d, g) for d in t[1]) for t, g in zip(topics, golds)) / n,
        answer_names_gold=tuple(per_mode(rows, lambda row, g: g.lower() in row[1].text.lower())
                                for rows in (rel, aware)),
        gold_first=tuple(per_mode(rows, lambda row, g: is_gold(row[0][0], g)) for rows in (rel, aware)),
        gold_mrr=tuple(per_mode(rows, lambda row, g: rank(row[0], g)) for rows in (rel, aware)),
        reuse_ratio=tuple(sum(r[1].metrics.reused_tokens for r in rows) / sum(r[1].metrics.prompt_tokens
                                                                               for r in rows)
                          for rows in (rel, aware)),
        prefix_hit_ratio=tuple(sum(r[1].metrics.reused_tokens for r in rows) / sum(r[2] for r in rows)
                               for rows in (rel, aware)),
    )


# ---------------------------------------------------------------------------------------------------- CLI
def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python benchmarks/reorder_study.py", description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=("cost", "answers"))
    parser.add_argument("--top-k", type=int, default=4, help="passages per question (answers)")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="answer length cap (answers)")
    parser.add_argument("--questions", type=int, default=None, help="use only the first N shuffled questions")
    parser.add_argument("--seed", type=int, default=0, help="question order")
    parser.add_argument("--repeats", type=int, default=50, help="timed calls per k (cost)")
    args = parser.parse_args(argv)
    if args.what == "cost":
        tokenizer = default_tokenizer()
        passages = [p.text for p in split_passages(stdlib_corpus(STDLIB_MODULES[:12], cache_dir=CORPUS_CACHE_DIR), tokens_per_passage=300,
                                                   tokenizer=tokenizer)]
        print("order_for_reuse cost (ms per call; SmolLM2 tokenizer, ~300-token passages, chunk 256)")
        print(f"{'k':>3} {'cold':>8} {'empty':>8} {'chain':>8}  chain replayed")
        for row in measure_cost(passages, tokenizer, repeats=args.repeats):
            print(f"{row.k:>3} {row.cold_ms:8.2f} {row.empty_ms:8.3f} {row.chain_ms:8.3f}  {row.placed}")
        return
    study = measure_answers(top_k=args.top_k, max_new_tokens=args.max_new_tokens, num_questions=args.questions,
                            seed=args.seed)
    print(f"{study.questions} questions, top-{study.top_k}, greedy, default model")
    print(f"reordered by cache-aware order : {study.reordered}/{study.questions}")
    print(f"answers identical (token ids)  : {study.answers_equal}/{study.questions} "
          f"({study.answers_equal_reordered}/{study.reordered} of the reordered)")
    print(f"retrieval hit@{study.top_k} (both orders)  : {study.retrieval_hit_at_k:.2f}")
    print(f"{'':32}{'relevance':>10} {'cache-aware':>12}")
    for label, pair in (("answer names the gold module", study.answer_names_gold),
                        ("gold passage first (hit@1)", study.gold_first), ("gold passage MRR", study.gold_mrr),
                        ("prompt tokens reused", study.reuse_ratio), ("document-prefix hit ratio",
                                                                      study.prefix_hit_ratio)):
        print(f"{label:32}{pair[0]:>10.2f} {pair[1]:>12.2f}")


if __name__ == "__main__":
    main()
