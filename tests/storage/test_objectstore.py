"""The object-store contract, run against FileStore and against S3Store on the real SeaweedFS."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest

from infra.stack import StackState, load_credentials
from storage.filestore import FileStore
from storage.objectstore import ObjectNotFound, ObjectStore, PreconditionFailed
from storage.s3 import S3Store
from storage.stores import open_store
from tests.support.stores import ResponseLosingProxy, s3_store

MiB = 1024 * 1024
RACERS = 8
RACE_TRIALS = 3


@pytest.fixture
def s3_options() -> dict[str, Any]:
    """Small multipart sizes for the `store` fixture's S3 store, to exercise the parallel paths."""
    return {"multipart_threshold_bytes": 6 * MiB, "part_size_bytes": 5 * MiB}


def test_put_then_get_returns_the_bytes_and_the_same_etag(store: ObjectStore) -> None:
    etag = store.put("a/b/c.bin", b"hello")
    assert store.get("a/b/c.bin") == b"hello"
    assert store.get_with_etag("a/b/c.bin") == (b"hello", etag)
    assert store.exists("a/b/c.bin") and store.size("a/b/c.bin") == 5
    store.put("a/b/c.bin", b"replaced")
    assert store.get("a/b/c.bin") == b"replaced"


def test_missing_key_raises_object_not_found_naming_the_key(store: ObjectStore) -> None:
    with pytest.raises(ObjectNotFound, match="nope/missing") as info:
        store.get("nope/missing")
    assert isinstance(info.value, KeyError) and info.value.key == "nope/missing"
    with pytest.raises(ObjectNotFound):
        store.get_with_etag("nope/missing")
    with pytest.raises(ObjectNotFound):
        store.size("nope/missing")
    with pytest.raises(ObjectNotFound):
        store.get_range("nope/missing", 0, 10)
    assert not store.exists("nope/missing")


def test_empty_object_round_trips(store: ObjectStore) -> None:
    store.put("empty", b"")
    assert store.get("empty") == b"" and store.size("empty") == 0
    assert store.get_range("empty", 0, 10) == b""


def test_large_object_round_trips_through_parallel_parts_and_ranges(store: ObjectStore) -> None:
    data = os.urandom(13 * MiB + 7)
    etag = store.put("big.bin", data)
    assert store.get_with_etag("big.bin") == (data, etag)
    assert store.get_range("big.bin", 5 * MiB - 3, 5 * MiB + 3) == data[5 * MiB - 3 : 5 * MiB + 3]


def test_get_range_is_half_open_and_clamped(store: ObjectStore) -> None:
    store.put("r", b"0123456789")
    assert store.get_range("r", 2, 5) == b"234"
    assert store.get_range("r", 8, 100) == b"89"
    assert store.get_range("r", 10, 20) == b""
    assert store.get_range("r", 3, 3) == b""
    with pytest.raises(ValueError):
        store.get_range("r", 5, 2)


def test_list_is_a_string_prefix_match_and_delete_is_idempotent(store: ObjectStore) -> None:
    for key in ("w/v01/a", "w/v01/b", "w/v02/a", "w/LATEST", "x/y"):
        store.put(key, b"1")
    assert store.list("w/v0") == ["w/v01/a", "w/v01/b", "w/v02/a"]
    assert store.list("w/") == ["w/LATEST", "w/v01/a", "w/v01/b", "w/v02/a"]
    assert store.list("zzz") == []
    store.delete("w/v01/a")
    store.delete("w/v01/a")
    store.delete_many(["w/v01/b", "w/never"])
    assert store.list("w/") == ["w/LATEST", "w/v02/a"]


def test_create_only_write_refuses_an_existing_key(store: ObjectStore) -> None:
    store.put_if_absent("m.json", b"first")
    with pytest.raises(PreconditionFailed, match="m.json"):
        store.put_if_absent("m.json", b"second")
    assert store.get("m.json") == b"first"


def test_a_retried_create_only_write_whose_first_attempt_landed_is_not_a_lost_race(stack: StackState) -> None:
    """The first PUT lands but its response is lost (the connection closes); the retry gets 412 and must succeed."""
    prefix = f"test-objectstore/{uuid.uuid4().hex}"

    def is_the_manifest_put(request_line: str) -> bool:
        return request_line.startswith("PUT ") and "/manifest.json" in request_line

    with ResponseLosingProxy(stack.s3_endpoint, lose=is_the_manifest_put) as proxy:
        with s3_store(stack, prefix, endpoint=proxy.endpoint) as store:
            store.put_if_absent("manifest.json", b"ours")
            puts = [line for line in proxy.request_lines if is_the_manifest_put(line)]
            assert len(proxy.lost) == 1 and len(puts) == 2, proxy.request_lines  # the first landed, unanswered
            assert store.get("manifest.json") == b"ours"
            with pytest.raises(PreconditionFailed):  # a first-attempt 412 is always a lost race, even for equal bytes
                store.put_if_absent("manifest.json", b"ours")


