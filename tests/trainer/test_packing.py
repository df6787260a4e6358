"""Packed micro-batches, the chunked LM head and the fused-kernel switch of the torch backend.

Packed and padded forwards, and the chunked and plain LM heads, must agree to float rounding: the
trainer's objective sees the same log-probs and the optimizer the same gradients either way.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from pydantic import ValidationError
from torch import Tensor
from transformers import AttentionInterface

from actors.models import build_model
from actors.trainer.backends import LossExtras, MicroBatch, TrainBatch, TrainSequence, build_backend, packing
from actors.trainer.backends.fused import apply_fused_kernels, chunked_token_logprobs
from actors.trainer.backends.packing import (
    PACKED_ATTENTION,
    check_packing,
    pack_by_real_tokens,
    pack_micro_batch,
    unpack_to_padded,
    use_packed_attention,
)
from actors.trainer.backends.torch_backend import TorchBackend
from pipeline.config import LeewayConfig

VOCAB = 40
LENGTHS = [5, 19, 3, 12, 8, 27, 6, 11]
SPECS = ["tiny-llama-2x64", "tiny-gpt2-2x64"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _backend(spec: str, **kwargs: object) -> TorchBackend:
    options: dict[str, object] = {"lr": 1e-2, "micro_batch_tokens": 40, "lm_head_chunk_tokens": 0}
    options.update(kwargs)
    return TorchBackend(build_model(spec, vocab_size=VOCAB, seed=3), **options)  # type: ignore[arg-type]


def _batch(lengths: list[int], seed: int = 0) -> TrainBatch:
    rng = np.random.default_rng(seed)
    seqs = []
    for n in lengths:
        mask = np.zeros(n, np.uint8)
        mask[2:] = 1
        seqs.append(
            TrainSequence(
                tokens=rng.integers(0, VOCAB, n).astype(np.int32),
                loss_mask=mask,
                behaviour_logprobs=np.where(mask == 1, -1.0, 0.0).astype(np.float32),
                versions=np.where(mask == 1, 0, -1).astype(np.int32),
                advantage=float(rng.normal()),
            )
        )
    return TrainBatch(tuple(seqs))


def _pg_loss(logp: Tensor, micro: MicroBatch, extras: LossExtras) -> tuple[Tensor, dict[str, float]]:
    """A policy-gradient-shaped loss: advantages weight the log-probs of loss tokens."""
    loss = -torch.where(micro.loss_mask, logp * micro.advantages, 0.0).sum() / extras.minibatch_loss_tokens
    return loss, {"entropy": float(extras.entropy[micro.loss_mask].mean())}


def _step_grads(backend: TorchBackend, batch: TrainBatch) -> tuple[dict[str, Tensor], float]:
    """The gradient of one step (captured instead of the optimizer's update) and the entropy mean."""
    seen: list[dict[str, Tensor]] = []
    backend.optimizer.step = lambda: seen.append(  # type: ignore[method-assign]
        {n: p.grad.clone() for n, p in backend.model.named_parameters() if p.grad is not None}
    )
    result = backend.train_step(batch, _pg_loss)
    assert len(seen) == 1
    return seen[0], result.entropy_mean


@pytest.mark.parametrize("spec", SPECS)
def test_packed_and_padded_forwards_agree_on_logprobs_and_gradients(spec: str) -> None:
    batch = _batch(LENGTHS)
    packed, padded = _backend(spec, packing=True), _backend(spec, packing=False)
    for a, b in zip(packed.logprobs(batch), padded.logprobs(batch), strict=True):
        assert a.shape == b.shape and a[0] == 0.0
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
    packed_grads, packed_entropy = _step_grads(packed, batch)
    padded_grads, padded_entropy = _step_grads(padded, batch)
    assert packed_grads.keys() == padded_grads.keys() and packed_grads
    for name, grad in padded_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    assert packed_entropy == pytest.approx(padded_entropy, rel=1e-5)


@pytest.mark.parametrize("spec", SPECS)
def test_the_packed_attention_function_matches_the_transformers_document_mask(spec: str) -> None:
    """`PACKED_ATTENTION` (per-sequence sdpa on the CPU, varlen on CUDA) against transformers' own
    packing support: position ids that restart at 0 and a document mask it builds for sdpa."""
    batch = _batch(LENGTHS)
    ours = _backend(spec, packing=True)
    assert ours.model.config._attn_implementation == PACKED_ATTENTION
    reference = _backend(spec, packing=True)
    reference.model.set_attn_implementation("sdpa")
    for a, b in zip(ours.logprobs(batch), reference.logprobs(batch), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
    unpacked = _backend(spec, packing=False)
    use_packed_attention(unpacked.model)  # without offsets: causal sdpa, exact for right padding
    for a, b in zip(unpacked.logprobs(batch), reference.logprobs(batch), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


def test_pack_and_unpack_put_every_value_back_in_its_padded_place() -> None:
    tokens = torch.tensor([[1, 2, 3, 4], [5, 6, 0, 0], [7, 8, 9, 0]])
    mask = (tokens != 0).long()
    packed = pack_micro_batch(tokens, mask)
    assert packed.input_ids.tolist() == [[1, 2, 3, 4, 5, 6, 7, 8, 9]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 0, 1, 2]]
    assert packed.cu_seqlens.tolist() == [0, 4, 6, 9] and packed.max_length == 4
    assert packed.has_target.tolist() == [True, True, True, False, True, False, True, True, False]
    assert packed.targets[packed.has_target].tolist() == [2, 3, 4, 6, 8, 9]
    # The value predicting token t sits at column t; column 0 and padding stay 0.
    padded = unpack_to_padded(packed.targets[packed.has_target].float(), mask)
    assert padded.tolist() == [[0, 2, 3, 4], [0, 6, 0, 0], [0, 8, 9, 0]]


def test_pack_by_real_tokens_fills_the_budget_and_keeps_sequences_whole() -> None:
    lengths = [5, 9, 3, 7, 1, 30, 4]
    packs = pack_by_real_tokens(lengths, 10)
    assert packs == pack_by_real_tokens(lengths, 10)
    assert sorted(i for p in packs for i in p) == list(range(len(lengths)))
    for pack in packs:
        assert sum(lengths[i] for i in pack) <= 10 or pack == [5]
    assert len(packs) == 4  # 30 | 9+1 | 7+3 | 5+4: 29 tokens under 10 need at least 3 packs
    with pytest.raises(ValueError, match="micro_batch_tokens"):
        pack_by_real_tokens([4], 0)


@pytest.mark.parametrize("packing", [True, False])
def test_micro_batches_keep_to_the_budget_in_real_or_padded_tokens(packing: bool) -> None:
    lengths, budget = [5, 9, 3, 30, 8, 6, 11, 4, 7, 10], 24
    seen: list[MicroBatch] = []

    def loss_fn(logp: Tensor, micro: MicroBatch, extras: LossExtras) -> tuple[Tensor, dict[str, float]]:
        seen.append(micro)
        return _pg_loss(logp, micro, extras)

    _backend("tiny-llama-2x64", packing=packing, micro_batch_tokens=budget).train_step(_batch(lengths), loss_fn)
    assert sorted(i for m in seen for i in m.seq_indices) == list(range(len(lengths)))
    for micro in seen:
        used = int(micro.attention_mask.sum()) if packing else micro.num_padded_tokens
        assert used <= budget or micro.seq_indices == (3,)
    # packed: the 63 tokens besides the long sequence fill 3 micro-batches; padded rows need 4
    assert len(seen) == (4 if packing else 5)


def _leaky_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):  # type: ignore[no-untyped-def]
    """Causal over the whole row, ignoring the sequence boundaries: what packing must never do."""
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def test_a_model_that_lets_packed_sequences_see_each_other_is_refused() -> None:
    AttentionInterface.register("leeway_test_leaky", _leaky_attention)
    model = build_model("tiny-llama-2x64", vocab_size=VOCAB, seed=0)
    model.set_attn_implementation("leeway_test_leaky")
    with pytest.raises(ValueError, match="trainer.packing: false"):
        check_packing(model, torch.device("cpu"))
    TorchBackend(model, lr=1e-3, packing=False)  # the padded fallback still works for it


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("packing", [True, False])
def test_chunked_lm_head_gives_the_plain_heads_logprobs_and_gradients(spec: str, packing: bool) -> None:
    batch = _batch(LENGTHS, seed=1)
    plain = _backend(spec, packing=packing, temperature=0.7)
    chunked = _backend(spec, packing=packing, temperature=0.7, lm_head_chunk_tokens=7)
    for a, b in zip(chunked.logprobs(batch), plain.logprobs(batch), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
    chunked_grads, chunked_entropy = _step_grads(chunked, batch)
    plain_grads, plain_entropy = _step_grads(plain, batch)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(chunked_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    assert chunked_entropy == pytest.approx(plain_entropy, rel=1e-5)


def test_chunked_token_logprobs_match_log_softmax_with_a_bias() -> None:
    gen = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=True)
    hidden = torch.randn(23, 16, generator=gen, requires_grad=True)
    targets = torch.randint(0, 50, (23,), generator=gen)
    weights = torch.randn(23, generator=gen)
    logp, entropy = chunked_token_logprobs(
        hidden, head, targets, temperature=1.3, chunk_tokens=5, compute_dtype=torch.float32, with_entropy=True
    )
    (logp * weights).sum().backward()
    got = (hidden.grad.clone(), head.weight.grad.clone(), head.bias.grad.clone())
    hidden.grad, head.weight.grad, head.bias.grad = None, None, None
    log_probs = torch.log_softmax(head(hidden) / 1.3, dim=-1)
    expected = log_probs.gather(-1, targets[:, None]).squeeze(-1)
    (expected * weights).sum().backward()
    torch.testing.assert_close(logp, expected, rtol=0, atol=1e-5)
    assert entropy is not None and not entropy.requires_grad
    torch.testing.assert_close(entropy, -(log_probs.exp() * log_probs).sum(-1).detach(), rtol=0, atol=1e-5)
    for a, b in zip(got, (hidden.grad, head.weight.grad, head.bias.grad), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_config_switches_reach_the_backend_and_bad_values_are_refused() -> None:
    config = LeewayConfig.model_validate(
        {"trainer": {"packing": False, "fused_kernels": "off", "lm_head_chunk_tokens": 64}}
    )
    backend = build_backend(config, build_model("tiny-llama-2x64", vocab_size=VOCAB, seed=0))
    assert isinstance(backend, TorchBackend)
    assert backend.packing is False and backend.fused_kernels is False and backend.lm_head_chunk_tokens == 64
    defaults = build_backend(LeewayConfig(), build_model("tiny-llama-2x64", vocab_size=VOCAB, seed=0))
    assert isinstance(defaults, TorchBackend)
    assert defaults.packing is True and defaults.lm_head_chunk_tokens == 0  # chunked head: CUDA only by default
    for bad in ({"fused_kernels": "yes"}, {"lm_head_chunk_tokens": -1}, {"packing": "sometimes"}):
        with pytest.raises(ValidationError, match=next(iter(bad))):
            LeewayConfig.model_validate({"trainer": bad})
    with pytest.raises(ValueError, match=r"fused_kernels: on needs a CUDA device"):
        apply_fused_kernels(build_model("tiny-llama-2x64", vocab_size=VOCAB, seed=0), "on", torch.device("cpu"))
    assert (
        apply_fused_kernels(build_model("tiny-llama-2x64", vocab_size=VOCAB, seed=0), "auto", torch.device("cpu"))
        is False
    )


# -- CUDA (run on a GPU machine: pytest -m gpu) ----------------------------------------------------

_needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@_needs_cuda
@pytest.mark.parametrize("autocast", [False, True])
def test_cuda_packed_varlen_matches_padded(autocast: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16: varlen flash attention; fp32: the block-diagonal sdpa mask. Same log-probs as padded."""
    batch = _batch(LENGTHS * 4)
    packed = _backend("tiny-llama-2x64", device="cuda", autocast=autocast, packing=True, fused_kernels="off")
    padded = _backend("tiny-llama-2x64", device="cuda", autocast=autocast, packing=False, fused_kernels="off")
    assert packed.model.config._attn_implementation == PACKED_ATTENTION
    used_varlen: list[bool] = []
    real_call = packing._varlen_call

    def spy(*args: Any) -> Any:
        call = real_call(*args)
        used_varlen.append(call is not None)
        return call

    monkeypatch.setattr(packing, "_varlen_call", spy)
    atol = 2e-2 if autocast else 1e-4
    for a, b in zip(packed.logprobs(batch), padded.logprobs(batch), strict=True):
        np.testing.assert_allclose(a, b, atol=atol, rtol=0)
    # bf16 must really run varlen flash attention; fp32 the per-sequence sdpa fallback
    assert used_varlen and all(used_varlen) == autocast and any(used_varlen) == autocast
    packed_grads, _ = _step_grads(packed, batch)
    padded_grads, _ = _step_grads(padded, batch)
    for name, grad in padded_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, rtol=5e-2 if autocast else 1e-3, atol=1e-4, msg=name)


@pytest.mark.gpu
@_needs_cuda
def test_cuda_chunked_head_matches_the_plain_head_under_autocast() -> None:
    batch = _batch(LENGTHS * 4)
    plain = _backend("tiny-llama-2x64", device="cuda", lm_head_chunk_tokens=0, fused_kernels="off")
    chunked = _backend("tiny-llama-2x64", device="cuda", lm_head_chunk_tokens=32, fused_kernels="off")
    for a, b in zip(chunked.logprobs(batch), plain.logprobs(batch), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-2, rtol=0)
    default = _backend("tiny-llama-2x64", device="cuda", lm_head_chunk_tokens=None, fused_kernels="off")
    assert default.lm_head_chunk_tokens == 4096


@pytest.fixture
def _restore_llama_module() -> Iterator[None]:
    """liger-kernel patches transformers' Llama module (RoPE function, norm and MLP classes) for the
    whole process; put it back so that later tests (some on the CPU) get the plain code."""
    from transformers.models.llama import modeling_llama

    saved = dict(vars(modeling_llama))
    yield
    for name, value in saved.items():
        if vars(modeling_llama).get(name) is not value:
            setattr(modeling_llama, name, value)


@pytest.mark.gpu
@_needs_cuda
@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.usefixtures("_restore_llama_module")
def test_cuda_fused_kernels_track_the_unfused_logprobs(autocast: bool) -> None:
    pytest.importorskip("liger_kernel", reason="the gpu extra (liger-kernel) is not installed")
    batch = _batch(LENGTHS * 4)
    # liger patches the Llama RoPE function process-wide: take the unfused log-probs first.
    unfused = _backend("tiny-llama-2x64", device="cuda", autocast=autocast, fused_kernels="off")
    expected = unfused.logprobs(batch)
    fused = _backend("tiny-llama-2x64", device="cuda", autocast=autocast, fused_kernels="on")
    assert fused.fused_kernels is True and unfused.fused_kernels is False
    atol = 2e-2 if autocast else 1e-4
    for a, b in zip(fused.logprobs(batch), expected, strict=True):
        np.testing.assert_allclose(a, b, atol=atol, rtol=0)
    result = fused.train_step(batch, _pg_loss)
    assert np.isfinite(result.loss) and np.isfinite(result.grad_norm) and result.skipped_minibatches == 0


def test_liger_style_module_patches_are_narrowed_to_cuda_rope() -> None:
    """What liger swaps in a transformers module: classes go back, functions run fused on CUDA only."""
    import types

    from actors.trainer.backends.fused import _contain_module_patch

    module = types.ModuleType("fake_modeling")

    class Norm:
        pass

    def rope(q: Tensor) -> str:
        return "plain"

    module.Norm, module.rope = Norm, rope  # type: ignore[attr-defined]
    before = dict(vars(module))
    module.Norm = type("FusedNorm", (), {})  # type: ignore[attr-defined]
    module.rope = lambda q: "fused"  # type: ignore[attr-defined]
    _contain_module_patch(module, before)
    assert module.Norm is Norm  # type: ignore[attr-defined]
    assert module.rope(torch.zeros(1)) == "plain"  # type: ignore[attr-defined]
