"""Tools gpt-oss was trained to call, run on this machine and offline.

- `tools.browser`: the `browser` tool (`search`, `open`, `find`) over a directory of the user's own
  documents, indexed with SQLite FTS5 (`tools.corpus`), pages extracted by `tools.documents`;
- `tools.python_tool`: the `python` tool, a stateful interpreter per conversation in a sandbox
  (`tools.python_sandbox`).

Nothing is imported here: a caller imports the tool it serves (`from gptoss_lite.tools.browser import
BrowserSession, Corpus`), so loading the package costs nothing.
"""
