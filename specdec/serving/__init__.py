"""Serving plumbing shared by the three services: gRPC servers and error mapping, settings
from flags and SPECDEC_* variables, telemetry, the worker registry, embedded Redis, and the
wire conversions. No torch: the coordinator imports this layer too."""
