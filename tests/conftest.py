"""Test-wide setup: 8 simulated CPU devices so sharding is really exercised (set before JAX starts),
and JAX's persistent compilation cache under .pytest_cache, so a second run of the suite loads the
engine's warmed-up programs from disk instead of compiling them again."""

import os
from pathlib import Path

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", False)
# R3JAX_TEST_COMPILATION_CACHE=0 (.ci/run on a fresh clone, where nothing could be reused): no cache, so
# no executable is serialized in this process (XLA once aborted there, in the 8-device train step's entry)
if "JAX_COMPILATION_CACHE_DIR" not in os.environ and os.environ.get("R3JAX_TEST_COMPILATION_CACHE") != "0":
    jax.config.update("jax_compilation_cache_dir",
                      str(Path(__file__).resolve().parents[1] / ".pytest_cache" / "jax-compilation"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)


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
