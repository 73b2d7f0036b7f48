"""`lbd supervise`: a node's DP ranks on their own ports, probed, restarted and drained, behind one
health port. Its API (and the /status JSON that routers read) is described in supervisor/health.py."""
