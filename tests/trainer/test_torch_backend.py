"""The torch training backend: log-probs, packing, gradient accumulation, export, determinism."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import Tensor

from actors.models import build_model
from actors.trainer.backends import LossExtras, MicroBatch, TrainBatch, TrainSequence, build_backend
from actors.trainer.backends.base import pack_by_token_budget
from actors.trainer.backends.torch_backend import TorchBackend
from pipeline.config import LeewayConfig

VOCAB = 32
SPEC = "tiny-llama-2x64"


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _backend(seed: int = 0, **kwargs: object) -> TorchBackend:
    options: dict[str, object] = {"lr": 1e-2, "grad_clip": 1.0, "micro_batch_tokens": 4096}
    options.update(kwargs)
    return TorchBackend(build_model(SPEC, vocab_size=VOCAB, seed=seed), **options)  # type: ignore[arg-type]


def _sequence(rng: np.random.Generator, length: int, prompt: int = 3, advantage: float = 1.0) -> TrainSequence:
    mask = np.zeros(length, np.uint8)
    mask[prompt:] = 1
    return TrainSequence(
        tokens=rng.integers(0, VOCAB, length).astype(np.int32),
        loss_mask=mask,
        behaviour_logprobs=np.where(mask == 1, -1.0, 0.0).astype(np.float32),
        versions=np.where(mask == 1, 0, -1).astype(np.int32),
        advantage=advantage,
    )


def _batch(lengths: list[int], seed: int = 0) -> TrainBatch:
    rng = np.random.default_rng(seed)
    return TrainBatch(tuple(_sequence(rng, n) for n in lengths))


def _nll(logp: Tensor, micro: MicroBatch, extras: LossExtras) -> tuple[Tensor, dict[str, float]]:
    """Mean negative log-likelihood of the minibatch's loss tokens (token_mean over the minibatch)."""
    loss = -torch.where(micro.loss_mask, logp, 0.0).sum() / extras.minibatch_loss_tokens
    return loss, {"num_loss_tokens": float(micro.loss_mask.sum())}


def _capture_grads(backend: TorchBackend) -> list[dict[str, Tensor]]:
    """Record the accumulated gradients each time the optimizer is about to step (instead of stepping)."""
    seen: list[dict[str, Tensor]] = []
    backend.optimizer.step = lambda: seen.append(  # type: ignore[method-assign]
        {n: p.grad.clone() for n, p in backend.model.named_parameters() if p.grad is not None}
    )
    return seen


def test_logprobs_match_a_manual_hf_forward() -> None:
    backend = _backend()
    batch = _batch([9, 5, 12])
    got = backend.logprobs(batch)
    reference = build_model(SPEC, vocab_size=VOCAB, seed=0)
    for seq, logp in zip(batch.sequences, got, strict=True):
        ids = torch.from_numpy(seq.tokens.astype(np.int64))[None]
        with torch.no_grad():
            log_probs = torch.log_softmax(reference(input_ids=ids).logits[0].float(), dim=-1)
        expected = np.concatenate([[0.0], log_probs[:-1].gather(-1, ids[0, 1:, None]).squeeze(-1).numpy()])
        assert logp.dtype == np.float32 and logp.shape == seq.tokens.shape
        np.testing.assert_allclose(logp, expected, atol=1e-5)


def test_logprobs_are_those_of_the_tempered_policy() -> None:
    batch = _batch([8])
    plain = _backend().logprobs(batch)[0]
    hot = _backend(temperature=2.0).logprobs(batch)[0]
    assert hot[0] == 0.0 and not np.allclose(plain[1:], hot[1:])
    model = build_model(SPEC, vocab_size=VOCAB, seed=0)
    ids = torch.from_numpy(batch.sequences[0].tokens.astype(np.int64))[None]
    with torch.no_grad():
        log_probs = torch.log_softmax(model(input_ids=ids).logits[0] / 2.0, dim=-1)
    np.testing.assert_allclose(hot[1:], log_probs[:-1].gather(-1, ids[0, 1:, None]).squeeze(-1).numpy(), atol=1e-5)


def test_train_step_lowers_the_loss() -> None:
    backend = _backend()
    batch = _batch([10, 14, 7, 12])
    first = backend.train_step(batch, _nll)
    for _ in range(10):
        last = backend.train_step(batch, _nll)
    assert last.loss < first.loss - 0.5
    assert first.grad_norm > 0 and np.isfinite(first.entropy_mean) and first.num_loss_tokens == batch.num_loss_tokens
    assert first.total_s >= first.forward_backward_s + first.optimizer_s > 0


def test_packed_micro_batches_give_the_gradient_of_one_big_batch() -> None:
    batch = _batch([5, 9, 3, 17, 8, 6, 11, 4, 7, 10])
    one = _backend(micro_batch_tokens=10_000)
    many = _backend(micro_batch_tokens=24)
    one_grads, many_grads = _capture_grads(one), _capture_grads(many)
    one_result = one.train_step(batch, _nll)
    many_result = many.train_step(batch, _nll)
    assert one_result.minibatches[0].num_micro_batches == 1
    assert many_result.minibatches[0].num_micro_batches >= 4  # 80 tokens, 24 per micro-batch
    assert one_grads[0].keys() == many_grads[0].keys()
    for name, grad in one_grads[0].items():
        torch.testing.assert_close(many_grads[0][name], grad, rtol=1e-4, atol=1e-6, msg=name)
    assert one_result.grad_norm == pytest.approx(many_result.grad_norm, rel=1e-5)


