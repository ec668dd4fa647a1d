#!/usr/bin/env bash
# Install the Debian packages pdserve builds and tests with, when missing.
# Idempotent: does nothing (and needs no network) when everything is present.
set -euo pipefail
pkgs=(build-essential cmake pkg-config libmicrohttpd-dev libcjson-dev libzmq3-dev libmsgpack-dev
      libcurl4-openssl-dev libutf8proc-dev)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# Node.js + npm run the HTTP test clients (and the OpenAI Node SDK); take
# Debian's only when no node is on the PATH.
if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
  missing+=(nodejs npm)
fi
# python3 (free ports and JSON in the demo and test scripts) and curl: Debian's when absent.
command -v python3 >/dev/null || missing+=(python3)
command -v curl >/dev/null || missing+=(curl)
if [ ${#missing[@]} -eq 0 ]; then
  echo "setup-deps: all packages present"
  exit 0
fi
echo "setup-deps: installing ${missing[*]}"
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
