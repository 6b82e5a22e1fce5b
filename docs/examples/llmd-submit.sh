#!/usr/bin/env bash
# Stream one greedy completion from llmd with socat and jq, in JSON lines.
# Usage: llmd-submit.sh PROMPT [MAX_TOKENS]. Exit status: 0 done, 1 refused or failed,
# 3 llmd not running.
set -euo pipefail
sock=${LLMD_SOCKET:-/run/llmd/llmd.sock}  # else $XDG_RUNTIME_DIR/llmd.sock, as llmctl looks
if [[ -z ${LLMD_SOCKET:-} && ! -S $sock && -n ${XDG_RUNTIME_DIR:-} ]]; then sock=$XDG_RUNTIME_DIR/llmd.sock; fi
[[ -S $sock ]] || { echo "llmd is not running (no socket at $sock)" >&2; exit 3; }
# socat runs as a coprocess so that its input stays open: the daemon aborts the requests
# of a connection once it is closed or half-closed, so `echo ... | socat` would abort it.
coproc LLMD { socat - "UNIX-CONNECT:$sock"; }
exec {to_llmd}>&"${LLMD[1]}" {from_llmd}<&"${LLMD[0]}"
jq -nc --arg prompt "$1" --argjson n "${2:-64}" \
  '{type: "submit", id: "1", prompt: $prompt, sampling: {max_tokens: $n, temperature: 0}}' >&"$to_llmd"
while IFS= read -r line <&"$from_llmd"; do
  jq -j 'select(.type == "output") | .text // ""' <<<"$line"
  case $(jq -r 'if .type == "error" or .finish_reason == "error" then "failed"
                elif .usage then "done" else "more" end' <<<"$line") in
    failed) jq -r '"llmd: \(.code // "error"): \(.message // .error)"' <<<"$line" >&2; exit 1 ;;
    done) echo; exit 0 ;;
  esac
done
echo "llmd: the connection closed early" >&2
exit 1
