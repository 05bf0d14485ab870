"""Fault tests: a recorded client history, a pure checker over it, and the workload that writes it."""