def test_a_create_only_write_of_equal_bytes_by_a_second_writer_still_loses(store: ObjectStore) -> None:
    store.put_if_absent("m.json", b"same")
    with pytest.raises(PreconditionFailed):
        store.put_if_absent("m.json", b"same")


def test_compare_and_swap_needs_the_current_etag(store: ObjectStore) -> None:
    etag1 = store.put("LATEST", b"1")
    etag2 = store.put_if_match("LATEST", b"2", etag1)
    with pytest.raises(PreconditionFailed):
        store.put_if_match("LATEST", b"3", etag1)
    assert store.get("LATEST") == b"2"
    store.put_if_match("LATEST", b"3", etag2)
    with pytest.raises(PreconditionFailed):
        store.put_if_match("never-written", b"x", etag2)
    assert not store.exists("never-written")


def test_racing_create_only_writes_have_exactly_one_winner(store: ObjectStore) -> None:
    for trial in range(RACE_TRIALS):
        key = f"race/{trial}"
        winners: list[int] = []
        losers: list[int] = []
        barrier = threading.Barrier(RACERS)

        def racer(
            i: int,
            key: str = key,
            winners: list[int] = winners,
            losers: list[int] = losers,
            barrier: threading.Barrier = barrier,
        ) -> None:
            barrier.wait()
            try:
                store.put_if_absent(key, f"writer-{i}".encode())
                winners.append(i)
            except PreconditionFailed:
                losers.append(i)

        threads = [threading.Thread(target=racer, args=(i,)) for i in range(RACERS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(winners) == 1 and len(losers) == RACERS - 1, (trial, winners)
        assert store.get(key) == f"writer-{winners[0]}".encode()


def test_compare_and_swap_loses_no_update_under_contention(store: ObjectStore) -> None:
    store.put("counter", b"0")
    increments_per_thread, num_threads = 4, 6

    def bump() -> None:
        for _ in range(increments_per_thread):
            while True:
                data, etag = store.get_with_etag("counter")
                try:
                    store.put_if_match("counter", str(int(data) + 1).encode(), etag)
                    break
                except PreconditionFailed:
                    continue

    threads = [threading.Thread(target=bump) for _ in range(num_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert int(store.get("counter")) == increments_per_thread * num_threads


@pytest.mark.parametrize("key", ["", "/abs", "a//b", "a/../b", "a/", "./a", ".lw-locks/x", "a/.lw-tmp-1"])
def test_keys_that_could_escape_or_collide_are_rejected(store: ObjectStore, key: str) -> None:
    with pytest.raises(ValueError):
        store.put(key, b"x")


def test_file_store_hides_its_bookkeeping_and_leaves_no_temp_files(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    etag = store.put("d/k", b"1")
    store.put_if_match("d/k", b"2", etag)
    store.put_if_absent("d/n", b"3")
    with pytest.raises(PreconditionFailed):
        store.put_if_absent("d/n", b"4")
    assert store.list("") == ["d/k", "d/n"]
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["k", "n"]
    store.delete("d/k")
    store.delete("d/n")
    assert not (tmp_path / "d").exists()


def test_open_store_picks_the_implementation_by_url(tmp_path: Path, stack: StackState) -> None:
    assert isinstance(open_store(tmp_path.as_uri()), FileStore)
    assert isinstance(open_store(str(tmp_path / "plain")), FileStore)
    creds = load_credentials(stack.dir)
    s3 = open_store(
        f"s3://{stack.bucket}/p/q",
        endpoint=stack.s3_endpoint,
        region=stack.region,
        access_key_id=creds.access_key_id,
        secret_access_key=creds.secret_access_key,
    )
    assert isinstance(s3, S3Store) and s3.prefix == "p/q"
    assert creds.secret_access_key not in repr(s3.options)
    s3.put("k", b"v")
    assert s3.get("k") == b"v"
    s3.delete("k")
    s3.close()
    with pytest.raises(ValueError, match="unsupported scheme"):
        open_store("gs://bucket/x")
    with pytest.raises(TypeError, match="bogus"):
        open_store(tmp_path.as_uri(), bogus=1)
    with pytest.raises(TypeError):
        open_store("s3://b/p", bogus=1)


def test_the_interface_imports_no_implementation_and_the_opener_no_boto3() -> None:
    """Code that only uses a store imports `storage.objectstore`; boto3 loads when an s3:// store is opened."""
    code = (
        "import sys, storage.objectstore\n"
        "loaded = [m for m in ('boto3', 'storage.s3', 'storage.filestore', 'storage.stores') if m in sys.modules]\n"
        "assert not loaded, loaded\n"
        "import storage.stores\n"
        "assert 'boto3' not in sys.modules and 'storage.s3' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])
