from setuptools import find_packages, setup

# One import package, `hybridkv`, whose subpackages are the repository's top-level folders:
# hybridkv/ holds only the public API (__init__) and `python -m hybridkv`; engine/ installs as
# hybridkv.engine, and so on. Nothing else lands on sys.path.
SUBPACKAGES = ["engine", "block_manager", "model_executor", "attention_backends", "entrypoints"]
packages = ["hybridkv"]
package_dir = {"hybridkv": "hybridkv"}
for top in SUBPACKAGES:
    for pkg in [top] + [f"{top}.{p}" for p in find_packages(where=top)]:
        packages.append(f"hybridkv.{pkg}")
    package_dir[f"hybridkv.{top}"] = top

setup(
    name="hybridkv",
    version="0.1.0",
    description="LLM inference engine with a block manager for hybrid attention (DeepSeek-V4 style)",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=packages,
    package_dir=package_dir,
    # The CPU kernels' C++ sources, compiled on the machine that runs them (first use).
    package_data={"hybridkv.attention_backends.cpu_kernels": ["*.cpp", "*.h"],
                  "hybridkv.model_executor.cpu_kernels": ["*.cpp"]},
    install_requires=[
        # CPU machines: install torch==2.13.0 (CPU build) first; this range never replaces it.
        "torch>=2.4",
        "transformers>=5.0",
        "sentencepiece",
        "safetensors",
        "tokenizers",
        "tqdm",
        "aiohttp",
        "prometheus-client",  # GET /metrics of `hybridkv serve`
        "pyzmq",  # KV cache events for KV-aware routers (kv_events_config), on vLLM's transport
        "msgspec",  # ... in vLLM's encoding (array-like msgpack structs)
        "gguf",  # converts the built-in demo model's GGUF to a HF folder
        "jinja2",
        # Structured outputs (engine/structured_output/): grammar matchers and token masks; one abi3
        # wheel with no torch dependency (engine/structured_output/grammar_compiler.py says why not xgrammar).
        "llguidance>=1.9,<2",
        "ninja",  # builds the CPU kernels (attention_backends/ and model_executor/cpu_kernels) with the system g++
        # Intel's OpenMP runtime (libiomp5), loaded by `import hybridkv` before torch: libgomp's spinning
        # workers stall every join when a server shares its cores (hybridkv/openmp_runtime.py).
        "intel-openmp>=2024.2,<2025; platform_machine == 'x86_64' and sys_platform == 'linux'",
    ],
    extras_require={
        # The storage tier's Redis backend (hicache_storage_backend="redis"); the default file
        # backend needs nothing. Tests run it against a real redis-server, so test pulls it too.
        "redis": ["redis>=5", "hiredis"],
        # sglang-router: the fleet tests put SGLang's cache-aware router (a Rust binary) in front
        # of real servers.
        "test": ["pytest", "hypothesis", "openai", "prometheus-client", "redis>=5", "hiredis", "sglang-router",
                 "jsonschema"],  # validates structured outputs against their schemas
        "gpu": ["triton", "xformers"],
    },
    entry_points={"console_scripts": ["hybridkv=hybridkv.entrypoints.cli:main"]},
)
