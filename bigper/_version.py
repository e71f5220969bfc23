"""The package version, in one place below every room that records it."""

__version__ = "0.1.0"
