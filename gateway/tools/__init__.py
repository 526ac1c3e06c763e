"""Tool (function) calling: the request side (tools, tool_choice) and reading calls from output."""
