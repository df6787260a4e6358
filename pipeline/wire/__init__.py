"""The wire: what crosses a process, and how.

Records and their encodings: `trajectory.py` (the group record), `codec.py` (its Arrow encoding),
`prompts.py` (the prompt record). Names: `names.py` (every subject, stream and key, from the run name),
`headers.py` (every header). Transport, by concept, as nats.py's jetstream package splits it:

    jetstream.py     connect, stream set-up, bounded publishes, taking a delivery, dead letters
    claim_check.py   large groups through the object store, a checked pointer on the stream
    trajectories.py  the trajectory streams, `TrajectoryPublisher`, decoding a received body
    consumer.py      the trainer's durable consumer, `TrajectoryConsumer`
    replay.py        reading a recorded range again, `ReplayReader`
    prompt_queue.py  the prompt work queue, `PromptQueue`

    generator ── TrajectoryPublisher.publish(group) ──► leeway.<run>.traj  (stream LEEWAY_<run>_TRAJ, limits)
                  encode; > max_inline_bytes: body to the object store (create-only, key = run/group/digest),
                  message = pointer (claim check)
                  Nats-Msg-Id = group id; every ack wait bounded; retried with backoff, same id
                                                            │
    trainer rank 0 ◄── TrajectoryConsumer.fetch() ◄─────────┘  durable pull consumer "trainer"
                  decode + validate; failure -> leeway.<run>.dlq.traj (stream LEEWAY_<run>_DLQ) + term()
                  claim object unreadable now (store error, timeout) -> nak with backoff; past max_deliver -> dlq
                  ack(seqs) only after the step that used the groups is committed
    replay   ◄── ReplayReader (ephemeral, ack none) from a stream seq / a start time, filtered by min version

Each module's docstring states the guarantees it keeps. Also here: version announcements
(`announce.py`) and retries with backoff (`retry.py`). Nothing here knows the RL logic: `pipeline/rl/`
imports this package, never the reverse (`tests/test_layout.py`). This file imports nothing, so a light
module (`pipeline/config.py` uses `names.py`) can import one part without NATS.
"""
