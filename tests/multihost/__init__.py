"""Multi-host test cluster on one machine: hosts are Linux network namespaces on one virtual switch.

net.py owns the namespaces, links and link rates; cluster.py one Ray node per host and
`pdserve serve` on host 1; __main__.py the by-hand commands (`python -m tests.multihost up|down|status`).
"""
