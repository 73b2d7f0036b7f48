"""Exact cache-aware routing: each router worker follows every engine's KV-cache events (vLLM's wire format)
and keeps an exact index of the block chains each endpoint holds; requests are tokenized in the router (the
engine's own tokenizer and chat template) so their block chains can be looked up.

Rooms: ``index`` holds the per-endpoint block chains, ``feed`` subscribes to one endpoint (gaps replayed,
restarts resynced) and decodes payloads with ``lbd.wire.kv_events`` (vLLM's current map-tagged events and the
older array form), ``tokenize`` renders and tokenizes requests with per-segment caching, ``view`` ties them to
the endpoints and annotates each request's facts with the exact cached length per endpoint. No engine import:
this works against vLLM engines as well as ours.
"""
