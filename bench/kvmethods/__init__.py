"""The methods `bench.kvtransfer` measures, each a pair of child processes (source, sink) that stay up
while it is measured and answer "run <tokens>" with the seconds one transfer took:

  base          KV shapes, buffers, summaries, the `Method` interface, child process plumbing and
                `measure` (round-robin over sizes and methods)
  plain_socket  a plain blocking TCP socket (the baseline)
  raw_ucx       UCX tag sends with no protocol, in three modes (RAW_UCX_MODES)
  protocol      the full kvtransfer protocol (KVSender -> KVReceiver) per ProtocolConfig
"""
