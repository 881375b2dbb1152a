"""What every pdserve process shares, torch-free, at the bottom of the layers (beside `proto`):

  config.py, engine_config.py, validation.py   the YAML config, loaded once into typed objects
  plugins.py       names of KV transports and routing policies -> their implementations
  faultspec.py     the grammar of KV fault specs (kv_transfer.faults)
  secrets.py, security.py   the shared secret and TLS on internal RPCs
  serving.py       a gRPC server's lifecycle: create, ready line, serve, drain (wait until idle)
  registration.py  a worker's registration and heartbeats with the router
  worker.py        `run_worker`: the process both worker packages run around their own parts
"""
