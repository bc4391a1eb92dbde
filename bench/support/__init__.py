"""What several benchmarks (and the tests) share: their child processes,
the CPU time they read, the services they start and the figures they
report."""
