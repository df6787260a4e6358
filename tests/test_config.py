"""Config loading: precedence, errors that name file, key, value and source, shipped configs as written."""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

from pipeline.config import ConfigError, load_config
from pipeline.config_checks import MAX_STALENESS_LIMIT
from pipeline.config_reference import config_reference

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted((ROOT / "configs").glob("*.yaml"))


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def _error(path: Path | None, overrides: tuple[str, ...] = (), environ: Mapping[str, str] | None = None) -> str:
    with pytest.raises(ConfigError) as err:
        load_config(path, overrides, environ={} if environ is None else environ)
    return str(err.value)


def _leaves(tree: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted key, value) of every non-mapping value; `task.args` is one free-form value."""
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping) and dotted != "task.args":
            yield from _leaves(value, f"{dotted}.")
        else:
            yield dotted, value


def _resolved(tree: Mapping[str, Any], dotted: str) -> Any:
    node: Any = tree
    for part in dotted.split("."):
        node = node[part]
    return node


# ---- shipped configs ------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_config_resolves_to_exactly_what_the_file_says(path: Path) -> None:
    written = yaml.safe_load(path.read_text())
    resolved = load_config(path, environ={}).model_dump(mode="json")
    leaves = list(_leaves(written))
    assert len(leaves) > 10
    for dotted, value in leaves:
        got = _resolved(resolved, dotted)
        assert got == (list(value) if isinstance(value, tuple) else value), f"{path.name}: {dotted}"


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_config_selects_only_built_parts(path: Path) -> None:
    cfg = load_config(path, environ={})
    assert cfg.engine.kind == "torch"
    assert cfg.trainer.backend == "torch"


def test_gpu_configs_put_both_roles_on_cuda_and_multi_node_names_external_servers() -> None:
    single = load_config(ROOT / "configs/gpu-single-node.yaml", environ={})
    multi = load_config(ROOT / "configs/multi-node.yaml", environ={})
    for cfg in (single, multi):
        assert (cfg.engine.device, cfg.trainer.device) == ("cuda", "cuda")
        assert cfg.model.tokenizer == cfg.model.name_or_path  # the checkpoint's own tokenizer
    assert single.uses_embedded_stack
    assert not multi.uses_embedded_stack
    assert multi.nats.creds_file and "@" not in (multi.nats.url or "")  # credentials never in the URL


# ---- precedence: file < environment < --set ----------------------------------------------------------------


def test_precedence_file_then_env_then_set(tmp_path: Path) -> None:
    path = _write(tmp_path, "trainer:\n  lr: 0.1\n  batch_groups: 3\nstaleness:\n  max_staleness: 5\n")
    env = {"LEEWAY_TRAINER__LR": "0.2", "LEEWAY_STALENESS__MAX_STALENESS": "7", "UNRELATED": "x"}
    cfg = load_config(path, ["trainer.lr=0.3"], environ=env)
    assert cfg.trainer.lr == 0.3  # --set beats env
    assert cfg.staleness.max_staleness == 7  # env beats file
    assert cfg.trainer.batch_groups == 3  # file beats default
    assert cfg.advantages.group_size == 8  # default


def test_the_winning_source_of_a_bad_value_is_named(tmp_path: Path) -> None:
    path = _write(tmp_path, "trainer:\n  lr: -1\n")
    from_file = _error(path)
    assert from_file.startswith(f"{path}: ") and "trainer.lr = -1" in from_file and "(from" not in from_file

    env = {"LEEWAY_TRAINER__LR": "-2"}
    from_env = _error(path, environ=env)
    assert "trainer.lr = -2" in from_env and "(from environment variable LEEWAY_TRAINER__LR)" in from_env

    from_set = _error(path, ("trainer.lr=-3",), environ=env)
    assert "trainer.lr = -3" in from_set and "(from --set trainer.lr)" in from_set
    assert "LEEWAY_TRAINER__LR" not in from_set


def test_an_override_is_not_blamed_for_a_key_that_merely_shares_its_prefix(tmp_path: Path) -> None:
    path = _write(tmp_path, "trainer:\n  lr_warmup: 10\n")
    message = _error(path, ("trainer.lr=0.1",))
    assert "trainer.lr_warmup: unknown key" in message and "(from" not in message


def test_env_variables_without_a_section_separator_are_not_config_keys() -> None:
    cfg = load_config(None, environ={"LEEWAY_LR": "oops", "LEEWAY_TRAINER__BATCH_GROUPS": "4"})
    assert cfg.trainer.batch_groups == 4


def test_nested_set_override() -> None:
    cfg = load_config(None, ["engine.sampling.top_k=5"], environ={})
    assert cfg.engine.sampling.top_k == 5


# ---- rejected keys and values ------------------------------------------------------------------------------


def test_unknown_key_is_named_with_file(tmp_path: Path) -> None:
    path = _write(tmp_path, "trainer:\n  learning_rate: 0.1\n")
    message = _error(path)
    assert message.startswith(str(path))
    assert "trainer.learning_rate: unknown key" in message


def test_unknown_section_is_rejected(tmp_path: Path) -> None:
    assert "optimiser: unknown key" in _error(_write(tmp_path, "optimiser:\n  lr: 1\n"))


def test_unknown_key_from_set_names_the_flag() -> None:
    assert "trainer.lrr: unknown key (from --set trainer.lrr)" in _error(None, ("trainer.lrr=3",))


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("trainer:\n  batch_groups: many\n", "trainer.batch_groups = 'many'"),
        ("staleness:\n  max_staleness: -1\n", "staleness.max_staleness = -1"),
        ("staleness:\n  policy: drop_everything\n", "staleness.policy = 'drop_everything'"),
        ("correction:\n  clip_c: 1.0\n", "correction.clip_c = 1.0"),
        ("store:\n  part_size_bytes: 1024\n", "store.part_size_bytes = 1024"),
    ],
)
def test_bad_value_names_file_key_and_value(tmp_path: Path, text: str, expected: str) -> None:
    path = _write(tmp_path, text)
    message = _error(path)
    assert message.startswith(str(path)) and expected in message


def test_invalid_run_name_says_what_is_allowed() -> None:
    message = _error(None, ("run.name=bad name!",))
    assert "run.name = 'bad name!': run name must be 1-64 letters" in message
    assert "Value error" not in message


def test_bad_yaml_names_file(tmp_path: Path) -> None:
    path = _write(tmp_path, "trainer: [unclosed\n")
    message = _error(path)
    assert message.startswith(str(path)) and "not valid YAML" in message


def test_top_level_must_be_a_mapping(tmp_path: Path) -> None:
    assert "expected a mapping of sections" in _error(_write(tmp_path, "- 1\n- 2\n"))


def test_missing_file_is_named(tmp_path: Path) -> None:
    assert _error(tmp_path / "nope.yaml") == f"{tmp_path / 'nope.yaml'}: config file not found"


def test_bad_set_without_equals() -> None:
    assert "KEY=VALUE" in _error(None, ("trainer.lr",))


def test_set_through_a_value_is_rejected(tmp_path: Path) -> None:
    assert "is a value, not a section" in _error(_write(tmp_path, "trainer:\n  lr: 0.1\n"), ("trainer.lr.x=3",))


# ---- parts that are not built yet --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "key_and_value", "instead"),
    [
        ("engine:\n  kind: sglang\n", "engine.kind = 'sglang'", "'torch'"),
        ("engine:\n  sglang_url: http://127.0.0.1:30000\n", "engine.sglang_url = 'http://127.0.0.1:30000'", "remove"),
    ],
)
def test_unbuilt_part_is_rejected_at_load_naming_file_key_and_what_exists(
    tmp_path: Path, text: str, key_and_value: str, instead: str
) -> None:
    path = _write(tmp_path, text)
    message = _error(path)
    assert message.startswith(str(path))
    line = next(line for line in message.splitlines() if key_and_value in line)
    assert "not built yet" in line and instead in line
    assert "unknown key" not in message


def test_unbuilt_part_from_set_names_the_flag() -> None:
    message = _error(None, ("engine.kind=sglang",))
    assert "engine.kind = 'sglang': not built yet" in message and "(from --set engine.kind)" in message


def test_the_built_choices_still_load() -> None:
    cfg = load_config(None, ["engine.kind=torch", "trainer.backend=torch"], environ={})
    assert (cfg.engine.kind, cfg.trainer.backend) == ("torch", "torch")
    cfg = load_config(None, ["trainer.backend=megatron", "megatron.tensor_parallel_size=2"], environ={})
    assert (cfg.trainer.backend, cfg.megatron.tensor_parallel_size) == ("megatron", 2)


# ---- settings the chosen backend would ignore ------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "key_and_value"),
    [
        (("trainer.backend=megatron", "trainer.fused_kernels='on'"), "trainer.fused_kernels = 'on'"),
        (("trainer.backend=megatron", "trainer.lm_head_chunk_tokens=1024"), "trainer.lm_head_chunk_tokens = 1024"),
        (("megatron.tensor_parallel_size=2",), "megatron.tensor_parallel_size = 2"),
        (("megatron.pipeline_parallel_size=2",), "megatron.pipeline_parallel_size = 2"),
        (("megatron.use_transformer_engine=false",), "megatron.use_transformer_engine = False"),
    ],
)
def test_a_setting_the_backend_would_ignore_against_its_meaning_is_refused(
    overrides: tuple[str, ...], key_and_value: str
) -> None:
    message = _error(None, overrides)
    line = next(line for line in message.splitlines() if key_and_value in line)
    assert "trainer.backend" in line and f"(from --set {key_and_value.split(' = ')[0]})" in line


def test_every_refused_setting_gets_its_own_line_and_a_file_is_named(tmp_path: Path) -> None:
    text = "trainer:\n  backend: megatron\n  fused_kernels: 'on'\n  lm_head_chunk_tokens: 64\n"
    path = _write(tmp_path, text)
    message = _error(path)
    assert message.startswith(f"{path}: invalid config:")
    lines = message.splitlines()[1:]
    assert [line.split(" = ")[0].strip() for line in lines] == ["trainer.fused_kernels", "trainer.lm_head_chunk_tokens"]
    assert "(from" not in message


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (("trainer.backend=megatron", "trainer.packing=false"), "trainer.packing"),
        (("trainer.backend=megatron", "trainer.fused_kernels='off'"), "trainer.fused_kernels"),
        (("trainer.backend=megatron", "trainer.lm_head_chunk_tokens=0"), "trainer.lm_head_chunk_tokens"),
    ],
)
def test_a_harmless_setting_the_backend_ignores_loads_with_a_warning(
    overrides: tuple[str, ...], key: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="pipeline.config"):
        load_config(None, overrides, environ={})
    assert [r.getMessage().split(" = ")[0] for r in caplog.records] == [key]
    assert "has no effect" in caplog.records[0].getMessage()


@pytest.mark.parametrize("backend", ["torch", "megatron"])
def test_a_written_out_config_of_either_backend_loads_again_without_warnings(
    backend: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`leeway run` writes every key (defaults included) to `<run.dir>/config.yaml` and the roles load it."""
    written = load_config(None, [f"trainer.backend={backend}"], environ={}).to_yaml()
    with caplog.at_level(logging.WARNING, logger="pipeline.config"):
        again = load_config(_write(tmp_path, written), environ={})
    assert again.trainer.backend == backend and not caplog.records


