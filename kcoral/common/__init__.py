"""
What the server, the node and the Router share: the wait queue, the report
schema a worker's health and a node's heartbeat follow, how a server tells
its supervisor where it listens, and the server's settings a node passes on.
None of it imports a component: each component imports it.
"""
