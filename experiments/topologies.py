"""TPU topologies for ahead-of-time compilation, and their CPU stand-ins.

With the ``tpu-aot`` extra (``jax[tpu]``, which brings the matching libtpu) a CPU-only host can ask
libtpu for the devices of a real topology (``jax.experimental.topologies.get_topology_desc``) and
compile a program for them: XLA then reports the program's memory per chip and raises
RESOURCE_EXHAUSTED when it does not fit HBM, as on the real machine, without a TPU or any array
allocated. Without the extra the same meshes are built from simulated CPU devices
(``--xla_force_host_platform_device_count``): shapes and shardings are the same, but XLA:CPU's
memory figures are only an estimate of the TPU's and nothing is refused for lack of HBM.

The table follows MaxText's ``accelerator_to_spec_map`` (chip config, hosts of 2x2x1 chips, which
dims wrap). HBM per chip is the nominal figure (libtpu reports a little less as available, e.g.
15.75 GiB of a v5e's 16).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os

import jax

GiB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Topology:
    """One TPU slice: ``name`` as libtpu spells it (``"v5e:4x4"``), chips, nominal HBM per chip."""

    name: str
    chip_config: str  # "default" (one TensorCore per chip) or "megacore" (v4/v5p: two cores as one device)
    hbm_bytes: int
    wrap: tuple[bool, bool, bool]

    @property
    def generation(self) -> str:
        return self.name.split(":")[0]

    @property
    def dims(self) -> tuple[int, ...]:
        return tuple(int(d) for d in self.name.split(":")[1].split("x"))

    @property
    def chips(self) -> int:
        return math.prod(self.dims)

    @property
    def total_hbm_bytes(self) -> int:
        return self.chips * self.hbm_bytes


_F, _T = False, True
_HBM = {"v5e": 16 * GiB, "v6e": 32 * GiB, "v4": 32 * GiB, "v5p": 95 * GiB}
_CHIP_CONFIG = {"v5e": "default", "v6e": "default", "v4": "megacore", "v5p": "megacore"}
_WRAPS = {  # from MaxText's accelerator_to_spec_map; every other slice listed here has no wraparound
    "v5e:8x16": (_F, _T, _F), "v5e:16x16": (_T, _T, _F), "v6e:8x16": (_F, _T, _F), "v6e:16x16": (_T, _T, _F),
    "v5p:4x4x4": (_T, _T, _T), "v5p:4x4x8": (_T, _T, _T), "v5p:4x8x8": (_T, _T, _T), "v5p:8x8x8": (_T, _T, _T),
}
_NAMES = ["v5e:2x2", "v5e:2x4", "v5e:4x4", "v5e:4x8", "v5e:8x8", "v5e:8x16", "v5e:16x16",
          "v6e:2x2", "v6e:4x4", "v6e:8x8", "v6e:16x16", "v4:2x2x1", "v4:2x2x2",
          "v5p:2x2x1", "v5p:2x2x2", "v5p:2x2x4", "v5p:2x4x4", "v5p:4x4x4", "v5p:4x4x8", "v5p:4x8x8",
          "v5p:8x8x8"]
TOPOLOGIES: dict[str, Topology] = {
    n: Topology(n, _CHIP_CONFIG[n.split(":")[0]], _HBM[n.split(":")[0]], _WRAPS.get(n, (_F, _F, _F)))
    for n in _NAMES}


def topology(name: str) -> Topology:
    if name not in TOPOLOGIES:
        raise ValueError(f"topology={name!r}: expected one of {', '.join(TOPOLOGIES)}")
    return TOPOLOGIES[name]


def tpu_aot_available() -> bool:
    """Whether libtpu (the ``tpu-aot`` extra) is importable in this interpreter."""
    return importlib.util.find_spec("libtpu") is not None


def devices(topo: Topology, backend: str) -> list:
    """The ``topo.chips`` devices to build a mesh from: libtpu's abstract TPU devices of the slice
    (``backend="tpu"``; nothing is allocated on them, they only compile) or the first simulated CPU
    devices (``backend="cpu"``)."""
    if backend == "tpu":
        if not tpu_aot_available():
            raise ValueError("backend='tpu': libtpu is not importable here: expected the tpu-aot extra "
                             "(pip install -e '.[tpu-aot]'; `make scale-plan` builds .venv-tpu)")
        # libtpu takes a host-wide lock file meant for processes that own real chips; compiling for
        # an abstract topology owns none, so several processes (a sweep, a test run) may compile at once
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
        from jax.experimental.topologies import get_topology_desc

        desc = get_topology_desc(platform="tpu", topology_name=topo.name, chip_config_name=topo.chip_config,
                                 chips_per_host_bounds=(2, 2, 1), num_slices=1, wrap=topo.wrap)
        devs = list(desc.devices)
        if len(devs) != topo.chips:
            raise ValueError(f"topology {topo.name}: libtpu gave {len(devs)} devices, expected {topo.chips}")
        return devs
    if backend == "cpu":
        cpus = jax.devices("cpu")
        if len(cpus) < topo.chips:
            raise ValueError(f"backend='cpu' for {topo.name}: {len(cpus)} CPU devices, expected >= {topo.chips} "
                             f"(set XLA_FLAGS=--xla_force_host_platform_device_count={topo.chips} before JAX starts)")
        return list(cpus[:topo.chips])
    raise ValueError(f"backend={backend!r}: expected 'tpu' or 'cpu'")
