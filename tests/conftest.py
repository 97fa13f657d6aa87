"""Test-wide setup: 8 simulated CPU devices so sharding is really exercised (set before JAX starts),
and JAX's persistent compilation cache under .pytest_cache, so a second run of the suite loads the
engine's warmed-up programs from disk instead of compiling them again."""

import os
from pathlib import Path

# LLVM at -O0 without its expensive passes: the suite's time is compiling (hundreds of small programs,
# each run a few times), and -O0 compiles them faster. What a test checks (equal arrays, equal routes)
# holds at any level, but the level can change floating-point results in the last bit (fused
# multiply-adds), so every process of a test that compares across processes gets the same flags:
# subprocesses take R3JAX_TEST_XLA_FLAGS (these flags without the device count).
TEST_XLA_FLAGS = (os.environ.get("XLA_FLAGS", "") +
                  " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true").strip()
os.environ["R3JAX_TEST_XLA_FLAGS"] = TEST_XLA_FLAGS
os.environ["XLA_FLAGS"] = TEST_XLA_FLAGS + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_enable_x64", False)
# R3JAX_TEST_COMPILATION_CACHE=0 (.ci/run on a fresh clone, where nothing could be reused): no cache, so
# no executable is serialized in this process (XLA once aborted there, in the 8-device train step's entry)
if "JAX_COMPILATION_CACHE_DIR" not in os.environ and os.environ.get("R3JAX_TEST_COMPILATION_CACHE") != "0":
    # one directory per pytest-xdist worker: JAX writes an entry in place, and a worker reading one that
    # another is still writing would load a truncated executable
    jax.config.update("jax_compilation_cache_dir", str(Path(__file__).resolve().parents[1] / ".pytest_cache"
                                                       / "jax-compilation" / os.environ.get("PYTEST_XDIST_WORKER", "main")))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)


# Longest files first (measured: `make test` prints the slowest tests), so the workers of
# `pytest -n auto --dist loadfile` finish together instead of one waiting on a long file picked up last.
_LONG_FILES = ("r3jax/demo/test_demo.py", "r3jax/serve/test_peer_endpoints.py", "r3jax/serve/test_cluster.py",
               "r3jax/train/test_step.py", "models/test_expert_parallel.py", "r3jax/serve/test_app.py",
               "models/test_routers.py", "models/test_transformer.py", "r3jax/train/test_logits.py",
               "r3jax/serve/test_skyrl_client.py", "r3jax/train/test_weight_sync.py", "r3jax/train/test_multiprocess.py")


def pytest_collection_modifyitems(items):
    def rank(item):
        rel = Path(str(item.fspath)).resolve().relative_to(Path(__file__).resolve().parent).as_posix()
        return _LONG_FILES.index(rel) if rel in _LONG_FILES else len(_LONG_FILES)
    items.sort(key=rank)  # stable: the order within a file, and of the other files, is unchanged


WORKER_BYTES = 6 << 30  # a worker's peak (the suite's largest engines and train steps)


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: `-n auto`
def pytest_xdist_auto_num_workers(config):
    """One worker per core, but no more than memory holds at a worker's peak."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return max(1, min(cores, memory // WORKER_BYTES))


# Every live XLA:CPU executable holds ~6 memory mappings, and the jit caches keep every program of the
# suite alive: near a thousand tests the process reaches Linux's vm.max_map_count (65530 by default)
# and the next compile segfaults inside XLA. Dropping the caches when the mappings run high frees them
# (programs a later test needs are compiled again; engines keep their own AOT-compiled steps).
_MAPS = Path("/proc/self/maps")
_MAP_LIMIT = Path("/proc/sys/vm/max_map_count")


def _map_count() -> int:
    with _MAPS.open("rb") as f:
        return sum(1 for _ in f)


def pytest_runtest_setup(item):
    if not _MAPS.exists():
        return
    limit = int(_MAP_LIMIT.read_text()) if _MAP_LIMIT.exists() else 65530
    if _map_count() > limit // 2:
        import gc

        jax.clear_caches()
        gc.collect()
