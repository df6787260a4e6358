"""The RL logic: pure functions and small state machines over the wire's records.

Staleness, advantages, batching, importance correction, the loss, step metrics, and the rollout: its engine
records (`engine_records.py`), how a trajectory's turns line up (`turns.py`), a prompt's ids (`prompt_ids.py`),
multi-turn episodes (`episodes.py`) and scoring, where every sample is built (`scoring.py`). It imports
`pipeline/wire/` (the records) and `pipeline/tasks/`, never I/O of its own.
"""
