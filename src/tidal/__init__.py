"""tidal: RL post-training for long-running, tool-using LLM agents.

Data flow (see README and DESIGN): ledger -> tree -> engine -> gateway -> sandbox ->
agent -> train -> schedule. Each package depends only on those before it.
"""

__version__ = "0.1.0"
