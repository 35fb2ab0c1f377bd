"""Configuration, run directories, I/O helpers: the bottom layer."""
