"""
The live dashboard that the Router and a node's gateway serve on C{GET /}: a
page and its two assets (L{kcoral.dashboard.page}) that render the pool from
C{/v1/dashboard} and C{/v1/nodes}, and the ring of recent samples behind its
plots (L{kcoral.dashboard.history}).
"""
