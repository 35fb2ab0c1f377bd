"""The step types a curation recipe can name, and how a recipe's step entry becomes a step.

A recipe lists steps as mappings tagged by ``type``; the other keys are that type's config
dataclass, checked like every recipe key. An optional ``name`` labels the step in rejects
and stats (default: the type). Step modules are imported only when a recipe uses them.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
from dataclasses import dataclass
from typing import Any

from lmforge.core.config import ConfigError, from_dict, to_dict

# type -> (module, config class, step class); the step class is built as StepClass(config)
STEP_TYPES: dict[str, tuple[str, str, str]] = {
    "extract": ("lmforge.curate.extract", "ExtractConfig", "HtmlExtract"),
    "language": ("lmforge.curate.langid", "LanguageConfig", "LanguageFilter"),
    "url_filter": ("lmforge.curate.filters", "UrlFilterConfig", "UrlFilter"),
    "gopher_quality": ("lmforge.curate.filters", "GopherQualityConfig", "GopherQualityFilter"),
    "gopher_repetition": ("lmforge.curate.filters", "GopherRepetitionConfig", "GopherRepetitionFilter"),
    "c4_quality": ("lmforge.curate.filters", "C4QualityConfig", "C4QualityFilter"),
    "fineweb_quality": ("lmforge.curate.filters", "FineWebQualityConfig", "FineWebQualityFilter"),
    "exact_dedup": ("lmforge.curate.exact_dedup", "ExactDedupConfig", "ExactDedup"),
    "minhash": ("lmforge.curate.minhash", "MinHashConfig", "MinHashDedup"),
    "classifier": ("lmforge.curate.quality", "ClassifierConfig", "ClassifierScore"),
    "perplexity": ("lmforge.curate.quality", "PerplexityConfig", "PerplexityScore"),
}


@dataclass
class StepSpec:
    label: str  # the name in rejects and stats
    type: str
    config: Any  # the type's config dataclass

    def build(self) -> Any:
        return _load(self.type)[1](self.config)

    def to_dict(self) -> dict[str, Any]:
        out = {"type": self.type}
        if self.label != self.type:
            out["name"] = self.label
        return {**out, **to_dict(self.config)}


def _load(step_type: str) -> tuple[type, type]:
    module_name, config_name, step_name = STEP_TYPES[step_type]
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"step type {step_type!r} needs {module_name}, which cannot be imported: {exc}") from exc
    return getattr(module, config_name), getattr(module, step_name)


def config_class(step_type: str) -> type:
    """The config dataclass of ``step_type`` (its module imported)."""
    return _load(step_type)[0]


def parse_step(index: int, raw: Any) -> StepSpec:
    where = f"steps[{index}]"
    if dataclasses.is_dataclass(raw):
        raise ConfigError(f"{where}: give a mapping with a 'type' key, not a {type(raw).__name__}")
    if not isinstance(raw, dict) or "type" not in raw:
        raise ConfigError(f"{where} must be a mapping with a 'type' key (types: {', '.join(STEP_TYPES)}), got {raw!r}")
    data = dict(raw)
    step_type = data.pop("type")
    label = data.pop("name", step_type)
    if step_type not in STEP_TYPES:
        close = difflib.get_close_matches(str(step_type), list(STEP_TYPES), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else f"; types: {', '.join(STEP_TYPES)}"
        raise ConfigError(f"{where}: unknown step type {step_type!r}{hint}")
    if not isinstance(label, str) or not label:
        raise ConfigError(f"{where}: name must be a non-empty string, got {label!r}")
    config_cls, _ = _load(step_type)
    return StepSpec(label, step_type, from_dict(config_cls, data, source="recipe", prefix=f"{where}."))


def parse_steps(raw: list[Any]) -> list[StepSpec]:
    specs = [parse_step(i, item) for i, item in enumerate(raw)]
    labels = [s.label for s in specs]
    repeated = sorted({x for x in labels if labels.count(x) > 1})
    if repeated:
        raise ConfigError(f"steps: {repeated[0]!r} appears twice; give each a distinct 'name'")
    return specs


def is_corpus_step(step: Any) -> bool:
    return hasattr(step, "index_shard") and hasattr(step, "apply_shard")
