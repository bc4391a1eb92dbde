"""The KCoral wire format: how programs, arrays and results cross HTTP."""
