"""`leeway sft`: supervised fine-tuning with the trainer's backends into a checkpoint that RL then post-trains.

`examples.py` (rows or a task's reference answers to ids and a loss mask), `loop.py` (steps, learning-rate
schedule, resumable state), `export.py` (the Hugging Face checkpoint directory), `runtime.py` (the command),
`command.py` (its parser, importable without torch).
"""
