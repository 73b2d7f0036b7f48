"""One engine rank (`lbd serve` / ``python -m lbd.engine``): the OpenAI front end (``server``), the core that
owns the device (``core``: scheduler, KV cache, runner), TP/PP workers (``executor``, ``distributed``),
models, the loader, metrics, KV events and the MoE DP group (``dp``). ``config`` is the torch-free part that
the supervisor and ``lbd serve``'s planner read.
"""
