"""Trace-driven simulation of PCR serving on the real cache engine (`pcr-rag simulate`, `pcr-rag profile`).

- `profiles`: hardware + model profiles (shipped, derived from datasheets; or measured by `pcr-rag profile`).
- `costmodel`: prefill/decode/transfer times, the per-layer load/compute/offload pipeline.
- `trace`: workload requests -> the runtime's chunk plans.
- `simulator`: the discrete-event simulator (real `CacheEngine` on a virtual clock, real `plan_prefetch`).
- `belady`: offline MIN eviction, the hit-ratio upper bound.
- `experiment`: bench-shaped runs (warm-up, rates, window sweep, hit-ratio study, speed check).
- `cli` / `profile` / `validate`: the commands.
"""
