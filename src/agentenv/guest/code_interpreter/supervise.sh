#!/bin/sh
# Keeps the code-interpreter server running: if it dies (crash, OOM, kill) it starts again, as
# E2B's systemd unit does with Restart=on-failure. Its own command line does not name the
# server, so `pkill -f server.py` stops the server, not this loop.
while true; do
    python3 -u /opt/code-interpreter/server.py --port 49999
    echo "code-interpreter server exited with $?; restarting" >&2
    sleep 0.5
done
