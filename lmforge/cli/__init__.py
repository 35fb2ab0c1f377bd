"""Command-line interface: verbs over YAML recipes."""
