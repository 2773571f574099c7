"""The RAG pipeline around the engine: offline corpora cut into passages (`corpus`), offline sentence embeddings
for Chroma (`embeddings`), and `pcr-rag demo` (`demo`), which puts them together with `PCRLLM`."""
