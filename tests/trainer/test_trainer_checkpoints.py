"""Trainer checkpoint layout, metrics roll-back, the prompt feed and the dedupe record (no servers)."""

from __future__ import annotations

import logging
from pathlib import Path

import orjson
import pytest
import torch

from actors.models import load_tokenizer
from actors.trainer.backends.checkpoint import encode_checkpoint
from actors.trainer.checkpoints import (
    DAMAGED_FILE,
    KEEP_CHECKPOINTS,
    MANIFEST_FILE,
    CheckpointFormatError,
    RecentIds,
    TrainerState,
    checkpoint_files,
    checkpoint_prefix,
    commit_sharded_checkpoint,
    complete_checkpoints,
    load_checkpoint,
    load_latest_checkpoint,
    new_attempt,
    write_checkpoint,
    write_rank_files,
)
from actors.trainer.metrics_log import roll_back_metrics
from actors.trainer.prompt_feed import PromptFeed
from pipeline.config import LeewayConfig
from pipeline.tasks import get_task
from storage.filestore import FileStore

RUN = "ckpt-run"


class _RecordingStore(FileStore):
    """A FileStore that remembers the order of writes."""

    def __init__(self, root: Path) -> None:
        super().__init__(str(root))
        self.writes: list[str] = []

    def put(self, key: str, data: bytes) -> str:
        self.writes.append(key)
        return super().put(key, data)

    def put_if_absent(self, key: str, data: bytes) -> str:
        self.writes.append(key)
        return super().put_if_absent(key, data)


def _write(store: FileStore, version: int, step: int | None = None, fill: float | None = None) -> str:
    state = TrainerState(
        step=step if step is not None else version,
        version=version,
        consumed_seq=10 * version,
        handled_group_ids=[f"g{version}"],
    )
    value = float(version) if fill is None else fill
    tensors = {"model/w": torch.full((2, 3), value), "optimizer/w/exp_avg": torch.zeros(2, 3)}
    return write_checkpoint(store, RUN, state, tensors, {"backend": "fake", "version": version})


def test_manifest_is_written_last(tmp_path: Path) -> None:
    store = _RecordingStore(tmp_path)
    prefix = _write(store, 4)
    assert store.writes[-1] == prefix + MANIFEST_FILE
    assert len(store.writes) > 2


def test_checkpoint_round_trips_state_tensors_and_meta(tmp_path: Path) -> None:
    store = FileStore(str(tmp_path))
    _write(store, 4)
    loaded = load_latest_checkpoint(store, RUN)
    assert loaded is not None
    state, tensors, meta = loaded
    assert (state.step, state.version, state.consumed_seq, state.handled_group_ids) == (4, 4, 40, ["g4"])
    assert torch.equal(tensors["model/w"], torch.full((2, 3), 4.0))
    assert meta == {"backend": "fake", "version": 4}


def test_checkpoint_without_manifest_is_ignored(tmp_path: Path) -> None:
    store = FileStore(str(tmp_path))
    _write(store, 2)
    _write(store, 4)
    store.delete(checkpoint_prefix(RUN, 4) + MANIFEST_FILE)  # as if killed before the manifest
    loaded = load_latest_checkpoint(store, RUN)
    assert loaded is not None and loaded[0].version == 2
    assert complete_checkpoints(store, RUN) == [2]


def test_no_checkpoint_loads_none(tmp_path: Path) -> None:
    assert load_latest_checkpoint(FileStore(str(tmp_path)), RUN) is None


def test_prune_keeps_the_newest_and_removes_older_leftovers(tmp_path: Path) -> None:
    store = FileStore(str(tmp_path))
    _write(store, 1)
    store.delete(checkpoint_prefix(RUN, 1) + MANIFEST_FILE)  # an interrupted write, older than what follows
    for version in (2, 4, 6, 8):
        _write(store, version)
    assert complete_checkpoints(store, RUN) == [6, 8][-KEEP_CHECKPOINTS:]
    assert store.list(checkpoint_prefix(RUN, 1)) == []
    assert store.list(checkpoint_prefix(RUN, 2)) == []


def test_corrupted_file_is_refused(tmp_path: Path) -> None:
    store = FileStore(str(tmp_path))
    _write(store, 3)
    store.put(checkpoint_files(store, RUN, 3)["model.safetensors"], b"not what the manifest says")
    with pytest.raises(ValueError, match="model.safetensors"):
        load_latest_checkpoint(store, RUN)


