"""LangChain over your own folder: DirectoryLoader -> Chroma (in process) + local MiniLM -> an LCEL chain on ChatPCR.

    python examples/langchain_lcel_rag.py [FOLDER] [--question Q ...] [--model ALIAS_OR_DIR]

FOLDER holds the documents (.txt and .md files, searched recursively, read with `TextLoader`; default:
examples/data, a few notes on Python modules). `PCRRetrievalCallback` announces what the retriever returned to
the engine (prefetch starts before the model is called); the model finds those documents through the run tree and
caches them as their own token runs, so a later question that retrieves the same leading documents reuses their KV.
"""

from __future__ import annotations

import argparse
import uuid
from pathlib import Path

from langchain_chroma import Chroma
from langchain_community.document_loaders import DirectoryLoader, TextLoader
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnablePassthrough
from langchain_pcr import ChatPCR, MiniLMEmbeddings, PCRRetrievalCallback

from pcr_rag import EngineConfig, PCREngine
from pcr_rag.rag.embeddings import chroma_client

DATA = Path(__file__).resolve().parent / "data"
QUESTIONS = ["How does heapq.heappop work?", "What does heapq.heappush do?"]
PROMPT = ChatPromptTemplate.from_messages([
    ("system", "Answer in one or two sentences using the context."),
    ("human", "Context:\n{context}\n\nQuestion: {question}"),
])


def load_folder(folder: str | Path) -> list:
    """Every .txt / .md file under ``folder`` as one LangChain document (`TextLoader`: no `unstructured` needed)."""
    loader = DirectoryLoader(str(folder), glob=["**/*.txt", "**/*.md"], loader_cls=TextLoader,
                             loader_kwargs={"encoding": "utf-8"})
    return loader.load()


def main(model: str | None = None, cache_dir: str | None = None, folder: str | Path = DATA,
         questions: list[str] | None = None) -> list[dict]:
    engine = PCREngine(model, config=EngineConfig(cache_dir=cache_dir, max_new_tokens=24))
    try:
        docs = load_folder(folder)
        store = Chroma(collection_name=f"pcr-example-{uuid.uuid4().hex[:12]}",  # a new in-process collection
                       embedding_function=MiniLMEmbeddings(), client=chroma_client())
        store.add_documents(docs)
        retriever = store.as_retriever(search_kwargs={"k": 2})

        llm = ChatPCR(engine=engine)  # or ChatPCR(): one shared engine per model/config in the process
        hook = PCRRetrievalCallback(llm)  # or install_global_retrieval_hook(llm) once for every chain
        context = retriever | (lambda found: "\n\n".join(d.page_content for d in found))
        chain = {"context": context, "question": RunnablePassthrough()} | PROMPT | llm

        out = []
        for question in questions or QUESTIONS:
            message = chain.invoke(question, config={"callbacks": [hook]})
            meta = message.response_metadata
            print(f"Q: {question}\nA: {(message.content or '').strip()}")
            print(f"   TTFT {meta['ttft_s']:.2f} s; prompt {meta['prompt_tokens']} tokens, reused {meta['reused_tokens']} "
                  f"(announced by the retriever: {meta['announcement_claimed']})\n")
            out.append({"question": question, "answer": message.content, **meta})
        text_chain = chain | StrOutputParser()  # the same chain, streaming plain text
        print("streamed:", "".join(text_chain.stream(out[0]["question"], config={"callbacks": [hook]})).strip())
        return out
    finally:
        engine.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", nargs="?", default=str(DATA), help="folder of .txt/.md files (default: %(default)s)")
    parser.add_argument("--question", action="append", help="ask this (repeatable; default: two heapq questions)")
    parser.add_argument("--model", default=None, help="model alias or HF directory (default model if unset)")
    parser.add_argument("--cache-dir", default=None, help="KV cache directory (default: ~/.cache/pcr-rag/kv)")
    args = parser.parse_args()
    main(args.model, args.cache_dir, args.folder, args.question)
