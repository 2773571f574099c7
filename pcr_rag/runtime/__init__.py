"""Deprecated: the runtime's modules moved to `pcr_rag.sched` (scheduling) and `pcr_rag.model` (loading, the
forward, sampling); each old name is an alias until the release `pcr_rag._moved.REMOVED_IN` names."""
