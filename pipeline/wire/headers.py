"""The NATS header names Leeway writes and reads, one place for every publisher and consumer.

Headers carry what a consumer must know before, or instead of, decoding a body: the dedupe id the
server keys on, the schema a body was written in, the policy versions replay filters on without
decoding (`pipeline/wire/replay.py`), the claim-check pointer (`pipeline/wire/claim_check.py`), and on a
dead letter where the original came from and why it was refused (`pipeline/wire/jetstream.py`).
A header name is part of the wire contract between processes launched independently, so it is
spelled once, here; this module imports nothing, so any module may import it.
"""

from __future__ import annotations

H_MSG_ID = "Nats-Msg-Id"
"""The server's dedupe key within a stream's duplicate window: a group's or a prompt's id."""
H_SCHEMA = "Leeway-Schema-Version"
"""Schema version of a trajectory body (`pipeline.wire.trajectory.SCHEMA_VERSION`)."""
H_MIN_VERSION = "Leeway-Min-Version"
"""Lowest policy version over a group's loss tokens (replay filters on it without decoding)."""
H_MAX_VERSION = "Leeway-Max-Version"
"""Highest policy version over a group's loss tokens."""
H_NUM_SAMPLES = "Leeway-Num-Samples"
"""Samples in the group (checked against the body)."""
H_NUM_TOKENS = "Leeway-Num-Tokens"
"""Tokens in the group, all samples together."""
H_ROUTE_BYTES = "Leeway-Route-Bytes-Per-Token"
"""A MoE group's route bytes per position (layers x top_k x id width); absent for a dense group (checked against
the body, and part of the decoder's inflation cap)."""
H_CLAIM_CHECK = "Leeway-Claim-Check"
"""Object-store key of a claim-checked body; the message body is then the pointer, not the group."""
H_DLQ_REASON = "Leeway-Dead-Letter-Reason"
"""Short stable code of why a message was dead-lettered (`decode_error`, `max_deliveries`, ...)."""
H_DLQ_DETAIL = "Leeway-Dead-Letter-Detail"
"""Human-readable detail of the reason, whitespace-folded and capped."""
H_DLQ_STREAM = "Leeway-Original-Stream"
"""Stream the dead-lettered message was delivered from."""
H_DLQ_SEQ = "Leeway-Original-Stream-Seq"
"""Its sequence in that stream."""
H_DLQ_SUBJECT = "Leeway-Original-Subject"
"""The subject it was published on."""
H_DLQ_MSG_ID = "Leeway-Original-Msg-Id"
"""Its `Nats-Msg-Id` (a group's or prompt's id): what returns an admission slot (`actors/trainer/slots.py`)."""
H_DLQ_BODY_OMITTED = "Leeway-Original-Body-Omitted-Bytes"
"""Set when the original body was too large to copy: its size, the dead letter then has an empty body."""