def test_reused_version_is_an_error(tmp_path: Path) -> None:
    store = FileStore(str(tmp_path))
    _write(store, 3)
    with pytest.raises(ValueError, match="already has a manifest"):
        _write(store, 3)


def test_a_refused_second_writer_at_the_same_version_leaves_the_first_checkpoint_loadable(tmp_path: Path) -> None:
    store = FileStore(str(tmp_path))
    _write(store, 3, fill=1.0)
    first = set(store.list(checkpoint_prefix(RUN, 3)))
    with pytest.raises(ValueError, match="already has a manifest"):
        _write(store, 3, fill=2.0)  # another trainer, or a reused number: different tensors, same version
    loaded = load_latest_checkpoint(store, RUN)
    assert loaded is not None and loaded[0].version == 3
    assert torch.equal(loaded[1]["model/w"], torch.full((2, 3), 1.0)), "the first checkpoint's files are intact"
    assert set(store.list(checkpoint_prefix(RUN, 3))) == first, "the refused writer removed its own files"


def _write_sharded(store: FileStore, version: int, fill: float, world: int = 2) -> str:
    """What a `RankGroup` checkpoint round writes: each rank its rows of `model/w` under one attempt, then
    rank 0's index, state and manifest."""
    attempt = new_attempt()
    digests, shards = [], []
    for rank in range(world):
        rows = torch.full((1, 3), fill + rank)
        files = encode_checkpoint({"model/w": rows, "rng/seed": torch.tensor([7])}, {"rank": rank})
        digests.append(write_rank_files(store, RUN, version, rank, files, attempt))
        shards.append({"model/w": [world, rank, 1]})
    state = TrainerState(step=version, version=version)
    return commit_sharded_checkpoint(store, RUN, state, digests, shards, attempt)


def test_a_refused_second_sharded_writer_leaves_the_first_checkpoint_loadable(tmp_path: Path) -> None:
    store = FileStore(str(tmp_path))
    _write_sharded(store, 5, fill=1.0)
    with pytest.raises(ValueError, match="already has a manifest"):
        _write_sharded(store, 5, fill=10.0)
    for rank in (0, 1):
        state, tensors, meta = load_checkpoint(store, RUN, 5, rank=rank)
        assert state.version == 5 and meta == {"rank": rank}
        assert torch.equal(tensors["model/w"], torch.tensor([[1.0] * 3, [2.0] * 3])), "every rank's rows intact"
    names = set(checkpoint_files(store, RUN, 5))
    assert {"index.json", "trainer_state.json", "rank-00000/model.safetensors", "rank-00001/meta.json"} <= names


@pytest.mark.parametrize("damage", ["corrupted", "missing"])
def test_resume_falls_back_to_the_newest_intact_checkpoint_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: str
) -> None:
    store = FileStore(str(tmp_path))
    _write(store, 2)
    _write(store, 4)
    key = checkpoint_files(store, RUN, 4)["model.safetensors"]
    if damage == "corrupted":
        store.put(key, b"bit rot")
    else:
        store.delete(key)
    with caplog.at_level(logging.WARNING, logger="actors.trainer.checkpoints"):
        loaded = load_latest_checkpoint(store, RUN)
    assert loaded is not None
    state, tensors, _ = loaded
    assert state.version == 2 and torch.equal(tensors["model/w"], torch.full((2, 3), 2.0))
    warned = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert "v4" in warned and "model.safetensors" in warned
    assert ("does not match" if damage == "corrupted" else "missing") in warned
    assert complete_checkpoints(store, RUN) == [2], "v4 is marked damaged: never loaded again"
    _write(store, 6)  # the resumed run's next checkpoint: pruning must keep the one it resumed from
    assert complete_checkpoints(store, RUN) == [2, 6]
    assert orjson.loads(store.get(checkpoint_prefix(RUN, 4) + DAMAGED_FILE))["version"] == 4  # kept for a person
    assert store.list(checkpoint_prefix(RUN, 4) + MANIFEST_FILE)


def test_resume_with_every_checkpoint_damaged_refuses_naming_each(tmp_path: Path) -> None:
    store = FileStore(str(tmp_path))
    _write(store, 2)
    _write(store, 4)
    for version in (2, 4):
        store.put(checkpoint_files(store, RUN, version)["trainer_state.json"], b"{}")
    with pytest.raises(ValueError, match=r"no complete checkpoint loads: v4: .*trainer_state.json.*; v2: "):
        load_latest_checkpoint(store, RUN)
    with pytest.raises(ValueError, match=r"every checkpoint is marked damaged \(v2, v4"):
        load_latest_checkpoint(store, RUN)  # a second resume: still refused, never a fresh start


