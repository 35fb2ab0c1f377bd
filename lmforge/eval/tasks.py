"""Tasks in lm-evaluation-harness's YAML format: reading them, their documents, and their prompts.

A task file is the harness's (``lm_eval.api.task.ConfigurableTask``), a subset of its keys:
``task``, ``dataset_path: json`` with ``dataset_kwargs: {data_files: ...}`` (local JSONL files,
paths relative to the YAML file), ``test_split``/``validation_split``/``training_split``/
``fewshot_split``, ``output_type``, ``doc_to_text``/``doc_to_target``/``doc_to_choice`` (a
field name, a Jinja2 template, an int or a list, as the harness reads each), ``description``,
``target_delimiter``, ``fewshot_delimiter``, ``num_fewshot``, ``generation_kwargs``,
``repeats``, ``metric_list`` and ``filter_list``. The file is untrusted input: its YAML is read
with safe tags only and aliases bounded (``core.untrusted``), Python code in a task (the
harness's ``!function``) is refused with its line, and its Jinja2 templates render in a
sandbox, so a template can read a document's fields but not reach Python's internals.

The prompt is built as the harness builds it without a chat template: the description, then
each few-shot example as ``text + target_delimiter + target + fewshot_delimiter``, then the
document's text. Few-shot examples are drawn by the harness's ``ContextSampler``: one
``random.Random(fewshot_seed)`` per task, ``sample(pool, n)`` for each document in order (n + 1
and the document itself removed when the few-shot split is the test split), so the same seed
gives the same shots in both programs.

A raw file (JSONL with a ``text`` field, Parquet, or plain text) becomes a
``loglikelihood_rolling`` task on the fly (``raw_text_task``): bits per byte of its documents.
"""

from __future__ import annotations

import ast
import difflib
import hashlib
import json
import math
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
import yaml

from lmforge.core.io import InputError, sha256_file
from lmforge.core.untrusted import compose_yaml, path_name, render_bounded, sandboxed_jinja
from lmforge.data.documents import BadRecord, DocumentsConfig, SkipLog, jsonl_records, read_documents
from lmforge.data.shards import MANIFEST, open_shards, read_manifest
from lmforge.data.tokenizer import Tokenizer
from lmforge.eval.scoring import check_generation_kwargs

OUTPUT_TYPES = ("multiple_choice", "loglikelihood", "loglikelihood_rolling", "generate_until")
DEFAULT_METRICS = {  # the harness's DEFAULT_METRIC_REGISTRY
    "loglikelihood": ["perplexity", "acc"],
    "loglikelihood_rolling": ["word_perplexity", "byte_perplexity", "bits_per_byte"],
    "multiple_choice": ["acc", "acc_norm"],
    "generate_until": ["exact_match"],
}
DEFAULT_MAX_GEN_TOKS = 256
DEFAULT_FEWSHOT_SEED = 1234  # simple_evaluate's fewshot_random_seed
KEYS = {
    "task", "task_alias", "tag", "dataset_path", "dataset_name", "dataset_kwargs", "training_split",
    "validation_split", "test_split", "fewshot_split", "doc_to_text", "doc_to_target", "doc_to_choice",
    "description", "target_delimiter", "fewshot_delimiter", "num_fewshot", "output_type", "generation_kwargs",
    "repeats", "metric_list", "filter_list", "metadata",
}
# Keys of the harness's TaskConfig that lmforge eval does not implement: what each would do. A
# harness file that sets one to a value that changes nothing (its default) runs unchanged.
HARNESS_ONLY_KEYS = {
    "include": "reads another task file as this one's base",
    "group": "makes the file a group of tasks (write a suite: group + a task list)",
    "class": "uses a Python task class",
    "custom_dataset": "builds the dataset with Python code",
    "process_docs": "transforms each document with a Python function",
    "process_results": "scores each answer with a Python function",
    "doc_to_image": "adds an image to each prompt",
    "doc_to_audio": "adds audio to each prompt",
    "unsafe_code": "runs code the model wrote to score it",
    "use_prompt": "takes the prompt from promptsource",
    "fewshot_config": "chooses and formats the few-shot examples its own way (sampler, samples, delimiters)",
    "should_decontaminate": "checks test documents for overlap with training data",
    "doc_to_decontamination_query": "names the text the decontamination check compares",
    "gen_prefix": "writes text after the prompt that the answer continues from",
}
INERT_VALUES = {  # the harness's defaults: set to one of these, the key does nothing
    "should_decontaminate": (False,), "unsafe_code": (False,), "doc_to_decontamination_query": (None,),
    "process_docs": (None,), "process_results": (None,), "doc_to_image": (None,), "doc_to_audio": (None,),
    "use_prompt": (None,), "gen_prefix": (None, ""), "fewshot_config": (None,), "custom_dataset": (None,),
}


