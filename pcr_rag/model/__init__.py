"""The model: loading (hub, model cache, provenance, weights), the forward and its KV arena, rotary placement,
the kernel probes, sampling, grammar-constrained decoding and detokenization. Depends on `pcr_rag.cache` and the
base modules only; it knows nothing of requests' scheduling."""
