"""`lbd route`: the cluster router (uvloop, llhttp via httptools) over DP rank endpoints.

`policies/` decides where each request goes."""
