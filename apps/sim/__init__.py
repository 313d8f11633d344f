"""The fleet simulator: the reconciler's own decisions on a fleet described in YAML (or a copy of
the live one), step by step through a script of events, with a report of what they did."""
