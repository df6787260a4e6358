"""The weight version store (public facade): the trainer publishes every policy version, generators pull on their own schedule.

    trainer: publish(v, tensors)                              generator: pull(want)
      1. parts in parallel: safetensors shards (full)           1. plan: delta chain from `have`, or the
         or codec blobs vs v-1 (delta), keys carry publish_id      newest full snapshot + deltas after it,
      2. manifest.json, create-only  <- the version exists         whichever downloads fewer bytes
      3. LATEST by compare-and-swap, only ever forward          2. parts in parallel, each hash-checked
      4. retention (storage.retention)                          3. apply in place (undo log), verify every
                                                                   tensor's hash; commit or roll back

Failure behaviour:
- A publish killed before its manifest leaves only unreferenced parts: the version does not exist.
- Two publishers racing for one version: the create-only manifest write lets exactly one win; the
  other gets `VersionConflict` and deletes its own parts (its part keys differ by `publish_id`, so
  it never touched the winner's). The winner reads its manifest back and checks its `publish_id`,
  so even a store whose create-only write were not atomic could not hand both a success silently.
- Pull: a missing or corrupted part is fetched again once; a tensor whose hash is wrong after
  applying makes the whole version be fetched and applied again once; then the subscriber falls
  back to the newest full snapshot; then it raises `WeightPullError` naming version, part and tensor.
  In every failure the subscriber's tensors are left exactly as they were (in-place changes are
  rolled back from an undo log of the changed 8-byte words only, so memory stays O(changes)).
- Manifests of another run or model config, or that are truncated or invalid: `ManifestError`.

Modules: `storage.publisher` (trainer side), `storage.subscriber` (generator side), `storage.weights_base`
(errors, tensor hashing, dtypes, the `LATEST` pointer, the sides' common base), `storage.manifest` (format and layout),
`storage.retention` (what is deleted when). Import from here: `from storage.weights import ...`.
"""

from storage.publisher import SEGMENT_ELEMS, WeightPublisher
from storage.subscriber import PullPlan, WeightSubscriber
from storage.weights_base import (
    DTYPE_NAMES,
    TORCH_DTYPES,
    NoVersionError,
    VersionConflict,
    WeightPullError,
    WeightStoreError,
    list_versions,
    tensor_hash,
)

__all__ = [
    "DTYPE_NAMES",
    "SEGMENT_ELEMS",
    "TORCH_DTYPES",
    "NoVersionError",
    "PullPlan",
    "VersionConflict",
    "WeightPublisher",
    "WeightPullError",
    "WeightStoreError",
    "WeightSubscriber",
    "list_versions",
    "tensor_hash",
]
