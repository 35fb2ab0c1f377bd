import dataclasses
from dataclasses import dataclass, field
from typing import Literal, get_args, get_type_hints

import pytest
import yaml

from lmforge.core.config import (
    ConfigError,
    Range,
    at_least,
    check_ranges,
    dump_config,
    field_help,
    field_range,
    from_dict,
    load_config,
    option,
    parse_scalar,
    plugin_field,
    positive,
    unit_interval,
)
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


@dataclass
class WithOptionalSection:
    lora: ModelCfg | None = None


def test_an_optional_sections_errors_name_the_key_inside_it(tmp_path):
    with pytest.raises(ConfigError, match=r"'lora\.n_layers' must be int, got 'four' \(str\)"):
        load_config(WithOptionalSection, None, ["lora.n_layers=four"])
    with pytest.raises(ConfigError, match=r"unknown key 'lora\.n_layer'.*did you mean 'lora\.n_layers'"):
        load_config(WithOptionalSection, write(tmp_path, "lora:\n  n_layer: 3\n"))
    with pytest.raises(ConfigError, match=r"'lora' must be a mapping or null, got 5 \(int\)"):
        load_config(WithOptionalSection, None, ["lora=5"])
    assert load_config(WithOptionalSection, None, ["lora.n_layers=3"]).lora.n_layers == 3
    assert load_config(WithOptionalSection, None, []).lora is None


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
    with pytest.raises(ConfigError, match=r":1:10: could not determine a constructor for the tag .*python/object/apply"):
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


# --------------------------------------------------------------------------- ranges


@dataclass
class RangedCfg:
    lr: float = positive(1e-3)
    ratio: float = unit_interval(0.1)
    beta: float = unit_interval(0.9, high_open=True)
    steps: int = at_least(0, 10)
    shard: int = at_least(1, -1, also=(-1,))
    cap: float | None = positive(None, allow_inf=True)
    ids: list[int] | None = at_least(0, None)
    limits: dict[int, float] = unit_interval(keys=Range(1), default_factory=lambda: {2: 0.5})


@pytest.mark.parametrize("override, message", [
    ("ratio=-1", "'ratio' = -1: must be in [0, 1]"),
    ("beta=1.5", "'beta' = 1.5: must be in [0, 1)"),
    ("beta=1", "'beta' = 1: must be in [0, 1)"),
    ("lr=0", "'lr' = 0: must be > 0 and finite"),
    ("lr=nan", "'lr' = nan: must be > 0 and finite"),
    ("lr=inf", "'lr' = inf: must be > 0 and finite"),
    ("steps=-1", "'steps' = -1: must be >= 0"),
    ("shard=0", "'shard' = 0: must be -1 or >= 1"),
    ("cap=nan", "'cap' = nan: must be > 0"),
    ("ids=[3,-2]", "'ids[1]' = -2: must be >= 0"),
    ("limits={2: 1.5}", "'limits.2' = 1.5: must be in [0, 1]"),
    ("limits={0: 0.5}", "'limits' has the key 0: keys must be >= 1"),
])
def test_a_number_outside_its_fields_range_is_one_line_naming_key_value_and_range(override, message):
    with pytest.raises(ConfigError) as exc:
        load_config(RangedCfg, None, [override])
    assert str(exc.value) == f"overrides: {message}"


def test_values_at_closed_bounds_special_values_and_allowed_infinity_are_accepted():
    cfg = load_config(RangedCfg, None, ["ratio=0", "beta=0", "steps=0", "shard=-1", "cap=inf", "ids=[]", "cap=null"])
    assert (cfg.ratio, cfg.steps, cfg.shard, cfg.cap, cfg.ids) == (0.0, 0, -1, None, [])
    assert load_config(RangedCfg, None, ["cap=inf"]).cap == float("inf")


def test_a_range_error_names_the_recipe_file_and_the_dotted_key(tmp_path):
    from lmforge.stages.pretrain import PretrainRecipe

    p = write(tmp_path, "train:\n  min_lr_ratio: -1\n")
    with pytest.raises(ConfigError) as exc:
        load_config(PretrainRecipe, p)
    assert str(exc.value) == f"{p}: 'train.min_lr_ratio' = -1: must be in [0, 1]"


def test_check_ranges_checks_a_config_built_in_python_with_dotted_keys():
    from lmforge.stages.pretrain import PretrainRecipe

    recipe = PretrainRecipe()
    recipe.train.lr = float("nan")
    with pytest.raises(ConfigError, match=r"^config: 'train\.lr' = nan: must be > 0 and finite$"):
        check_ranges(recipe)


