"""Replaying a real request trace (Mooncake format) on this machine: `workload` scales the trace and names every
block's tokens, `setups` lists the configurations compared, `report` scores, plots and renders the runs;
bench/experiments/trace_replay.py runs them (`pdserve bench trace`)."""