# ---- removed keys ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["false", "true"])
def test_metrics_jsonl_is_gone_and_the_error_says_the_file_is_always_written(tmp_path: Path, value: str) -> None:
    message = _error(_write(tmp_path, f"logging:\n  metrics_jsonl: {value}\n"))
    assert f"logging.metrics_jsonl = {value.capitalize()}: removed" in message
    assert "metrics.jsonl` is always written" in message and "--resume" in message
    assert "unknown key" not in message


# ---- reference and import weight ---------------------------------------------------------------------------


def test_every_field_has_a_docstring() -> None:
    reference = config_reference()
    assert "| `trainer.lr` |" in reference
    (kind,) = [line for line in reference.splitlines() if line.startswith("| `engine.kind` |")]
    assert "`sglang`" in kind and "has not been run" in kind  # the reference says what was never executed
    for line in reference.splitlines():
        if line.startswith("| `"):
            assert not line.rstrip().endswith("|  |"), line


def test_config_module_imports_without_heavy_dependencies() -> None:
    code = (
        "import sys, pipeline.config\n"
        "heavy = [m for m in ('torch', 'transformers', 'numpy', 'pyarrow') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_max_staleness_has_an_upper_bound_and_the_bound_itself_loads() -> None:
    message = _error(None, (f"staleness.max_staleness={MAX_STALENESS_LIMIT + 1}",))
    assert f"staleness.max_staleness = {MAX_STALENESS_LIMIT + 1}" in message
    assert f"less than or equal to {MAX_STALENESS_LIMIT}" in message
    assert "(from --set staleness.max_staleness)" in message
    cfg = load_config(None, [f"staleness.max_staleness={MAX_STALENESS_LIMIT}"], environ={})
    assert cfg.staleness.max_staleness == MAX_STALENESS_LIMIT


@pytest.mark.parametrize("heartbeat", ["60", "90.5"])
def test_a_heartbeat_no_more_often_than_the_prompt_ack_wait_is_refused_naming_both(
    tmp_path: Path, heartbeat: str
) -> None:
    path = _write(tmp_path, f"generator:\n  heartbeat_s: {heartbeat}\nstream:\n  prompt_ack_wait_s: 60\n")
    message = _error(path)
    assert message.startswith(f"{path}: invalid config:")
    line = next(line for line in message.splitlines() if "generator.heartbeat_s" in line)
    assert f"generator.heartbeat_s = {float(heartbeat)!r}: must be below stream.prompt_ack_wait_s = 60.0" in line
    assert load_config(None, ["generator.heartbeat_s=59", "stream.prompt_ack_wait_s=60"], environ={})


def test_an_admission_window_the_stream_may_not_hold_loads_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    # (8 + 1) x 16 groups of up to 1 MiB inline: 144 MiB, in a 64 MiB stream
    sets = ["staleness.max_staleness=8", "stream.max_bytes=67108864"]
    with caplog.at_level(logging.WARNING, logger="pipeline.config"):
        load_config(None, sets, environ={})
    assert [r.getMessage().split(" lets ")[0] for r in caplog.records] == ["staleness.max_staleness = 8"]
    assert "144 groups" in caplog.records[0].getMessage()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pipeline.config"):
        load_config(None, ["staleness.max_staleness=2", "stream.max_bytes=67108864"], environ={})
    assert not caplog.records, "(2 + 1) x 16 MiB fits in 64 MiB"
