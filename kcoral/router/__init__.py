"""The Router: one stable address in front of a changing pool of nodes."""
