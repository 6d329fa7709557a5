"""Tensor parallelism over two "nodes" on one machine, through loopback: node 1 is a real
`hybridkv generate --node-rank 1` process, the driver an LLM in this process. The greedy tokens
equal one node's and one process's; node 1 exits 0 after the driver's shutdown, and (as
`hybridkv serve --node-rank 1`, which starts no server) non-zero naming the driver when the
driver dies; a driver whose node 1 never comes raises naming the rank. Also
the layout's validation and torchrun's variables as the fallback source."""
from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist

from hybridkv.engine.config import EngineConfig
from hybridkv.engine.node_layout import NodeLayout, resolve_nodes
from hybridkv.entrypoints import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
COMMON = dict(dtype="float32", max_model_len=128, kv_cache_memory_bytes=8 << 20)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _prompts(vocab: int, n: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    return [{"prompt_token_ids": torch.randint(3, vocab, (5 + 7 * i,), generator=g).tolist()} for i in range(n)]


def _start_node(path: str, port: int, command: str = "generate", max_model_len: int = 128) -> subprocess.Popen:
    """Node 1 of 2 (`hybridkv generate` or `serve`), in a session of its own (so a finally can
    reach its workers too)."""
    model = ["--model", path] if command == "generate" else [path, "--port", "0"]
    return subprocess.Popen(
        [sys.executable, "-m", "hybridkv", command, *model, "--dtype", "float32", "--max-model-len", str(max_model_len),
         "--tensor-parallel-size", "2", "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", f"127.0.0.1:{port}"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def _group_alive(pgid: int) -> list[int]:
    """Live (not zombie) processes of a process group."""
    alive = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            alive.append(int(entry))
    return alive


def _group_left(pgid: int, wait_s: float = 10.0) -> list[int]:
    """The group's processes still alive after up to wait_s (an exiting process, or multiprocessing's
    resource tracker that follows its parent out, takes a moment)."""
    deadline = time.monotonic() + wait_s
    while _group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return _group_alive(pgid)


def _stop(proc: subprocess.Popen) -> str:
    """Kill whatever of the process's session still runs; its output."""
    if proc.poll() is None:
        proc.kill()
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    out, _ = proc.communicate(timeout=30)
    return out or ""


def _no_workers_left() -> bool:
    return not multiprocessing.active_children() and not dist.is_initialized()


@pytest.mark.slow
def test_two_nodes_over_loopback_give_the_tokens_of_one(tiny_ckpt):
    path = tiny_ckpt("llama", num_key_value_heads=4)
    one = LLM(path, **COMMON)
    prompts = _prompts(one.engine.runner.config.vocab_size, 4)
    want = [o.outputs[0].token_ids for o in one.generate(prompts, GREEDY, use_tqdm=False)]
    two = LLM(path, tensor_parallel_size=2, **COMMON)
    try:
        single_node = [o.outputs[0].token_ids for o in two.generate(prompts, GREEDY, use_tqdm=False)]
    finally:
        two.shutdown()

    port = _free_port()
    node = _start_node(path, port)
    output = ""
    try:
        t0 = time.monotonic()
        llm = LLM(path, tensor_parallel_size=2, nnodes=2, node_rank=0, dist_init_addr=f"127.0.0.1:{port}", **COMMON)
        try:
            assert llm.engine.runner.workers.processes == []  # rank 1 runs on node 1
            assert list(llm.engine.runner.workers.remote_pids) == [1]
            got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
            assert "node 1: rank 1 (pid" in llm.engine.runner.workers.describe()
        finally:
            llm.shutdown()
        assert node.wait(timeout=30) == 0, "node 1 did not exit 0 after the driver's shutdown"
        assert not _group_left(node.pid), "node 1 left processes behind"
        print(f"two nodes: {time.monotonic() - t0:.1f}s")
    finally:
        output = _stop(node)
    assert got == single_node == want, output[-3000:]
    assert "joining the driver at 127.0.0.1" in output and "the driver stopped this node's ranks" in output
    assert _no_workers_left()


@pytest.mark.slow
def test_a_rank_killed_on_node_1_fails_the_driver_and_node_1(tiny_ckpt):
    path = tiny_ckpt("llama", num_key_value_heads=4)
    port = _free_port()
    node = _start_node(path, port)
    try:
        llm = LLM(path, tensor_parallel_size=2, nnodes=2, node_rank=0, dist_init_addr=f"127.0.0.1:{port}", **COMMON)
        try:
            runner = llm.engine.runner
            execute, calls = runner.execute, []

            def execute_then_kill(batch, plan):
                calls.append(1)
                if len(calls) == 3:  # mid-generation
                    os.kill(runner.workers.remote_pids[1], signal.SIGKILL)
                return execute(batch, plan)

            runner.execute = execute_then_kill
            t0 = time.monotonic()
            with pytest.raises(RuntimeError, match=r"rank\(s\) 1 \(node 1\) run on other nodes"):
                llm.generate(_prompts(320, 2), SamplingParams(temperature=0, max_tokens=50, ignore_eos=True),
                             use_tqdm=False)
            assert time.monotonic() - t0 < 30
        finally:
            llm.shutdown()
        assert _no_workers_left()
        assert node.wait(timeout=30) != 0
        assert not _group_left(node.pid), "node 1 left processes behind"
        output = _stop(node)
        assert "a tensor-parallel worker of node 1 failed" in output and "rank 1 exited with code -9" in output, \
            output[-3000:]
    finally:
        _stop(node)


DRIVER = """
import sys, time
from hybridkv.entrypoints import LLM, SamplingParams
if __name__ == "__main__":
    llm = LLM(sys.argv[1], dtype="float32", max_model_len=128, kv_cache_memory_bytes=8 << 20,
              tensor_parallel_size=2, nnodes=2, node_rank=0, dist_init_addr=sys.argv[2])
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)
    print("generated", flush=True)
    time.sleep(600)
"""


@pytest.mark.slow
def test_node_1_exits_non_zero_naming_the_driver_when_it_dies(tiny_ckpt, tmp_path):
    path = tiny_ckpt("llama", num_key_value_heads=4)
    script = tmp_path / "driver.py"
    script.write_text(textwrap.dedent(DRIVER))
    port = _free_port()
    node = _start_node(path, port, "serve")
    driver = subprocess.Popen([sys.executable, str(script), path, f"127.0.0.1:{port}"], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        assert driver.stdout.readline().strip() == "generated", _stop(driver)
        driver.kill()
        driver.wait(timeout=10)
        t0 = time.monotonic()
        code = node.wait(timeout=60)
        took = time.monotonic() - t0
        assert not _group_left(node.pid), "node 1 left processes behind"
        output = _stop(node)
        assert code != 0, output[-3000:]
        assert took < 30, f"node 1 took {took:.1f}s to notice"
        assert "the driver (node 0 at 127.0.0.1:" in output and "is gone" in output, output[-3000:]
        assert "serving the OpenAI-compatible API" not in output  # node 1 runs no server
    finally:
        _stop(driver)
        _stop(node)


def test_the_driver_names_the_rank_that_never_joined(tiny_ckpt, monkeypatch):
    monkeypatch.setenv("HYBRIDKV_TP_TIMEOUT_S", "3")
    port = _free_port()
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank\(s\) 1 \(node 1\) did not join within 3s.*--node-rank"):
        LLM(tiny_ckpt("llama", num_key_value_heads=4), tensor_parallel_size=2, nnodes=2, node_rank=0,
            dist_init_addr=f"127.0.0.1:{port}", **COMMON)
    assert time.monotonic() - t0 < 30
    assert _no_workers_left()
    with socket.socket() as s:  # the store's address was given back
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))


@pytest.mark.slow
def test_a_node_started_with_other_settings_is_refused_by_both_sides(tiny_ckpt):
    path = tiny_ckpt("llama", num_key_value_heads=4)
    port = _free_port()
    node = _start_node(path, port, max_model_len=64)
    try:
        with pytest.raises(RuntimeError, match=r"rank\(s\) 1 \(node 1\) refused to join: rank 1 was started with "
                                               r"other settings than the driver's: max_model_len 64 \(the driver's: 128\)"):
            LLM(path, tensor_parallel_size=2, nnodes=2, node_rank=0, dist_init_addr=f"127.0.0.1:{port}", **COMMON)
        assert _no_workers_left()
        assert node.wait(timeout=30) != 0
        assert "max_model_len 64 (the driver's: 128)" in _stop(node)
    finally:
        _stop(node)


def test_a_follower_node_runs_no_engine(tiny_ckpt):
    with pytest.raises(ValueError, match="node_rank=1 runs no engine"):
        LLM(tiny_ckpt("llama"), tensor_parallel_size=2, nnodes=2, node_rank=1, dist_init_addr="127.0.0.1:1")


@pytest.mark.parametrize("kwargs,match", [
    (dict(tensor_parallel_size=3, nnodes=2, dist_init_addr="h:1"), "divisible by nnodes=2"),
    (dict(tensor_parallel_size=2, nnodes=2, node_rank=2, dist_init_addr="h:1"), r"node_rank must be in \[0, nnodes=2\)"),
    (dict(tensor_parallel_size=2, nnodes=0), "nnodes must be >= 1"),
    (dict(tensor_parallel_size=2, nnodes=2), "needs dist_init_addr"),
    (dict(tensor_parallel_size=2, nnodes=2, dist_init_addr="nohost"), "host:port"),
    (dict(tensor_parallel_size=2, nnodes=2, dist_init_addr="h:70000"), "host:port"),
])
def test_layouts_that_cannot_run_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kwargs)


def test_one_node_is_the_default_and_the_single_machine_layout():
    config = EngineConfig(tensor_parallel_size=2)
    assert (config.nnodes, config.node_rank, config.dist_init_addr) == (1, 0, None)
    layout = NodeLayout.of(4, 2, 1, "[::1]:29500")
    assert (layout.host, layout.port, layout.address) == ("::1", 29500, "[::1]:29500")
    assert list(layout.local_ranks) == [2, 3] and layout.remote_ranks == [0, 1] and layout.local_index(3) == 1


TORCHRUN = {"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "LOCAL_RANK": "0"}


def test_the_flags_reach_the_engine_config():
    from hybridkv.entrypoints.cli import build_parser, engine_kwargs

    for command in (["generate"], ["serve", "some/model"]):
        args = build_parser().parse_args([*command, "--tensor-parallel-size", "4", "--nnodes", "2", "--node-rank", "1",
                                          "--dist-init-addr", "10.0.0.1:29500"])
        config = EngineConfig(**engine_kwargs(args))
        assert (config.nnodes, config.node_rank, config.dist_init_addr) == (2, 1, "10.0.0.1:29500")


def test_torchrun_variables_are_the_fallback_and_arguments_win():
    assert resolve_nodes(2, None, None, None, TORCHRUN) == (2, 1, "10.0.0.1:29500")
    assert resolve_nodes(4, 2, 0, "node0:1234", TORCHRUN) == (2, 0, "node0:1234")
    assert resolve_nodes(1, None, None, None, TORCHRUN) == (1, 0, None)  # one rank: nothing to distribute
    assert resolve_nodes(2, 1, None, None, {**TORCHRUN, "LOCAL_RANK": "1"}) == (1, 0, None)  # one node, as asked
    with pytest.raises(ValueError, match="one hybridkv process per node"):
        resolve_nodes(2, None, None, None, {**TORCHRUN, "LOCAL_RANK": "1"})
    with pytest.raises(ValueError, match="WORLD_SIZE='two' is not an integer"):
        resolve_nodes(2, None, None, None, {"WORLD_SIZE": "two"})
