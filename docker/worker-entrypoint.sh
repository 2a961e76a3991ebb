#!/bin/sh
# Starts `prefixgate worker` named by its container's address, then any arguments given.
#
# Replicas of one compose service (`--scale worker=N`) share one definition, so nothing static can
# tell them apart. Each takes its id and the URL gateways reach it at (both announced through the Redis
# registry) from the address Docker gave it. That address is also the `instance` that Prometheus's DNS
# discovery sees, so configs/prometheus.yml copies it into a `replica` label and the dashboard joins
# worker and gateway series on it. Flags given to the container come last and win (argparse).
set -eu
port="${PREFIXGATE_WORKER_PORT:-8101}"
bind="${PREFIXGATE_WORKER_HOST:-0.0.0.0}"
addr="${PREFIXGATE_ADVERTISE_HOST:-$(python -c 'import socket; print(socket.gethostbyname(socket.gethostname()))')}"
set -- --host "$bind" --port "$port" --id "$addr:$port" --advertise-url "http://$addr:$port" "$@"
if [ -n "${PREFIXGATE_REDIS_URL:-}" ]; then
  set -- --redis "$PREFIXGATE_REDIS_URL" "$@"
fi
exec prefixgate worker "$@"
