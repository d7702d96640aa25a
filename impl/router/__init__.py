"""The KV-cache-aware multi-turn router: the control plane in front of P/D-disaggregated vLLM.

Reading guide, one concern per module:

* :mod:`~impl.router.app`       -- aiohttp routes, authentication, errors, lifecycle (start here)
* :mod:`~impl.router.proxy`     -- one turn through P and D, and its faults
* :mod:`~impl.router.recorder`  -- what is stored after D answered, and when
* :mod:`~impl.router.request`   -- validating a request and choosing the guard's prompt view
* :mod:`~impl.router.capture`   -- what D's response teaches: answer, kv_transfer_params, completion
* :mod:`~impl.router.sse`       -- splitting D's byte stream into whole SSE events
* :mod:`~impl.router.notify`    -- the vLLM 0.32 path: D's connector posts its params (the contract)
* :mod:`~impl.router.upstreams` -- instances, load snapshots for placement, health probing
* :mod:`~impl.router.tenants`   -- API keys -> tenants
* :mod:`~impl.router.metrics`   -- Prometheus exposition
* :mod:`~impl.router.config`, :mod:`~impl.router.cli` -- settings and ``bidikv router``

Every decision (store, guard, placement) is impl.policy's, used verbatim; this package is I/O.
"""
