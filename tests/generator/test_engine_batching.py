"""TorchEngine's slot cache, continuous batching, shared-prefix prefill, counter-based sampling, atomic weight
updates and over-long prompts. The key tests run on the CPU and, marked ``gpu``, on CUDA (CUDA graphs on)."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
import torch

from actors.generator.engines.base import GenerateRequest, SamplingParams
from actors.generator.engines.slot_runner import FastSlotRunner, HFSlotRunner
from actors.generator.engines.torch_engine import TorchEngine, sampling_logprobs
from actors.models import build_model
from pipeline.rl.scoring import score_group
from pipeline.tasks import Prompt, VerifierPool
from pipeline.tasks.char_tokenizer import PAD_ID, load_char_tokenizer
from pipeline.tasks.reverse import ReverseDigitsTask
from storage.weights_base import tensor_hash

VOCAB = 21
PAD = 0
PROMPTS = ([1, 5, 6, 7, 8, 14], [1, 9, 9, 14], [1, 4, 14], [1, 12, 11, 10, 9, 8, 7, 14])
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
SLOW_COPY_S = 0.3
"""How long the slowed copy pauses after its first tensor: room for a racing caller to run if it could."""


def _model(spec: str = "tiny-llama-2x64", seed: int = 0, device: str = "cpu") -> torch.nn.Module:
    return build_model(spec, vocab_size=VOCAB, seed=seed).to(device)


def _reference(model: torch.nn.Module, prompt: list[int], tokens: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Behaviour log-probs recomputed by one un-batched, cache-free HF forward over prompt + tokens."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt + tokens.tolist()], device=device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float().cpu()
    chosen = torch.as_tensor(tokens, dtype=torch.long)[:, None]
    return sampling_logprobs(logits, params).gather(-1, chosen)[:, 0].numpy()


class _Steps:
    """An ``on_decode_step`` hook that records the steps and runs each action once, at its step."""

    def __init__(self) -> None:
        self.seen: list[int] = []
        self.actions: dict[int, list] = {}

    def at(self, step: int, action) -> None:
        self.actions.setdefault(step, []).append(action)

    def __call__(self, step: int) -> None:
        self.seen.append(step)
        for action in self.actions.pop(step, []):
            action()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("spec", ["tiny-llama-2x64", "tiny-gpt2-2x64"])
def test_logprobs_equal_a_separate_forward_under_continuous_batching_and_prefix_sharing(spec: str, device: str) -> None:
    """Fewer slots than requests, groups of 3 sharing a prompt, budgets of different lengths: slots are
    refilled mid-run, shared prompts are prefilled once, and every log-prob matches a plain HF forward."""
    model = _model(spec, device=device)
    engine = TorchEngine(model, pad_token_id=PAD, seed=3, max_slots=5)
    assert isinstance(engine.runner, FastSlotRunner)
    params = SamplingParams(max_new_tokens=9, temperature=0.8, top_k=12, top_p=0.95)
    requests = [
        GenerateRequest(prompt, max_new_tokens=3 + (3 * g + i) % 7, request_id=f"{g}-{i}")
        for g, prompt in enumerate(PROMPTS)
        for i in range(3)
    ]
    results = engine.generate(requests, params)
    for request, result in zip(requests, results, strict=True):
        assert result.finish_reason == "length" and len(result.token_ids) == request.max_new_tokens
        reference = _reference(model, list(request.input_ids), result.token_ids, params)
        np.testing.assert_allclose(result.logprobs, reference, atol=1e-4)
        assert result.request_id == request.request_id and (result.versions == 0).all()


def test_a_finished_rows_slot_takes_the_next_waiting_request_at_the_next_step() -> None:
    """Two slots; A needs 1 token, B and C need 4. Continuous batching: C enters at step 1 (A's slot), so the
    run takes 5 steps; batch-at-a-time decoding would take 8."""
    steps = _Steps()
    engine = TorchEngine(_model(), pad_token_id=PAD, max_slots=2, on_decode_step=steps)
    params = SamplingParams(max_new_tokens=4)
    budgets = (1, 4, 4)
    results = engine.generate([GenerateRequest(PROMPTS[i], max_new_tokens=n) for i, n in enumerate(budgets)], params)
    assert [len(r.token_ids) for r in results] == list(budgets)
    assert steps.seen == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("device", DEVICES)
def test_a_requests_tokens_are_identical_alone_in_a_full_batch_and_in_any_slot(device: str) -> None:
    engine = TorchEngine(_model(device=device), pad_token_id=PAD, max_slots=4)
    params = SamplingParams(max_new_tokens=10, temperature=1.0, top_p=0.9)
    probe = GenerateRequest(PROMPTS[1], seed=1234)
    (alone,) = engine.generate([probe], params)
    others = [GenerateRequest(PROMPTS[(i + 2) % 4], seed=i) for i in range(7)]
    for batch in ([probe, *others[:3]], [*others[:3], probe], [*others, probe], [*others[:2], probe, *others[2:]]):
        together = engine.generate(batch, params)[batch.index(probe)]
        np.testing.assert_array_equal(together.token_ids, alone.token_ids)
        np.testing.assert_allclose(together.logprobs, alone.logprobs, atol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_versions_switch_exactly_at_the_step_a_swap_is_applied(device: str) -> None:
    """A swap applied before step 3: running rows carry version 0 up to step 2 and 1 from step 3; a request
    admitted into a freed slot at step 2 switches at its second token; one admitted after carries only 1."""
    steps = _Steps()
    new_state = {n: t.detach().clone() for n, t in _model(seed=1, device=device).state_dict().items()}
    engine = TorchEngine(_model(device=device), pad_token_id=PAD, max_slots=2, on_decode_step=steps)
    steps.at(3, lambda: engine.update_weights(new_state, 1))
    params = SamplingParams(max_new_tokens=6)
    budgets = (6, 2, 4, 2)  # B leaves at step 1, C enters at step 2; D waits for A or C
    results = engine.generate([GenerateRequest(PROMPTS[i], max_new_tokens=n) for i, n in enumerate(budgets)], params)
    a, b, c, d = (r.versions.tolist() for r in results)
    assert a == [0, 0, 0, 1, 1, 1] and b == [0, 0] and c == [0, 1, 1, 1] and d == [1, 1]
    assert engine.version == 1


def test_abort_returns_partial_results_of_running_and_waiting_requests_and_spares_later_ones() -> None:
    steps = _Steps()
    engine = TorchEngine(_model(), pad_token_id=PAD, max_slots=2, on_decode_step=steps)
    steps.at(2, engine.abort)
    results = engine.generate([GenerateRequest(p) for p in PROMPTS], SamplingParams(max_new_tokens=10))
    assert [r.finish_reason for r in results] == ["abort"] * 4
    assert [len(r.token_ids) for r in results] == [3, 3, 0, 0]  # running: steps 0..2; waiting: nothing
    assert all(len(r.logprobs) == len(r.versions) == len(r.token_ids) for r in results)
    (later,) = engine.generate([GenerateRequest(PROMPTS[0])], SamplingParams(max_new_tokens=4))
    assert later.finish_reason == "length" and len(later.token_ids) == 4


def test_abort_by_request_id_finishes_only_those_requests() -> None:
    """The generator aborts one batch's requests (its prompt's ids) and leaves other batches running."""
    steps = _Steps()
    engine = TorchEngine(_model(), pad_token_id=PAD, max_slots=2, on_decode_step=steps)
    steps.at(2, lambda: engine.abort(["b", "c"]))
    requests = [GenerateRequest(p, request_id=r) for p, r in zip(PROMPTS[:3], "abc", strict=True)]
    results = engine.generate(requests, SamplingParams(max_new_tokens=5))
    assert [r.finish_reason for r in results] == ["length", "abort", "abort"]
    assert [len(r.token_ids) for r in results] == [5, 3, 0]


class _SlowCopyEngine(TorchEngine):
    """Pauses after copying the first tensor of an update, so a caller that returned early could mutate the
    source mid-copy (as the weight subscriber does on its next pull). Updates are applied only by the decode
    loop (between two steps), the path where the waiter and the copier are different threads."""

    mutated = threading.Event()

    def _apply_pending_locked(self) -> None:
        if self._loop is threading.current_thread():  # the thread running the decode loop
            super()._apply_pending_locked()

    def _copy_tensor(self, target: torch.Tensor, source: torch.Tensor) -> None:
        target.copy_(source)
        if not getattr(self, "_paused", False):
            self._paused = True
            self.mutated.wait(SLOW_COPY_S)


def test_update_weights_returns_only_after_its_copy_completed_and_hashes_match_the_manifest() -> None:
    """Weight sync mutates its tensors in place right after `update_weights` returns (next pull). With a slowed
    copy, an early return would leave a mix of version 1 and 2 labelled 1; the engine must hold exactly the
    tensors whose hashes a manifest of version 1 records (`storage.weights_base.tensor_hash`)."""
    v1 = {n: t.detach().clone() for n, t in _model(seed=1).state_dict().items()}
    manifest_hashes = {n: tensor_hash(t) for n, t in v1.items()}
    v2 = {n: t.detach().clone() for n, t in _model(seed=2).state_dict().items()}
    steps = _Steps()
    engine = _SlowCopyEngine(_model(), pad_token_id=PAD, on_decode_step=steps)
    engine.mutated.clear()
    returned = threading.Event()

    def pull_then_next_pull() -> None:
        engine.update_weights(v1, 1)
        returned.set()
        for name, tensor in v1.items():  # the next pull overwrites the same tensors in place
            tensor.copy_(v2[name])
        engine.mutated.set()

    updater = threading.Thread(target=pull_then_next_pull)
    steps.at(2, updater.start)
    (result,) = engine.generate([GenerateRequest(PROMPTS[0])], SamplingParams(max_new_tokens=12))
    updater.join(timeout=60)
    assert returned.is_set() and engine.version == 1
    engine_hashes = {n: tensor_hash(t.detach()) for n, t in engine.model.state_dict().items()}
    assert engine_hashes == manifest_hashes
    assert set(result.versions.tolist()) <= {0, 1} and result.versions[-1] == 1


def test_a_prompt_longer_than_max_len_finishes_alone_with_prompt_too_long_and_is_never_trained_on() -> None:
    tok = load_char_tokenizer()
    model = build_model("tiny-gpt2-2x64", vocab_size=tok.get_vocab_size(), seed=0)
    engine = TorchEngine(model, pad_token_id=PAD_ID, max_len=16)
    assert engine.max_context_tokens == 16
    long, edge, short = [1] * 20, [1] * 15, [1, 2, 3]
    results = engine.generate([GenerateRequest(p) for p in (long, edge, short)], SamplingParams(max_new_tokens=4))
    assert [r.finish_reason for r in results] == ["prompt_too_long", "length", "length"]
    assert [len(r.token_ids) for r in results] == [0, 1, 4]
    task = ReverseDigitsTask(num_digits=2)
    prompt = Prompt("long", token_ids=tuple(long), answer="12")
    with VerifierPool() as verifiers:
        (sample,) = asyncio.run(
            score_group(
                task,
                prompt,
                long,
                [results[0]],
                SamplingParams(max_new_tokens=4),
                tokenizer=tok,
                group_id="long",
                verifiers=verifiers,
            )
        )
    assert sample.status == "infra_error" and sample.reward is None and sample.reward_source == "none"
    assert sample.finish_reason == "prompt_too_long" and "prompt_too_long" in sample.info["error"]
    assert sample.loss_mask.sum() == 0


def test_the_generic_hf_path_matches_a_separate_forward_too() -> None:
    """Models outside the Llama family and GPT-2 run through per-slot HF forwards: same invariants, slower."""
    model = _model()
    engine = TorchEngine(model, pad_token_id=PAD, seed=5, max_slots=3, fast_forward=False)
    assert isinstance(engine.runner, HFSlotRunner)
    params = SamplingParams(max_new_tokens=5, temperature=0.9, top_k=10)
    requests = [GenerateRequest(p, max_new_tokens=2 + i) for i, p in enumerate(PROMPTS)]
    for request, result in zip(requests, engine.generate(requests, params), strict=True):
        np.testing.assert_allclose(
            result.logprobs, _reference(model, list(request.input_ids), result.token_ids, params), atol=1e-4
        )


def test_a_decode_step_padded_to_a_graph_bucket_gives_the_exact_steps_logits() -> None:
    """What a CUDA graph replays: the batch padded with dummy rows (token 0 at position 0 of free slots) and the
    attended length rounded up (masked keys). It must equal the exact step and leave running slots intact."""
    model = _model("tiny-gpt2-2x64")
    runner = FastSlotRunner(model, 8, 64, cuda_graphs=False)
    prompts = [list(p) for p in PROMPTS[:3]]
    runner.prefill(prompts, [[0], [1], [2]])
    tokens, positions = [3, 4, 5], [len(p) for p in prompts]
    exact = runner.decode([0, 1, 2], tokens, positions)
    with torch.inference_mode():
        padded = runner.decode_dense(torch.tensor([*tokens, 0]), torch.tensor([*positions, 0]), 64)[:3]
    torch.testing.assert_close(padded, exact, atol=1e-5, rtol=1e-5)
    again = runner.decode([0, 1, 2], [6, 7, 8], [n + 1 for n in positions])
    fresh = FastSlotRunner(model, 8, 64, cuda_graphs=False)
    fresh.prefill(prompts, [[0], [1], [2]])
    fresh.decode([0, 1, 2], tokens, positions)
    torch.testing.assert_close(again, fresh.decode([0, 1, 2], [6, 7, 8], [n + 1 for n in positions]))


@pytest.mark.gpu
def test_cuda_graph_decode_matches_eager_decode() -> None:
    """The captured decode step (bucketed batch and length) gives the eager step's logits, also after an
    in-place weight update (graphs read the updated Parameters) and for a batch width between buckets."""
    model = _model(device="cuda")
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    requests = [GenerateRequest(p, seed=i) for i, p in enumerate(PROMPTS * 2)][:7]
    graphs = TorchEngine(model, pad_token_id=PAD, max_slots=8, cuda_graphs=True)
    eager = TorchEngine(_model(device="cuda"), pad_token_id=PAD, max_slots=8, cuda_graphs=False)
    for _ in range(2):
        with_graphs = graphs.generate(requests, params)
        without = eager.generate(requests, params)
        for g, e in zip(with_graphs, without, strict=True):
            np.testing.assert_array_equal(g.token_ids, e.token_ids)
        new_state = {n: t.detach().clone() for n, t in _model(seed=7, device="cuda").state_dict().items()}
        graphs.update_weights(new_state, graphs.version + 1)
        eager.update_weights(new_state, eager.version + 1)
    assert graphs.runner._graphs is not None and graphs.runner._graphs._graphs  # graphs were captured and replayed
