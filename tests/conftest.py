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
