"""LangChain LCEL RAG chain with ChatPCR: Chroma + local MiniLM embeddings, and the retrieval hook.

    python examples/langchain_lcel_rag.py [--model ALIAS_OR_DIR]

`PCRRetrievalCallback` announces what the retriever returned to the engine (prefetch starts before the model is
called); the model finds those documents through the run tree and caches them as their own token runs.
"""

from __future__ import annotations

import argparse

from langchain_chroma import Chroma
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnablePassthrough
from langchain_pcr import ChatPCR, MiniLMEmbeddings, PCRRetrievalCallback

from pcr_rag import EngineConfig, PCREngine
from pcr_rag.corpus import split_passages, stdlib_corpus
from pcr_rag.embeddings import chroma_client

QUESTIONS = ["How does heapq.heappop work?", "What does heapq.heappush do?"]
PROMPT = ChatPromptTemplate.from_messages([
    ("system", "Answer in one or two sentences using the context."),
    ("human", "Context:\n{context}\n\nQuestion: {question}"),
])


def main(model: str | None = None, cache_dir: str | None = None) -> list[dict]:
    engine = PCREngine(model, config=EngineConfig(cache_dir=cache_dir, max_new_tokens=24))
    try:
        passages = split_passages(stdlib_corpus(["heapq", "bisect", "json", "textwrap"]), tokens_per_passage=200,
                                  tokenizer=engine.tokenizer)
        store = Chroma(collection_name="pcr-example-langchain", embedding_function=MiniLMEmbeddings(),
                       client=chroma_client())
        store.add_texts([p.text for p in passages], ids=[p.doc_id for p in passages])
        retriever = store.as_retriever(search_kwargs={"k": 2})

        llm = ChatPCR(engine=engine)  # or ChatPCR(): one shared engine per model/config in the process
        hook = PCRRetrievalCallback(llm)  # or install_global_retrieval_hook(llm) once for every chain
        context = retriever | (lambda docs: "\n\n".join(d.page_content for d in docs))
        chain = {"context": context, "question": RunnablePassthrough()} | PROMPT | llm

        out = []
        for question in QUESTIONS:
            message = chain.invoke(question, config={"callbacks": [hook]})
            meta = message.response_metadata
            print(f"Q: {question}\nA: {(message.content or '').strip()}")
            print(f"   TTFT {meta['ttft_s']:.2f} s; prompt {meta['prompt_tokens']} tokens, reused {meta['reused_tokens']} "
                  f"(announced by the retriever: {meta['announcement_claimed']})\n")
            out.append({"question": question, "answer": message.content, **meta})
        text_chain = chain | StrOutputParser()  # the same chain, streaming plain text
        print("streamed:", "".join(text_chain.stream(QUESTIONS[0], config={"callbacks": [hook]})).strip())
        return out
    finally:
        engine.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model alias or HF directory (default model if unset)")
    parser.add_argument("--cache-dir", default=None, help="KV cache directory (default: ~/.cache/pcr-rag/kv)")
    args = parser.parse_args()
    main(args.model, args.cache_dir)
