"""Clients for KCoral servers and Routers: L{Client} (blocking) and L{AsyncClient} (treq)."""
