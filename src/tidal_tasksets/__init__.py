"""Task data that ships with tidal, apart from its code: `swe_mini/`, the built-in
`swe-mini` set of Harbor-format tasks (each a small repository with its own tests).
Nothing here is imported; `tidal.agent.harbor.HARBOR_SETS` finds the sets by path."""
