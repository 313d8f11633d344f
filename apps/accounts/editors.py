"""What an editor needs to use this gateway: Continue's assistant file, Codex's provider and
profile, Cline's fields, and the install scripts served at /connect/<tool>.sh.

Pure text: no ORM, no request. The views pass the gateway's address and a model name in.

Formats, as their projects document them (checked 2026-11):

- Continue: a local assistant is a YAML file in ~/.continue/assistants (its own file, so the
  person's config.yaml is left alone), with name, version and schema v1, and models with
  name, provider, model, apiBase, apiKey and roles (config.yaml reference,
  docs.continue.dev/reference). ``${{ secrets.NAME }}`` in a local file is read from
  ~/.continue/.env (and, since Continue PR 5961, from the process environment).
- Codex: a provider is a ``[model_providers.<id>]`` table in ~/.codex/config.toml with name,
  base_url, env_key and wire_api ("responses", the only value Codex still accepts). Since
  Codex 0.134 a profile is its own file, ~/.codex/<name>.config.toml with top-level keys,
  chosen with ``codex --profile <name>``; a ``[profiles.<name>]`` table in config.toml is no
  longer read, and one with the same name makes ``--profile`` fail
  (developers.openai.com/codex/config-advanced, openai/codex PRs 22647 and 24059).
- Cline: settings live in VS Code's secret storage, so there is no file to write; the person
  pastes API Provider "OpenAI Compatible", Base URL, API Key and Model ID
  (docs.cline.bot/provider-config/openai-compatible).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from typing import Any

import yaml
from django.utils.translation import gettext as _
from django.utils.translation import gettext_noop

__all__ = [
    "CODEX_CONFIG_FILE",
    "CODEX_PROFILE_FILE",
    "CONTINUE_ENV_FILE",
    "CONTINUE_FILE",
    "ENV_VAR",
    "PROVIDER_ID",
    "SCRIPT_TOOLS",
    "TOOLS",
    "Tool",
    "api_base",
    "codex_profile_toml",
    "codex_provider_toml",
    "codex_script",
    "continue_env_line",
    "continue_script",
    "continue_yaml",
    "install_command",
    "script",
    "toml_string",
]

# The environment variable that carries the key, in the scripts and in Codex's env_key.
ENV_VAR = "LLMGW_API_KEY"
# The provider, profile and file name the gateway takes in each tool's configuration.
PROVIDER_ID = "llmgw"
CONTINUE_FILE = "~/.continue/assistants/llmgw.yaml"
CONTINUE_ENV_FILE = "~/.continue/.env"
CODEX_CONFIG_FILE = "~/.codex/config.toml"
CODEX_PROFILE_FILE = f"~/.codex/{PROVIDER_ID}.config.toml"


@dataclass(frozen=True)
class Tool:
    slug: str
    label: str  # a product name: not translated


TOOLS: dict[str, Tool] = {
    "continue": Tool("continue", "Continue"),
    "codex": Tool("codex", "Codex"),
    "cline": Tool("cline", "Cline"),
}
# The tools that get a one-line install command (Cline keeps its settings in VS Code).
SCRIPT_TOOLS = ("continue", "codex")


def api_base(server: str) -> str:
    return f"{server.rstrip('/')}/v1"


# Continue ------------------------------------------------------------------------------


def continue_yaml(server: str, model: str) -> str:
    """The assistant file ~/.continue/assistants/llmgw.yaml; the key stays in ~/.continue/.env."""
    assistant: dict[str, Any] = {
        "name": PROVIDER_ID,
        "version": "1.0.0",
        "schema": "v1",
        "models": [
            {
                "name": f"{model} ({PROVIDER_ID})",
                "provider": "openai",
                "model": model,
                "apiBase": api_base(server),
                "apiKey": f"${{{{ secrets.{ENV_VAR} }}}}",
                # Not autocomplete: that role wants a fill-in-the-middle model, which a chat model is not.
                "roles": ["chat", "edit", "apply"],
            }
        ],
    }
    return yaml.safe_dump(assistant, sort_keys=False, allow_unicode=True, default_flow_style=False)


def continue_env_line(secret: str) -> str:
    return f"{ENV_VAR}={secret}\n"


# Codex ---------------------------------------------------------------------------------


def toml_string(value: str) -> str:
    """A TOML basic string: quote, backslash and control characters escaped."""
    out = []
    for char in value:
        if char in '"\\':
            out.append("\\" + char)
        elif ord(char) < 0x20 or ord(char) == 0x7F:
            out.append(f"\\u{ord(char):04X}")
        else:
            out.append(char)
    return '"' + "".join(out) + '"'


def codex_provider_toml(server: str) -> str:
    """The provider table added to ~/.codex/config.toml. The key is read from LLMGW_API_KEY."""
    return (
        f"[model_providers.{PROVIDER_ID}]\n"
        f"name = {toml_string(PROVIDER_ID)}\n"
        f"base_url = {toml_string(api_base(server))}\n"
        f"env_key = {toml_string(ENV_VAR)}\n"
        f'wire_api = "responses"\n'
    )


def codex_profile_toml(model: str) -> str:
    """The profile ~/.codex/llmgw.config.toml: only the model and the provider, over config.toml."""
    return f"model = {toml_string(model)}\nmodel_provider = {toml_string(PROVIDER_ID)}\n"


# Scripts -------------------------------------------------------------------------------


def install_command(server: str, tool: str, model: str, secret: str) -> str:
    """The one line that fetches the script (no secret in the URL) and hands it the key."""
    url = f"{server.rstrip('/')}/connect/{tool}.sh?model={model}"
    return f"curl -fsSL {shlex.quote(url)} | {ENV_VAR}={shlex.quote(secret)} sh"


def _sh(message: str, **names: str) -> str:
    """A translated message as a double-quoted sh word; %(name)s becomes "${variable}".

    A translation is text to the shell, never code: \\ $ ` and " are escaped. One that names
    a placeholder the English does not falls back to the English.
    """
    parts = re.split(r"%\((\w+)\)s", message)
    if any(part not in names for part in parts[1::2]):
        raise KeyError(message)
    out = []
    for index, part in enumerate(parts):
        if index % 2:
            out.append(f"${{{names[part]}}}")
        else:
            text = part.replace("%%", "%")
            out.append(re.sub(r'([\\$`"])', r"\\\1", text))
    return '"' + "".join(out) + '"'


