"""Tools that gpt-oss calls while it answers: `python_tool` (its built-in `python` tool, sandboxed).

Nothing is imported here: the server imports `gptoss_lite.tools.python_tool` when it serves the tool.
"""
