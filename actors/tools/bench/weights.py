"""`leeway bench weights`: the delta codec and the weight store end to end, on a fixed synthetic workload.

    synthetic_versions (fp32 AdamW -> bf16)  --codec_stats-->  sizes, bounds, baselines, codec speed
              |
              v
    WeightPublisher.publish(v) --S3 (embedded SeaweedFS or --store)--> WeightSubscriber.pull(v)
              timed from the start of publish to the end of pull: *_publish_to_applied_s

Version 0 is a full snapshot, versions 1..steps are deltas; codec numbers are averaged over the delta
steps. Progress goes to stderr; the CLI prints the returned dict as one JSON object.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

from actors.tools.bench.weights_workload import codec_stats, synthetic_versions
from storage.objectstore import ObjectStore
from storage.stores import open_store
from storage.weights import WeightPublisher, WeightSubscriber

DEFAULT_PARAMS = 100_000_000
DEFAULT_LR = 1e-6
DEFAULT_STEPS = 3
RUN = "bench-weights"
_SUM_KEYS = (
    "full_bytes",
    "delta_bytes",
    "entropy_bound_bytes",
    "xor_zstd1_bytes",
    "index_value_bytes",
    "expert_full_bytes",
    "expert_delta_bytes",
)
_MEAN_KEYS = ("changed_fraction", "encode_gbps", "decode_apply_gbps")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--params", type=int, default=DEFAULT_PARAMS, help="parameters of the synthetic model")
    parser.add_argument("--lr", type=float, default=DEFAULT_LR, help="AdamW learning rate")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="measured delta versions after version 0")
    parser.add_argument(
        "--store",
        default=None,
        help="object store URL (s3://bucket/prefix uses the standard AWS environment, or file:///path); "
        "default: an embedded SeaweedFS in a temporary directory",
    )
    parser.add_argument("--part-bytes", type=int, default=16 * 1024 * 1024, help="target size of one stored part")
    parser.add_argument("--parallelism", type=int, default=4, help="parallel transfers and codec threads in the store")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--experts",
        type=int,
        default=0,
        help="a mixture-of-experts model: this many experts per layer (Qwen3-MoE layout); 0: dense. The expert "
        "tensors' share of the full and delta bytes is reported",
    )


def _progress(message: str) -> None:
    print(f"[bench weights] {message}", file=sys.stderr, flush=True)


def _open_bench_store(url: str | None, tmp: str) -> tuple[ObjectStore, str | None]:
    """The store to publish through, and the embedded stack's dir to stop afterwards (None if external)."""
    if url is not None:
        return open_store(url), None
    from infra.stack import load_credentials, start_stack
    from storage.s3 import S3Options, S3Store

    stack_dir = os.path.join(tmp, "stack")
    _progress(f"starting the embedded stack in {stack_dir}")
    state = start_stack(stack_dir)
    creds = load_credentials(stack_dir)
    options = S3Options(
        endpoint=state.s3_endpoint,
        region=state.region,
        access_key_id=creds.access_key_id,
        secret_access_key=creds.secret_access_key,
    )
    return S3Store(state.bucket, f"bench/{os.getpid()}-{int(time.time())}", options), stack_dir


def _bits_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n].view(torch.int16), b[n].view(torch.int16)) for n in a)


def _timed_round(pub: WeightPublisher, sub: WeightSubscriber, version: int, tensors: dict[str, torch.Tensor]) -> float:
    start = time.perf_counter()
    pub.publish(version, tensors)
    sub.pull(version)
    return time.perf_counter() - start


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}")
    torch.set_num_threads(1)  # the codec speeds are per core, and the workload must not steal cores from the store
    with tempfile.TemporaryDirectory(prefix="leeway-bench-weights-") as tmp:
        store, stack_dir = _open_bench_store(args.store, tmp)
        try:
            return _measure(args, store)
        finally:
            store.close()
            if stack_dir is not None:
                from infra.stack import stop_stack

                stop_stack(stack_dir)


def _measure(args: argparse.Namespace, store: ObjectStore) -> dict[str, Any]:
    run_name = f"{RUN}-{os.getpid()}-{int(time.time())}"
    pub = WeightPublisher(
        store,
        run_name,
        model_config_hash="bench",
        full_every=1 << 30,
        keep_versions=args.steps + 1,
        part_bytes=args.part_bytes,
        parallelism=args.parallelism,
    )
    sub = WeightSubscriber(store, run_name, parallelism=args.parallelism)
    stats: list[dict[str, Any]] = []
    delta_s: list[float] = []
    bit_exact = True
    prev: dict[str, torch.Tensor] | None = None
    try:
        for version, tensors in enumerate(
            synthetic_versions(args.params, args.lr, args.steps, seed=args.seed, experts=args.experts)
        ):
            if prev is None:
                full_s = _timed_round(pub, sub, version, tensors)
                full_stored = sub.manifest(version).num_bytes
                _progress(
                    f"v{version}: full snapshot {full_stored / 1e6:.1f} MB published and pulled in {full_s:.2f} s"
                )
            else:
                stats.append(codec_stats(prev, tensors, threads=1))
                delta_s.append(_timed_round(pub, sub, version, tensors))
                _progress(
                    f"v{version}: changed {stats[-1]['changed_fraction']:.4%}, delta "
                    f"{sub.manifest(version).num_bytes / 1e6:.2f} MB, publish->applied {delta_s[-1]:.2f} s"
                )
            bit_exact &= _bits_equal(sub.tensors, tensors)
            prev = tensors
    finally:
        pub.close()
        sub.close()
    return _summary(args, stats, delta_s, full_s, full_stored, bit_exact)


def _summary(
    args: argparse.Namespace,
    stats: list[dict[str, Any]],
    delta_s: list[float],
    full_s: float,
    full_stored: int,
    bit_exact: bool,
) -> dict[str, Any]:
    steps = len(stats)
    out: dict[str, Any] = {"params": stats[0]["num_elements"], "lr": args.lr, "steps": steps}
    for key in _MEAN_KEYS:
        out[key] = statistics.fmean(s[key] for s in stats)
    for key in _SUM_KEYS:
        out[key] = sum(s[key] for s in stats) / steps  # per delta step
    out["experts"] = args.experts
    out["expert_share_full"] = out["expert_full_bytes"] / out["full_bytes"]
    out["expert_share_delta"] = out["expert_delta_bytes"] / out["delta_bytes"]
    out["ratio_vs_full"] = out["full_bytes"] / out["delta_bytes"]
    out["delta_vs_entropy_bound"] = out["delta_bytes"] / out["entropy_bound_bytes"]
    out["delta_vs_xor_zstd1"] = out["delta_bytes"] / out["xor_zstd1_bytes"]
    out["delta_vs_index_value"] = out["delta_bytes"] / out["index_value_bytes"]
    out["full_snapshot_stored_bytes"] = full_stored
    out["bit_exact"] = bit_exact and all(s["bit_exact"] for s in stats)
    out["delta_publish_to_applied_s"] = statistics.median(delta_s)
    out["full_publish_to_applied_s"] = full_s
    out["full_vs_delta_latency"] = full_s / out["delta_publish_to_applied_s"]
    return out


if __name__ == "__main__":
    import json

    parser = argparse.ArgumentParser(description=__doc__)
    add_arguments(parser)
    print(json.dumps(run(parser.parse_args()), default=float))
