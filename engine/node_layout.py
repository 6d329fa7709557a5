"""Where the tensor-parallel ranks run: how many machines (nodes), which one this is, and where
they meet.

SGLang's flags name it: `--nnodes`, `--node-rank`, `--dist-init-addr host:port`. The ranks are
split evenly: node k runs global ranks [k * per_node, (k + 1) * per_node). Node 0 runs the driver
(rank 0) and hosts the rendezvous store at dist_init_addr; every other node only starts its
worker processes, which connect to that store (engine/tp_node.py).

Launchers that set torchrun's variables are the fallback source of the same values (one hybridkv
process per node, e.g. a Kubernetes PyTorchJob or `torchrun --nproc-per-node 1`): WORLD_SIZE is
the number of nodes, RANK this node's rank, MASTER_ADDR:MASTER_PORT the address. An explicit
argument (or flag) always wins; the variables are read only when tensor_parallel_size > 1 and
nnodes is not given as 1 (a one-rank or one-node engine has nothing to distribute, so a
launcher's environment does not change it).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

# The address the driver binds when one machine runs every rank and none is given.
LOOPBACK = "127.0.0.1"


def parse_dist_init_addr(text: str) -> tuple[str, int]:
    """`host:port` (IPv6 as `[::1]:port`) -> (host, port); ValueError naming the problem."""
    host, sep, port = text.strip().rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"dist_init_addr must be 'host:port' with a port in 1-65535, got {text!r}")
    return host, int(port)


def _env_int(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name, "").strip()
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def resolve_nodes(tensor_parallel_size: int, nnodes: int | None, node_rank: int | None,
                  dist_init_addr: str | None, env: Mapping[str, str] | None = None
                  ) -> tuple[int, int, str | None]:
    """(nnodes, node_rank, dist_init_addr) from the arguments, else torchrun's variables, else
    one node; ValueError when they do not describe a valid layout."""
    env = os.environ if env is None else env
    if tensor_parallel_size > 1 and nnodes != 1 and None in (nnodes, node_rank, dist_init_addr):
        local_rank = _env_int(env, "LOCAL_RANK")
        if local_rank not in (None, 0):  # a launcher that starts a process per rank: each would start them all
            raise ValueError(f"LOCAL_RANK={local_rank}: run one hybridkv process per node (it starts that "
                             "node's ranks itself), e.g. torchrun --nproc-per-node 1")
        nnodes = nnodes if nnodes is not None else _env_int(env, "WORLD_SIZE")
        node_rank = node_rank if node_rank is not None else _env_int(env, "RANK")
        if dist_init_addr is None and (nnodes or 1) > 1:
            addr, port = env.get("MASTER_ADDR", "").strip(), env.get("MASTER_PORT", "").strip()
            if addr and port:
                dist_init_addr = f"{addr}:{port}"
    nnodes = 1 if nnodes is None else nnodes
    node_rank = 0 if node_rank is None else node_rank
    for name, value in (("nnodes", nnodes), ("node_rank", node_rank)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be an integer, got {value!r}")
    if nnodes < 1:
        raise ValueError(f"nnodes must be >= 1, got {nnodes}")
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"node_rank must be in [0, nnodes={nnodes}), got {node_rank}")
    if tensor_parallel_size % nnodes:
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size} must be divisible by nnodes={nnodes} "
                         "(every node runs the same number of ranks)")
    if dist_init_addr is not None:
        parse_dist_init_addr(dist_init_addr)
    elif nnodes > 1:
        raise ValueError(f"nnodes={nnodes} needs dist_init_addr (--dist-init-addr host:port, node 0's address; "
                         "or MASTER_ADDR and MASTER_PORT)")
    return nnodes, node_rank, dist_init_addr


@dataclass(frozen=True)
class NodeLayout:
    """The ranks of one engine over its nodes, seen from one node."""

    size: int  # tensor_parallel_size: ranks over all nodes
    nnodes: int
    node_rank: int
    host: str  # the store's address (node 0's): bound there, connected to from everywhere
    port: int  # 0 = any free port (one node only: the store picks one and tells its workers)

    @classmethod
    def of(cls, size: int, nnodes: int, node_rank: int, dist_init_addr: str | None) -> "NodeLayout":
        host, port = parse_dist_init_addr(dist_init_addr) if dist_init_addr else (LOOPBACK, 0)
        return cls(size, nnodes, node_rank, host, port)

    @property
    def per_node(self) -> int:
        return self.size // self.nnodes

    def node_ranks(self, node: int) -> range:
        return range(node * self.per_node, (node + 1) * self.per_node)

    @property
    def local_ranks(self) -> range:
        return self.node_ranks(self.node_rank)

    @property
    def remote_ranks(self) -> list[int]:
        return [r for r in range(self.size) if r not in self.local_ranks]

    def node_of(self, rank: int) -> int:
        return rank // self.per_node

    def local_index(self, rank: int) -> int:
        """The rank's index among its node's ranks (its CUDA device there)."""
        return rank - self.node_rank * self.per_node

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"
