"""Scheduling: what runs when. The scheduler and admission, the step budget, the batch executor and its prefill
and decode steps (`runner`), blend mode's plan and gate, announcements, the prefetcher and the tier-to-arena
copies (`transfer`). Depends on `pcr_rag.model` and `pcr_rag.cache`, never on the engine facade."""
