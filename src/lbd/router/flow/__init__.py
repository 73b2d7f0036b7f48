"""Flow control: requests wait in the router, by tenant and priority, while the pool is saturated.

A room of its own on the request path (``lbd.router.proxy`` enters it at one point, after the facts step
and before decide; nothing here imports the proxy, the router's state, the relay or the steps after it).
The counters every router worker shares, per flow (tenant x class), are ``lbd.router.shared_flows``
(shared memory made before the workers fork, beside ``lbd.router.shared``). Its modules:

- ``identity``: who a request is (its tenant, weight and priority class) and its TTFT deadline;
- ``settings``: the flags and their checks;
- ``saturation``: when the pool is saturated, by the telemetry of the endpoint snapshots;
- ``bands``: one worker's held requests, strict across priority bands and virtual-token fair within one;
- ``control``: the entry (``FlowControl.enter`` / ``leave``), the dispatcher and the status.
"""
