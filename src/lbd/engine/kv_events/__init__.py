"""KV-cache events in vLLM's wire format (the flag's config is ``lbd.engine.config.kv_events``): the recorder
fed by the KV-cache manager (``recorder``) and the ZMQ publisher (``publisher``); the msgspec structs are
``lbd.wire.kv_events``, which the router reads too. Nothing here imports the scheduler; the core wires them
together."""
