"""KV-cache events in vLLM's wire format (the flag's config is ``lbd.engine.config.kv_events``): the
msgspec structs are ``lbd.wire.kv_events`` (the router reads the same ones), the recorder fed by the KV-cache manager (``recorder``) and the ZMQ publisher
(``publisher``). Nothing here imports the scheduler; the core wires them together."""