def test_micro_batches_respect_the_token_budget_and_hold_every_sequence_once() -> None:
    lengths = [5, 9, 3, 30, 8, 6, 11, 4, 7, 10]
    budget = 24
    seen: list[MicroBatch] = []

    def loss_fn(logp: Tensor, micro: MicroBatch, extras: LossExtras) -> tuple[Tensor, dict[str, float]]:
        seen.append(micro)
        return _nll(logp, micro, extras)

    _backend(micro_batch_tokens=budget).train_step(_batch(lengths), loss_fn)
    for micro in seen:  # packed (the default): real tokens within the budget
        assert int(micro.attention_mask.sum()) <= budget or len(micro.seq_indices) == 1
    assert sorted(i for m in seen for i in m.seq_indices) == list(range(len(lengths)))
    assert [i for i, n in enumerate(lengths) if n > budget] == [3]
    assert any(m.seq_indices == (3,) for m in seen)


def test_pack_by_token_budget_is_deterministic_and_keeps_sequences_whole() -> None:
    packs = pack_by_token_budget([4, 4, 10, 2, 4], 12)
    assert packs == [[2], [0, 1, 4], [3]]
    with pytest.raises(ValueError, match="micro_batch_tokens"):
        pack_by_token_budget([4], 0)


def test_loss_tokens_only_where_loss_mask_is_one() -> None:
    rng = np.random.default_rng(3)
    seqs = [_sequence(rng, 9, prompt=4), _sequence(rng, 6, prompt=2)]
    holes = np.array(seqs[0].loss_mask)
    holes[6] = 0  # a tool-output token inside the completion
    seqs[0] = TrainSequence(seqs[0].tokens, holes, seqs[0].behaviour_logprobs, seqs[0].versions, advantage=2.0)
    seen: list[MicroBatch] = []

    def loss_fn(logp: Tensor, micro: MicroBatch, extras: LossExtras) -> tuple[Tensor, dict[str, float]]:
        seen.append(micro)
        assert logp.shape == micro.tokens.shape and logp.requires_grad
        assert extras.entropy.shape == logp.shape and not extras.entropy.requires_grad
        return _nll(logp, micro, extras)

    _backend().train_step(TrainBatch(tuple(seqs)), loss_fn)
    (micro,) = seen
    for row, index in enumerate(micro.seq_indices):
        seq = seqs[index]
        n = seq.num_tokens
        np.testing.assert_array_equal(micro.loss_mask[row, :n].numpy(), seq.loss_mask.astype(bool))
        assert not micro.loss_mask[row, n:].any() and not micro.attention_mask[row, n:].any()
        np.testing.assert_array_equal(micro.advantages[row, :n].numpy(), seq.advantages_per_token())


def test_fully_masked_sample_does_not_change_the_gradient() -> None:
    batch = _batch([9, 7])
    masked = _sequence(np.random.default_rng(9), 11)
    masked = TrainSequence(masked.tokens, np.zeros(11, np.uint8), masked.behaviour_logprobs, masked.versions)
    with_masked = TrainBatch((*batch.sequences, masked))
    a, b = _backend(), _backend()
    grads_a, grads_b = _capture_grads(a), _capture_grads(b)
    a.train_step(batch, _nll)
    b.train_step(with_masked, _nll)
    for name, grad in grads_a[0].items():
        torch.testing.assert_close(grads_b[0][name], grad, rtol=1e-5, atol=1e-7, msg=name)


def _checkpointing(backend: TorchBackend) -> bool:
    return any(getattr(module, "gradient_checkpointing", False) for module in backend.model.modules())


