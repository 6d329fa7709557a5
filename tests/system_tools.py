"""System programs some tests need (redis-server), and what a test does without one.

On a developer's machine a missing program skips the tests that need it, with one line naming
the command that installs it. CI sets HYBRIDKV_REQUIRE_SYSTEM_TOOLS=1 (.ci/run), which turns
that skip into a failure: there every test must run.
"""
from __future__ import annotations

import os
import shutil

import pytest

REQUIRE_VARIABLE = "HYBRIDKV_REQUIRE_SYSTEM_TOOLS"


def require_program(name: str, install: str) -> str:
    """The path of program `name`; without it, skip (or fail under HYBRIDKV_REQUIRE_SYSTEM_TOOLS=1)
    with a message naming `install`, the command that provides it."""
    path = shutil.which(name)
    if path is not None:
        return path
    message = f"{name} is not installed: `{install}` provides it"
    if os.environ.get(REQUIRE_VARIABLE, "").strip() not in ("", "0"):
        pytest.fail(f"{message} ({REQUIRE_VARIABLE} is set, so this test may not skip)")
    pytest.skip(message)
