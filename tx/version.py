"""tx's version, kept apart from the package root so that any module may read it without importing
the backends (tx/__init__.py imports them)."""

__version__ = "0.1.0"
