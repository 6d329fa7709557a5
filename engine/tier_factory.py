"""The tiers under the device KV, wired from the engine's config: the host tier's page buffers
(HiCache L2, executed by the model runner) and the storage tier (L3: a file or Redis store the
KV cache manager reads ahead from and writes behind to)."""
from __future__ import annotations

import logging
import os

from hybridkv.block_manager.kv_cache_manager import KVCacheManager
from hybridkv.block_manager.space_spec import SpaceSpec
from hybridkv.block_manager.storage.backend import make_backend
from hybridkv.block_manager.storage.kv_fingerprint import kv_fingerprint
from hybridkv.block_manager.storage_tier import StorageTier
from hybridkv.engine.config import EngineConfig
from hybridkv.model_executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def wire_tiers(config: EngineConfig, kv: KVCacheManager, runner: ModelRunner, host_pages: dict[str, int] | None,
               model_dir: str, specs: list[SpaceSpec]) -> StorageTier | None:
    """Bind the host tier's buffers (when host_pages is set) and attach the storage tier (when a
    backend is configured) to the KV manager. Returns the storage tier, or None."""
    if host_pages is None:
        return None
    runner.bind_host_cache(host_pages, config.hicache_mem_layout)
    logger.info("host tier (HiCache L2): pages per space %s, %.1f MiB, layout=%s, write policy=%s, preemption=%s",
                host_pages, runner.host_cache.nbytes / 2**20, config.hicache_mem_layout,
                config.hicache_write_policy, config.preemption_mode)
    if config.hicache_storage_backend is None:
        return None
    storage = make_storage_tier(config, kv, runner, model_dir, specs)
    kv.attach_storage(storage)
    return storage


def make_storage_tier(config: EngineConfig, kv: KVCacheManager, runner: ModelRunner, model_dir: str,
                      specs: list[SpaceSpec]) -> StorageTier:
    """The L3 store under the host tier: pages are named by hash chains seeded with this
    configuration's KV fingerprint (set on the index before any node exists)."""
    parallel = runner.parallel  # a stored page holds every rank's shard: the group's size is part of its identity
    fp = kv_fingerprint(model_dir, str(runner.dtype), kv.page_size, specs, runner.host_cache.page_layout,
                        tp_size=parallel.size if parallel is not None else 1, kv_dtype=str(runner.kv_dtype))
    # The file store's directory defaults to beside the demo model, under HYBRIDKV_CACHE_DIR; the
    # extra config (JSON text from the CLI, or a dict) overrides it (make_backend parses both).
    from hybridkv.model_executor.demo_model import default_cache_dir

    store_dir = config.hicache_storage_dir or os.path.join(default_cache_dir(), "kv_store")
    backend = make_backend(config.hicache_storage_backend, config.hicache_storage_backend_extra_config,
                           defaults={"dir": store_dir})
    kv.index.chain_seed = fp.seed
    logger.info("storage tier (HiCache L3): backend=%s prefetch=%s fingerprint=%s",
                config.hicache_storage_backend, config.hicache_storage_prefetch_policy, fp.seed.hex()[:16])
    return StorageTier(backend, kv, runner.stored_host_pages(), fp, config.hicache_storage_prefetch_policy)
