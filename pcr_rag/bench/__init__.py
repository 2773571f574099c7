"""The benchmarks: ``pcr-rag bench`` (serving), ``pcr-rag cache-bench`` (cache micro-benchmarks) and the limit ratio.

- `config`: `BenchConfig`, the ``--quick`` preset, the benchmark's system prompt.
- `systems`: the compared systems as `EngineConfig` overrides (the simulator reads the same table).
- `workload`: requests from document ids (Zipf topics, Poisson/gamma arrivals), working set, tier capacities.
- `retrieval`: real questions with their top-k passages (Chroma + MiniLM) as workload topics.
- `traces`: a run's warm-up and measured traces and exact token counts, from its config alone.
- `serving`: the serving-benchmark harness: real engines, open-loop arrivals, interleaved measured runs.
- `limit`: the limit ratio (cached TTFT over a raw forward over a resident cache), ``python -m pcr_rag.bench.limit``.
- `targets`: every pass/fail threshold the reports check.
- `report`: the report shared with ``pcr-rag simulate``: records, targets judged, JSON, Markdown, PNG plots.
- `disk`: page-cache eviction and a byte-counting storage wrapper.
- `cache_bench`: ``pcr-rag cache-bench``; `cli`: ``pcr-rag bench``.
"""
