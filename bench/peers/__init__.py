"""
The programs the benchmarks measure KCoral against, each run as a child
process (``python -m bench.peers.NAME``): proxies with nothing of the Router
in them, other model servers, and bare servers that answer at once. Some run
in virtualenvs of their own (Ray Serve, PyTriton, KServe), which hold
neither KCoral's dependencies nor, beyond this package, the benchmarks'.
"""
