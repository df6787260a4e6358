"""TorchEngine: behaviour log-probs, batching, filters, stop tokens, in-flight weight swaps, abort."""

from __future__ import annotations

import inspect
import threading

import numpy as np
import pytest
import torch

from actors.generator.engines.base import GenerateRequest, SamplingParams
from actors.generator.engines.torch_engine import TorchEngine, sampling_logprobs
from actors.models import build_model

VOCAB = 21
PAD = 0
PROMPTS = ([1, 5, 6, 7, 8, 14], [1, 9, 9, 14], [1, 4, 14], [1, 12, 11, 10, 9, 8, 7, 14])


def _model(seed: int = 0) -> torch.nn.Module:
    return build_model("tiny-llama-2x64", vocab_size=VOCAB, seed=seed)


def _cache_kwarg(model: torch.nn.Module) -> str:
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _reference(model: torch.nn.Module, prompt: list[int], tokens: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Behaviour log-probs recomputed by one un-batched, cache-free forward over prompt + tokens."""
    ids = torch.tensor([prompt + tokens.tolist()])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
    return (
        sampling_logprobs(logits, params).gather(-1, torch.as_tensor(tokens, dtype=torch.long)[:, None])[:, 0].numpy()
    )


def test_logprob_is_that_of_the_filtered_distribution_the_token_was_drawn_from() -> None:
    model = _model()
    engine = TorchEngine(model, pad_token_id=PAD, seed=3)
    params = SamplingParams(max_new_tokens=12, temperature=0.7, top_k=8, top_p=0.9)
    results = engine.generate([GenerateRequest(p) for p in PROMPTS], params)
    for prompt, result in zip(PROMPTS, results, strict=True):
        assert result.finish_reason == "length" and len(result.token_ids) == 12
        assert result.logprobs.dtype == np.float32 and result.versions.dtype == np.int32
        np.testing.assert_allclose(
            result.logprobs, _reference(model, list(prompt), result.token_ids, params), atol=1e-4
        )
        assert (result.versions == 0).all()


def test_batched_generation_matches_one_at_a_time() -> None:
    engine = TorchEngine(_model(), pad_token_id=PAD)
    params = SamplingParams(max_new_tokens=10, temperature=1.0)
    requests = [GenerateRequest(p, seed=100 + i) for i, p in enumerate(PROMPTS)]
    batched = engine.generate(requests, params)
    for request, together in zip(requests, batched, strict=True):
        (alone,) = engine.generate([request], params)
        np.testing.assert_array_equal(alone.token_ids, together.token_ids)
        np.testing.assert_allclose(alone.logprobs, together.logprobs, atol=1e-5)


def test_sampling_logprobs_renormalise_over_top_k_then_top_p() -> None:
    logits = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1]))
    top_k = sampling_logprobs(logits, SamplingParams(max_new_tokens=1, top_k=2)).exp()
    torch.testing.assert_close(top_k, torch.tensor([4 / 7, 3 / 7, 0.0, 0.0]))
    # top-p 0.7 over the full distribution keeps 0.4 + 0.3 (the mass before 0.2 already reaches 0.7).
    top_p = sampling_logprobs(logits, SamplingParams(max_new_tokens=1, top_p=0.7)).exp()
    torch.testing.assert_close(top_p, torch.tensor([4 / 7, 3 / 7, 0.0, 0.0]))
    # top-k 3 renormalises to (4, 3, 2) / 9; top-p 0.5 then keeps 4/9 and 3/9 (mass before 3/9 is 4/9 < 0.5).
    both = sampling_logprobs(logits, SamplingParams(max_new_tokens=1, top_k=3, top_p=0.5)).exp()
    torch.testing.assert_close(both, torch.tensor([4 / 7, 3 / 7, 0.0, 0.0]))
    # the most likely token is kept however small top_p is; temperature 0 is a point mass.
    assert sampling_logprobs(logits, SamplingParams(max_new_tokens=1, top_p=0.01)).exp().tolist() == [1, 0, 0, 0]
    assert sampling_logprobs(logits, SamplingParams(max_new_tokens=1, temperature=0)).tolist()[0] == 0.0


def test_tokens_outside_the_top_k_are_never_sampled() -> None:
    model = _model()
    engine = TorchEngine(model, pad_token_id=PAD, seed=5)
    params = SamplingParams(max_new_tokens=10, top_k=2)
    for prompt, result in zip(
        PROMPTS * 2, engine.generate([GenerateRequest(p) for p in PROMPTS * 2], params), strict=True
    ):
        ids = torch.tensor([list(prompt) + result.token_ids.tolist()])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
        ranks = (logits > logits.gather(-1, torch.as_tensor(result.token_ids, dtype=torch.long)[:, None])).sum(-1)
        assert (ranks < 2).all()
        full = torch.log_softmax(logits, -1).gather(-1, torch.as_tensor(result.token_ids, dtype=torch.long)[:, None])
        assert (result.logprobs >= full[:, 0].numpy() - 1e-6).all()  # renormalised: never below the unfiltered value


def test_stop_token_ends_its_row_and_is_returned_last() -> None:
    engine = TorchEngine(_model(), pad_token_id=PAD, seed=7)
    stop = tuple(range(4, 9))  # half the digits: most rows stop within a few tokens, some run out of budget
    results = engine.generate(
        [GenerateRequest(p) for p in PROMPTS * 8], SamplingParams(max_new_tokens=6, stop_token_ids=stop)
    )
    reasons = {r.finish_reason for r in results}
    assert reasons == {"stop", "length"}
    for result in results:
        body = result.token_ids.tolist()
        if result.finish_reason == "stop":
            assert body[-1] in stop and not set(body[:-1]) & set(stop)
        else:
            assert len(body) == 6 and not set(body) & set(stop)


def test_greedy_decoding_is_deterministic_with_logprob_zero() -> None:
    engine = TorchEngine(_model(), pad_token_id=PAD)
    params = SamplingParams(max_new_tokens=5, temperature=0)
    first, second = (engine.generate([GenerateRequest(PROMPTS[0])], params)[0] for _ in range(2))
    np.testing.assert_array_equal(first.token_ids, second.token_ids)
    assert (first.logprobs == 0).all()


def test_in_flight_swap_tags_tokens_from_the_swap_step_and_keeps_the_kv_cache() -> None:
    """Swap weights before decode step k. Asserted exactly:
    - versions are 0 for tokens [0, k) and 1 for tokens [k, n);
    - tokens < k match a full forward of the old weights;
    - tokens >= k match the new weights run on top of a KV cache that the OLD weights computed for the
      prompt and tokens [0, k-1) (token k-1 is fed to the new weights at step k): the engine keeps its cache;
    - token k does NOT match a full forward of the new weights (which would mean the cache was recomputed).
    """
    k, n = 3, 8
    old, new = _model(seed=0), _model(seed=1)
    new_state = {name: t.detach().clone() for name, t in new.state_dict().items()}

    def swap_at_k(step: int) -> None:
        if step == k:
            engine.update_weights(new_state, version=1)

    engine = TorchEngine(_model(seed=0), pad_token_id=PAD, seed=11, on_decode_step=swap_at_k)
    params = SamplingParams(max_new_tokens=n, temperature=0.8)
    results = engine.generate([GenerateRequest(p) for p in PROMPTS[:2]], params)
    assert engine.version == 1
    for prompt, result in zip(PROMPTS[:2], results, strict=True):
        prompt = list(prompt)
        tokens = result.token_ids
        assert result.versions.tolist() == [0] * k + [1] * (n - k)
        np.testing.assert_allclose(result.logprobs[:k], _reference(old, prompt, tokens, params)[:k], atol=1e-4)

        kwarg = _cache_kwarg(old)
        with torch.no_grad():
            prefix = old(input_ids=torch.tensor([prompt + tokens[: k - 1].tolist()]), use_cache=True)
            cache = getattr(prefix, kwarg)
            logits = new(
                input_ids=torch.tensor([tokens[k - 1 : -1].tolist()]), use_cache=True, **{kwarg: cache}
            ).logits[0]
        mixed = sampling_logprobs(logits, params).gather(-1, torch.as_tensor(tokens[k:], dtype=torch.long)[:, None])
        np.testing.assert_allclose(result.logprobs[k:], mixed[:, 0].numpy(), atol=1e-4)
        assert abs(result.logprobs[k] - _reference(new, prompt, tokens, params)[k]) > 1e-3


def test_update_weights_from_another_thread_lands_between_decode_steps() -> None:
    new_state = {name: t.detach().clone() for name, t in _model(seed=1).state_dict().items()}
    threads: list[threading.Thread] = []

    def start_update(step: int) -> None:
        if step == 2:
            threads.append(threading.Thread(target=engine.update_weights, args=(new_state, 1)))
            threads[0].start()

    engine = TorchEngine(_model(), pad_token_id=PAD, on_decode_step=start_update)
    (result,) = engine.generate([GenerateRequest(PROMPTS[0])], SamplingParams(max_new_tokens=100))
    threads[0].join(timeout=10)
    assert engine.version == 1
    switch = int(np.argmax(result.versions)) if result.versions.max() == 1 else len(result.versions)
    assert switch >= 2
    assert result.versions.tolist() == [0] * switch + [1] * (len(result.versions) - switch)
    torch.testing.assert_close(engine.model.state_dict()["lm_head.weight"], new_state["lm_head.weight"])


def test_abort_returns_the_tokens_so_far_with_reason_abort() -> None:
    def abort_at_3(step: int) -> None:
        if step == 3:
            engine.abort()

    engine = TorchEngine(_model(), pad_token_id=PAD, on_decode_step=abort_at_3)
    results = engine.generate([GenerateRequest(p) for p in PROMPTS], SamplingParams(max_new_tokens=10))
    assert [r.finish_reason for r in results] == ["abort"] * len(PROMPTS)
    assert all(len(r.token_ids) == len(r.logprobs) == len(r.versions) == 4 for r in results)


def test_weights_with_unknown_names_or_shapes_or_missing_are_rejected() -> None:
    engine = TorchEngine(_model(), pad_token_id=PAD)
    state = {name: t.detach().clone() for name, t in engine.model.state_dict().items()}
    with pytest.raises(ValueError, match="unknown tensor"):
        engine.update_weights({"nope.weight": torch.zeros(1)}, 1)
    with pytest.raises(ValueError, match="shape"):
        engine.update_weights({"lm_head.weight": torch.zeros(3, 3)}, 1)
    with pytest.raises(ValueError, match="missing"):
        engine.load_state({"lm_head.weight": state["lm_head.weight"]}, 1)
    engine.load_state(state, 4)
    assert engine.version == 4
    with pytest.raises(ValueError, match="older"):
        engine.update_weights(state, 3)


def test_build_model_is_deterministic_from_seed_and_loads_local_checkpoints(tmp_path) -> None:
    a, b, c = _model(seed=0), _model(seed=0), _model(seed=1)
    for name, tensor in a.state_dict().items():
        assert torch.equal(tensor, b.state_dict()[name])
    assert not torch.equal(a.state_dict()["lm_head.weight"], c.state_dict()["lm_head.weight"])
    assert a.config.num_hidden_layers == 2 and a.config.hidden_size == 64 and not a.config.tie_word_embeddings
    a.save_pretrained(tmp_path)
    loaded = build_model(str(tmp_path), vocab_size=VOCAB, seed=123)
    assert torch.equal(loaded.state_dict()["lm_head.weight"], a.state_dict()["lm_head.weight"])
    with pytest.raises(ValueError, match="neither"):
        build_model("no-such-model", vocab_size=VOCAB, seed=0)


def test_gpt2_preset_decodes_with_the_kv_cache_and_absolute_positions_under_left_padding(tmp_path) -> None:
    """The GPT-2 preset (learned absolute positions): cached, left-padded batched decoding gives the log-probs of
    a cache-free forward and the tokens of one-at-a-time decoding, and in-flight swaps keep working."""
    model = build_model("tiny-gpt2-2x64", vocab_size=VOCAB, seed=0)
    assert type(model).__name__ == "GPT2LMHeadModel" and not model.config.tie_word_embeddings
    assert model.config.n_positions == 128 and model.config.resid_pdrop == model.config.attn_pdrop == 0.0
    assert all(
        torch.equal(t, build_model("tiny-gpt2-2x64", vocab_size=VOCAB, seed=0).state_dict()[n])
        for n, t in model.state_dict().items()
    )
    engine = TorchEngine(model, pad_token_id=PAD)
    params = SamplingParams(max_new_tokens=10, temperature=1.0)
    requests = [GenerateRequest(p, seed=100 + i) for i, p in enumerate(PROMPTS)]
    batched = engine.generate(requests, params)
    for request, together in zip(requests, batched, strict=True):
        np.testing.assert_allclose(
            together.logprobs, _reference(model, list(request.input_ids), together.token_ids, params), atol=1e-4
        )
        (alone,) = engine.generate([request], params)
        np.testing.assert_array_equal(alone.token_ids, together.token_ids)
    other = build_model("tiny-gpt2-2x64", vocab_size=VOCAB, seed=1).state_dict()
    engine.update_weights(other, 1)
    (after,) = engine.generate([requests[0]], params)
    assert (after.versions == 1).all()
    model.save_pretrained(tmp_path)
    assert type(build_model(str(tmp_path), vocab_size=VOCAB, seed=5)).__name__ == "GPT2LMHeadModel"
