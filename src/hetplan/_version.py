"""The tool version recorded in every plan."""

__version__ = "0.1.0"