# The issue's examples: each is refused by load_config before any work, in one line.
ISSUE_EXAMPLES = [
    ("train.min_lr_ratio=-1", "'train.min_lr_ratio' = -1: must be in [0, 1]"),
    ("model.d_model=0", "'model.d_model' = 0: must be > 0"),
    ("train.checkpoint_every=-1", "'train.checkpoint_every' = -1: must be >= 0"),
    ("train.batch_tokens=0", "'train.batch_tokens' = 0: must be > 0"),
    ("model.n_kv_heads=0", "'model.n_kv_heads' = 0: must be > 0"),
    ("model.n_layers=0", "'model.n_layers' = 0: must be > 0"),
    ("train.lr=nan", "'train.lr' = nan: must be > 0 and finite"),
    ("train.beta1=1.5", "'train.beta1' = 1.5: must be in [0, 1)"),
    ("train.lr=inf", "'train.lr' = inf: must be > 0 and finite"),
    ("train.eps=0", "'train.eps' = 0: must be > 0 and finite"),
    ("model.rope_theta=0", "'model.rope_theta' = 0: must be > 0 and finite"),
]


@pytest.mark.parametrize("override, message", ISSUE_EXAMPLES)
def test_the_issues_bad_pretrain_values_are_refused_by_load_config(override, message):
    from lmforge.stages.pretrain import PretrainRecipe

    with pytest.raises(ConfigError) as exc:
        load_config(PretrainRecipe, None, [override])
    assert str(exc.value) == f"overrides: {message}"


@pytest.mark.parametrize("override, message", [
    ("model.n_heads=5", "'model': d_model = 384 must be divisible by n_heads = 5 (or set head_dim)"),
    ("model.n_kv_heads=4", "'model': n_heads = 6 must be a multiple of n_kv_heads = 4"),
    ("model.head_dim=63", "'model': head_dim = 63 must be even for RoPE"),
])
def test_model_shape_constraints_between_keys_are_one_line_naming_both(override, message):
    from lmforge.stages.pretrain import PretrainRecipe

    with pytest.raises(ConfigError) as exc:
        load_config(PretrainRecipe, None, [override])
    assert str(exc.value) == f"overrides: {message}"


def test_a_model_config_built_in_python_checks_its_ranges_before_dividing():
    from lmforge.model.config import ModelConfig

    with pytest.raises(ConfigError, match=r"'n_heads' = 0: must be > 0"):
        ModelConfig(n_heads=0)


def config_roots() -> list[type]:
    """Every config dataclass a user sets: each verb's recipe, curate's step types and
    train-classifier, and the generation engine's config."""
    from lmforge.curate.quality import TrainClassifierConfig
    from lmforge.curate.steps import STEP_TYPES, _load
    from lmforge.inference.engine import GenerationConfig
    from lmforge.stages import VERBS

    return ([verb.load().RECIPE for verb in VERBS] + [_load(t)[0] for t in STEP_TYPES]
            + [TrainClassifierConfig, GenerationConfig])


def reachable_dataclasses(roots: list[type]) -> list[type]:
    seen: list[type] = []

    def visit(tp) -> None:
        if dataclasses.is_dataclass(tp) and isinstance(tp, type):
            if tp in seen:
                return
            seen.append(tp)
            for hint in get_type_hints(tp).values():
                visit(hint)
        for arg in get_args(tp):
            visit(arg)

    for root in roots:
        visit(root)
    return seen


def holds_numbers(tp) -> bool:
    """Whether a field's annotation has an int or float in it (``int | None``, ``list[int]``, ``dict[int, float]``)."""
    return tp in (int, float) or any(holds_numbers(a) for a in get_args(tp))


def test_a_fields_help_text_lives_in_its_metadata_beside_its_default_and_range():
    @dataclass
    class Cfg:
        name: str = option(help="what it is called")
        width: int = positive(8, help="columns")
        tags: list[str] = option(default_factory=list, help="labels")
        reward: str | None = plugin_field(help="module:function")
        plain: int = 1  # a comment is not help text

    fields = {f.name: f for f in dataclasses.fields(Cfg)}
    assert {name: field_help(f) for name, f in fields.items()} == {
        "name": "what it is called", "width": "columns", "tags": "labels", "reward": "module:function", "plain": ""}
    assert field_range(fields["width"]) == Range(0, low_open=True)
    assert fields["reward"].metadata["plugin"]
    assert Cfg(name="x").tags == [] and Cfg(name="x").width == 8
    with pytest.raises(TypeError):
        Cfg()  # option() without a default is a required key


def test_every_numeric_field_of_every_config_declares_its_range():
    classes = reachable_dataclasses(config_roots())
    assert len(classes) > 30
    missing = [f"{cls.__module__}.{cls.__qualname__}.{f.name}" for cls in classes
               for f in dataclasses.fields(cls) if holds_numbers(get_type_hints(cls)[f.name]) and field_range(f) is None]
    assert not missing, f"declare a range (positive(), at_least(), unit_interval(), in_range()) for: {missing}"


def test_every_config_default_lies_in_its_declared_range():
    for root in config_roots():
        try:
            instance = root()
        except (TypeError, ValueError):  # a recipe with required keys (export, import)
            continue
        check_ranges(instance, source=root.__qualname__)