def _say(english: str, **names: str) -> str:
    """The message (marked with gettext_noop for makemessages) in the reader's language, as a sh word.

    The English stays at hand so that a translation with a wrong placeholder cannot break a script.
    """
    try:
        return _sh(_(english), **names)
    except KeyError:
        return _sh(english, **names)


def _heredoc(text: str, marker: str = "LLMGW_EOF") -> str:
    """Text for a quoted here-document: the shell expands nothing in it."""
    if marker in text.splitlines():
        raise ValueError("the text holds the here-document's marker")
    return f"<<'{marker}'\n{text}{'' if text.endswith(chr(10)) else chr(10)}{marker}\n"


# What the scripts say, marked for makemessages and translated when a script is served.
NO_KEY = gettext_noop("LLMGW_API_KEY is empty, so nothing was changed. Make a key on %(account)s and run:")
NOT_A_KEY = gettext_noop("LLMGW_API_KEY does not look like an llmgw key, so nothing was changed.")
ODD_KEY = gettext_noop("LLMGW_API_KEY holds characters no llmgw key has, so nothing was changed.")
UP_TO_DATE = gettext_noop("%(file)s is already up to date.")
KEPT_COPY = gettext_noop("Kept a copy of %(file)s as %(copy)s.")
WROTE = gettext_noop("Wrote %(file)s.")
CONTINUE_DONE = gettext_noop(
    "Done. In Continue, pick the assistant “llmgw” (reload the editor window if it is not listed)."
)
LEGACY_PROFILES = gettext_noop(
    "config.toml still has [profiles.*] tables, which Codex 0.134 and later no longer read: "
    "move each into its own <name>.config.toml."
)
CODEX_EXPORT = gettext_noop(
    "Codex reads the key from LLMGW_API_KEY. Add this line to your shell's profile "
    "(~/.profile, ~/.bashrc or ~/.zshrc) and open a new shell:"
)
CODEX_START = gettext_noop("Then start Codex with: codex --profile llmgw")


