"""Trace-driven simulation of PCR serving on the real cache engine (`pcr-rag simulate`, `pcr-rag profile`).

- `profiles`: the `Profile` format (hardware + model) and the shipped profiles derived from datasheets.
- `measure_profile`: `pcr-rag profile`, measuring a `Profile` on this machine with a real model.
- `costmodel`: prefill/decode/transfer times, the per-layer load/compute/offload pipeline.
- `trace`: workload requests and trace-file requests -> the runtime's chunk plans (and blend mode's documents).
- `simulator`: the discrete-event simulator (real `CacheManager` on a virtual clock, real `plan_prefetch`).
- `belady`: offline MIN eviction, the hit-ratio upper bound.
- `experiment`: bench-shaped runs (warm-up, rates, window sweep, hit-ratio study, speed check).
- `trace_replay`: ``pcr-rag simulate --trace``: a trace file projected onto profiles (exact vs blend reuse).
- `cli` / `validate`: `pcr-rag simulate` and its ``--validate`` mode.
"""
