"""LlamaIndex over your own folder: SimpleDirectoryReader -> Chroma (in process) + local MiniLM -> PCRLLM.

    python examples/llamaindex_query_engine.py [FOLDER] [--question Q ...] [--model ALIAS_OR_DIR]

FOLDER holds the documents (.txt and .md files, searched recursively; default: examples/data, a few notes on
Python modules). Each file is one document; LlamaIndex splits long files into nodes. A later question that
retrieves the same leading documents takes their KV from the cache instead of recomputing it, and its answer is
exactly the one it would get without the cache.
"""

from __future__ import annotations

import argparse
import uuid
from pathlib import Path

from llama_index.core import SimpleDirectoryReader, StorageContext, VectorStoreIndex
from llama_index.llms.pcr import PCRLLM, MiniLMEmbedding
from llama_index.vector_stores.chroma import ChromaVectorStore

from pcr_rag import EngineConfig, PCREngine
from pcr_rag.rag.embeddings import chroma_client, chroma_embedding_function

DATA = Path(__file__).resolve().parent / "data"
QUESTIONS = ["How do I insert into a sorted list with bisect?", "What does bisect.bisect_right return?"]


def load_folder(folder: str | Path) -> list:
    """Every .txt / .md file under ``folder`` as a LlamaIndex document whose only metadata is its file name (the
    reader's default metadata holds the absolute path and dates, which would enter the prompt)."""
    reader = SimpleDirectoryReader(str(folder), required_exts=[".txt", ".md"], recursive=True,
                                   file_metadata=lambda path: {"file_name": Path(path).name})
    return reader.load_data()


def build_index(folder: str | Path) -> VectorStoreIndex:
    collection = chroma_client().create_collection(  # a new in-process collection per index
        f"pcr-example-{uuid.uuid4().hex[:12]}", embedding_function=chroma_embedding_function())  # never Chroma's default
    storage = StorageContext.from_defaults(vector_store=ChromaVectorStore(chroma_collection=collection))
    return VectorStoreIndex.from_documents(load_folder(folder), storage_context=storage, embed_model=MiniLMEmbedding())


def main(model: str | None = None, cache_dir: str | None = None, folder: str | Path = DATA,
         questions: list[str] | None = None) -> list[dict]:
    engine = PCREngine(model, config=EngineConfig(cache_dir=cache_dir, max_new_tokens=24))
    try:
        index = build_index(folder)
        llm = PCRLLM(engine=engine)  # or simply PCRLLM(): one shared engine per model/config in the process
        query_engine = index.as_query_engine(llm=llm, similarity_top_k=2)  # "compact" keeps documents whole
        out = []
        for question in questions or QUESTIONS:
            response = query_engine.query(question)
            stats = engine.stats().as_dict()["requests"]
            sources = [n.node.metadata["file_name"] for n in response.source_nodes]
            print(f"Q: {question}\nA: {response.response.strip()}")
            print(f"   sources: {sources}; reused prompt tokens so far: {stats['reused_tokens']}\n")
            out.append({"question": question, "answer": response.response, "sources": sources,
                        "reused_tokens": stats["reused_tokens"]})
        return out
    finally:
        engine.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", nargs="?", default=str(DATA), help="folder of .txt/.md files (default: %(default)s)")
    parser.add_argument("--question", action="append", help="ask this (repeatable; default: two bisect questions)")
    parser.add_argument("--model", default=None, help="model alias or HF directory (default model if unset)")
    parser.add_argument("--cache-dir", default=None, help="KV cache directory (default: ~/.cache/pcr-rag/kv)")
    args = parser.parse_args()
    main(args.model, args.cache_dir, args.folder, args.question)
