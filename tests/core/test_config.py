from dataclasses import dataclass, field
from typing import Literal

import pytest
import yaml

from lmforge.core.config import ConfigError, dump_config, from_dict, load_config, parse_scalar
from lmforge.core.run import start_run


@dataclass
class ModelCfg:
    n_layers: int = 2
    d_model: int = 64
    norm: Literal["rmsnorm", "layernorm"] = "rmsnorm"
    dropout: float = 0.0


@dataclass
class TrainCfg:
    lr: float = 1e-3
    max_steps: int = 10
    compile: bool = False
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    warmup: int | None = None


@dataclass
class Recipe:
    run_dir: str = "runs/x"
    model: ModelCfg = field(default_factory=ModelCfg)
    train: TrainCfg = field(default_factory=TrainCfg)


def write(tmp_path, text):
    p = tmp_path / "r.yaml"
    p.write_text(text)
    return p


def test_yaml_values_and_dotted_overrides_build_nested_dataclasses(tmp_path):
    p = write(tmp_path, "model:\n  n_layers: 6\ntrain:\n  lr: 0.01\n")
    cfg = load_config(Recipe, p, ["model.n_layers=4", "train.lr=3e-4", "train.compile=true", "train.betas=[0.8,0.9]"])
    assert cfg.model.n_layers == 4 and isinstance(cfg.model.n_layers, int)
    assert cfg.train.lr == pytest.approx(3e-4) and isinstance(cfg.train.lr, float)
    assert cfg.train.compile is True
    assert cfg.train.betas == [0.8, 0.9]
    assert cfg.model.d_model == 64  # untouched default


def test_yaml_scientific_notation_without_dot_is_a_float(tmp_path):
    cfg = load_config(Recipe, write(tmp_path, "train:\n  lr: 3e-4\n"))
    assert cfg.train.lr == pytest.approx(3e-4)


def test_unknown_key_names_the_closest_valid_key(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown key 'model\.n_layer'.*did you mean 'model\.n_layers'"):
        load_config(Recipe, write(tmp_path, "model:\n  n_layer: 3\n"))
    with pytest.raises(ConfigError, match=r"unknown key 'trian'.*did you mean 'train'"):
        load_config(Recipe, None, ["trian.lr=1"])


def test_wrong_type_names_key_value_and_expected_type(tmp_path):
    with pytest.raises(ConfigError, match=r"'model\.n_layers' must be int, got 'four' \(str\)"):
        load_config(Recipe, None, ["model.n_layers=four"])
    with pytest.raises(ConfigError, match=r"'train\.compile' must be bool, got 1 \(int\)"):
        load_config(Recipe, None, ["train.compile=1"])
    with pytest.raises(ConfigError, match=r"'model\.norm' must be one of 'rmsnorm', 'layernorm', got 'batchnorm'"):
        load_config(Recipe, None, ["model.norm=batchnorm"])
    with pytest.raises(ConfigError, match=r"'model' must be a mapping"):
        from_dict(Recipe, {"model": 3})


def test_optional_fields_accept_null_and_values():
    assert load_config(Recipe, None, ["train.warmup=null"]).train.warmup is None
    assert load_config(Recipe, None, ["train.warmup=5"]).train.warmup == 5


def test_override_must_have_key_and_value():
    with pytest.raises(ConfigError, match="must look like key.subkey=value"):
        load_config(Recipe, None, ["model.n_layers"])
    with pytest.raises(ConfigError, match="is a value, not a section"):
        load_config(Recipe, None, ["run_dir=a", "run_dir.x=1"])


def test_yaml_is_loaded_safely(tmp_path):
    p = write(tmp_path, "run_dir: !!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(Recipe, p)


def test_recipe_must_exist_and_be_a_mapping(tmp_path):
    with pytest.raises(ConfigError, match="recipe not found"):
        load_config(Recipe, tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_config(Recipe, write(tmp_path, "- 1\n- 2\n"))


def test_dumped_config_loads_back_equal(tmp_path):
    cfg = load_config(Recipe, None, ["model.n_layers=7", "train.warmup=3"])
    again = load_config(Recipe, write(tmp_path, dump_config(cfg)))
    assert again == cfg


def test_resolved_config_is_written_into_the_run_directory(tmp_path):
    cfg = load_config(Recipe, None, [f"run_dir={tmp_path / 'run'}", "model.d_model=32"])
    run_dir = start_run(cfg, cfg.run_dir)
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["model"]["d_model"] == 32 and saved["train"]["lr"] == 1e-3


def test_parse_scalar_reads_numbers_lists_and_strings():
    assert parse_scalar("3e-4") == 3e-4
    assert parse_scalar("12") == 12
    assert parse_scalar("[a, b]") == ["a", "b"]
    assert parse_scalar("true") is True
    assert parse_scalar("runs/x") == "runs/x"
