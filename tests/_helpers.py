"""Small helpers shared by the test modules (imported as a sibling module)."""

from __future__ import annotations

import re

import pytest


def raises(exc, *fragments):
    """pytest.raises requiring every fragment somewhere in the message (in any order)."""
    return pytest.raises(exc, match="".join(f"(?=[\\s\\S]*{re.escape(f)})" for f in fragments))