def test_gradient_checkpointing_gives_the_same_gradient() -> None:
    batch = _batch([9, 13, 6])
    plain, checkpointed = _backend(), _backend(gradient_checkpointing=True)
    assert _checkpointing(checkpointed) and not _checkpointing(plain)
    grads_plain, grads_ckpt = _capture_grads(plain), _capture_grads(checkpointed)
    plain.train_step(batch, _nll)
    checkpointed.train_step(batch, _nll)
    for name, grad in grads_plain[0].items():
        torch.testing.assert_close(grads_ckpt[0][name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_minibatches_take_one_update_each_in_order() -> None:
    backend = _backend()
    extras_seen: list[LossExtras] = []

    def loss_fn(logp: Tensor, micro: MicroBatch, extras: LossExtras) -> tuple[Tensor, dict[str, float]]:
        extras_seen.append(extras)
        return _nll(logp, micro, extras)

    result = backend.train_step(_batch([5, 6, 7, 8, 9]), loss_fn, num_minibatches=2)
    assert len(result.minibatches) == 2 and backend.optimizer.state_dict()["state"][0]["step"] == 2
    assert [e.minibatch_seq_indices for e in extras_seen] == [(0, 1, 2), (3, 4)]
    assert [e.minibatch_loss_tokens for e in extras_seen] == [2 + 3 + 4, 5 + 6]
    with pytest.raises(ValueError, match="num_minibatches"):
        backend.train_step(_batch([5, 6]), loss_fn, num_minibatches=3)


def test_training_is_deterministic_given_the_seed() -> None:
    batch = _batch([9, 13, 6, 20])
    a, b = _backend(micro_batch_tokens=30), _backend(micro_batch_tokens=30)
    for _ in range(3):
        assert a.train_step(batch, _nll).loss == b.train_step(batch, _nll).loss
    for (name, wa), wb in zip(a.model.state_dict().items(), b.model.state_dict().values(), strict=True):
        assert torch.equal(wa, wb), name


def test_non_finite_gradient_skips_the_update() -> None:
    backend = _backend()
    before = {n: p.clone() for n, p in backend.model.named_parameters()}

    def nan_loss(logp: Tensor, micro: MicroBatch, extras: LossExtras) -> tuple[Tensor, dict[str, float]]:
        return logp.sum() * float("nan"), {}

    result = backend.train_step(_batch([6, 7]), nan_loss)
    assert result.skipped_minibatches == 1
    for name, param in backend.model.named_parameters():
        assert torch.equal(param, before[name]), name


def test_export_weights_are_bf16_copies_under_hf_names() -> None:
    backend = _backend()
    exported = backend.export_weights(torch.bfloat16)
    state = backend.model.state_dict()
    assert list(exported) == list(state)
    for name, tensor in exported.items():
        assert tensor.dtype == torch.bfloat16 and tensor.device.type == "cpu" and tensor.is_contiguous(), name
        assert torch.equal(tensor, state[name].to(torch.bfloat16)), name
    backend.train_step(_batch([8, 9]), _nll)
    assert not torch.equal(exported["lm_head.weight"], backend.export_weights(torch.bfloat16)["lm_head.weight"])
    fp32 = backend.export_weights(torch.float32)
    assert fp32["lm_head.weight"].data_ptr() != backend.model.lm_head.weight.data_ptr()


def test_a_model_with_dropout_is_rejected() -> None:
    model = build_model(SPEC, vocab_size=VOCAB, seed=0)
    model.config.attention_dropout = 0.1
    with pytest.raises(ValueError, match="attention_dropout"):
        TorchBackend(model, lr=1e-3)


def test_a_loss_token_at_position_zero_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"loss_mask\[0\]"):
        TrainSequence(
            np.arange(3, dtype=np.int32), np.ones(3, np.uint8), np.zeros(3, np.float32), np.zeros(3, np.int32)
        )


def test_build_backend_uses_the_trainer_config() -> None:
    config = LeewayConfig.model_validate(
        {"trainer": {"lr": 3e-4, "micro_batch_tokens": 64}, "engine": {"sampling": {"temperature": 0.7}}}
    )
    backend = build_backend(config, build_model(SPEC, vocab_size=VOCAB, seed=0))
    assert isinstance(backend, TorchBackend)
    assert backend.optimizer.param_groups[0]["lr"] == 3e-4 and backend.micro_batch_tokens == 64
    assert backend.temperature == 0.7 and backend.autocast is False


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_bf16_autocast_tracks_fp32_log_probs() -> None:
    batch = _batch([9, 13, 6])
    cpu = _backend().logprobs(batch)
    gpu = _backend(device="cuda")
    assert gpu.autocast == torch.cuda.is_bf16_supported()
    for got, expected in zip(gpu.logprobs(batch), cpu, strict=True):
        np.testing.assert_allclose(got, expected, atol=5e-2)
    result = gpu.train_step(batch, _nll)
    assert np.isfinite(result.loss) and np.isfinite(result.grad_norm) and result.skipped_minibatches == 0
    assert all(t.device.type == "cpu" for t in gpu.export_weights(torch.bfloat16).values())


def test_gpt2_preset_trains_and_exports_under_hf_names() -> None:
    model = build_model("tiny-gpt2-2x64", vocab_size=VOCAB, seed=0)
    backend = TorchBackend(model, lr=1e-2, grad_clip=1.0, micro_batch_tokens=4096)
    batch = _batch([10, 14, 7, 12])
    reference = build_model("tiny-gpt2-2x64", vocab_size=VOCAB, seed=0)
    for seq, logp in zip(batch.sequences, backend.logprobs(batch), strict=True):
        ids = torch.from_numpy(seq.tokens.astype(np.int64))[None]
        with torch.no_grad():
            log_probs = torch.log_softmax(reference(input_ids=ids).logits[0].float(), dim=-1)
        np.testing.assert_allclose(logp[1:], log_probs[:-1].gather(-1, ids[0, 1:, None]).squeeze(-1).numpy(), atol=1e-5)
    first = backend.train_step(batch, _nll)
    for _ in range(10):
        last = backend.train_step(batch, _nll)
    assert last.loss < first.loss - 0.5
    exported = backend.export_weights(torch.float32)
    assert list(exported) == list(reference.state_dict()) and "transformer.wpe.weight" in exported
