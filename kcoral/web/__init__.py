"""HTTP plumbing shared by the server, the Router and the gateway."""
