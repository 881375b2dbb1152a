"""The parts of the serving benchmark `bench.serve` (its CLI and driver):

  workload  seeded request lists (random, chat mix, shared prefixes, a file) and arrival times
  records   what the client observed of one request (`RequestRecord`) and its token statistics
  clients   gRPC (pdserve Router/Generate) and OpenAI-compatible SSE backends that fill a record
  loadgen   `run_load`: send a workload at its arrival times, capped in flight, bursts included
  metrics   vLLM's serving metrics from the raw stamps, and ITL inside / outside burst windows
  plots     latency CDFs, ITL timelines, goodput against rate
"""
