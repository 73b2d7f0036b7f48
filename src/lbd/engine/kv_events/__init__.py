"""KV-cache events in vLLM's wire format: the config (``config``, stdlib only, read by ``..args``), the
msgspec structs (``wire``), the recorder fed by the KV-cache manager (``recorder``) and the ZMQ publisher
(``publisher``). Nothing here imports the scheduler; the core wires them together."""
