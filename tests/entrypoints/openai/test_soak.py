"""benchmarks/soak.py end to end (a CI-sized run): `hybridkv serve` as a subprocess, streaming
requests with 20% of clients hanging up mid-stream. Invariants: no 5xx and no other error at the
client, no unhandled error in the server's log (e.g. a client gone just before [DONE]), and once
idle no request, KV page or prefix-cache lock left in use."""
from __future__ import annotations

import json

import pytest

from benchmarks import soak


@pytest.mark.slow
def test_soak_with_disconnects_leaves_nothing_in_use(tiny_ckpt, capsys):
    rc = soak.main(["--serve-args", f"{tiny_ckpt('llama')} --max-model-len 256", "--requests", "600",
                    "--concurrency", "64", "--disconnect-fraction", "0.2", "--max-tokens", "12"])
    out = capsys.readouterr().out
    result = json.loads(out.split("RESULT ", 1)[1])
    assert result["5xx"] == 0 and result["errors"] == 0 and result["unhandled"] == 0, out
    assert result["pages_in_use"] == 0 and result["locks"] == 0 and result["requests"] == 0, out
    assert result["disconnected"] > 50 and result["completed"] + result["disconnected"] == 600, out
    assert rc == 0, out
