import dataclasses
import json
import re
import subprocess
import sys

import pytest

from lmforge.cli.main import VERBS, VERBS_BY_NAME, main, recipe_keys
from lmforge.core.config import load_config, option, positive


def run_cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "lmforge", *args], capture_output=True, text=True, cwd=cwd, timeout=120)


def test_help_lists_every_verb_with_a_line_each(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    for verb in VERBS:
        assert verb.name in out and verb.summary[:30] in out


def test_python_dash_m_prints_the_same_help_as_the_console_script():
    r = run_cli("--help")
    assert r.returncode == 0
    assert all(v.name in r.stdout for v in VERBS)


@pytest.mark.parametrize("verb", [v.name for v in VERBS])
def test_every_verb_has_its_own_help_listing_recipe_keys(verb, capsys):
    with pytest.raises(SystemExit) as exc:
        main([verb, "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "recipe keys" in out


def test_unknown_key_is_reported_with_a_suggestion_and_exit_code_2(capsys):
    assert main(["prepare", "val_fractoin=0.1"]) == 2
    assert "did you mean 'val_fraction'" in capsys.readouterr().err



def test_under_torchrun_an_error_every_rank_meets_alike_is_printed_by_the_first_rank_only(tmp_path, monkeypatch,
                                                                                         capsys):
    """A bad override, or a divergence (decided from all-reduced numbers), reads the same on every
    rank: the machine's first rank prints it, the others exit with the same status. An error inside
    a stage may be one rank's own, so every rank prints it."""
    import lmforge.stages.export as export
    from lmforge.core.run import RunDiverged

    monkeypatch.setenv("LOCAL_RANK", "1")
    assert main(["prepare", "val_fractoin=0.1"]) == 2
    assert capsys.readouterr().err == ""
    assert main(["export", str(tmp_path / "missing"), str(tmp_path / "hf")]) == 2  # raised inside the stage
    assert "lmforge export: error: " in capsys.readouterr().err

    def diverged(cfg):
        raise RunDiverged("non-finite loss or gradient norm for 3 steps in a row")

    monkeypatch.setattr(export, "run", diverged)
    assert main(["export", str(tmp_path / "missing"), str(tmp_path / "hf")]) == 1
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert main(["prepare", "val_fractoin=0.1"]) == 2
    assert "did you mean 'val_fraction'" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "missing"), str(tmp_path / "hf")]) == 1
    assert capsys.readouterr().err == "lmforge export: error: non-finite loss or gradient norm for 3 steps in a row\n"


