"""Tensor parallelism: one engine as N ranks (processes) in one torch.distributed group.

Lifecycle: rank 0 is the process that serves requests. `TensorParallelGroup.start` opens the step
channel, starts ranks 1..N-1 (`follower.serve_rank`, each in its own process) and joins the
torch.distributed group with them (gloo on CPU, NCCL on GPU). Every rank loads the model sharded by
transformers' tensor-parallel plan (`model_loader.load_model(..., tensor_parallel_size=N)`), so it
holds 1/N of the attention heads and of the MLP, and its own paged KV pool of just its KV heads. The
scheduler and sampler run on rank 0 only: each step rank 0 sends the `StepItem`s it scheduled down
the channel and every rank runs the same forward, kept in lockstep by the all-reduces inside it.
`close` sends the stop and joins the followers; a follower whose rank 0 is gone exits on its own.
"""

from engine.parallel.group import LocalRanks, RankInfo, RankLauncher, TensorParallelGroup

__all__ = ["LocalRanks", "RankInfo", "RankLauncher", "TensorParallelGroup"]
