"""One-line descriptions of exceptions: what the tables, JSON and skip lists record."""

from __future__ import annotations


def first_line(exc: BaseException, limit: int = 300) -> str:
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    text = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."