def test_state_of_another_format_is_refused() -> None:
    data = orjson.dumps({**orjson.loads(TrainerState().to_json()), "state_format": 99})
    with pytest.raises(CheckpointFormatError, match="state_format=99"):
        TrainerState.from_json(data, "x")
    newer = orjson.dumps({**orjson.loads(TrainerState().to_json()), "a_later_field": [1]})
    with pytest.raises(CheckpointFormatError, match="a_later_field"):  # not damage: never marked, never skipped
        TrainerState.from_json(newer, "x")
    older = orjson.loads(TrainerState(step=3).to_json())
    del older["claim_objects"]
    assert TrainerState.from_json(orjson.dumps(older), "x").step == 3  # an older state loads


def test_roll_back_moves_records_after_the_checkpoint_and_torn_lines(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    lines = [orjson.dumps({"step": s, "version": s}) for s in (1, 2, 3, 4)]
    path.write_bytes(b"\n".join(lines) + b'\n{"step": 5, "ver')
    assert roll_back_metrics(path, 2) == 3
    assert [orjson.loads(x)["step"] for x in path.read_bytes().splitlines()] == [1, 2]
    rolled = (tmp_path / "metrics.rolled_back.jsonl").read_bytes().splitlines()
    assert [orjson.loads(x)["step"] for x in rolled[:2]] == [3, 4] and rolled[2].startswith(b'{"step": 5')


def test_prompt_feed_is_deterministic_unique_and_resumable() -> None:
    cfg = LeewayConfig()
    task = get_task("reverse_digits", num_digits=4)
    first = PromptFeed(cfg, task, start=0).take(7)
    resumed = PromptFeed(cfg, task, start=4).take(3)
    assert [p.prompt_id for p in first[4:]] == [p.prompt_id for p in resumed]
    assert [p.text for p in first[4:]] == [p.text for p in resumed]
    assert len({p.prompt_id for p in first}) == 7


def test_prompt_feed_ids_stay_unique_when_the_task_cycles(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "1>", "answer": "1"}\n{"prompt": "2>", "answer": "2"}\n')
    cfg = LeewayConfig.model_validate({"task": {"name": "exact_match", "args": {"path": str(path)}}})
    prompts = PromptFeed(cfg, get_task("exact_match", path=str(path)), start=0).take(6)
    assert len({p.prompt_id for p in prompts}) == 6
    assert [p.text for p in prompts] != []


def test_recent_ids_forget_the_oldest_past_the_limit() -> None:
    ids = RecentIds(["a", "b"], limit=3)
    ids.add_all(["b", "c", "d"])
    assert "a" not in ids and all(x in ids for x in "bcd")
    assert ids.to_list() == ["b", "c", "d"]


def test_a_prompts_file_with_a_row_that_can_never_be_admitted_is_refused_naming_file_row_and_limit(
    tmp_path: Path,
) -> None:
    path = tmp_path / "p.jsonl"
    rows = [{"prompt": "12>", "answer": "21"}, {"prompt": "3" * 5000 + ">", "answer": "3"}]
    path.write_text("".join(orjson.dumps(r).decode() + "\n" for r in rows))
    cfg = LeewayConfig.model_validate(
        {"task": {"name": "exact_match", "args": {"path": str(path)}, "prompts_file": str(path)}}
    )
    task = get_task("exact_match", path=str(path))
    assert len(PromptFeed(cfg, task, start=0).take(2)) == 2  # fits the 2 MiB queue message, no context given
    small = LeewayConfig.model_validate(
        {**cfg.model_dump(), "stream": {**cfg.stream.model_dump(), "max_msg_bytes": 4096}}
    )
    with pytest.raises(ValueError, match=rf"{path}: row 1 .* over stream.max_msg_bytes = 4096"):
        PromptFeed(small, task, start=0)
    tokenizer = load_tokenizer(cfg, task)
    with pytest.raises(ValueError, match=rf"{path}: row 1: .*prompt_too_long; model context 64 tokens"):
        PromptFeed(cfg, task, start=0, tokenizer=tokenizer, max_context_tokens=64)
    long_id = tmp_path / "id.jsonl"
    long_id.write_text(orjson.dumps({"prompt": "1>", "id": "x" * 195}).decode() + "\n")
    with pytest.raises(ValueError, match=rf"{long_id}: row 0: cannot be admitted"):
        PromptFeed(LeewayConfig.model_validate({"task": {"prompts_file": str(long_id)}}), task, start=0)