def _regex_replace(text: str, pattern: str, repl: str, count: int = 0) -> str:
    return re.sub(pattern, repl, text, count=count)


JINJA = sandboxed_jinja(keep_trailing_newline=True)
JINJA.filters["regex_replace"] = _regex_replace  # the harness's one custom filter


@dataclass
class Task:
    """A task read from its file: its config (the YAML mapping), documents by split, and where each
    document came from (``file:line``, for errors)."""

    name: str
    path: Path
    config: dict[str, Any]
    lines: dict[str, int]  # top-level key -> its line in the YAML file
    splits: dict[str, list[dict]]
    sources: dict[str, list[str]]
    data_sha256: dict[str, str] = field(default_factory=dict)
    _templates: dict[str, jinja2.Template] = field(default_factory=dict, repr=False)
    _columns: set[str] | None = field(default=None, repr=False)

    # ---- config
    def get(self, key: str, default: Any = None) -> Any:
        value = self.config.get(key)
        return default if value is None else value

    def where(self, key: str) -> str:
        """``file:line`` of a top-level key (the file alone when the key is absent)."""
        return f"{self.path}:{self.lines[key]}" if key in self.lines else str(self.path)

    def error(self, key: str, message: str) -> InputError:
        return InputError(f"{self.where(key)}: {key}: {message}")

    @property
    def output_type(self) -> str:
        return self.get("output_type", "generate_until")

    @property
    def target_delimiter(self) -> str:
        return self.get("target_delimiter", " ")

    @property
    def fewshot_delimiter(self) -> str:
        return self.get("fewshot_delimiter", "\n\n")

    @property
    def repeats(self) -> int:
        return self.get("repeats", 1)

    def generation_kwargs(self) -> dict:
        """The harness's TaskConfig defaults: no ``until`` means the few-shot delimiter."""
        kwargs = dict(self.get("generation_kwargs", {}))
        until = [self.fewshot_delimiter] if self.fewshot_delimiter else []
        if not kwargs:
            return {"until": until, "do_sample": False, "temperature": 0.0, "max_gen_toks": DEFAULT_MAX_GEN_TOKS}
        if isinstance(kwargs.get("temperature"), int) and not isinstance(kwargs["temperature"], bool):
            kwargs["temperature"] = float(kwargs["temperature"])  # 1 and 1.0 seed the same draws
        kwargs.setdefault("until", until)
        return kwargs

    # ---- documents
    def split(self, key: str) -> list[dict] | None:
        name = self.config.get(key)
        if name is None:
            return None
        if name not in self.splits:
            raise self.error(key, f"split {name!r} is not in the data files (splits: {', '.join(self.splits)})")
        return self.splits[name]

    def eval_split(self) -> str:
        for key in ("test_split", "validation_split"):
            if self.config.get(key) is not None:
                self.split(key)
                return self.config[key]
        raise InputError(f"{self.path}: the task needs test_split or validation_split (the documents to score)")

    def fewshot_pool(self) -> list[dict] | None:
        """The harness's few-shot documents: ``fewshot_split``, else the training, validation or test split."""
        for key in ("fewshot_split", "training_split", "validation_split", "test_split"):
            if self.config.get(key) is not None:
                return self.split(key)
        return None

    def source_of(self, doc: dict) -> str:
        for split, docs in self.splits.items():
            for i, d in enumerate(docs):
                if d is doc:
                    return self.sources[split][i]
        return "a document"

    # ---- the harness's doc_to_* readings
    def render(self, key: str, template: str, doc: dict) -> str:
        compiled = self._templates.get(template)
        if compiled is None:
            try:
                compiled = self._templates[template] = JINJA.from_string(template)
            except jinja2.TemplateSyntaxError as exc:
                raise self.error(key, f"bad Jinja2 template {template!r}: {exc.message}") from exc
        try:
            return render_bounded(compiled, doc)
        except jinja2.sandbox.SecurityError as exc:
            raise self.error(key, f"{self.source_of(doc)}: the template {template!r} is refused: {exc} (a task "
                                  "template may use the document's fields, not Python's internals, and renders a prompt, "
                                  "not megabytes)") from exc
        except jinja2.UndefinedError as exc:
            raise self.error(key, f"{self.source_of(doc)}: {exc.message} (the template {template!r} needs it; "
                                  f"the document has {', '.join(doc) or 'no fields'})") from exc
        except Exception as exc:
            raise self.error(key, f"{self.source_of(doc)}: the template {template!r} failed: {exc}") from exc

    def field_or_template(self, key: str, doc: dict) -> Any:
        spec = self.config.get(key)
        if isinstance(spec, str) and spec in self.columns:
            if spec not in doc:
                raise self.error(key, f"{self.source_of(doc)}: the document has no field {spec!r}")
            return doc[spec]
        return self.render(key, spec, doc)

    @property
    def columns(self) -> set[str]:
        """Every field some document has (a dataset's features)."""
        if self._columns is None:
            self._columns = {k for docs in self.splits.values() for d in docs for k in d}
        return self._columns

    def doc_to_text(self, doc: dict) -> str:
        spec = self.config.get("doc_to_text")
        if spec is None:
            raise self.error("doc_to_text", "missing: the task needs doc_to_text (a field name or a template)")
        if isinstance(spec, int) or not isinstance(spec, str):
            raise self.error("doc_to_text", "an int or other non-string doc_to_text (multiple inputs per document) "
                                            "is not supported by lmforge eval")
        text = self.field_or_template("doc_to_text", doc)
        if isinstance(text, str) and text.isdigit() and self.config.get("doc_to_choice") is not None:
            raise self.error("doc_to_text", f"{self.source_of(doc)}: gives the number {text} (multiple inputs per "
                                            "document), which lmforge eval does not support")
        if not isinstance(text, str):
            raise self.error("doc_to_text", f"{self.source_of(doc)}: gives {type(text).__name__} {text!r}, not text")
        return text

    def doc_to_target(self, doc: dict) -> Any:
        spec = self.config.get("doc_to_target")
        if spec is None:
            raise self.error("doc_to_target", "missing: the task needs doc_to_target (a field name, template or int)")
        if isinstance(spec, (int, list)) and not isinstance(spec, bool):
            return spec
        if not isinstance(spec, str):
            raise self.error("doc_to_target", f"must be a field name, a template, an int or a list; got {spec!r}")
        if spec in self.columns:
            return self.field_or_template("doc_to_target", doc)
        target = self.render("doc_to_target", spec, doc)
        if target.isascii() and target.isdigit() and self.config.get("doc_to_choice") is not None:
            return int(target)
        if len(target) >= 2 and target[0] == "[" and target[-1] == "]":
            try:
                return ast.literal_eval(target)
            except (SyntaxError, ValueError):
                return target
        return target

    def doc_to_choice(self, doc: dict) -> list[str]:
        spec = self.config.get("doc_to_choice")
        if spec is None:
            raise self.error("doc_to_choice", "missing: a multiple_choice task needs doc_to_choice")
        if isinstance(spec, list):
            choices = spec
        elif isinstance(spec, dict):
            choices = list(spec.values())
        elif isinstance(spec, str) and spec in self.columns:
            choices = self.field_or_template("doc_to_choice", doc)
        elif isinstance(spec, str):
            rendered = self.render("doc_to_choice", spec, doc)
            try:
                choices = ast.literal_eval(rendered)
            except (SyntaxError, ValueError) as exc:
                raise self.error("doc_to_choice", f"{self.source_of(doc)}: the template gives {rendered!r}, "
                                                  "not a Python list of strings") from exc
        else:
            raise self.error("doc_to_choice", f"must be a field name, a template, a list or a mapping; got {spec!r}")
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
            raise self.error("doc_to_choice", f"{self.source_of(doc)}: gives {choices!r}, not a non-empty list of strings")
        return choices

    def description(self, doc: dict) -> str:
        spec = self.config.get("description")
        if not spec:
            return ""
        text = doc[spec] if spec in doc else self.render("description", spec, doc)
        if not isinstance(text, str):
            raise self.error("description", f"{self.source_of(doc)}: the field {spec!r} gives {text!r}, not text")
        return text

    def choice_at(self, doc: dict, index: Any) -> str:
        """The choice a target index names (with ``doc_to_choice``, a target is an index into the choices)."""
        choices = self.doc_to_choice(doc)
        if not isinstance(index, int) or isinstance(index, bool) or not -len(choices) <= index < len(choices):
            raise self.error("doc_to_target", f"{self.source_of(doc)}: with doc_to_choice the target is the index of "
                                              f"the answer among {len(choices)} choices, got {index!r}")
        return choices[index]

    # ---- identity
    def config_hash(self, settings: dict) -> str:
        """Hash of what decides the task's figures: its config, its data files' contents, and the settings."""
        blob = json.dumps({"config": self.config, "data": self.data_sha256, "settings": settings},
                          sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


# --------------------------------------------------------------------------- few-shot examples


class FewshotSampler:
    """The harness's ``ContextSampler``: ``Random(seed)`` drawing ``sample(pool, n)`` per document,
    or ``n + 1`` with the document removed when the pool is the documents being scored."""

    def __init__(self, pool: list[dict], seed: int | None):
        self.pool, self.rnd = pool, random.Random(seed)

    def sample(self, n: int, eval_doc: dict | None = None) -> list[dict]:
        if n == 0:
            return []
        if n + (eval_doc is not None) > len(self.pool):
            raise ValueError(f"{n} few-shot examples asked for, but the few-shot split has {len(self.pool)} documents")
        if not eval_doc:
            return self.rnd.sample(self.pool, n)
        shots = [x for x in self.rnd.sample(self.pool, n + 1) if x != eval_doc][:n]
        if len(shots) < n:  # the pool held copies of the document
            shots = self.rnd.sample([x for x in self.pool if x != eval_doc], n)
        return shots


def fewshot_context(task: Task, doc: dict, num_fewshot: int, sampler: FewshotSampler | None) -> str:
    """The prompt of ``doc`` (the harness's ``fewshot_context`` without a chat template)."""
    parts = [task.description(doc)]
    if num_fewshot > 0:
        if sampler is None:
            raise task.error("num_fewshot", "few-shot examples need a fewshot_split (or a training/validation split)")
        eval_doc = doc if task.config.get("fewshot_split") == task.config.get("test_split") else None
        try:
            shots = sampler.sample(num_fewshot, eval_doc)
        except ValueError as exc:
            raise task.error("num_fewshot", str(exc)) from exc
        for shot in shots:
            answer = task.doc_to_target(shot)
            has_answer = answer is not None and answer != ""
            if has_answer:
                if isinstance(answer, int) and task.config.get("doc_to_choice") is not None:
                    answer = task.choice_at(shot, answer)
                elif isinstance(answer, list):
                    answer = answer[0]
                if not isinstance(answer, str):
                    raise task.error("doc_to_target", f"{task.source_of(shot)}: a few-shot answer must be text, "
                                                      f"got {answer!r}")
                parts += [task.doc_to_text(shot), task.target_delimiter, answer, task.fewshot_delimiter]
            else:
                parts.append(task.doc_to_text(shot))
    parts.append(task.doc_to_text(doc))
    return "".join(parts)


def effective_fewshot(task: Task, num_fewshot: int | None) -> int:
    """simple_evaluate's rule: an override replaces the task's count unless the task fixes it at 0."""
    own = task.config.get("num_fewshot")
    if num_fewshot is not None and own != 0:
        return num_fewshot
    return own or 0


def limited(docs: list[dict], limit: float | None) -> list[dict]:
    """The first ``limit`` documents (a fraction below 1: that share, rounded up), as the harness takes them."""
    if limit is None:
        return docs
    n = int(math.ceil(len(docs) * limit)) if limit < 1.0 else int(limit)
    return docs[:n]


# --------------------------------------------------------------------------- reading a task file


def read_yaml(path: Path) -> tuple[dict, dict[str, int]]:
    """The task file's mapping and the line of each top-level key; a document whose aliases
    would expand past ``core.untrusted.MAX_YAML_NODES`` nodes is refused at its first alias."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError as exc:
        raise InputError(f"{path}: task file not found") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"{path}: cannot read the task file: {exc}") from exc
    try:
        config, node = compose_yaml(text, path)  # one parse gives both the data and its key lines
    except InputError as exc:
        cause, mark = exc.__cause__, getattr(exc.__cause__, "problem_mark", None)
        if isinstance(cause, yaml.constructor.ConstructorError) and "'!function'" in str(cause.problem) and mark:
            value = text.splitlines()[mark.line][mark.column:].split("#")[0].strip()  # the tagged node as written
            raise InputError(f"{path}:{mark.line + 1}:{mark.column + 1}: '{value}' runs Python code from the task, "
                             "which lmforge eval does not do; use a field name or a Jinja2 template") from cause
        raise
    if not isinstance(config, dict):
        raise InputError(f"{path}: a task file must be a YAML mapping of keys (task, dataset_path, ...)")
    lines = {k.value: k.start_mark.line + 1 for k, _ in node.value if isinstance(k, yaml.ScalarNode)}
    return config, lines


def check_keys(config: dict, path: Path, lines: dict[str, int]) -> None:
    for key in config:
        where = f"{path}:{lines.get(key, '?')}"
        if key in HARNESS_ONLY_KEYS:
            value = config[key]
            if any(value is inert or (value == inert and type(value) is type(inert)) for inert in INERT_VALUES.get(key, ())):
                continue  # the harness's default: a file written for the harness runs unchanged
            raise InputError(f"{where}: {key} = {value!r}: in lm-evaluation-harness it {HARNESS_ONLY_KEYS[key]}, "
                             "which lmforge eval does not do; remove the key"
                             + (f" or set it to {INERT_VALUES[key][0]!r}" if key in INERT_VALUES else ""))
        if key not in KEYS:
            close = difflib.get_close_matches(str(key), sorted(KEYS), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise InputError(f"{where}: unknown key {key!r}{hint}")
    output_type = config.get("output_type", "generate_until")
    if output_type not in OUTPUT_TYPES:
        raise InputError(f"{path}:{lines.get('output_type', '?')}: output_type: unknown {output_type!r}; "
                         f"choose one of {', '.join(OUTPUT_TYPES)}")


def check_values(config: dict, path: Path, lines: dict[str, int]) -> None:
    """The types and ranges of the keys read as given, so that a wrong one is named here, with its
    line, instead of failing as a traceback once documents are scored."""
    def bad(key: str, message: str) -> InputError:
        return InputError(f"{path}:{lines.get(key, '?')}: {key}: {message}, got {config[key]!r}")

    def integer(value: object) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    texts = ("task", "task_alias", "training_split", "validation_split", "test_split", "fewshot_split",
             "description", "target_delimiter", "fewshot_delimiter", "output_type")
    for key in texts:
        if config.get(key) is not None and not isinstance(config[key], str):
            raise bad(key, "must be a string")
    if config.get("num_fewshot") is not None and not (integer(config["num_fewshot"]) and config["num_fewshot"] >= 0):
        raise bad("num_fewshot", "must be an integer >= 0 (the few-shot examples before each document)")
    if config.get("repeats") is not None and not (integer(config["repeats"]) and config["repeats"] >= 1):
        raise bad("repeats", "must be an integer >= 1 (the samples generated per document)")
    if config.get("generation_kwargs") is not None:
        where = f"{path}:{lines.get('generation_kwargs', '?')}"
        kwargs = config["generation_kwargs"]
        try:
            check_generation_kwargs(kwargs)
        except ValueError as exc:
            raise InputError(f"{where}: {exc}") from exc
        until = kwargs.get("until")
        if until is not None and not all([until] if isinstance(until, str) else until):
            raise InputError(f"{where}: generation_kwargs.until: a stop string must not be empty, got {until!r}")


def data_files(config: dict, path: Path, lines: dict[str, int]) -> dict[str, list[Path]]:
    """Split -> files, as ``datasets.load_dataset("json", data_files=...)`` reads the argument
    (a path or list: the ``train`` split; a mapping: one split per key), relative to the YAML file."""
    where = f"{path}:{lines.get('dataset_path', '?')}"
    if config.get("dataset_path") != "json":
        raise InputError(f"{where}: dataset_path: {config.get('dataset_path')!r}: lmforge eval reads local JSON "
                         "files only (dataset_path: json with dataset_kwargs: {data_files: ...})")
    if config.get("dataset_name") is not None:
        raise InputError(f"{path}:{lines.get('dataset_name')}: dataset_name: not used with dataset_path: json; remove it")
    kwargs = config.get("dataset_kwargs") or {}
    where = f"{path}:{lines.get('dataset_kwargs', '?')}"
    if not isinstance(kwargs, dict) or "data_files" not in kwargs:
        raise InputError(f"{where}: dataset_kwargs: needs data_files (a file, a list, or split: file)")
    extra = set(kwargs) - {"data_files"}
    if extra:
        raise InputError(f"{where}: dataset_kwargs: {', '.join(sorted(extra))} not supported (only data_files)")
    spec = kwargs["data_files"]
    splits = spec if isinstance(spec, dict) else {"train": spec}
    out = {}
    for split, files in splits.items():
        files = [files] if isinstance(files, str) else files
        if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
            raise InputError(f"{where}: dataset_kwargs.data_files: split {split!r} must name a file or a list of files")
        out[str(split)] = [(path.parent / f) for f in files]
    return out


def read_split(files: list[Path], task_path: Path) -> tuple[list[dict], list[str]]:
    docs, sources = [], []
    for file in files:
        if not file.is_file():
            raise InputError(f"{task_path}: dataset_kwargs.data_files: {file} not found (paths are relative to the task file)")
        if file.suffix == ".json" and file.read_bytes().lstrip().startswith(b"["):
            try:
                records = json.loads(file.read_text(encoding="utf-8"))
            except UnicodeDecodeError as exc:
                raise InputError(f"{file}: not valid UTF-8 ({exc.reason} at byte {exc.start})") from exc
            except json.JSONDecodeError as exc:
                raise InputError(f"{file}:{exc.lineno}:{exc.colno}: not valid JSON: {exc.msg}") from exc
            items = [(f"{file}[{i}]", r) for i, r in enumerate(records)]
        else:
            items = list(jsonl_records(file))
        for where, record in items:
            if isinstance(record, BadRecord):
                raise InputError(f"{where}: {record.detail}")
            if not isinstance(record, dict):
                raise InputError(f"{where}: a document must be a JSON object, got {type(record).__name__}")
            docs.append(record)
            sources.append(where)
    return docs, sources


def load_task(path: str | Path) -> Task:
    """Read a task file (YAML); a directory written by ``lmforge prepare`` (``DIR`` for its
    validation split, ``DIR@SPLIT`` for another): the bits-per-byte task of that split's
    documents; any other file: the bits-per-byte task of its raw text."""
    text = str(path)
    directory, _, split = text.rpartition("@") if "@" in Path(text).name else (text, "", "val")
    if (Path(directory) / MANIFEST).is_file():
        return prepared_split_task(Path(directory), split)
    path = Path(path)
    if path.suffix not in (".yaml", ".yml"):
        return raw_text_task(path)
    config, lines = read_yaml(path)
    check_keys(config, path, lines)
    check_values(config, path, lines)
    splits, sources, digests = {}, {}, {}
    for split, files in data_files(config, path, lines).items():
        splits[split], sources[split] = read_split(files, path)
        for f in files:
            digests[str(f.name)] = sha256_file(f)
    name = path.stem if config.get("task") is None else path_name(config["task"], f"{path}:{lines['task']}: task")
    task = Task(name, path, config, lines, splits, sources, digests)
    docs = task.split(task_key(task))
    if not docs:
        raise InputError(f"{path}: the split {task.eval_split()!r} has no documents")
    return task


def task_key(task: Task) -> str:
    task.eval_split()
    return "test_split" if task.config.get("test_split") is not None else "validation_split"


def prepared_split_task(directory: Path, split: str = "val") -> Task:
    """Bits per byte of one split of prepared token shards, as a ``loglikelihood_rolling`` task:
    each stored document (BOS, its tokens, EOS) decoded back to its text with the tokenizer the
    manifest names (its sha256 checked), so the held-out text prepare set aside is scored as it is."""
    manifest = read_manifest(directory)
    shards = open_shards(directory, split)  # names the split and the splits there are
    tok_dir = Path(manifest["tokenizer"])
    if not tok_dir.is_absolute() and not tok_dir.exists():
        tok_dir = directory.parent / tok_dir.name
    if not (tok_dir / "tokenizer.json").is_file():
        raise InputError(f"{directory / MANIFEST}: its tokenizer {manifest['tokenizer']} is not found (from "
                         f"{Path.cwd()}); run from where `lmforge prepare` ran")
    tok = Tokenizer.load(tok_dir)
    if tok.sha256 != manifest["tokenizer_sha256"]:
        raise InputError(f"{directory / MANIFEST}: the tokenizer at {tok_dir} is not the one these shards were made with")
    special = {manifest["bos_id"], manifest["eos_id"], manifest["pad_id"]}
    texts = []
    for shard in shards:
        for a, b in zip(shard.doc_starts[:-1], shard.doc_starts[1:]):
            ids = [int(t) for t in shard.tokens[a:b] if int(t) not in special]
            if ids:
                texts.append(tok.decode(ids))
    if not texts:
        raise InputError(f"{directory}: the split {split!r} has no documents")
    name = f"{directory.name}_{split}"
    config = {"task": name, "dataset_path": "json", "test_split": split, "output_type": "loglikelihood_rolling",
              "doc_to_text": "", "doc_to_target": "text"}
    digests = {info["tokens"]: info["sha256"] for info in manifest["splits"][split]["shards"]}
    return Task(name, directory, config, {}, {split: [{"text": t} for t in texts]},
                {split: [f"{directory}@{split}:{i}" for i in range(len(texts))]}, digests)


def raw_text_task(path: Path) -> Task:
    """Bits per byte of a JSONL (``text`` field), Parquet or plain-text file's documents, as a
    ``loglikelihood_rolling`` task over each whole document."""
    if not path.is_file():
        raise InputError(f"{path}: not found")
    skipped = SkipLog()  # counted, then refused: every record is scored, or none
    documents = list(read_documents(DocumentsConfig(paths=[str(path)], skip_bad_records=True), skipped))
    if skipped.total:
        raise InputError(f"{skipped.examples[0]} ({skipped.total} bad record(s) in the file; lmforge eval scores "
                         "every record, so fix or remove them)")
    if not documents:
        raise InputError(f"{path}: no documents with text")
    config = {"task": path.stem, "dataset_path": "json", "test_split": "train", "output_type": "loglikelihood_rolling",
              "doc_to_text": "", "doc_to_target": "text"}
    docs = [{"text": d.text} for d in documents]
    return Task(path.stem, path, config, {}, {"train": docs}, {"train": [d.id for d in documents]},
                {path.name: sha256_file(path)})
