"""megaheal: keeps large distributed training jobs healthy."""

__version__ = "0.1.0"