def test_an_override_error_names_the_override_and_a_file_error_the_file(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("steps: 3\n")
    with pytest.raises(ConfigError) as exc:
        load_config(RangedCfg, recipe, ["steps=-1"])
    assert str(exc.value) == "override 'steps=-1': 'steps' = -1: must be >= 0"
    recipe.write_text("ratio: 2\n")
    with pytest.raises(ConfigError) as exc:
        load_config(RangedCfg, recipe, ["steps=1"])
    assert str(exc.value) == f"{recipe}: 'ratio' = 2: must be in [0, 1]"
    with pytest.raises(ConfigError, match=r"^command-line override 'limits=\{2: 3\}': 'limits.2' = 3"):
        load_config(RangedCfg, recipe, ["ratio=0", "limits={2: 3}"], overrides_label="command-line override")


def test_a_renamed_key_moves_to_its_new_place_maps_its_values_and_refuses_both_set(tmp_path):
    from typing import ClassVar

    from lmforge.core.config import Renamed

    @dataclass
    class Loss:
        beta: float = 0.1
        name: str = "none"

    @dataclass
    class Old:
        objective: Loss = field(default_factory=Loss)
        RENAMED_KEYS: ClassVar[dict] = {"beta": Renamed("objective.beta"),
                                        "eval.enabled": Renamed("objective.name", {True: "on", False: "none"})}

    cfg = load_config(Old, None, ["beta=0.5", "eval.enabled=true"])  # the emptied `eval` section goes with its key
    assert cfg.objective == Loss(beta=0.5, name="on")
    with pytest.raises(ConfigError, match=r"both 'beta' \(deprecated\) and 'objective.beta' are set: keep 'objective.beta'"):
        load_config(Old, None, ["beta=0.5", "objective.beta=0.2"])
    with pytest.raises(ConfigError, match=r"'eval.enabled' = 'maybe' \(str\): must be one of \[True, False\]"):
        load_config(Old, None, ["eval.enabled=maybe"])
    recipe = tmp_path / "r.yaml"
    recipe.write_text("beta: 0.3\neval: {enabled: false}\n")
    assert load_config(Old, recipe).objective == Loss(beta=0.3, name="none")
    assert dataclasses.fields(Old)[0].name == "objective" and len(dataclasses.fields(Old)) == 1


def test_setting_one_key_of_a_section_keeps_the_recipes_other_defaults_for_it():
    """A recipe's section default (a default_factory) is not replaced by the class's defaults
    when one key of the section is overridden."""
    from dataclasses import dataclass, field

    @dataclass
    class Inner:
        a: int = 1
        b: float = 0.5
        c: str = "x"

    @dataclass
    class Recipe:
        inner: Inner = field(default_factory=lambda: Inner(b=0.25, c="recipe"))

    assert load_config(Recipe, None, []).inner == Inner(1, 0.25, "recipe")
    assert load_config(Recipe, None, ["inner.a=7"]).inner == Inner(7, 0.25, "recipe")
    assert load_config(Recipe, None, ["inner.c=mine"]).inner == Inner(1, 0.25, "mine")


def test_a_dpo_recipe_keeps_its_train_defaults_when_one_train_key_is_set():
    from lmforge.stages.dpo import DPORecipe

    default = load_config(DPORecipe, None, ["checkpoint=c", "data.train=[x.jsonl]"]).train
    changed = load_config(DPORecipe, None, ["checkpoint=c", "data.train=[x.jsonl]", "train.max_steps=30"]).train
    assert changed.max_steps == 30 and changed.lr == default.lr == 5e-6 and changed.warmup_steps == default.warmup_steps


def test_the_key_suggested_for_an_unknown_key_comes_with_its_help_text():
    @dataclass
    class Cfg:
        width: int = positive(8, help="columns")
        height: int = 3

    with pytest.raises(ConfigError, match=r"^overrides: unknown key 'widht'; did you mean 'width' \(columns\)\?$"):
        load_config(Cfg, None, ["widht=2"])
    with pytest.raises(ConfigError, match=r"^overrides: unknown key 'heigth'; did you mean 'height'\?$"):
        load_config(Cfg, None, ["heigth=2"])


def test_a_plugin_in_the_working_directory_imports_without_pythonpath(tmp_path, monkeypatch):
    import sys

    from lmforge.core.config import load_plugin

    (tmp_path / "my_cwd_rewards.py").write_text("def brevity(text, prompt):\n    return -len(text)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    assert load_plugin("my_cwd_rewards:brevity", "reward.components[0].function")("abc", None) == -3
    with pytest.raises(ConfigError, match=r"^reward\.function = 'my_cwd_rewards:nope': 'my_cwd_rewards' has no "
                                          r"callable 'nope'$"):
        load_plugin("my_cwd_rewards:nope", "reward.function")
