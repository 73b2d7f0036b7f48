"""`lbd route`: the cluster router (aiohttp + uvloop) over DP rank endpoints; `policies/` decides."""
