"""The SFT loop: the learning-rate schedule's shape, the per-epoch example order, a step's loss being the mean
negative log-likelihood of the assistant tokens, exact resume (3 steps, saved state, a fresh model resumed to 6
equals 6 straight steps bit for bit), state of other data refused, and the loss falling on a small dataset."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from actors.models import build_policy_model
from actors.sft.examples import ExampleSet, example
from actors.sft.loop import METRICS_FILE, PROGRESS_FILE, ResumeError, Schedule, SftLoop, batch_indices, total_steps
from actors.trainer.backends import TrainingBackend, build_backend
from pipeline.config import LeewayConfig, load_config
from pipeline.config_sections import SftConfig
from pipeline.tasks.char_tokenizer import load_char_tokenizer

TOKENIZER = load_char_tokenizer()
PAIRS = [("12+3=", "15"), ("4+4=", "8"), ("9-2=", "7"), ("10+10=", "20"), ("3+3=", "6"), ("7-7=", "0")]


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _config(*overrides: str) -> LeewayConfig:
    return load_config(None, ["model.name_or_path=tiny-llama-1x32", "trainer.torch_threads=1", *overrides], environ={})


def _examples(pairs: list[tuple[str, str]] = PAIRS) -> ExampleSet:
    out = []
    for i, (prompt, completion) in enumerate(pairs):
        prompt_ids = TOKENIZER.encode(prompt).ids
        reply = [*TOKENIZER.encode(completion, add_special_tokens=False).ids, TOKENIZER.token_to_id("<eos>")]
        out.append(example(f"ex-{i}", [*prompt_ids, *reply], [False] * len(prompt_ids) + [True] * len(reply)))
    return ExampleSet(out, "test")


def _backend(settings: SftConfig, *overrides: str) -> TrainingBackend:
    cfg = _config(*overrides)
    model = build_policy_model(cfg, TOKENIZER)
    return build_backend(cfg, model, lr=settings.lr, grad_clip=settings.grad_clip, temperature=1.0)


def _loop(settings: SftConfig, out: Path, examples: ExampleSet | None = None) -> SftLoop:
    out.mkdir(parents=True, exist_ok=True)  # as `leeway sft` makes it before the loop
    return SftLoop(settings, _backend(settings), examples or _examples(), out, seed=0)


def _weights(loop: SftLoop) -> dict[str, torch.Tensor]:
    return loop.backend.export_weights(torch.float32)


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / METRICS_FILE).read_text().splitlines()]


# ---- schedule -------------------------------------------------------------------------------------------


def test_warm_up_rises_linearly_to_the_peak_at_warmup_steps() -> None:
    schedule = Schedule(lr=1e-3, total=20, warmup=4, kind="cosine", min_ratio=0.1)
    assert [schedule.lr_at(s) for s in (1, 2, 3, 4)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3])
    assert schedule.lr_at(5) < 1e-3


@pytest.mark.parametrize("kind", ["cosine", "linear"])
def test_decay_ends_at_min_ratio_of_the_peak_on_the_last_step(kind: str) -> None:
    schedule = Schedule(lr=1e-3, total=20, warmup=4, kind=kind, min_ratio=0.1)
    rates = [schedule.lr_at(s) for s in range(4, 21)]
    assert rates[0] == pytest.approx(1e-3)
    assert rates[-1] == pytest.approx(1e-4)
    assert all(a > b for a, b in zip(rates, rates[1:], strict=False))  # strictly decreasing after the warm-up
    middle = schedule.lr_at(12)  # half-way through the decay
    assert middle == pytest.approx(1e-4 + 0.5 * 9e-4)


def test_cosine_and_linear_differ_in_shape() -> None:
    cosine = Schedule(lr=1.0, total=10, kind="cosine", min_ratio=0.0)
    linear = Schedule(lr=1.0, total=10, kind="linear", min_ratio=0.0)
    assert linear.lr_at(2) == pytest.approx(0.8)
    assert cosine.lr_at(2) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.2)))
    assert cosine.lr_at(10) == pytest.approx(0.0) and linear.lr_at(10) == pytest.approx(0.0)


def test_constant_stays_at_the_peak_after_warm_up() -> None:
    schedule = Schedule(lr=1e-3, total=10, warmup=2, kind="constant", min_ratio=0.1)
    assert schedule.lr_at(1) == pytest.approx(5e-4)
    assert [schedule.lr_at(s) for s in range(2, 11)] == pytest.approx([1e-3] * 9)


def test_total_steps_is_max_steps_or_the_epochs_over_the_batch() -> None:
    assert total_steps(SftConfig(max_steps=7, batch_examples=4), 100) == 7
    assert total_steps(SftConfig(epochs=2.0, batch_examples=4), 10) == 5
    assert total_steps(SftConfig(epochs=0.01, batch_examples=4), 10) == 1


# ---- order ----------------------------------------------------------------------------------------------


def test_batch_indices_are_deterministic_and_each_epoch_is_a_permutation() -> None:
    n, batch = 12, 4
    steps_per_epoch = n // batch
    epochs = [
        [i for step in range(e * steps_per_epoch, (e + 1) * steps_per_epoch) for i in batch_indices(n, batch, step, 3)]
        for e in range(3)
    ]
    for order in epochs:
        assert sorted(order) == list(range(n))
    assert epochs[0] != epochs[1] and epochs[1] != epochs[2]
    again = [i for step in range(steps_per_epoch) for i in batch_indices(n, batch, step, 3)]
    assert again == epochs[0]
    other_seed = [i for step in range(steps_per_epoch) for i in batch_indices(n, batch, step, 4)]
    assert other_seed != epochs[0]


def test_a_batch_that_does_not_divide_the_count_runs_on_into_the_next_epoch() -> None:
    n, batch = 5, 3
    positions = [i for step in range(10) for i in batch_indices(n, batch, step, 0)]  # 30 positions: 6 epochs
    for e in range(6):
        assert sorted(positions[e * n : (e + 1) * n]) == list(range(n))


# ---- one step -------------------------------------------------------------------------------------------


def test_a_step_s_loss_is_the_mean_nll_of_the_assistant_tokens_of_its_examples(tmp_path: Path) -> None:
    settings = SftConfig(max_steps=1, batch_examples=3, lr=1e-2, log_every=1)
    loop = _loop(settings, tmp_path)
    examples = loop.examples.examples
    chosen = batch_indices(len(examples), 3, 0, 0)
    nll, count = 0.0, 0
    with torch.no_grad():
        for i in chosen:
            tokens = torch.as_tensor(examples[i].tokens)[None]
            logprobs = torch.log_softmax(loop.backend.model(tokens).logits[0, :-1].double(), -1)
            picked = logprobs.gather(-1, tokens[0, 1:, None])[:, 0]
            mask = torch.as_tensor(examples[i].loss_mask[1:])
            nll -= float(picked[mask].sum())
            count += int(mask.sum())
    record = loop.train()
    assert record["step"] == 1 and record["loss_tokens"] == count
    assert record["loss"] == pytest.approx(nll / count, rel=1e-4)
    assert record["lr"] == pytest.approx(loop.schedule.lr_at(1))


def test_packed_and_padded_sft_give_the_same_loss_and_the_same_update(tmp_path: Path) -> None:
    """Examples of different lengths: packed into one row without padding, or padded to the longest; the loss and
    the weights after the step agree (the padding and the other examples are masked out either way)."""
    settings = SftConfig(max_steps=1, batch_examples=len(PAIRS), lr=1e-2, log_every=1)
    runs = {}
    for packing in (True, False):
        out = tmp_path / str(packing)
        out.mkdir()
        backend = _backend(settings, f"trainer.packing={str(packing).lower()}")
        assert backend.packing is packing
        loop = SftLoop(settings, backend, _examples(), out, seed=0)
        runs[packing] = (loop.train(), _weights(loop))
    (packed, packed_weights), (padded, padded_weights) = runs[True], runs[False]
    assert packed["loss_tokens"] == padded["loss_tokens"]
    assert packed["loss"] == pytest.approx(padded["loss"], abs=1e-5)
    for name, tensor in packed_weights.items():
        torch.testing.assert_close(tensor, padded_weights[name], atol=1e-5, rtol=0, msg=name)


# ---- state ----------------------------------------------------------------------------------------------


def test_resuming_from_step_3_on_a_fresh_model_equals_six_straight_steps_bit_for_bit(tmp_path: Path) -> None:
    straight = _loop(SftConfig(max_steps=6, batch_examples=2, lr=1e-2, warmup_steps=2, log_every=1), tmp_path / "a")
    straight.train()
    expected = _weights(straight)

    settings = SftConfig(max_steps=6, batch_examples=2, lr=1e-2, warmup_steps=2, log_every=1, checkpoint_every=3)
    first = _loop(settings, tmp_path / "b")
    first.train()  # saves its state at step 3 on the way (not at 6: the command saves the finished state)
    assert first.newest_state() is not None and first.newest_state()[0] == 3
    progress = json.loads((first.newest_state()[1] / PROGRESS_FILE).read_text())
    assert progress["step"] == 3 and progress["total_steps"] == 6 and progress["examples"] == len(PAIRS)

    resumed = _loop(settings, tmp_path / "b")
    assert not all(torch.equal(expected[k], v) for k, v in _weights(resumed).items())  # a fresh init, untrained
    assert resumed.resume() == 3 and resumed.step == 3
    resumed.train()
    got = _weights(resumed)
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name
    straight_losses = [r["loss"] for r in _records(tmp_path / "a")]
    # the records of the lost steps 4-6 moved aside on resume; the log reads as one straight run
    resumed_records = _records(tmp_path / "b")
    assert [r["step"] for r in resumed_records] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in resumed_records] == straight_losses
    rolled_back = (tmp_path / "b" / "sft.rolled_back.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in rolled_back] == [4, 5, 6]


def test_resume_without_state_starts_at_step_0(tmp_path: Path) -> None:
    loop = _loop(SftConfig(max_steps=2, batch_examples=2), tmp_path)
    assert loop.resume() == 0 and loop.step == 0


def test_resume_refuses_state_saved_over_other_examples(tmp_path: Path) -> None:
    settings = SftConfig(max_steps=2, batch_examples=2, lr=1e-2)
    saved = _loop(settings, tmp_path)
    saved.train()
    saved.save_state()
    other = _loop(settings, tmp_path, _examples([(p, c + "0") for p, c in PAIRS]))
    assert other.fingerprint != saved.fingerprint
    with pytest.raises(ResumeError, match="fingerprint"):
        other.resume()
    assert other.step == 0


def test_only_the_two_newest_complete_states_are_kept_and_partial_ones_are_ignored(tmp_path: Path) -> None:
    loop = _loop(SftConfig(max_steps=5, batch_examples=2, checkpoint_every=1), tmp_path)
    loop.train()
    assert sorted(p.name for p in (tmp_path / "state").iterdir()) == ["step-00000003", "step-00000004"]
    half = tmp_path / "state" / "step-00000009"
    half.mkdir()  # a state whose progress.json was never written
    (tmp_path / "state" / "step-00000010.partial").mkdir()
    assert loop.newest_state() == (4, tmp_path / "state" / "step-00000004")


# ---- learning -------------------------------------------------------------------------------------------


def test_thirty_steps_on_a_small_repeated_dataset_bring_the_loss_well_down(tmp_path: Path) -> None:
    settings = SftConfig(max_steps=30, batch_examples=4, lr=1e-2, schedule="constant", log_every=1)
    loop = _loop(settings, tmp_path, _examples(PAIRS[:4]))
    loop.train()
    losses = [r["loss"] for r in _records(tmp_path)]
    assert len(losses) == 30 and all(math.isfinite(x) for x in losses)
    assert losses[0] > 2.0  # near log(21): a random init
    assert max(losses[-3:]) < 0.4 * losses[0], losses
