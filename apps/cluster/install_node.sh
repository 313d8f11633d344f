#!/bin/sh
# Installs the llmgw node agent from the control plane at @SERVER@, enrols this node with
# LLMGW_TOKEN, checks it with `doctor` and starts the agent.
set -eu
SERVER=@SERVER@
PREFIX="${LLMGW_PREFIX:-/opt/llmgw}"
CONFIG_DIR="${LLMGW_CONFIG_DIR:-/etc/llmgw}"
STATE_DIR="${LLMGW_STATE_DIR:-/var/lib/llmgw-agent}"
say() { printf 'llmgw: %s\n' "$*" >&2; }
die() { say "$*"; exit 1; }

[ -n "${LLMGW_TOKEN:-}" ] || die "LLMGW_TOKEN is not set: run the command \`llmgw ctl node add NAME\` printed"
PYTHON=""
for candidate in python3.13 python3.12 python3.11 python3; do
  if command -v "$candidate" >/dev/null 2>&1 &&
     "$candidate" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' 2>/dev/null; then
    PYTHON="$(command -v "$candidate")"; break
  fi
done
[ -n "$PYTHON" ] || die "no Python 3.11 or newer on this node: install python3 (Debian/Ubuntu: apt-get install python3)"
command -v curl >/dev/null 2>&1 || die "curl is needed"
command -v sha256sum >/dev/null 2>&1 || die "sha256sum is needed (coreutils)"

mkdir -p "$PREFIX" "$CONFIG_DIR" "$STATE_DIR"
chmod 0750 "$STATE_DIR"
say "downloading the agent from $SERVER"
curl -fsSL -o "$PREFIX/llmgw-agent.pyz.part" "$SERVER/install/llmgw-agent.pyz"
curl -fsSL -o "$PREFIX/llmgw-agent.pyz.sha256" "$SERVER/install/llmgw-agent.pyz.sha256"
expected="$(cut -d' ' -f1 "$PREFIX/llmgw-agent.pyz.sha256")"
actual="$(sha256sum "$PREFIX/llmgw-agent.pyz.part" | cut -d' ' -f1)"
[ "$expected" = "$actual" ] || { rm -f "$PREFIX/llmgw-agent.pyz.part"; die "the agent's sha256 is $actual, the control plane says $expected: not installed"; }
mv -f "$PREFIX/llmgw-agent.pyz.part" "$PREFIX/llmgw-agent.pyz"
say "agent $("$PYTHON" "$PREFIX/llmgw-agent.pyz" version) installed in $PREFIX (sha256 $actual)"

CONFIG="$CONFIG_DIR/agent.yaml"
if [ -e "$CONFIG" ]; then
  say "$CONFIG exists: kept as it is (put the token in it by hand to enrol again)"
else
  umask 077
  cat > "$CONFIG" <<YAML
server: $SERVER
token: $LLMGW_TOKEN
state_dir: $STATE_DIR
labels: {}
model_dirs: []
YAML
  umask 022
  say "wrote $CONFIG"
fi

say "checking this node (llmgw doctor):"
"$PYTHON" "$PREFIX/llmgw-agent.pyz" doctor --config "$CONFIG" >&2 || say "some checks failed (above); the agent starts anyway"

if [ "${LLMGW_NO_SYSTEMD:-}" = "1" ] || ! command -v systemctl >/dev/null 2>&1; then
  # Restart an agent this script started before (its engines keep running; the new one adopts them).
  if [ -f "$STATE_DIR/agent.pid" ] && kill -0 "$(cat "$STATE_DIR/agent.pid")" 2>/dev/null; then
    old="$(cat "$STATE_DIR/agent.pid")"
    kill "$old"
    for _ in $(seq 30); do kill -0 "$old" 2>/dev/null || break; sleep 0.5; done
    kill -0 "$old" 2>/dev/null && kill -9 "$old"
  fi
  nohup "$PYTHON" "$PREFIX/llmgw-agent.pyz" agent --config "$CONFIG" >> "$STATE_DIR/agent.log" 2>&1 &
  echo $! > "$STATE_DIR/agent.pid"
  say "agent started (pid $(cat "$STATE_DIR/agent.pid"), log $STATE_DIR/agent.log)"
else
  cat > /etc/systemd/system/llmgw-agent.service <<UNIT
[Unit]
Description=llmgw node agent
Wants=network-online.target
After=network-online.target

[Service]
Type=simple
ExecStart=$PYTHON $PREFIX/llmgw-agent.pyz agent --config $CONFIG
# Engines outlive a restart of the agent, which adopts them: stop only the agent's own process.
KillMode=process
Restart=on-failure
RestartSec=10
AmbientCapabilities=CAP_SYSLOG
LimitMEMLOCK=infinity
LimitNOFILE=1048576

[Install]
WantedBy=multi-user.target
UNIT
  systemctl daemon-reload
  systemctl enable llmgw-agent.service
  systemctl restart llmgw-agent.service  # a new bundle takes over; its engines keep running
  say "agent started: systemctl status llmgw-agent"
fi
