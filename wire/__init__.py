"""The shared wire package: what the gateway and its workers say to each other, and nothing else.

Imported by both processes; imports neither, nor torch or Quart (standard library and msgspec
only, and PyYAML in wire.yaml_file). Owns the typed messages down to their leaves (wire.messages,
wire.params, wire.results, wire.stats), the frame codec (wire.codec), the worker state table
(wire.states), the log line format both processes write (wire.log_format), what both agree on
about tracing (wire.trace_context), and how both read the registry file (wire.yaml_file,
wire.env_expand).
"""
