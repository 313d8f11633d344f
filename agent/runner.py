"""One way to run node tools, so tests can point every probe at captured output."""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass

__all__ = ["CommandResult", "CommandRunner"]


@dataclass(frozen=True)
class CommandResult:
    returncode: int | None  # None when the tool is missing or timed out
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0


class CommandRunner:
    """Runs tools by name; `tools` maps a name (nvidia-smi) to the executable to use."""

    def __init__(self, tools: dict[str, str] | None = None, timeout: float = 20.0) -> None:
        self.tools = dict(tools or {})
        self.timeout = timeout

    def path(self, tool: str) -> str:
        return self.tools.get(tool, tool)

    async def run(self, tool: str, *args: str, timeout: float | None = None) -> CommandResult:
        argv = [self.path(tool), *args]
        try:
            process = await asyncio.create_subprocess_exec(
                *argv,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                stdin=asyncio.subprocess.DEVNULL,
                env={**os.environ, "LC_ALL": "C"},
            )
        except (FileNotFoundError, PermissionError) as exc:
            return CommandResult(None, "", f"{argv[0]}: {exc.strerror}")
        try:
            out, err = await asyncio.wait_for(process.communicate(), timeout or self.timeout)
        except TimeoutError:
            process.kill()
            await process.wait()
            return CommandResult(None, "", f"{argv[0]} did not answer within {timeout or self.timeout:.0f} s")
        return CommandResult(process.returncode, out.decode(errors="replace"), err.decode(errors="replace"))
