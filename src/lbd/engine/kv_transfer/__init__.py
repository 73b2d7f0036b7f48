"""Prefill/decode disaggregation inside one engine rank: KV blocks exported by a producer and pulled by a
consumer, behind ``--kv-transfer-config`` (``lbd.engine.config.kv_transfer``) and vLLM's HTTP
``kv_transfer_params`` (``lbd.wire.kv_transfer``).

- ``blocks``: the bytes of KV blocks, read from and written into the runner's paged cache;
- ``agent``: the two threads beside the core loop (the producer's block server, the consumer's puller);
- ``connector``: the core's side, hooked into the scheduler at three points (a prefill's finish holds its
  blocks, a decode request waits parked while its blocks come, the pulled blocks enter the prefix cache);
- ``sim``: ``--device sim`` ranks' blocks, which move in modelled time only (the sim profile's link).
"""
