"""Test harnesses for KV transfer (not used by the serving runtime).

`loopback`: a KV receiver or sender in a child process, driven over a pipe, for the integration
tests and `bench/kvtransfer.py`.
"""
