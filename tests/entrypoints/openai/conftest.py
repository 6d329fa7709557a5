"""Fixtures: `server` is module-scoped (one engine per test module keeps the suite fast); every test
that uses it goes through `srv`, whose teardown waits until the engine has no request left and
checks on the engine thread that every page is free or cached (the per-test leak check of
tests/conftest.py only sees engines built inside the test itself).
"""
from __future__ import annotations

import pytest

from server_harness import MODEL, launch


@pytest.fixture(scope="module")
def server(tiny_ckpt):
    handle = launch(tiny_ckpt("llama"), served_model_names=[MODEL, "tiny-alias"])
    yield handle
    handle.stop()


@pytest.fixture
def srv(server):
    yield server
    server.engine.check_idle(timeout=15)


@pytest.fixture
def client(srv):
    c = srv.client()
    yield c
    c.close()
