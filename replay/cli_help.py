"""Module docstrings as command-line help: plain text, without the reStructuredText literals they are written in."""

from __future__ import annotations


def plain_help(doc: str | None) -> str:
    """``doc`` with its ``literal`` markers dropped, for ``argparse``'s description."""
    return (doc or "").replace("``", "")
