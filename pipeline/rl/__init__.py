"""The RL logic: pure functions and small state machines over the wire's records.

Staleness, advantages, batching, importance correction, the loss, step metrics and the rollout's
engine records. It imports `pipeline/wire/` (the records) and `pipeline/tasks/`, never I/O of its own.
"""
