"""Config loading: every shipped YAML loads, errors name file/key/value, override precedence."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.config import ConfigError, LeewayConfig, config_reference, load_config

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_loads(path: Path) -> None:
    cfg = load_config(path, environ={})
    assert isinstance(cfg, LeewayConfig)
    assert cfg.run.name


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def test_unknown_key_is_named_with_file(tmp_path: Path) -> None:
    path = _write(tmp_path, "trainer:\n  learning_rate: 0.1\n")
    with pytest.raises(ConfigError) as err:
        load_config(path, environ={})
    assert "trainer.learning_rate" in str(err.value)
    assert "unknown key" in str(err.value)
    assert str(path) in str(err.value)


def test_unknown_section_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="optimiser: unknown key"):
        load_config(_write(tmp_path, "optimiser:\n  lr: 1\n"), environ={})


def test_wrong_type_names_key_and_value(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(_write(tmp_path, "trainer:\n  batch_groups: many\n"), environ={})
    assert "trainer.batch_groups" in str(err.value) and "'many'" in str(err.value)


def test_constraint_violation_names_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"staleness\.max_staleness = -1"):
        load_config(_write(tmp_path, "staleness:\n  max_staleness: -1\n"), environ={})


def test_bad_yaml_names_file(tmp_path: Path) -> None:
    path = _write(tmp_path, "trainer: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML") as err:
        load_config(path, environ={})
    assert str(path) in str(err.value)


def test_top_level_must_be_a_mapping(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="mapping"):
        load_config(_write(tmp_path, "- 1\n- 2\n"), environ={})


def test_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml", environ={})


def test_bad_set_without_equals() -> None:
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        load_config(None, ["trainer.lr"], environ={})


def test_bad_set_unknown_key() -> None:
    with pytest.raises(ConfigError, match="trainer.lrr: unknown key"):
        load_config(None, ["trainer.lrr=3"], environ={})


def test_set_through_a_value_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="is a value"):
        load_config(_write(tmp_path, "trainer:\n  lr: 0.1\n"), ["trainer.lr.x=3"], environ={})


def test_invalid_run_name_rejected() -> None:
    with pytest.raises(ConfigError, match="run.name"):
        load_config(None, ["run.name=bad name!"], environ={})


def test_precedence_file_then_env_then_set(tmp_path: Path) -> None:
    path = _write(tmp_path, "trainer:\n  lr: 0.1\n  batch_groups: 3\nstaleness:\n  max_staleness: 5\n")
    env = {"LEEWAY_TRAINER__LR": "0.2", "LEEWAY_STALENESS__MAX_STALENESS": "7", "UNRELATED": "x"}
    cfg = load_config(path, ["trainer.lr=0.3"], environ=env)
    assert cfg.trainer.lr == 0.3  # --set beats env
    assert cfg.staleness.max_staleness == 7  # env beats file
    assert cfg.trainer.batch_groups == 3  # file beats default
    assert cfg.advantages.group_size == 8  # default


def test_env_override_error_names_variable() -> None:
    with pytest.raises(ConfigError, match="LEEWAY_TRAINER__LR"):
        load_config(None, environ={"LEEWAY_TRAINER__LR": "fast"})


def test_nested_set_override() -> None:
    cfg = load_config(None, ["engine.sampling.top_k=5"], environ={})
    assert cfg.engine.sampling.top_k == 5


def test_external_servers_skip_embedded_stack() -> None:
    assert load_config(None, environ={}).uses_embedded_stack
    cfg = load_config(None, ["nats.url=nats://h:4222", "store.endpoint=http://h:9000"], environ={})
    assert not cfg.uses_embedded_stack


def test_every_field_has_a_docstring() -> None:
    reference = config_reference()
    assert "| `trainer.lr` |" in reference
    for line in reference.splitlines():
        if line.startswith("| `"):
            assert not line.rstrip().endswith("|  |"), line


def test_config_module_imports_without_heavy_dependencies() -> None:
    code = (
        "import sys, pipeline.config\n"
        "heavy = [m for m in ('torch', 'ray', 'sglang', 'megatron') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
