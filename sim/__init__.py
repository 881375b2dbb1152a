"""The cluster simulator behind `pdserve plan` (torch-free; imports common/ only).

sim.profile   what each stage costs (a `pdserve profile` file), interpolated
sim.workload  simulated requests from a Mooncake trace or a synthetic rate/length distribution
sim.core      the event loop, hosts (CPU cores shared by workers) and shared KV links
sim.kvpool    a worker's KV blocks: ref counts, LRU prefix cache keyed by the trace's hash ids, a second tier
sim.worker    one worker's step loop (token budget, chunked prefill, continuous batching, preemption)
sim.router    routing policies and admission
sim.cluster   a cluster shape run over a workload -> per-request results
sim.metrics   percentiles, ITL, goodput (common/slo.py's definition)
sim.planner   `pdserve plan`: search shapes, TP and policy for the fewest accelerators
"""