def test_print_config_shows_the_resolved_recipe(capsys, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("tokenizer:\n  vocab_size: 1000\n")
    assert main(["tokenizer", str(recipe), "tokenizer.min_frequency=3", "--print-config"]) == 0
    out = capsys.readouterr().out
    assert "vocab_size: 1000" in out and "min_frequency: 3" in out


def test_tokenizer_then_prepare_from_the_command_line(tmp_path, corpus_jsonl):
    r = run_cli("tokenizer", f"data.paths={corpus_jsonl}", f"run_dir={tmp_path}/tok", "tokenizer.vocab_size=400", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    stats = json.loads((tmp_path / "tok" / "stats.json").read_text())
    assert stats["vocab_size"] == 400 and stats["heldout"]["bytes_per_token"] > 1
    assert "bytes/token" in r.stderr
    r = run_cli("prepare", f"data.paths={corpus_jsonl}", f"tokenizer={tmp_path}/tok", f"run_dir={tmp_path}/data", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    manifest = json.loads((tmp_path / "data" / "manifest.json").read_text())
    assert manifest["n_docs"] == 60
    assert (tmp_path / "data" / "config.yaml").is_file() and (tmp_path / "tok" / "config.yaml").is_file()


def test_a_bad_input_file_is_a_one_line_error_not_a_traceback(tmp_path, small_tokenizer_dir):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\nnot json\n')
    r = run_cli("prepare", f"data.paths={bad}", f"tokenizer={small_tokenizer_dir}", f"run_dir={tmp_path}/out")
    assert r.returncode == 2
    assert "bad.jsonl:2: malformed JSON" in r.stderr and "Traceback" not in r.stderr


def test_curate_train_classifier_trains_from_the_command_line(tmp_path, capfd):
    import json

    texts = {1: "the cat sat on the mat and read a good book about the sea", 0: "buy cheap pills now click here win"}
    rows = [{"text": f"{texts[label]} {i}", "label": label} for i in range(30) for label in (0, 1)]
    data = tmp_path / "labelled.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "classifier"
    assert main(["curate", "train-classifier", f"data=[{data}]", f"output={out}", "hash_bits=12"]) == 0
    assert (out / "classifier.npz").is_file()
    saved = json.loads((out / "classifier.json").read_text())
    assert saved["validation"]["accuracy"] == 1.0
    assert "train-classifier: 54 training examples" in capfd.readouterr().err


def test_verb_help_explains_each_key_with_its_fields_help_text(capsys):
    with pytest.raises(SystemExit):
        main(["dpo", "--help"])
    out = " ".join(capsys.readouterr().out.split())  # a long help text wraps over lines
    assert "train.lr" in out and "peak learning rate" in out  # TrainConfig, nested
    assert "keeps DPO from lowering the chosen answer's likelihood" in out  # a help text of several lines
    assert "dpo | ipo | cdpo | rdpo | hinge" in out  # inherited from PreferenceLossConfig


def keys_without_help(recipe: type) -> list[str]:
    """The keys ``--help`` and the docs list for ``recipe`` whose field declares no help text."""
    return [row.key for row in recipe_keys(recipe) if not row.help.strip()]


def help_entry_classes(module) -> list[tuple[str, type]]:
    """``(entry name, config class)`` of every entry a verb's ``help_entries`` lists below its
    recipe keys (curate's step types, from the step registry, and train-classifier)."""
    sections = module.help_entries() if hasattr(module, "help_entries") else []
    return [entry for _, entries in sections for entry in entries]


@pytest.mark.parametrize("verb", [v.name for v in VERBS])
def test_every_key_of_every_verbs_recipe_has_help_text(verb):
    """The recipe's keys, and the keys of every entry ``--help`` lists below them (each curate step
    type's config): a field declared without ``help=`` fails here."""
    module = VERBS_BY_NAME[verb].load()
    assert keys_without_help(module.RECIPE) == []
    missing = [f"{name}: {key}" for name, cls in help_entry_classes(module) for key in keys_without_help(cls)]
    assert missing == []


def test_curate_help_lists_every_registered_step_type_so_each_ones_keys_are_checked_for_help_text():
    from lmforge.curate.quality import TrainClassifierConfig
    from lmforge.curate.steps import STEP_TYPES, config_class

    listed = dict(help_entry_classes(VERBS_BY_NAME["curate"].load()))
    assert {name: listed.get(name) for name in STEP_TYPES} == {name: config_class(name) for name in STEP_TYPES}
    assert listed["train-classifier"] is TrainClassifierConfig


def test_curate_help_shows_each_step_types_keys_and_minhash_explains_its_keys_in_field_metadata(capsys):
    from lmforge.curate.minhash import MinHashConfig
    from lmforge.curate.steps import STEP_TYPES

    assert keys_without_help(MinHashConfig) == []  # its help is where --help reads it, not in comments
    out = verb_help("curate", capsys)
    steps = out.split("step types (each entry of steps:", 1)[1]
    assert all(re.search(rf"^  {name}\b", steps, re.M) for name in STEP_TYPES)
    minhash = steps.split("\n  minhash: MinHash-LSH near-dedup", 1)[1]
    assert re.search(r"^    n_grams\s+int\s+default 5\n\s+words per shingle$", minhash, re.M)
    assert "LSH bands b; more bands catch lower similarities" in minhash
    language = steps.split("\n  language: ", 1)[1].split("\n  url_filter: ", 1)[0]
    assert re.search(r"^    languages\s+a list of str\s+default \['en'\]\n\s+ISO 639 codes", language, re.M)
    classifier = " ".join(out.split("train-classifier recipe keys", 1)[1].split())
    assert "hash_bits int default 20 features are hashed into 2^hash_bits buckets" in classifier
    assert max(len(line) for line in out.splitlines()) <= 100


def test_a_recipe_field_without_help_text_is_found_and_a_comment_does_not_count():
    @dataclasses.dataclass
    class Section:
        depth: int = positive(2)

    @dataclasses.dataclass
    class Entry:
        name: str = option("", help="what it is called")
        size: int = 1

    @dataclasses.dataclass
    class Recipe:
        width: int = option(8, help="columns")
        height: int = 3  # a comment is not help text
        section: Section = dataclasses.field(default_factory=Section)
        optional: Section | None = None
        entries: list[Entry] = option(default_factory=list, help="the entries")

    assert keys_without_help(Recipe) == ["height", "section.depth", "optional", "optional.depth", "size"]


def verb_help(verb, capsys):
    with pytest.raises(SystemExit) as exc:
        main([verb, "--help"])
    assert exc.value.code == 0
    return capsys.readouterr().out



@pytest.mark.parametrize("verb", ["export", "import"])
def test_export_and_import_help_list_every_familys_hugging_face_classes_from_the_registry(verb, capsys):
    """Written from ``lmforge.model.families``, so a new family or class cannot be left out."""
    from lmforge.model.families import FAMILIES, hf_classes

    out = verb_help(verb, capsys)
    assert all(f"`{cls}`" in out for cls in hf_classes().values())
    assert all(f"| `{name}` |" in out for name in FAMILIES)
    assert "no HF equivalent" not in out  # the hand-written text that said gpt2 models were refused


def key_line(out, key):
    """The table row of ``key`` (its first line)."""
    return next(line for line in out.splitlines() if re.match(rf"^\s+{re.escape(key)}\s", line))


@pytest.mark.parametrize("verb", [v.name for v in VERBS])
def test_the_override_example_is_a_key_of_the_verbs_own_recipe(verb, capsys):
    out = " ".join(verb_help(verb, capsys).split())
    example = re.search(r"overrides of the recipe keys below, e\.g\. (\S+)", out).group(1)
    recipe = VERBS_BY_NAME[verb].load().RECIPE
    assert example.partition("=")[0] in [row.key for row in recipe_keys(recipe)]
    load_config(recipe, None, [example])  # and it parses as an override


def test_run_help_shows_the_keys_of_a_stage_entry(capsys):
    out = verb_help("run", capsys)
    assert "list of {name, verb, recipe, overrides}" in out
    assert "a list of a mapping" not in out
    for key, type_ in [("name", "str"), ("verb", "str"), ("recipe", "str or null"), ("overrides", "a list of str")]:
        assert re.search(rf"^ {{4}}{key}\s+{type_}\s+default", out, re.M), key
    assert "any `lmforge` verb with a recipe" in out  # an entry key's help


def test_pretrain_help_shows_the_path_weight_and_name_of_each_dataset(capsys):
    out = verb_help("pretrain", capsys)
    assert "list of {path, weight, name}" in key_line(out, "data.datasets")
    assert "required" in key_line(out, "path") and "default 1.0" in key_line(out, "weight")
    assert "default None" in key_line(out, "name")


@pytest.mark.parametrize("key", ["model.n_kv_heads", "model.head_dim", "model.ffn_hidden"])
def test_a_default_filled_in_from_other_keys_is_shown_as_derived(key, capsys):
    line = key_line(verb_help("pretrain", capsys), key)
    assert "default None (derived" in line
    assert not re.search(r"default \d", line)


def test_any_field_whose_post_init_fills_its_default_is_marked_derived():
    @dataclasses.dataclass
    class Shape:
        width: int = 8
        height: int = option(0, help="0 = width")

        def __post_init__(self):
            self.height = self.height or self.width

    rows = {row.key: row for row in recipe_keys(Shape)}
    assert rows["width"].default == "default 8"
    assert rows["height"].default == "default 0 (derived: 8)" and rows["height"].help == "0 = width"


def test_nested_defaults_come_from_the_recipe_not_the_section_class(capsys):
    out = verb_help("sft", capsys)
    assert "default 0.0001" in key_line(out, "train.lr")  # SFTRecipe's TrainConfig(lr=1e-4), not 3e-4


def test_an_optional_section_lists_the_keys_that_turn_it_on(capsys):
    out = verb_help("sft", capsys)
    assert "default 8" in key_line(out, "lora.r") and "lora.use_dora" in out


@pytest.mark.parametrize("verb", ["pretrain", "dpo", "curate", "export"])
def test_the_key_table_keeps_its_columns_within_100_characters(verb, capsys):
    table = verb_help(verb, capsys).partition("recipe keys")[2].splitlines()[1:]
    assert all(len(line) <= 100 for line in table)
    rows = [line for line in table if re.match(r"^  \S", line) and re.search(r" (default|required)\b", line)]
    columns = {re.search(r" (default|required)\b", line).start() for line in rows}
    assert len(rows) > 3 and len(columns) == 1  # a long `one of ...` type does not push its default right


@pytest.mark.parametrize("argv", [["prepare", "run_dir={out}"], ["run", "run_dir={out}"], ["tokenizer", "run_dir={out}"],
                                  ["generate", "checkpoint={out}"], ["export", "{out}", "{out}/hf"]])
def test_a_verb_that_runs_in_one_process_refuses_torchrun_before_any_work(argv, tmp_path, monkeypatch, capsys):
    """Under torchrun every rank would do the same work into the same files; the training stages
    (pretrain, sft, reward, dpo, kto, grpo, ppo) are the verbs that run there."""
    out = tmp_path / "out"
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main([a.format(out=out) for a in argv]) == 2
    err = capsys.readouterr().err
    assert f"`lmforge {argv[0]}` runs in one process, but WORLD_SIZE=2: launch it without torchrun" in err
    assert "pretrain, sft, reward, dpo, kto, grpo, ppo" in err
    assert not out.exists()
    assert {v.name for v in VERBS if v.distributed} == {"pretrain", "sft", "reward", "dpo", "kto", "grpo", "ppo"}


@pytest.mark.parametrize("override, message", [
    ("train.lr=nan", "overrides: 'train.lr' = nan: must be > 0 and finite"),
    ("model.n_kv_heads=0", "overrides: 'model.n_kv_heads' = 0: must be > 0"),
])
def test_an_out_of_range_value_exits_2_with_one_line_and_no_traceback(override, message, capsys):
    assert main(["pretrain", override]) == 2
    err = capsys.readouterr().err
    assert err == f"lmforge pretrain: error: {message}\n"


def test_an_impossible_micro_batch_is_refused_by_its_memory_estimate_before_any_work(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["pretrain", f"run_dir={run_dir}", "train.micro_batch_size=100000000", "train.device=cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert re.match(r"lmforge pretrain: error: train\.micro_batch_size = 100000000 x data\.seq_len = 256 needs at "
                    r"least [\d.]+ [KMGT]?B per device", err)
    assert not run_dir.exists()


def one_error_line(capsys, verb: str) -> str:
    err = capsys.readouterr().err
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert err.startswith(f"lmforge {verb}: error: ")
    return err.removeprefix(f"lmforge {verb}: error: ").rstrip("\n")


def test_a_typo_in_a_command_line_override_is_blamed_on_the_command_line_not_the_recipe(capsys):
    assert main(["pretrain", "recipes/demo/pretrain.yaml", "train.max_step=10"]) == 2
    assert one_error_line(capsys, "pretrain") == (
        "command-line override 'train.max_step=10': unknown key 'train.max_step'; "
        "did you mean 'train.max_steps' (optimizer steps; the schedule spans them)?")
    assert main(["pretrain", "recipes/demo/pretrain.yaml", "trian.lr=3"]) == 2  # the unknown section came from it
    assert one_error_line(capsys, "pretrain").startswith("command-line override 'trian.lr=3': unknown key 'trian'")
    assert main(["pretrain", "recipes/demo/pretrain.yaml", "train.lr=fast"]) == 2
    assert one_error_line(capsys, "pretrain") == "command-line override 'train.lr=fast': 'train.lr' must be float, got 'fast' (str)"


def test_an_error_in_the_recipe_file_is_blamed_on_the_file_even_beside_overrides(tmp_path, capsys):
    recipe = tmp_path / "pretrain.yaml"
    recipe.write_text("train:\n  max_step: 10\n")
    assert main(["pretrain", str(recipe), "train.lr=0.001"]) == 2
    assert one_error_line(capsys, "pretrain") == (
        f"{recipe}: unknown key 'train.max_step'; did you mean 'train.max_steps' (optimizer steps; the schedule spans them)?")


def test_a_sections_own_check_is_blamed_on_the_overrides_it_names_else_on_the_recipe(tmp_path, capsys):
    recipe = tmp_path / "pretrain.yaml"
    recipe.write_text("train:\n  max_steps: 300\n  warmup_steps: 20\n")
    check = "'train': warmup_steps must be in [0, max_steps], got"
    assert main(["pretrain", str(recipe), "train.warmup_steps=500"]) == 2
    assert one_error_line(capsys, "pretrain") == f"command-line override 'train.warmup_steps=500': {check} 500"
    assert main(["pretrain", str(recipe), "train.max_steps=10", "train.lr=0.01"]) == 2  # the other side of the check
    assert one_error_line(capsys, "pretrain") == f"command-line override 'train.max_steps=10': {check} 20"
    assert main(["pretrain", str(recipe), "train.max_steps=10", "train.warmup_steps=500"]) == 2
    assert one_error_line(capsys, "pretrain") == (
        f"command-line overrides 'train.max_steps=10', 'train.warmup_steps=500': {check} 500")
    recipe.write_text("train:\n  max_steps: 300\n  warmup_steps: 500\n")
    assert main(["pretrain", str(recipe), "train.lr=0.01"]) == 2  # an override the check does not name
    assert one_error_line(capsys, "pretrain") == f"{recipe}: {check} 500"



def test_a_preset_or_family_error_is_blamed_on_the_override_that_named_it_else_on_the_recipe(tmp_path, capsys):
    recipe = tmp_path / "pretrain.yaml"
    recipe.write_text("model:\n  preset: tiny\n  max_seq_len: 512\n")
    assert main(["pretrain", str(recipe), "model.preset=olmo-tiny"]) == 2
    assert one_error_line(capsys, "pretrain").startswith(
        "command-line override 'model.preset=olmo-tiny': 'model': unknown model preset 'olmo-tiny'; choose one of tiny,")
    assert main(["pretrain", str(recipe), "model.family=olmo"]) == 2
    assert one_error_line(capsys, "pretrain").startswith(
        "command-line override 'model.family=olmo': 'model': unknown model family 'olmo'; choose one of llama,")
    window = "'model': sliding_window = 4096 must be in [1, max_seq_len = 512]"  # the preset's window, the recipe's context
    assert main(["pretrain", str(recipe), "model.preset=gemma2-2b"]) == 2
    assert one_error_line(capsys, "pretrain").startswith(f"command-line override 'model.preset=gemma2-2b': {window}")
    recipe.write_text("model:\n  preset: olmo-tiny\n")
    assert main(["pretrain", str(recipe), "model.d_model=64"]) == 2  # the recipe's own preset stays the recipe's
    assert one_error_line(capsys, "pretrain").startswith(f"{recipe}: 'model': unknown model preset 'olmo-tiny'")
    recipe.write_text("model:\n  preset: gemma2-2b\n  max_seq_len: 512\n")
    assert main(["pretrain", str(recipe), "model.d_model=2304"]) == 2  # an override the check does not name
    assert one_error_line(capsys, "pretrain").startswith(f"{recipe}: {window}")


def test_a_bare_key_of_a_section_gets_the_dotted_key_suggested(capsys):
    assert main(["prepare", "recipes/demo/prepare.yaml", "skip_bad_records=true"]) == 2
    assert one_error_line(capsys, "prepare") == (
        "command-line override 'skip_bad_records=true': unknown key 'skip_bad_records'; did you mean 'data.skip_bad_records'?")


def test_a_yaml_syntax_error_names_the_file_and_line_in_one_line(tmp_path, capsys):
    recipe = tmp_path / "prepare.yaml"
    recipe.write_text("data:\n  paths: [a.jsonl]\n  text_field: : x\n")
    assert main(["prepare", str(recipe)]) == 2
    line = one_error_line(capsys, "prepare")
    assert line == f"{recipe}:3:15: mapping values are not allowed here"
    assert "<unicode string>" not in line


def test_a_recipe_of_nested_aliases_is_refused_before_it_is_expanded(tmp_path, capsys):
    from tests.core.test_untrusted import BOMB

    recipe = tmp_path / "pretrain.yaml"
    recipe.write_text("metadata_bomb:\n" + "".join(f"  {line}\n" for line in BOMB.splitlines()))
    assert main(["pretrain", str(recipe)]) == 2
    assert re.fullmatch(rf"{re.escape(str(recipe))}:\d+:\d+: aliases expand this document past .*",
                        one_error_line(capsys, "pretrain"))


def test_a_checkpoint_path_that_does_not_exist_is_said_to_not_exist(tmp_path, capsys):
    missing = tmp_path / "no-such-run"
    assert main(["generate", f"checkpoint={missing}", "prompts=[hi]"]) == 2
    assert one_error_line(capsys, "generate") == (
        f"{missing}: not a checkpoint: the path does not exist (give a checkpoint directory or a run directory)")


def test_a_hugging_face_folder_given_as_a_checkpoint_points_to_lmforge_import(tmp_path, capsys):
    hf = tmp_path / "hf-model"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"")
    assert main(["generate", f"checkpoint={hf}", "prompts=[hi]"]) == 2
    line = one_error_line(capsys, "generate")
    assert line.startswith(f"{hf}: a Hugging Face model folder, not an lmforge checkpoint")
    assert f"lmforge import {hf} <checkpoint_dir>" in line


@pytest.mark.parametrize("verb", ["tokenizer", "pretrain"])
@pytest.mark.parametrize("where", ["file", "under_file"])
def test_a_run_dir_that_is_a_file_is_one_line_before_any_work(verb, where, tmp_path, corpus_jsonl,
                                                             small_tokenizer_dir, capsys):
    existing = tmp_path / "taken"
    existing.write_text("mine\n")
    run_dir = existing if where == "file" else existing / "run"
    if verb == "pretrain":
        assert main(["prepare", f"run_dir={tmp_path / 'data'}", f"tokenizer={small_tokenizer_dir}",
                     f"data.paths=[{corpus_jsonl}]"]) == 0
        capsys.readouterr()
    before = sorted(tmp_path.rglob("*"))
    args = {"tokenizer": [f"data.paths=[{corpus_jsonl}]", "tokenizer.vocab_size=300"],
            "pretrain": [f"tokenizer={small_tokenizer_dir}", f"data.datasets=[{{path: {tmp_path / 'data'}}}]",
                         "train.max_steps=2", "train.warmup_steps=0"]}[verb]
    assert main([verb, f"run_dir={run_dir}", *args]) == 2
    assert f"run_dir = {run_dir}: " in one_error_line(capsys, verb)
    assert existing.read_text() == "mine\n" and sorted(tmp_path.rglob("*")) == before


def test_print_config_lists_every_plugin_without_importing_it(tmp_path, capsys):
    marker = tmp_path / "IMPORTED"
    (tmp_path / "my_plugin_mod.py").write_text(f"open({str(marker)!r}, 'w').close()\n"
                                               "def brevity(text, prompt):\n    return 0.0\n")
    recipe = tmp_path / "grpo.yaml"
    recipe.write_text("reward:\n  components:\n    - kind: exact_match\n"
                      "    - {kind: callable, name: short, function: my_plugin_mod:brevity}\n")
    life = tmp_path / "life.yaml"
    life.write_text(f"run_dir: {tmp_path / 'run'}\nstages:\n  - {{name: rl, verb: grpo, recipe: {recipe}}}\n")
    sys.path.insert(0, str(tmp_path))
    try:
        assert main(["grpo", str(recipe), "--print-config"]) == 0
        out = capsys.readouterr().out
        assert out.endswith("# plugins: this recipe imports and runs these functions when its stage starts\n"
                            "#   reward.components[1].function: my_plugin_mod:brevity\n")
        assert main(["run", str(life), "--print-config"]) == 0
        assert capsys.readouterr().out.endswith("#   rl: reward.components[1].function: my_plugin_mod:brevity\n")
        assert not marker.exists() and "my_plugin_mod" not in sys.modules  # named, not imported
    finally:
        sys.path.remove(str(tmp_path))
    assert main(["tokenizer", "--print-config"]) == 0
    assert capsys.readouterr().out.endswith("# plugins: none (this recipe imports and runs no code of yours)\n")


def test_a_verb_with_a_model_section_lists_what_each_family_changes_of_its_keys(capsys):
    from lmforge.model.families import FAMILIES

    out = verb_help("pretrain", capsys)
    families = out[out.index("model families (model.family"):]
    for name in FAMILIES.keys() - {"llama"}:
        assert f"model.family={name}: " in families
    flat = " ".join(families.split())
    assert "model.attn_softcap float or null default None Gemma 2: each attention score" in flat  # a key Gemma adds
    assert "fixed by the family, not keys: ffn, norm, positions, mlp_bias" in flat  # keys Gemma's recipe lacks
    assert "positions='learned'" in flat and "norm='layernorm'" in flat  # GPT-2's defaults
    assert "held at one value (another is refused): norm='rmsnorm'" in flat  # OLMo 2's and Phi-3's FIXED_FIELDS
    assert all(len(line) <= 100 for line in families.splitlines())
    assert "model families" not in verb_help("curate", capsys)  # no model section, no families


def test_every_key_a_family_adds_has_help_text():
    from lmforge.model.families import FAMILIES

    for family in FAMILIES.values():
        assert keys_without_help(family.config) == [], family.name
