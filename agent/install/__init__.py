"""Engines the agent installs itself: chosen for the node's hardware, verified, kept working.

- `builds`: the llama.cpp builds a node may run, best first, from what only the node knows
  (driver, GPU generation, CPU flags, OS and architecture), and the release asset of each.
- `fetch`: a download streamed to disk, checked against its sha256, with progress.
- `archive`: an archive unpacked into an empty staging directory, refusing any member that
  would leave it.
- `verify`: what proves an unpacked engine works (ldd, `--version`, `--list-devices`).
- `manager`: the desired engines converged on, one build after another until one works;
  the installed set kept in `<state_dir>/engines/installed.json` and checked again every
  ten minutes.

No Django import; importable on Python 3.11.
"""
