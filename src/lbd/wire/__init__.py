"""The contracts between lbd's processes, one type each, imported by producer and consumer alike.

Each module holds the types of one wire: ``status`` (the supervisor's and ``lbd serve``'s /status, the
engine's /status; its states in ``states``), ``dp`` (the DP group's state, a rank's DP status, the DP
coordinator's /status),
``dp_messages`` (an MoE DP rank's core <-> the DP coordinator), ``kv_events`` (the KV-event batch in vLLM's
msgpack format, its encoder and tolerant decoder), ``load_state`` (a rank's load, pushed to routers),
``events`` (the supervisor's rank lifecycle events), ``scale`` (a node's resize: POST /scale, /status's
``scaling``), ``roles`` (node and rank roles), ``core_messages``
(engine core <-> front end) and ``executor_messages`` (a TP x PP rank's core <-> its workers). Types are
msgspec Structs or slots dataclasses; their field names are the wire's.

Rules: this package imports nothing of lbd (the standard library, msgspec and msgpack only, never torch), so
every program can import it. Decoders tolerate what a newer peer may add: unknown fields are skipped, and an
enum value this version does not know decodes to that enum's ``UNKNOWN`` member. This module re-exports
nothing: import the module that holds the type.
"""
