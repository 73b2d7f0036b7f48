"""What every lbd server does at its network edge: limits, keys, TLS, the DP-rank header rule, redaction.

Shared by the engine's front end, the supervisor's health port and the router, so each rule exists once.
Every module here imports only the standard library, except ``aio_guard`` (aiohttp, which the engine and the
supervisor serve with anyway): the router and the supervisor import this package without torch.
"""
