"""KV transfer on ``--device sim`` ranks: the blocks move in time only.

A sim rank holds no KV tensors, so nothing but the protocol crosses the wire: the same leases, pulls, token
checks, prefix-cache registration and KV events as a real rank (``lbd.engine.kv_transfer.connector``), with
empty block payloads. What a real pull costs is modelled on the consumer: after the producer's answer the
puller waits out ``SimProfile.kv_transfer_time`` of the blocks it lacked (the link's per-pull latency plus
blocks * block size * KV bytes per token over the link's bandwidth, from the rank's ``--sim-profile``), and
only then is the request unparked. Pulls of one decode rank run one after another, as they share its link.

The metrics count the modelled bytes (``lbd:kv_transfer_bytes_*`` and ``bytes_per_token`` follow the
profile's KV layout). The layout name differs from every real rank's, so a sim rank and a real rank never
pair: the consumer recomputes instead.
"""

from __future__ import annotations

from lbd.engine.sim_profiles import SimProfile


class SimBlockIO:
    """The sim rank's stand-in for ``KVBlockIO``: modelled block sizes, nothing read or written."""

    wire_block_bytes = 0  # what actually crosses the wire per block

    def __init__(self, profile: SimProfile, block_size: int) -> None:
        self.profile, self.block_size = profile, block_size
        self.block_bytes = int(profile.kv_bytes_per_token * block_size)  # modelled, for metrics
        self.layout = f"sim/{profile.name}/{profile.kv_bytes_per_token:g}B/{block_size}"

    def read(self, block_ids: list[int]) -> memoryview:
        """No bytes: the producer answers with the header only."""
        return memoryview(b"")

    def write(self, block_ids: list[int], data: bytes | memoryview) -> None:
        """Nothing to write: registering the blocks in the prefix cache is the whole import."""

    def transfer_seconds(self, blocks: int) -> float:
        """The modelled time of one pull of ``blocks`` blocks (time-dilated as the profile's steps are)."""
        return self.profile.kv_transfer_time(blocks * self.block_size)
