"""LlamaIndex query engine with PCRLLM: Chroma + local MiniLM embeddings over Python's stdlib docs.

    python examples/llamaindex_query_engine.py [--model ALIAS_OR_DIR]

The second question retrieves the same leading passages as the first, so its prompt's document KV comes from the
cache instead of being recomputed; the answer is the same as without the cache.
"""

from __future__ import annotations

import argparse

from llama_index.core import StorageContext, VectorStoreIndex
from llama_index.core.schema import TextNode
from llama_index.llms.pcr import PCRLLM, MiniLMEmbedding
from llama_index.vector_stores.chroma import ChromaVectorStore

from pcr_rag import EngineConfig, PCREngine
from pcr_rag.corpus import split_passages, stdlib_corpus
from pcr_rag.embeddings import chroma_client, chroma_embedding_function

QUESTIONS = ["How do I insert into a sorted list with bisect?", "What does bisect.bisect_right return?"]


def build_index(tokenizer) -> VectorStoreIndex:
    passages = split_passages(stdlib_corpus(["bisect", "heapq", "json", "textwrap"]), tokens_per_passage=200,
                              tokenizer=tokenizer)
    collection = chroma_client().get_or_create_collection(
        "pcr-example-llamaindex", embedding_function=chroma_embedding_function())  # never Chroma's default
    nodes = [TextNode(text=p.text, id_=p.doc_id) for p in passages]
    storage = StorageContext.from_defaults(vector_store=ChromaVectorStore(chroma_collection=collection))
    return VectorStoreIndex(nodes, storage_context=storage, embed_model=MiniLMEmbedding())


def main(model: str | None = None, cache_dir: str | None = None) -> list[dict]:
    engine = PCREngine(model, config=EngineConfig(cache_dir=cache_dir, max_new_tokens=24))
    try:
        index = build_index(engine.tokenizer)
        llm = PCRLLM(engine=engine)  # or simply PCRLLM(): one shared engine per model/config in the process
        query_engine = index.as_query_engine(llm=llm, similarity_top_k=2)  # "compact" keeps passages whole
        out = []
        for question in QUESTIONS:
            response = query_engine.query(question)
            stats = engine.stats().as_dict()["requests"]
            print(f"Q: {question}\nA: {response.response.strip()}")
            print(f"   sources: {[n.node.id_ for n in response.source_nodes]}; "
                  f"reused prompt tokens so far: {stats['reused_tokens']}\n")
            out.append({"question": question, "answer": response.response,
                        "sources": [n.node.id_ for n in response.source_nodes],
                        "reused_tokens": stats["reused_tokens"]})
        return out
    finally:
        engine.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model alias or HF directory (default model if unset)")
    parser.add_argument("--cache-dir", default=None, help="KV cache directory (default: ~/.cache/pcr-rag/kv)")
    args = parser.parse_args()
    main(args.model, args.cache_dir)