def _preamble(server: str, tool: str, model: str, key_prefix: str) -> str:
    """The part both scripts share: refuse without a key, and the helpers that keep a copy."""
    command = shlex.quote(f"curl -fsSL '{server}/connect/{tool}.sh?model={model}' | {ENV_VAR}={key_prefix}... sh")
    account = shlex.quote(f"{server}/account/")
    return f"""#!/bin/sh
# Connects {TOOLS[tool].label} to the llmgw gateway at {server} (model {model}).
# Run it as: curl -fsSL '{server}/connect/{tool}.sh?model={model}' | {ENV_VAR}=<your key> sh
# This file holds no secret: the key comes only from {ENV_VAR}.
# Every file it replaces is kept beside it as <file>.bak.<time>.
set -eu
umask 077

say() {{ printf 'llmgw: %s\\n' "$1"; }}
fail() {{ printf 'llmgw: %s\\n' "$1" >&2; exit 1; }}

key=${{{ENV_VAR}:-}}
account={account}
command={command}
if [ -z "$key" ]; then
  printf 'llmgw: %s\\n  %s\\n' {_say(NO_KEY, account="account")} "$command" >&2
  exit 1
fi
prefix={shlex.quote(key_prefix)}
case $key in
  "$prefix"*) ;;
  *) fail {_say(NOT_A_KEY)} ;;
esac
case $key in
  *[!A-Za-z0-9_-]*) fail {_say(ODD_KEY)} ;;
esac

stamp=$(date +%Y%m%d%H%M%S)
tmp=
trap 'rm -f "$tmp" "$tmp.keep"' EXIT

# put_file FILE NEW: replace FILE with NEW (a file beside it), keeping a copy of FILE first.
# Nothing is written when FILE already says the same.
# A FILE that is a link is written through, so a dotfiles checkout keeps its link.
put_file() {{
  if [ -f "$1" ] && cmp -s "$2" "$1"; then
    rm -f "$2"
    say {_say(UP_TO_DATE, file="1")}
    return 0
  fi
  if [ -e "$1" ]; then
    copy="$1.bak.$stamp"
    if [ -e "$copy" ]; then copy="$copy.$$"; fi
    cp -p "$1" "$copy"
    say {_say(KEPT_COPY, file="1", copy="copy")}
  fi
  if [ -L "$1" ]; then
    cat "$2" > "$1"
    rm -f "$2"
  elif [ -e "$1" ]; then
    # Replaced in one step, keeping the file's mode: the new text goes into a copy of the old file.
    cp -p "$1" "$2.keep"
    cat "$2" > "$2.keep"
    mv -f "$2.keep" "$1"
    rm -f "$2"
  else
    mv -f "$2" "$1"
  fi
  say {_say(WROTE, file="1")}
}}
"""


# Strips the llmgw tables (and their sub-tables) from a config.toml and keeps every other line
# as it was. A blank line held before one of ours goes with it; the END block says whether a
# blank line should separate the rest from the tables appended after it.
_STRIP_LLMGW_TABLES = r"""
function header(line) {
  return line ~ /^[ \t]*\[/ && line ~ /\][ \t]*(#.*)?$/ && line !~ /=/
}
function ours(line,    name) {
  if (line !~ /^[ \t]*\[[ \t]*(model_providers|profiles)[ \t]*\./) return 0
  name = line
  sub(/^[ \t]*\[[ \t]*(model_providers|profiles)[ \t]*\.[ \t]*/, "", name)
  return name ~ /^("llmgw"|'llmgw'|llmgw)[ \t]*(\.[^]]*)?\][ \t]*(#.*)?$/
}
{
  if (header($0)) {
    if (ours($0)) { skip = 1; held = ""; nheld = 0; next }
    skip = 0
  }
  if ($0 ~ /^[ \t]*$/) { held = held $0 "\n"; nheld++; next }
  if (skip) { held = ""; nheld = 0; next }
  printf "%s", held
  if (nheld) { held = ""; nheld = 0 }
  print
  printed = 1
}
END {
  if (!skip && nheld) { printf "%s", held; printed = 0 }
  if (printed) print ""
}
"""


