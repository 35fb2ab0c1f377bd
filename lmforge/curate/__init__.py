"""Data curation: raw web pages and documents to a clean, deduplicated corpus (`lmforge curate`)."""
