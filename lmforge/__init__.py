"""lmforge: a language-model training stack from raw documents to a served model."""

__version__ = "0.1.0"