def continue_script(server: str, model: str, key_prefix: str) -> str:
    """Write ~/.continue/assistants/llmgw.yaml and the key's line in ~/.continue/.env."""
    server = server.rstrip("/")
    return (
        _preamble(server, "continue", model, key_prefix)
        + f"""
# Continue's folder: $CONTINUE_GLOBAL_DIR when set, as Continue itself reads it.
dir=${{CONTINUE_GLOBAL_DIR:-$HOME/.continue}}
mkdir -p "$dir/assistants"

# The assistant, in its own file: config.yaml is never touched.
tmp="$dir/assistants/.llmgw.yaml.new.$$"
cat > "$tmp" {_heredoc(continue_yaml(server, model))}put_file "$dir/assistants/llmgw.yaml" "$tmp"

# The key, where Continue reads ${{{{ secrets.{ENV_VAR} }}}}: the one {ENV_VAR} line is replaced.
tmp="$dir/.env.llmgw.new.$$"
: > "$tmp"
if [ -f "$dir/.env" ]; then
  awk '!/^[ \\t]*(export[ \\t]+)?{ENV_VAR}[ \\t]*=/' "$dir/.env" > "$tmp"
fi
printf '%s=%s\\n' {ENV_VAR} "$key" >> "$tmp"
put_file "$dir/.env" "$tmp"
chmod 600 "$dir/.env"  # it holds the key

say {_say(CONTINUE_DONE)}
"""
    )


def codex_script(server: str, model: str, key_prefix: str) -> str:
    """Add the llmgw provider to ~/.codex/config.toml and write the profile ~/.codex/llmgw.config.toml."""
    server = server.rstrip("/")
    return (
        _preamble(server, "codex", model, key_prefix)
        + f"""
# Codex's folder: $CODEX_HOME when set, as Codex itself reads it.
dir=${{CODEX_HOME:-$HOME/.codex}}
mkdir -p "$dir"

# config.toml: the llmgw tables are replaced, or appended; every other line stays as it was,
# the default model included. (An old [profiles.llmgw] table goes too: Codex 0.134 and later
# refuse --profile llmgw while config.toml still has one.)
strip=$(cat {_heredoc(_STRIP_LLMGW_TABLES, "LLMGW_AWK")})
tmp="$dir/.config.toml.llmgw.new.$$"
: > "$tmp"
if [ -f "$dir/config.toml" ]; then
  awk "$strip" "$dir/config.toml" > "$tmp"
fi
cat >> "$tmp" {_heredoc(codex_provider_toml(server))}put_file "$dir/config.toml" "$tmp"

# The profile, in its own file: codex --profile llmgw reads it over config.toml.
tmp="$dir/.{PROVIDER_ID}.config.toml.new.$$"
cat > "$tmp" {_heredoc(codex_profile_toml(model))}put_file "$dir/{PROVIDER_ID}.config.toml" "$tmp"

if grep -q '^[[:space:]]*\\[[[:space:]]*profiles[[:space:]]*\\.' "$dir/config.toml"; then
  say {_say(LEGACY_PROFILES)}
fi
say {_say(CODEX_EXPORT)}
printf '  export %s=%s\\n' {ENV_VAR} "$key"
say {_say(CODEX_START)}
"""
    )


# What may be baked into a script: the address and a model name, never anything the shell would read as code.
SAFE_SERVER = re.compile(r"^https?://[A-Za-z0-9.:\[\]_~%/-]+$")
SAFE_MODEL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")


def script(tool: str, server: str, model: str, key_prefix: str) -> str:
    """The install script for a tool. ValueError for an address or model name it cannot hold safely."""
    if not SAFE_SERVER.match(server) or not SAFE_MODEL.match(model) or not SAFE_MODEL.match(key_prefix):
        raise ValueError(f"cannot write a script for {server!r} and {model!r}")
    if tool == "continue":
        return continue_script(server, model, key_prefix)
    if tool == "codex":
        return codex_script(server, model, key_prefix)
    raise ValueError(tool)
