"""Agent-workload benchmarks: workload generators, the live driver, an oracle bound and a scale simulator.

Modules, in dependency order:
- `bench.workloads`: the three agent workloads (sessions of steps), deterministic
  from a seed.
- `bench.workload_render`: their rendering to OpenAI requests and token ids.
- `bench.trace`: one record per request and the figures a run is judged by.
- `bench.fingerprint_set`, `bench.sim_cache`: a compact set of block hashes, and
  a replica's LRU block cache with the KV events it publishes.
- `bench.oracle`: hit-rate bounds for a recorded trace (built on the two above).
- `bench.sim_cost`, `bench.sim_routers`: the simulator's replica cost profiles
  and routers.
- `bench.simulator`: a discrete-event simulation of N replicas driving the
  production router (`router.index.PrefixIndex`, `router.policy.PrefixAwarePolicy`).
- `bench.live`: `warmpath bench`, the same workload against the real local cluster.
- `bench.report`: tables (ratios to pow2), JSON and the PNG plot.

`bench/router_decision.py` is a standalone micro-benchmark of one routing decision.
"""
