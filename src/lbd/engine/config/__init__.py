"""The engine's configuration, torch-free: flags (``args``), the TP/PP/DP checks against the model and the
devices (``parallel``, ``layout``, ``placement``), the KV-event config (``kv_events``), the architectures and
what each supports (``architectures``), and where a model's files are (``model_files``).

This is the only part of the engine that other programs import: the supervisor, ``lbd serve``'s planner and
``lbd bench`` validate and pass engine flags through without loading torch. It imports the standard library
and ``lbd.common`` only, which the import contracts check.
"""
