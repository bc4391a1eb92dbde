"""A node: the supervisor and the server process(es) it runs, one per device."""
