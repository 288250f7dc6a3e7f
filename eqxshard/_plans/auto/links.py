"""The alpha-beta model of a collective's time, and the links it is measured over.

A collective that moves `b` bytes per device in `s` sequential steps over a link takes
`s * latency + b / bandwidth` seconds. A collective over several mesh axes is as slow as
their slowest link. `LINKS` holds presets; their figures are nominal per-device,
per-direction rates from the vendors' data sheets, rounded, not measurements.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any


@dataclasses.dataclass(frozen=True)
class Link:
    """How fast the devices along a mesh axis talk, for `auto_plan`'s time estimates.

    - `bandwidth`: bytes per second each device sends (one direction).
    - `latency`: seconds per step of a collective (a ring all-reduce over `n` devices
        takes `2 (n - 1)` steps, an all-gather `n - 1`, a permute one).

    Presets are in `eqxshard.links.LINKS` by name, e.g. `"nvlink4"`, `"infiniband_ndr"`.

    !!! Example

        ```python
        print(eqxshard.links.LINKS["inter_node"])  # Link(bandwidth=5e+10, latency=5e-06)
        measured = eqxshard.links.Link(bandwidth=20e9, latency=8e-6)  # e.g. from nccl-tests
        links = {"data": measured, "model": "nvlink4"}  # auto_plan(..., links=links)
        ```
    """

    bandwidth: float
    latency: float

    def __post_init__(self) -> None:
        for name in ("bandwidth", "latency"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise TypeError(f"`Link` takes `{name}` as a number, but got {value!r}.")
        if not self.bandwidth > 0 or self.latency < 0:
            raise ValueError(
                "`Link` takes `bandwidth` > 0 (bytes per second) and `latency` >= 0 "
                f"(seconds), but got bandwidth={self.bandwidth!r}, latency={self.latency!r}."
            )

    def __repr__(self) -> str:
        return f"Link(bandwidth={self.bandwidth:.3g}, latency={self.latency:.3g})"


LINKS: dict[str, Link] = {
    # Within one node.
    "nvlink4": Link(bandwidth=450e9, latency=3e-6),  # H100 SXM: 900 GB/s both ways
    "nvlink3": Link(bandwidth=300e9, latency=3e-6),  # A100 SXM: 600 GB/s both ways
    "pcie4": Link(bandwidth=25e9, latency=5e-6),  # PCIe 4.0 x16, about 25 GB/s usable
    "pcie5": Link(bandwidth=50e9, latency=5e-6),  # PCIe 5.0 x16
    "tpu_v5e_ici": Link(bandwidth=100e9, latency=3e-6),  # 1600 Gbit/s over 4 links
    # Between nodes (one network card per device).
    "infiniband_ndr": Link(bandwidth=50e9, latency=5e-6),  # 400 Gbit/s
    "infiniband_hdr": Link(bandwidth=25e9, latency=5e-6),  # 200 Gbit/s
    "ethernet_100g": Link(bandwidth=12.5e9, latency=20e-6),  # 100 Gbit/s, TCP
}
"""`auto_plan`'s `Link` presets by name: `"nvlink4"`, `"nvlink3"`, `"pcie4"`, `"pcie5"`,
`"tpu_v5e_ici"` within a node; `"infiniband_ndr"`, `"infiniband_hdr"`, `"ethernet_100g"`
between nodes; `"intra_node"` (`"nvlink4"`) and `"inter_node"` (`"infiniband_ndr"`); `"host"`
(`"pcie5"`), device to pinned host memory.
Nominal per-device, per-direction rates from the vendors' data sheets, rounded."""
LINKS["intra_node"] = LINKS["nvlink4"]
LINKS["inter_node"] = LINKS["infiniband_ndr"]
LINKS["host"] = LINKS["pcie5"]  # device <-> pinned host memory, for offload

# Every axis, unless told otherwise: one host's devices.
DEFAULT_LINK = "intra_node"

# What a device computes per second, unless told otherwise: about an H100's dense bf16
# rate at a realistic 40% utilisation.
DEFAULT_FLOPS = 400e12


def as_link(value: Any, where: str) -> Link:
    if isinstance(value, Link):
        return value
    if isinstance(value, str):
        if value not in LINKS:
            raise ValueError(
                f"`auto_plan` got {where} = {value!r}, which is not a preset; presets: "
                f"{', '.join(sorted(LINKS))}. Or pass "
                "`eqxshard.links.Link(bandwidth=..., latency=...)`."
            )
        return LINKS[value]
    raise TypeError(
        f"`auto_plan` takes {where} as a preset name ({', '.join(sorted(LINKS))}) or an "
        f"`eqxshard.links.Link`, but got {type(value).__name__}."
    )


# Per kind: (bytes each device sends per byte of the result, sequential steps), for a
# ring over `n` devices. The result of an all-gather is the gathered array; of a
# reduce-scatter, one device's part.
def traffic(kind: str, result_bytes: float, n: int) -> tuple[float, int]:
    if kind == "collective-permute":
        return result_bytes, 1
    if n <= 1:
        return 0.0, 0
    if kind == "all-reduce":
        return 2 * (n - 1) / n * result_bytes, 2 * (n - 1)
    if kind == "reduce-scatter":
        return (n - 1) * result_bytes, n - 1
    return (n - 1) / n * result_bytes, n - 1  # all-gather, all-to-all


def seconds(
    kind: str, result_bytes: float, n: int, axes: Iterable[str], links: Mapping[str, Link]
) -> float:
    sent, steps = traffic(kind, result_bytes, n)
    used = [links[a] for a in axes if a in links] or [LINKS[DEFAULT_LINK]]
    bandwidth = min(link.bandwidth for link in used)
    latency = max(link.latency for link in used)
    return steps * latency + sent / bandwidth


def host_round_trip(nbytes: float, links: Mapping[str, Link]) -> float:
    """Seconds to move `nbytes` per device to pinned host memory and back over the `host`
    link (`links["host"]`, else the `"host"` preset), per step."""
    link = links.get("host", LINKS["host"])
    return 2 * (link.latency + nbytes / link.bandwidth)
