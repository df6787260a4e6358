"""The wire: what crosses a process, and how.

Records (`trajectory.py`, `prompts.py`), their Arrow encoding (`codec.py`), the names every subject,
stream and key derives from (`names.py`), the JetStream transport and the prompt queue, version
announcements and retries. Nothing here knows the RL logic: `pipeline/rl/` imports this package,
never the reverse (`tests/test_layout.py`).
"""
